"""The layer-by-layer step (lucegen/engine/layered.py) and its tree verifier (layered_verify.py) on host memory:
device arrays on numpy byte buffers (tests/host_kernels.py), every kernel launch replaced by its family's numpy
reference applied to exactly the arguments the kernel gets, CUDA graphs by lists of recorded launches replayed in
order. For an HF checkpoint (bf16 matrices, HF's grouped value-head order: the order of the tree references).

Projections run row by row (a GEMM row is the GEMV of that row, as on the GPU), so the emulation is as
deterministic per row as the kernels, and a verify's node can be held bit for bit to its decode step."""
from __future__ import annotations

import contextlib
import re
from types import SimpleNamespace

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

import lucegen.engine.layered as layered_mod
from lucegen.kernels import gemm, layered, qgemv, sample, topk, tree
from lucegen.kernels.gdn import gated_norm_reference
from lucegen.kernels.qgemv import fmt_of
from lucegen.model.checkpoint import make_checkpoint
from lucegen.model.config import tiny_config
from lucegen.model import kvformats
from lucegen.model.gguf_file import gguf_name, load_gguf
from lucegen.model.quants import GGMLType, dequantize
from lucegen.model.weights import open_weights
from lucegen.engine.layered_weights import Source
from host_kernels import HostArray, HostStream, on_host, rows_of, store


class HostGraph:
    """A captured graph: the launches made inside `with HostGraph.capture(stream)`, replayed by launch()."""
    recording: list | None = None

    def __init__(self):
        self.launches: list = []

    @classmethod
    def capture(cls, stream) -> "HostGraph":
        return cls()

    def __enter__(self) -> "HostGraph":
        HostGraph.recording = self.launches
        return self

    def __exit__(self, *exc) -> None:
        HostGraph.recording = None

    def launch(self, stream=None) -> None:
        for run in self.launches:
            run()

    def destroy(self) -> None:
        self.launches = None  # a replay after destroy() fails loudly


def _pos(io, start: int) -> int:
    """A tree kernel's committed position: start, plus io[0] where io is an array (not the null argument)."""
    return start + (int(io.a[0]) if isinstance(io, HostArray) else 0)


def _array(a):
    return a if isinstance(a, HostArray) else None


_MATRICES: dict = {}  # (buffer id, offset, format, n, k) -> (the buffer, kept alive so ids stay unique; values)


def matrix(w: HostArray, fmt: str, n: int, k: int) -> np.ndarray:
    """The float values of the first n rows of K = k of a weight buffer (weights are written once: cached)."""
    key = (id(w.buf), w.offset, fmt, n, k)
    if key not in _MATRICES:
        f = fmt_of(fmt)
        _MATRICES[key] = (w.buf, dequantize(f.matrix_rows(w.a, n, k), f.ggml).astype(np.float32))
    return _MATRICES[key][1]


def kv_format(cache, head_dim: int) -> str:
    """The KV format of a cache's rows (DeviceState: bf16 values, or the bytes of a quantized format's rows)."""
    if cache.a.dtype != np.uint8:
        return "bf16"
    return next(f for f in ("q8_0", "q4_0", "tq3_0") if kvformats.row_bytes(f, head_dim) == cache.a.shape[-1])


def store_kv(cache, start: int, rows: np.ndarray) -> None:
    """fp32 K or V rows [n, n_kv, head_dim] into cache rows start .. in the cache's format."""
    fmt = kv_format(cache, rows.shape[-1])
    cache.a[start:start + len(rows)] = rows.astype(cache.a.dtype) if fmt == "bf16" else kvformats.encode(rows, fmt)


def kv_values(cache, head_dim: int) -> np.ndarray:
    """A cache's rows as attention reads them, fp32."""
    fmt = kv_format(cache, head_dim)
    return cache.a.astype(np.float32) if fmt == "bf16" else kvformats.decode(cache.a, fmt)


def write_xblocks(xq, rows: np.ndarray, at=None) -> None:
    """The XBlocks of fp32 rows (qgemv.xblocks, the kernels' bytes) into a buffer of XBlocks as its rows `at`
    (default 0 ..; qgemv.place_xblocks), unless xq is the null argument."""
    if _array(xq) is not None:
        qgemv.place_xblocks(xq.a, qgemv.xblocks(rows), at)


def xblock_values(xq, m: int, k: int) -> np.ndarray:
    """float64 [m, k]: the values dx * qx of m rows of XBlocks (what the quantized products multiply)."""
    b = qgemv.xblocks_of(xq.a, m, k).reshape(m, k // 32, qgemv.XBLOCK_BYTES)
    q = b[..., :32].view(np.int8).astype(np.float64)
    d = b[..., 32:36].copy().view(np.float32).astype(np.float64)
    return (q * d).reshape(m, k)


def parents_of_depths(depth: np.ndarray) -> list[int]:
    """A topologically ordered tree with these depths (what attention_kv's references read of a tree)."""
    last: dict[int, int] = {}
    parents = []
    for n, d in enumerate(depth):
        parents.append(-1 if d == 0 else last[int(d) - 1])
        last[int(d)] = n
    return parents


def topk_on_host(n: int, logits, vocab: int, k: int, ids, logprobs, values) -> None:
    """topk_f32 by its numpy reference (topk.reference) on n rows of the launch's logits; its outputs written as the
    kernel writes them (values: the logits themselves, or (0, c_void_p) for none)."""
    rows = logits.a.reshape(-1)[:n * vocab].reshape(n, vocab)
    ref_ids, ref_lp = topk.reference(rows, k)
    ids.a.reshape(-1)[:n * k] = ref_ids.reshape(-1)
    logprobs.a.reshape(-1)[:n * k] = ref_lp.reshape(-1)
    if not isinstance(values, tuple):
        values.a.reshape(-1)[:n * k] = np.take_along_axis(rows, ref_ids, axis=1).reshape(-1)


class LayeredHostKernel:
    def __init__(self, cfg, name: str, unit: str = ""):
        self.cfg, self.name, self.unit = cfg, name, unit  # unit: the kernel's module (layered_<embedding format>)

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        pass

    def max_active_blocks_per_sm(self, threads: int, smem: int) -> int:
        return 1

    def __call__(self, grid, block, *args, smem=0, stream=None, cluster=1):
        grid = (grid,) if isinstance(grid, int) else grid
        if HostGraph.recording is not None:
            HostGraph.recording.append(lambda: self.run(grid, args))
        else:
            self.run(grid, args)

    def run(self, grid, args) -> None:
        c, name = self.cfg, self.name
        H, C, VD = c.hidden_size, c.conv_dim, c.value_dim
        lin_rows = C + VD + 2 * c.linear_num_value_heads
        if name.startswith(("qgemv_", "qgemm_")):
            w, x, y, n, m, *ldy = args  # the GEMMs (M-tiles past one row) take Y's row stride
            ldy = ldy[0] if ldy else n
            fmt, k = re.fullmatch(r"qgem[vm](?:_mma)?(?:_m\d+)?(?:_r\d+)?_(\w+?)_k(\d+)(?:_r\d+)?(?:_s\d+)?_t\d+"
                                  r"(?:_st\d+)?(?:_mb\d+)?", name).groups()
            k = int(k)
            W = matrix(w, fmt, n, k)
            # the quantized formats read XBlocks (their values dx * qx, exactly), bf16 fp32 rows
            X = xblock_values(x, m, k) if fmt_of(fmt).quantizes_x else rows_of(x, m, k)
            Y = y.a.reshape(-1)
            for t in range(m):  # row by row: every row the GEMV of that row
                store(Y[t * ldy:t * ldy + n], W.astype(np.float64) @ X[t].astype(np.float64))
        elif name == "qquant_x":
            x, out, m, row_blocks = args
            write_xblocks(out, x.a.reshape(-1)[:32 * m * row_blocks].reshape(m, -1))
        elif name == "argmax_f32":
            v, n, out, _, _ = args
            rows = grid[1] if len(grid) > 1 else 1
            out.a[:rows] = np.argmax(v.a.reshape(-1)[:rows * n].reshape(rows, n), axis=1)
        elif name == "topk_f32":
            logits, vocab, k, _, _, _, ids, logprobs, values = args
            topk_on_host(grid[1], logits, vocab, k, ids, logprobs, values)
        elif name == "sample_f32":
            v, n, (inv_t, _), (u, _), us, out, parts, _ = args  # us: the rows' uniforms, or (0, c_void_p): u's
            blocks, rows = grid
            records = parts.a.reshape(-1)[:rows * blocks * sample.PART_BYTES].view(sample.PART_DTYPE)
            for r, row in enumerate(v.a.reshape(-1)[:rows * n].reshape(rows, n)):
                mine = records[r * blocks:(r + 1) * blocks]
                mine["sum"], mine["max"] = sample.parts(row, 1 / inv_t, blocks)
                ur = u if isinstance(us, tuple) else us.a[r]
                out.a[r] = -1 if ur < 0 else sample.reference(row, 1 / inv_t, ur, blocks)
        elif name == "layered_embed":
            table, io, x = args
            m, V = grid[0], c.vocab_size
            store(rows_of(x, m, H), matrix(table, self.unit.removeprefix("layered_"), V, H)[io.a[1:1 + m]])
        elif name == "layered_add_rmsnorm":
            x, y, w, x_out, h, xq = args
            m = grid[0]
            x1, h1 = layered.add_rmsnorm_reference(rows_of(x, m, H), None if _array(y) is None else rows_of(y, m, H),
                                                   w.a, c.rms_norm_eps)
            store(rows_of(x_out, m, H), x1)
            store(rows_of(h, m, H), h1)
            write_xblocks(xq, rows_of(h, m, H))
        elif name == "layered_silu_mul":
            gate_up, act, xq = args
            m, inter = grid[0], c.intermediate_size
            store(rows_of(act, m, inter), layered.silu_mul_reference(rows_of(gate_up, m, 2 * inter)))
            write_xblocks(xq, rows_of(act, m, inter))
        elif name == "layered_place":
            src, dst, n, ld, off = args
            m = grid[0]
            store(rows_of(dst, m, ld)[:, off:off + n], rows_of(src, m, n))
        elif name == "layered_advance":
            io, tokens, m = args
            io.a[0] += m
            io.a[1] = tokens.a[m - 1]
        elif name == "tree_deltanet":
            (mixed, stride, conv_w, a_log, dt_bias, ring, state, parents, depth, codes, nodes, steps, levels, io,
             start, out, ticket, commit, norm_w, normed, normed_q, _) = args
            start, X = _pos(io, start), mixed.a.reshape(-1, stride)
            assert X.shape[1] == lin_rows, "the in-projection rows' stride"
            O = out.a.reshape(-1, VD)
            tiled = self.unit == tree.unit_name(True)

            def norm(rows):  # the gated RMSNorm of out's rows (and their XBlocks), where normed is given
                if _array(normed) is None:
                    return
                hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
                N = normed.a.reshape(-1, VD)
                N[rows] = gated_norm_reference(O[rows].reshape(-1, hv, dv), X[rows, C:C + VD].reshape(-1, hv, dv),
                                               norm_w.a, c.rms_norm_eps).reshape(-1, VD)
                write_xblocks(normed_q, N[rows], rows)

            if not commit:
                o, _, _ = tree.deltanet_reference(c, X[:nodes], conv_w.a, a_log.a, dt_bias.a, ring.a, state.a,
                                                  parents.a[:nodes], start, tiled)
                store(O[:nodes], o)
                norm(list(range(nodes)))
                return
            path = list(codes.a[:steps] & 0xFFFF)  # the schedule of a commit (or the decode step) is the path
            chain = [-1, *range(len(path) - 1)]
            o, _, recs = tree.deltanet_reference(c, X[path], conv_w.a, a_log.a, dt_bias.a, ring.a, state.a, chain,
                                                 start, tiled)
            new_ring, new_state = tree.deltanet_commit_reference(X[path], ring.a, state.a, recs,
                                                                 list(range(len(path))), start)
            store(ring.a, new_ring)
            store(state.a, new_state)
            for i, n in enumerate(path):
                store(O[n], o[i])
            norm(path)
        elif name == "tree_attention_kv":
            qkv, stride, k_norm, keys, values, depth, io, start = args
            n, start = grid[0], _pos(io, start)
            k, v = tree.attention_kv_reference(c, qkv.a.reshape(-1, stride)[:n], k_norm.a,
                                               parents_of_depths(depth.a[:n]), start)
            store_kv(keys, start, k)
            store_kv(values, start, v)
        elif name == "tree_attention":
            (qkv, stride, q_norm, k_norm, keys, values, parents, depth, io, start, _, _, _, out, writes_kv,
             out_q) = args
            n, start, Q = grid[1], _pos(io, start), qkv.a.reshape(-1, stride)
            if writes_kv:  # the decode step: a 1-node tree that writes its own K/V row
                k, v = tree.attention_kv_reference(c, Q[:1], k_norm.a, [-1], start)
                store_kv(keys, start, k)
                store_kv(values, start, v)
            o = tree.attention_reference(c, Q[:n], q_norm.a, kv_values(keys, c.head_dim),
                                         kv_values(values, c.head_dim), parents.a[:n], start)
            store(out.a.reshape(-1, o.shape[1])[:n], o)
            write_xblocks(out_q, out.a.reshape(-1, o.shape[1])[:n])
        elif name == "tree_kv_commit":
            keys, values, path, length, io, start = args
            start = _pos(io, start)
            for cache in (keys, values):
                cache.a[...] = tree.kv_commit_reference(cache.a, list(path.a[:length]), start)
        else:
            raise KeyError(f"no host stand-in for kernel {name}")


class LayeredHostModule:
    def __init__(self, cfg, unit: str):
        self.cfg, self.unit = cfg, unit

    def kernel(self, name: str) -> LayeredHostKernel:
        return LayeredHostKernel(self.cfg, name, self.unit)


@contextlib.contextmanager
def layered_on_host(monkeypatch):
    """Inside: LayeredEngine runs on host memory with the kernels' numpy references."""
    with on_host(monkeypatch):
        def fake_build(spec, cfg, unit_list, root=None):
            return SimpleNamespace(module=lambda name: LayeredHostModule(cfg, name))
        monkeypatch.setattr(layered_mod, "build", fake_build)
        monkeypatch.setattr(layered_mod, "Graph", HostGraph)
        monkeypatch.setattr(layered_mod, "Stream", HostStream)
        yield


# ---- checkpoints of the 27B's shape ratios, and the reference that quantizes activations as the GEMVs do --------
# the 27B's ratios and head dims at hidden 256 (every matrix a whole number of Q4_K blocks, so the Q4_K_M mix
# applies without fallbacks: Q4_K, with Q6_K for the LM head and for attn_qkv / attn_v / ffn_down on the
# use_more_bits layers, which makes fused projections of two formats)
RATIO3_Q = tiny_config(name="ratio3q", hidden_size=256, num_hidden_layers=8, intermediate_size=512,
                       num_attention_heads=6, num_key_value_heads=1, head_dim=128, linear_num_key_heads=2,
                       linear_num_value_heads=6, linear_key_head_dim=128, linear_value_head_dim=128)


class ActivationQuantized:
    """A weight matrix W for the reference's `x @ W.T`, multiplied as the quantized GEMV does: x quantized to 8 bits
    per 32 values (qgemv.quantize_x, the kernels' rounding bit for bit) times W's values, summed in float64."""
    __array_ufunc__ = None  # numpy defers `x @ self` to __rmatmul__

    def __init__(self, w: np.ndarray):
        self.w = w

    @property
    def T(self) -> "ActivationQuantized":
        return self

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        rows = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
        q, dx, _ = qgemv.quantize_x(rows)
        xq = (q.reshape(len(rows), -1, 32) * dx[..., None].astype(np.float64)).reshape(rows.shape)
        return (xq @ self.w.T.astype(np.float64)).astype(np.float32).reshape(*x.shape[:-1], -1)


class ActivationBf16:
    """A weight matrix W for the reference's `x @ W.T`, multiplied as the tensor-core GEMM does: x rounded to bf16
    times W rounded to bf16, as kernels/gemm.py's reference sums them (fp32), so that the host emulation's next
    rounding to bf16 falls on the same side as the reference's."""
    __array_ufunc__ = None

    def __init__(self, w: np.ndarray):
        self.w = np.asarray(w, np.float32).astype(ml_dtypes.bfloat16)

    @property
    def T(self) -> "ActivationBf16":
        return self

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return gemm.reference(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), self.w, "f32")


def bf16_rounded(weights: dict) -> dict:
    """Matrices rounded to bf16 (what the device holds), vectors as they are (fp32 on the device)."""
    return {k: (v.astype(ml_dtypes.bfloat16).astype(np.float32) if v.ndim == 2 else v) for k, v in weights.items()}


def draft_block(cfg, token: int) -> list[int]:
    """A DFlash draft's input block: the last token, then mask tokens."""
    return [token] + [cfg.mask_token_id] * (cfg.block_size - 1)


def bf16_activations(draft_weights: dict) -> dict:
    """A DFlash draft's weights for the reference as lucegen.engine.draft_gpu multiplies them: every matrix an
    ActivationBf16, the vectors as they are."""
    return {k: ActivationBf16(v) if np.ndim(v) == 2 else v for k, v in draft_weights.items()}


UNQUANTIZED = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}


def unquantized(ref: dict) -> dict:
    """The reference weights with plain float32 matrices (no activation quantization)."""
    return {k: v.w if isinstance(v, ActivationQuantized) else v for k, v in ref.items()}


def checkpoint(tmp_path_factory, fmt: str, peaked: bool):
    """(weights as lucegen loads them, the reference's weights) of RATIO3_Q. From a GGUF, every matrix stored in a
    quantized format multiplies quantized activations in the reference too (the embedding gather stays plain)."""
    d = tmp_path_factory.mktemp(f"ratio3q-{fmt}-{int(peaked)}")
    paths = make_checkpoint(d, RATIO3_Q, seed=11, peaked=peaked, formats=(fmt,), progress=False, tokenizer=False)
    weights = load_gguf(paths["gguf"]) if fmt == "gguf" else open_weights(paths["hf"])
    ref = {k: np.asarray(v, np.float32) for k, v in weights.load_all(progress=False).items()}
    if fmt == "gguf":
        quantized = {k for k, v in ref.items() if v.ndim == 2 and k != "embed_tokens.weight"
                     and weights.raw(gguf_name(k)).type not in UNQUANTIZED}
        if "lm_head.weight" not in ref and weights.raw("token_embd.weight").type not in UNQUANTIZED:
            ref["lm_head.weight"] = ref["embed_tokens.weight"]  # tied: the LM head GEMV reads the embeddings
            quantized.add("lm_head.weight")
        ref.update({k: ActivationQuantized(ref[k]) for k in quantized})
    return weights, ref


# ---- checks both the host emulation and the GPU run --------------------------------------------------------------
# draft trees of 1 to 14 nodes, as parents tuples (topologically ordered: parents[0] = -1, parents[i] < i)
trees = st.integers(1, 14).flatmap(lambda n: st.tuples(*[st.just(-1)] + [st.integers(0, i - 1) for i in range(1, n)]))


def tree_case(engine, parents, prefix: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A verify's inputs drawn from seed: (context of `prefix` tokens, one token per node of parents), with the
    engine left after the context (after())."""
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size
    context, tokens = rng.integers(0, vocab, prefix), rng.integers(0, vocab, len(parents))
    after(engine, context)
    return context, tokens


def after(engine, context, tokens=()) -> np.ndarray:
    """Reset, prefill `context` in the engine's chunks, then decode `tokens` one by one; the last logits."""
    engine.reset()
    logits = engine.prefill([int(t) for t in context])
    for t in tokens:
        logits = engine.decode(int(t))
    return logits


def plain_greedy(engine, prompt, n: int) -> list[int]:
    """n greedy tokens after `prompt` from a reset engine, one decode step each."""
    out = [int(np.argmax(after(engine, prompt)))]
    while len(out) < n:
        out.append(int(np.argmax(engine.decode(out[-1]))))
    return out


def assert_speculation_is_plain_decoding(engine, prompt, n: int, depth: int, budget: int, seed: int,
                                         chain: bool = False, params=None) -> None:
    """The generation loop's n tokens (lucegen.engine.generate's) with engine.speculate rounds through its
    TreeVerifier and a noisy oracle draft of them (accuracy 0.8) are its tokens without a draft, one decode step
    each, in fewer than 0.75 (n - 1) rounds: greedy (params None), or drawn under `params` from the same seed (the
    same uniform for each token, drawn from the same logits)."""
    import itertools

    from lucegen.engine.generate import _Tokens
    from lucegen.engine.layered_verify import TreeVerifier
    from lucegen.engine.sampling import Sampler, SamplingParams
    from lucegen.spec_decode import Speculation, oracle_draft
    params = params or SamplingParams(temperature=0)

    def tokens() -> tuple[list[int], int]:
        engine.reset()
        source = _Tokens(engine, Sampler(params), prompt, n)
        return list(itertools.islice(source, n)), source.passes

    engine.speculation = None
    plain, _ = tokens()
    if params.temperature == 0:
        assert plain == plain_greedy(engine, prompt, n)
    draft = oracle_draft(plain, len(prompt), engine.config.vocab_size, accuracy=0.8, seed=seed)
    engine.speculation = Speculation(draft, depth=depth, budget=budget, chain=chain)
    out, rounds = tokens()
    engine.speculation = None
    assert isinstance(engine._verifier, TreeVerifier)
    assert out == plain
    assert rounds < (n - 1) * 0.75, f"{rounds} rounds for {n - 1} tokens: the draft's tokens were not accepted"


class QuantizedSource(Source):
    """A target whose embedding is Q4_K and LM head Q6_K (as the 27B Q4_K_M GGUF), other matrices bf16."""
    FORMATS = {"embed_tokens.weight": "q4_k", "lm_head.weight": "q6_k"}

    def matrix(self, name: str):
        fmt = self.FORMATS.get(name)
        if fmt is None:
            return super().matrix(name)
        return fmt, qgemv.encode(np.asarray(self.weights[name], np.float32), fmt)
