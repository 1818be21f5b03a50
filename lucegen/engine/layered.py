"""The layer-by-layer step: M consecutive tokens (M = 1: a decode step; M > 1: a prompt chunk or a chain verify)
through every layer with per-layer kernels, then the final norm, the LM head and the argmax of every token, in the
DeviceState layout (lucegen/engine/state.py). For models the decode megakernel cannot hold: weights used as loaded
(lucegen/engine/layered_weights.py: GGUF bytes, or an HF checkpoint's bf16).

One step over m tokens at positions p .. p+m-1 (rows fp32, [m, width]):
    x = embed(ids)                                             (a gather that decodes the embedding's format)
    per layer:  h = rmsnorm(x (+= y, the previous layer's down projection; the sum into the other of two buffers))
      DeltaNet: mixed = h [in_qkv | z | b | a]^T -> the mixer (conv ring, recurrent state) -> o
                -> gated RMSNorm with z -> y = . out^T
      attention: qkv = h [q (query, gate) | k | v]^T -> the mixer (K/V into the cache, attention, gate) -> y = . o^T
      MLP:      h = rmsnorm(x += y) -> gu = h [gate | up]^T -> act = silu(gate) up -> y = act down^T
    h = rmsnorm(x += y) with the final norm; logits = h lm_head^T; tokens = argmax per row
Projections are qgemv.QMatmul (the GEMV for m = 1, the small-M GEMM otherwise; a GEMM row is bit for bit the GEMV
of that row). Their quantized activations (8 bits per 32 values) are written by the kernels that make the rows
they read (add + RMSNorm, SiLU x up, the DeltaNet mixer's gated norm, the attention's merge), not by a launch
before each projection. The mixers are the tree kernels (lucegen/kernels/tree.py), driven by a mixer object: DecodeMixer runs
the m tokens one by one as 1-node trees (the decode step), so an M-token step is M decode steps' arithmetic exactly;
a tree verify (lucegen/engine/layered_verify.py) runs the same layers over the N nodes of a draft tree at once
through the same kernels, so each node's logits are its decode step's.

The step reads its position and token ids from the device (io = [position, ids...]) and is captured once per m
(per tree shape for a verify) in a CUDA graph: a step is one graph launch, with no host round trip inside it.

Target features (capture_features, for a DFlash draft): the hidden states after some layers (HF hidden_states[i +
1]: the residual stream after layer i, which the next add + RMSNorm forms; after the last layer, the final norm's
output), each row's copied by the place kernel into its column block of `features` [rows, layers x hidden] as part
of every step and verify; LayeredStep.commit_rows hands the rows of committed tokens to the step's `follower`
(lucegen/engine/layered_draft.py: the GPU draft's context).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..codegen.build import BUILD_DIR, build
from ..kernels import argmax, layered, qgemm_tc, qgemv, sample, topk, tree
from ..model.config import LINEAR, ModelConfig
from ..model.draft_config import DraftConfig
from ..model.gguf_file import GGUFCheckpoint
from ..runtime import DeviceArray, Graph, Stream
from ..spec import ChipSpec, spec_for_current_device
from .base import ContextOverflow
from .layered_weights import GGUFSource, LayeredWeights, Projection, Source
from .speculating import Speculating
from .state import DeviceState


def units(spec: ChipSpec, cfg: ModelConfig, weights: LayeredWeights):
    """Every kernel a step over `weights` launches on `spec` (the tree kernels in the weights' value-head order)."""
    tc = [(f, k) for f, k in weights.pairs() if f in spec.tuning.qgemv.tensor_core_formats]
    return [*layered.units(spec, cfg, [weights.embed.parts[0].fmt]), *tree.units(spec, cfg, [weights.tiled]),
            *qgemv.units(spec, cfg, [p for p in weights.pairs() if p not in tc]), *argmax.units(spec, cfg),
            *sample.units(spec, cfg), *topk.units(spec, cfg), *(qgemm_tc.units(spec) if tc else [])]


def rows(a: DeviceArray, m: int, width: int, first: int = 0) -> DeviceArray:
    """Rows first .. first + m - 1 of a row-major fp32 buffer of rows `width` wide, as [m, width]."""
    return a.view((m, width), offset_bytes=4 * first * width)


class DecodeMixer:
    """The mixers of a step over m consecutive tokens: one 1-node tree (the decode step) per token, each after the
    previous one (its DeltaNet state, conv ring and K/V row updated in place, at position io[0] + t)."""
    advances = True  # the step leaves io at the next position (launch_greedy continues from there)

    def __init__(self, step: "LayeredStep"):
        self.step = step

    def in_rows(self, i: int) -> DeviceArray:
        """Where linear layer i's in-projection rows go (the step's scratch: nothing reads them after the layer)."""
        return self.step.proj

    def linear(self, L: Mapping, i: int, mixed, out, m: int, stream, normed, normed_q) -> None:
        """The DeltaNet mixer of linear layer i: raw head outputs into out, their gated RMSNorm into normed and its
        XBlocks into normed_q (None: none)."""
        s, c = self.step, self.step.cfg
        for t in range(m):
            norm = (L["norm"], rows(normed, 1, c.value_dim, t), qgemv.xblock_row(normed_q, t, c.value_dim))
            s.tree.decode_deltanet(rows(mixed, 1, L["lin_in"].n, t), L["conv"], L["a_log"], L["dt_bias"],
                                   s.state.conv[i], s.state.recurrent[i], rows(out, 1, c.value_dim, t), t, s.io,
                                   stream=stream, norm=norm)

    def full(self, L: Mapping, i: int, qkv, out, m: int, stream, out_q) -> None:
        """The attention mixer of full layer i: gated outputs into out, their XBlocks into out_q (None: none)."""
        s, c = self.step, self.step.cfg
        width = c.num_attention_heads * c.head_dim
        for t in range(m):
            s.tree.decode_attention(rows(qkv, 1, L["att_in"].n, t), L["q_norm"], L["k_norm"], s.state.keys[i],
                                    s.state.values[i], rows(out, 1, width, t), t, s.io, stream=stream,
                                    out_q=qgemv.xblock_row(out_q, t, width))


class LayeredStep:
    """step(ids) over a DeviceState: logits [m, vocab] and tokens [m] (argmax) on the device, for up to
    `max_tokens` tokens a step; its buffers also hold a tree verify's rows (the spec's largest DDTree + the root)."""

    def __init__(self, spec: ChipSpec, weights: LayeredWeights, state: DeviceState, max_tokens: int = 16,
                 root: Path = BUILD_DIR):
        cfg = self.cfg = weights.cfg
        if problem := layered.shape_problem(spec, cfg) or tree.shape_problem(cfg, spec):
            raise ValueError(problem)
        if not cfg.linear_layers or not cfg.full_layers:
            raise ValueError(f"{cfg.name}: the layer-by-layer step takes models with both DeltaNet and attention "
                             f"layers")
        if state.kv_format != tree.kv_rows(spec, cfg):
            raise ValueError(f"the state holds {state.kv_format} KV rows; {spec.name}'s kernels read "
                             f"{tree.kv_rows(spec, cfg)} (tuning.kv_format)")
        self.spec, self.weights, self.state, self.max_tokens = spec, weights, state, max_tokens
        self.max_rows = max(max_tokens, spec.tuning.ddtree.capacity + 1)
        if self.max_rows > qgemv.VERIFY_ROWS:
            raise ValueError(f"a step of {self.max_rows} rows; the projections reserve activations for at most "
                             f"{qgemv.VERIFY_ROWS} (qgemv.VERIFY_ROWS)")
        result = build(spec, cfg, units(spec, cfg, weights), root=root)
        mod = lambda name: result.module(name)
        self.kernels = layered.LayerKernels(mod(layered.unit_name(weights.embed.parts[0].fmt)), spec, cfg)
        self.tree = tree.TreeKernels(mod(tree.unit_name(weights.tiled)), cfg, spec)
        self.mixer = DecodeMixer(self)
        qmods = {}
        self.mm = {}
        for fmt, k in weights.pairs():
            if fmt in spec.tuning.qgemv.tensor_core_formats:  # one batch-invariant kernel for every M
                self.mm[fmt, k] = qgemm_tc.QGemmTC(mod(qgemm_tc.UNIT), spec, fmt, self.max_rows, k)
                continue
            qmods.setdefault(fmt, mod(f"qgemv_{fmt}"))
            self.mm[fmt, k] = qgemv.QMatmul(qmods[fmt], spec, fmt, k, model=cfg.name)
        self.argmax = argmax.Argmax(mod("argmax"), spec, self.max_rows)
        self.sample = sample.Sample(mod("sample"), spec)
        self.top_k = topk.TopKKernel(mod("topk"), spec, rows=1, vocab=cfg.vocab_size)
        self.stream = Stream(programmatic=spec.tuning.layered.pdl)  # every kernel of the step waits as it must
        self.graphs: dict[tuple, Graph] = {}
        self._allocate(self.max_rows)
        self.feature_layers: tuple[int, ...] = ()  # capture_features
        self.features: DeviceArray | None = None
        self.follower = None  # takes follow(rows, position) of committed tokens (commit_rows)

    def _allocate(self, n: int) -> None:
        c, W = self.cfg, self.weights
        projs = [W.lm_head, *(p for L in W.layers for p in L.values() if isinstance(p, Projection))]
        width = max(p.n for p in projs if p is not W.lm_head)
        self.io = DeviceArray.zeros(1 + n, np.int32)
        self.x, self.x_next, self.h, self.y = (DeviceArray.empty((n, c.hidden_size), np.float32) for _ in range(4))
        self.proj = DeviceArray.empty((n, width), np.float32)
        self.mix_out = DeviceArray.empty((n, max(c.value_dim, c.num_attention_heads * c.head_dim)), np.float32)
        self.normed = DeviceArray.empty((n, c.value_dim), np.float32)
        self.act = DeviceArray.empty((n, c.intermediate_size), np.float32)
        # the XBlocks of h, normed, act and the attention output, written by the kernels that make them, where a
        # quantized matrix reads them (else None: the kernels skip them, and the attention output's projection
        # quantizes it itself where the attention cannot: tree.xblocks_in_merge)
        xq = lambda width: DeviceArray.empty(qgemv.xblock_bytes(n, width), np.uint8) \
            if self.quantized(width) else None
        self.hq, self.normedq, self.actq = xq(c.hidden_size), xq(c.value_dim), xq(c.intermediate_size)
        self.attq = xq(c.num_attention_heads * c.head_dim) if tree.xblocks_in_merge(c) else None
        self.logits = DeviceArray.empty((n, c.vocab_size), np.float32)
        self.tokens = DeviceArray.empty(n, np.int32)

    def capture_features(self, layer_ids: Sequence[int]) -> DeviceArray:
        """From now on every step and verify also writes each row's target features into `features`, fp32
        [max_rows, len(layer_ids) x hidden]: block j of a row is the hidden state after layer layer_ids[j] (HF
        hidden_states[layer_ids[j] + 1]). Graphs captured before (without the copies) are dropped."""
        c = self.cfg
        if not layer_ids or not all(0 <= i < c.num_hidden_layers for i in layer_ids):
            raise ValueError(f"feature layers {list(layer_ids)}: the target has layers 0 .. {c.num_hidden_layers - 1}")
        for key in list(self.graphs):
            self.graphs.pop(key).destroy()
        if self.features is not None:
            self.features.free()
        self.feature_layers = tuple(layer_ids)
        self.features = DeviceArray.empty((self.max_rows, len(layer_ids) * c.hidden_size), np.float32)
        return self.features

    def capture(self, layer: int, x: DeviceArray, m: int, stream) -> None:
        """Rows x [m, hidden], the hidden states after `layer`, into the column blocks of `features` that hold
        that layer's (none unless capture_features asked for it)."""
        H = self.cfg.hidden_size
        for j, i in enumerate(self.feature_layers):
            if i == layer:
                self.kernels.place(x, self.features, H, self.features.shape[1], j * H, m, stream=stream)

    def quantized(self, k: int) -> bool:
        """Whether a matrix of row width k multiplies quantized activations (a part in a quantized format)."""
        return k % 32 == 0 and any(qgemv.fmt_of(f).quantizes_x for f, kk in self.weights.pairs() if kk == k)

    # ---- one step -----------------------------------------------------------------------------------------------
    def project(self, P: Projection, x: DeviceArray, y: DeviceArray, m: int, stream, xq=None) -> None:
        """y [m, P.n] = x [m, P.k] P^T (Projection.apply)."""
        P.apply(self.mm, x, y, m, stream, xq)

    def enqueue(self, m: int, stream, mixer=None) -> None:
        """Every launch of a step over the m tokens of io (position and ids already on the device); the mixers
        are `mixer`'s (by default the decode step's)."""
        c, W, k = self.cfg, self.weights, self.kernels
        mixer = mixer or self.mixer
        k.embed(W.embed.parts[0].w, self.io, self.x, m, stream=stream)
        hq, normedq, actq = self.hq, self.normedq, self.actq
        residual = [self.x, self.x_next]  # each add + RMSNorm reads the first and writes the sum to the second

        def add_norm(y, w):
            k.add_rmsnorm(residual[0], y, w, residual[1], self.h, m, stream=stream, xq=hq)
            residual.reverse()

        for i, kind in enumerate(c.layer_types):
            L = W.layers[i]
            add_norm(None if i == 0 else self.y, L["ln1"])
            self.capture(i - 1, residual[0], m, stream)  # the residual stream after layer i - 1
            if kind == LINEAR:
                mixed = mixer.in_rows(i)
                self.project(L["lin_in"], self.h, mixed, m, stream, hq)
                mixer.linear(L, i, mixed, self.mix_out, m, stream, self.normed, normedq)
                self.project(L["lin_out"], self.normed, self.y, m, stream, normedq)
            else:
                self.project(L["att_in"], self.h, self.proj, m, stream, hq)
                mixer.full(L, i, self.proj, self.mix_out, m, stream, self.attq)
                self.project(L["att_out"], self.mix_out, self.y, m, stream, self.attq)
            add_norm(self.y, L["ln2"])
            self.project(L["gate_up"], self.h, self.proj, m, stream, hq)
            k.silu_mul(self.proj, self.act, m, stream=stream, xq=actq)
            self.project(L["down"], self.act, self.y, m, stream, actq)
        add_norm(self.y, W.final_norm)
        self.capture(c.num_hidden_layers - 1, self.h, m, stream)  # HF's last hidden state: the final norm's output
        V = c.vocab_size
        self.project(W.lm_head, self.h, self.logits, m, stream, hq)
        self.argmax(self.logits.view(m * V), self.tokens.view(m), stream=stream, rows=m)
        if mixer.advances:
            k.advance(self.io, self.tokens, m, stream=stream)

    def check_ids(self, ids: Sequence[int], most: int, what: str) -> np.ndarray:
        """ids as int32 after checking their count (1 .. most) and values; a clear error otherwise."""
        m = len(ids)
        if not 1 <= m <= most:
            raise ValueError(f"{what} takes 1 .. {most} tokens; got {m}")
        ids = np.asarray(ids, np.int64)
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in 0 .. {self.cfg.vocab_size - 1}")
        return ids.astype(np.int32)

    def upload(self, ids: np.ndarray) -> None:
        """io = [the state's position, ids...] (on the stream, before the launches that read it)."""
        self._io_host = np.concatenate([[self.state.position], ids]).astype(np.int32)  # alive until the copy ran
        self.io.view(1 + len(ids)).copy_from(self._io_host, stream=self.stream)

    def replay(self, key: tuple, enqueue) -> None:
        """Launch the graph of `key` (its first element: who owns it), captured from enqueue(stream) on first
        use."""
        if key not in self.graphs:
            with Graph.capture(self.stream) as g:
                enqueue(self.stream)
            self.graphs[key] = g
        self.graphs[key].launch(self.stream)

    def launch(self, ids: Sequence[int]) -> None:
        """Start a step over `ids` at the state's position (one graph launch, captured on first use of this m);
        advances the position. Outputs: logits[:m], tokens[:m] once the stream is done (wait()); io then holds the
        next position and tokens[m - 1] (launch_greedy continues from there)."""
        ids = self.check_ids(ids, self.max_tokens, "a step")
        if self.state.position + len(ids) > self.state.max_context:
            raise ContextOverflow(f"{self.state.position} tokens in the state + {len(ids)} exceed the context of "
                                  f"{self.state.max_context} tokens")
        self.upload(ids)
        self._replay(len(ids))

    def launch_greedy(self, n: int) -> None:
        """n one-token steps, each on the previous step's argmax (left in io by the step before), without the host:
        greedy generation after a launch(), or n decode steps timed back to back."""
        if self.state.position + n > self.state.max_context:
            raise ContextOverflow(f"{self.state.position} tokens in the state + {n} exceed the context of "
                                  f"{self.state.max_context} tokens")
        for _ in range(n):
            self._replay(1)

    def drop(self, owner) -> None:
        """Destroy the graphs `owner` captured (before it frees buffers they read)."""
        for key in [k for k in self.graphs if k[0] is owner]:
            self.graphs.pop(key).destroy()

    def _replay(self, m: int) -> None:
        self.replay((self, m), lambda stream: self.enqueue(m, stream))
        self.commit_rows(range(m))

    def commit_rows(self, rows: Sequence[int]) -> None:
        """The tokens of `rows` of the last step or verify (in order) are now in the state: the position moves past
        them, and the follower (if any) takes their rows, queued on the stream before the next launch."""
        if self.follower is not None:
            self.follower.follow(rows, self.state.position)
        self.state.position += len(rows)

    def wait(self) -> None:
        self.stream.synchronize()

    def free(self) -> None:
        for g in self.graphs.values():
            g.destroy()
        for a in (self.io, self.x, self.x_next, self.h, self.y, self.proj, self.mix_out, self.normed,
                  self.act, self.logits, self.tokens, self.hq, self.normedq, self.actq, self.attq, self.features):
            if a is not None:
                a.free()
        for op in self.mm.values():  # their scratch: quantized or fp16 activations
            op.free()
        self.argmax.free()
        self.sample.free()
        self.top_k.free()
        self.tree.free()
        self.stream.destroy()


def weight_source(weights: Mapping[str, np.ndarray] | Source, config: ModelConfig) -> Source:
    """The Source of a checkpoint: a GGUF file as stored, an HF one in bf16 (already a Source: itself)."""
    if isinstance(weights, Source):
        return weights
    return GGUFSource(weights) if isinstance(weights, GGUFCheckpoint) else Source(weights, config)


class LayeredEngine(Speculating):
    """One sequence through the layer-by-layer step (the Engine interface): prompts in chunks of up to
    `chunk` tokens, then one step per generated token. gpu_draft() attaches a DFlash draft that runs on the GPU
    from the step's own target features."""
    draft = None  # the LayeredDraft of gpu_draft()

    def __init__(self, weights: Mapping[str, np.ndarray] | Source, config: ModelConfig,
                 spec: ChipSpec | None = None, max_context: int | None = None, chunk: int = 16,
                 build_root: Path = BUILD_DIR):
        self.config = config
        self.spec = spec or spec_for_current_device()
        self.max_context = min(max_context or self.spec.tuning.max_context, config.max_position_embeddings)
        self.weights = LayeredWeights(weight_source(weights, config), self.spec.tuning.qgemv.tensor_core_formats)
        kv = tree.kv_rows(self.spec, config)
        if kv != self.spec.tuning.kv_format:
            warnings.warn(f"{self.spec.name}: tuning.kv_format {self.spec.tuning.kv_format} is not read by the "
                          f"layer-by-layer step's attention for {config.name} (head_dim {config.head_dim}); its KV "
                          f"cache holds {kv} rows")
        self.state = DeviceState(config, self.max_context, kv)
        self.step = LayeredStep(self.spec, self.weights, self.state, chunk, build_root)
        self.build_root = build_root

    @property
    def position(self) -> int:
        return self.state.position

    def reset(self) -> None:
        self.state.reset()

    def run(self, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """One step over ids: (logits [m, vocab], argmax [m])."""
        self.step.launch(ids)
        self.step.wait()
        m = len(ids)
        return self.step.logits.view((m, self.config.vocab_size)).numpy(), self.step.tokens.view(m).numpy()

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        if not len(tokens):
            raise ValueError("no tokens to prefill")
        if self.position + len(tokens) > self.max_context:
            raise ContextOverflow(f"{self.position} tokens in the state + {len(tokens)} exceed the context of "
                                  f"{self.max_context} tokens")
        n = self.step.max_tokens
        for c0 in range(0, len(tokens), n):
            chunk = tokens[c0:c0 + n]
            self.step.launch(chunk)
        self.step.wait()
        V = self.config.vocab_size
        return self.step.logits.view(V, offset_bytes=4 * (len(chunk) - 1) * V).numpy()

    def decode(self, token: int) -> np.ndarray:
        return self.run([token])[0][0]

    def decode_argmax(self, token: int) -> int:
        """decode's step, returning the step's device argmax (numpy's rule), not vocab logits."""
        self.step.launch([token])
        self.step.wait()
        return int(self.step.tokens.view(1).numpy()[0])

    def decode_sample(self, token: int, temperature: float, u: float) -> int:
        """decode's step, returning the token drawn on the device from softmax(logits / temperature) with the
        uniform u (kernels/sample.py's law: Sampler's for the same u), not vocab logits."""
        self.step.launch([token])
        self.step.sample(self.step.logits.view(self.config.vocab_size), temperature, u, stream=self.step.stream)
        self.step.wait()
        return int(self.step.sample.out.numpy()[0])

    @property
    def max_top_k(self) -> int:
        """The most tokens decode_top_k returns (tuning.topk.max_k)."""
        return topk.max_k(self.spec)

    def decode_top_k(self, token: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """decode's step, returning the k best tokens of its logits (best first, ties to the lower id) and their
        log-softmax values, found on the device (kernels/topk.py), not vocab logits; step_logits() has the rest."""
        self.step.launch([token])
        ids, values = self.step.top_k(self.step.logits, 1, self.config.vocab_size, k, stream=self.step.stream)
        self.step.wait()
        return ids.numpy()[0], values.numpy()[0]

    def decode_top_p(self, token: int, temperature: float, k: int) -> tuple[np.ndarray, np.ndarray, float, float]:
        """decode's step, returning the k best tokens of its logits (best first, ties to the lower id), their logits,
        and the row's softmax at the temperature (kernels/sample.py's softmax_of: Z and S), found on the device, not
        vocab logits: what Sampler.draw_top_p takes; step_logits() has the rest."""
        s, V = self.step, self.config.vocab_size
        s.launch([token])
        ids, _, values = s.top_k.best(s.logits, 1, V, k, stream=s.stream)
        s.sample.softmax(s.logits.view(V), temperature, stream=s.stream)
        s.wait()
        return (ids.numpy()[0], values.numpy()[0], *s.sample.softmax_of(1, temperature)[0])

    def step_logits(self) -> np.ndarray:
        """The logits [vocab] of the last one-token step."""
        return self.step.logits.view(self.config.vocab_size).numpy()

    @property
    def max_tree_nodes(self) -> int:
        return self.step.tree.max_nodes  # the spec's largest DDTree (tuning.ddtree.capacity) + the root

    def verifier(self):
        """The whole tree in one forward of the step, through the kernels it decodes with."""
        from .layered_verify import TreeVerifier  # here: it imports this module
        return TreeVerifier(self.step)

    def gpu_draft(self, cfg: DraftConfig, draft_weights: Mapping[str, np.ndarray]):
        """A DFlash draft (DraftConfig cfg, float32 weights by checkpoint name) on the GPU that follows this
        engine's committed tokens (lucegen/engine/layered_draft.py): a draft_fn for a Speculation. Replaces the
        one attached before."""
        from .layered_draft import LayeredDraft  # here: it imports this module
        if self.draft is not None:
            self.draft.free()
        self.draft = LayeredDraft(self.step, cfg, draft_weights, root=self.build_root)
        return self.draft

    def free(self) -> None:
        self.free_speculation()
        if self.draft is not None:
            self.draft.free()
            self.draft = None
        self.step.free()
        self.state.free()
        self.weights.free()
