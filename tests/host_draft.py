"""The GPU DFlash draft (lucegen/engine/draft_gpu.py) and the device top-K (lucegen/kernels/topk.py) on host memory:
device arrays on numpy buffers (tests/host_kernels.py), every kernel launch replaced by its family's numpy reference
applied to exactly the kernel's arguments (the draft family's here, the layered and qgemv ones from
tests/host_layered.py), CUDA graphs by their recorded launches. Used by tests/test_draft_gpu_host.py and, with the
layer-by-layer step on host too, tests/test_layered_draft_host.py; the checks at the end by that file and by
tests/gpu/test_layered_draft_gpu.py alike."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import lucegen.engine.draft_gpu as draft_gpu_mod
import lucegen.engine.layered_draft as layered_draft_mod
from lucegen.engine.generate import generate
from lucegen.engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from lucegen.engine.sampling import Sampler, SamplingParams
from lucegen.kernels import draft
from lucegen.model.draft import load_draft
from lucegen.model.tokenizer import Tokenizer
from lucegen.model.weights import open_weights
from lucegen.reference import relative_error
from lucegen.reference.dflash import dflash_draft_fn
from lucegen.spec_decode import Speculation

from host_kernels import on_host, rows_of, run_gemm, store
from host_layered import (HostGraph, HostStream, LayeredHostKernel, _array, after, bf16_activations, layered_on_host,
                          plain_greedy, topk_on_host, write_xblocks)

STEP_RTOL = 1e-2  # the step's bf16 K/V cache against the reference's fp32 one (tests/gpu/test_layered_gpu.py)
# the log-prob gap (nats) between the reference draft's best and second token past which the GPU draft's best may
# not differ: features within STEP_RTOL of the reference's move a draft's log-probs by far less (measured on the
# host emulation: 3e-4 at log-probs of -5)
MARGIN = 0.1


class DraftHostKernel(LayeredHostKernel):
    """The draft family's kernels by their numpy references, the GEMM's as tests/host_kernels.py runs them (the spec's
    method must be mma: tensor maps do not reach the host), the others as tests/host_layered.py runs them."""
    gemm_launches = 0  # the split-K blocks' order of each launch is drawn from this count

    def __init__(self, cfg, name: str, unit: str, draft_cfg):
        super().__init__(cfg, name, unit)
        self.draft = draft_cfg

    def run(self, grid, args) -> None:
        if self.name.startswith("gemm_"):  # the draft's projections
            DraftHostKernel.gemm_launches += 1
            return run_gemm(self.name, grid, args, DraftHostKernel.gemm_launches)
        if not self.name.startswith("draft_"):
            return super().run(grid, args)
        d, name = self.draft, self.name
        H, B = d.hidden_size, d.block_size
        nh, nkv, hd, L = d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.num_hidden_layers
        rows = nh // nkv * B
        if name == "draft_rmsnorm":
            x, y, w, x_out, h, xq, h16 = args
            m = grid[0]
            x1, h1 = draft.rmsnorm_reference(rows_of(x, m, H), None if _array(y) is None else rows_of(y, m, H), w.a,
                                             d.rms_norm_eps)
            store(rows_of(x_out, m, H), x1)
            store(rows_of(h, m, H), h1)
            write_xblocks(xq, rows_of(h, m, H))
            if _array(h16) is not None:
                store(rows_of(h16, m, H), h1)
        elif name == "draft_to_bf16":
            x, y, n = args
            store(y.a.reshape(-1)[:n], x.a.reshape(-1)[:n])
        elif name == "draft_block_qkv":
            qkv, q_norm, k_norm, io, q, k, v = args
            assert grid[0] == B
            outs = draft.block_qkv_reference(d, rows_of(qkv, B, (nh + 2 * nkv) * hd), q_norm.a, k_norm.a,
                                             int(io.a[0]))
            for dst, val in zip((q, k, v), outs):
                store(dst.a.reshape(-1)[:val.size], val.ravel())
        elif name == "draft_context_kv":
            kv, k_norms, pos, slot0, window, keys, values = args
            T, layers = grid
            assert layers == L
            kk, vv = draft.context_kv_reference(d, rows_of(kv, T, L * 2 * nkv * hd), k_norms.a.reshape(L, hd),
                                                pos.a[:T])
            slots = draft.ring_slots(slot0, T, window)
            for ring, val in ((keys, kk), (values, vv)):
                r = ring.a.reshape(L, window, nkv, hd)
                r[:, slots] = val.transpose(1, 0, 2, 3)
        elif name == "draft_attention":
            q, bk, bv, ring_k, ring_v, n_ctx, part_o, part_ml = args
            assert grid[0] == nkv
            n, splits = int(n_ctx.a[0]), grid[1]
            po, pml = draft.attention_partials(q.a.reshape(B, nh, hd), bk.a.reshape(B, nkv, hd),
                                               bv.a.reshape(B, nkv, hd), ring_k.a, ring_v.a, n, splits)
            done = len(draft.split_ranges(n + B, splits))  # the kernel writes the non-empty splits alone
            part_o.a.reshape(nkv, splits, rows, hd)[:, :done] = po[:, :done]
            part_ml.a.reshape(nkv, splits, rows, 2)[:, :done] = pml[:, :done]
        elif name == "draft_merge":
            part_o, part_ml, n_ctx, out = args
            assert grid == (nkv, rows)
            splits = part_o.size // (nkv * rows * hd)
            merged = draft.merge_reference(part_o.a.reshape(nkv, splits, rows, hd),
                                           part_ml.a.reshape(nkv, splits, rows, 2), int(n_ctx.a[0]), B, nh)
            store(rows_of(out, B, nh * hd), merged)
        else:
            raise KeyError(f"no host stand-in for kernel {name}")


def draft_on_host(monkeypatch, draft_cfg):
    """Inside: GpuDraft runs on host memory with the kernels' numpy references."""
    ctx = on_host(monkeypatch)
    ctx.__enter__()
    seen = {}

    def fake_build(spec, cfg, unit_list, root=None):
        seen["units"] = [u.name for u in unit_list]
        return SimpleNamespace(module=lambda name: SimpleNamespace(
            kernel=lambda k: DraftHostKernel(cfg, k, name, draft_cfg)))
    monkeypatch.setattr(draft_gpu_mod, "build", fake_build)
    monkeypatch.setattr(draft_gpu_mod, "Graph", HostGraph)
    monkeypatch.setattr(draft_gpu_mod, "Stream", HostStream)
    return ctx, seen


class TopKHostKernel:
    """topk_f32 by its numpy reference (topk.reference) on the launch's logits; its outputs written as the kernel
    writes them."""

    def __call__(self, grid, block, logits, vocab, k, lists, stats, tickets, ids, logprobs, values, stream=None):
        topk_on_host(grid[1], logits, vocab, k, ids, logprobs, values)


@contextlib.contextmanager
def layered_draft_on_host(monkeypatch, draft_cfg):
    """Inside: LayeredEngine, its GPU draft (LayeredEngine.gpu_draft) and the draft's top-K run on host memory
    with the kernels' numpy references."""
    with layered_on_host(monkeypatch):
        ctx, _ = draft_on_host(monkeypatch, draft_cfg)
        monkeypatch.setattr(layered_draft_mod, "build", lambda spec, cfg, unit_list, root=None: SimpleNamespace(
            module=lambda name: SimpleNamespace(kernel=lambda k: TopKHostKernel())))
        try:
            yield
        finally:
            ctx.__exit__(None, None, None)


# ---- checks both the host emulation and the GPU run --------------------------------------------------------------
class Recording:
    """A draft_fn that records its calls: (context, n, what the draft returned)."""

    def __init__(self, draft_fn):
        self.draft_fn, self.calls = draft_fn, []

    def __call__(self, context, n: int):
        out = self.draft_fn(context, n)
        self.calls.append((list(context), n, out))
        return out


def speculative_greedy(engine, prompt, n: int, decode_every: int = 0) -> list[int]:
    """n greedy tokens after `prompt` from a reset engine in engine.speculate rounds (engine.speculation set), with
    a plain decode step after every `decode_every`-th round (0: none)."""
    greedy = Sampler(SamplingParams(temperature=0))
    out, rounds = [int(np.argmax(after(engine, prompt)))], 0
    while len(out) < n:
        out += engine.speculate([*prompt, *out], n - len(out), greedy)
        rounds += 1
        if decode_every and rounds % decode_every == 0 and len(out) < n:
            out.append(int(np.argmax(engine.decode(out[-1]))))
    return out


def assert_drafts_as_the_reference(calls, reference, least: int = 10) -> None:
    """Each recorded call's TopK against the log-probs [n, vocab] of reference(context, n) (the reference DFlash
    draft on the reference target's features): the same best token at every depth where the reference's best
    leads its second by more than MARGIN, and log-probs at the TopK's ids within STEP_RTOL (relative); at least
    `least` depths compared so."""
    compared = 0
    for context, n, top in (call for call in calls if call[1]):  # (a round with nothing to draft: n = 0)
        lp = reference(context, n)
        best = np.sort(lp, axis=1)
        clear = best[:, -1] - best[:, -2] > MARGIN
        np.testing.assert_array_equal(top.ids[clear, 0], lp.argmax(1)[clear], err_msg=f"after {len(context)} tokens")
        err = relative_error(top.logprobs, np.take_along_axis(lp, top.ids, 1))
        assert err < STEP_RTOL, f"after {len(context)} tokens: log-probs off by {err:.2e} (relative)"
        compared += int(clear.sum())
    assert compared >= least, f"{compared} depths with a clear margin: the comparison says little"


def assert_gpu_draft_speculation(engine, cfg, draft_weights, reference_weights, prompts, n: int,
                                 budget: int | None = None) -> None:
    """engine.gpu_draft(cfg, draft_weights) in speculative rounds (trees of `budget`, default the spec's), a plain
    decode step after every third round: plain greedy's n tokens after each prompt, one sequence after another on
    the engine; and every fourth round's draft the reference DFlash draft's on the reference target's features
    (dflash_draft_fn on reference_weights)."""
    recording = Recording(engine.gpu_draft(cfg, draft_weights))
    engine.speculation = Speculation(recording, cfg.block_size - 1, budget or engine.spec.tuning.ddtree.budget)
    for prompt in prompts:
        assert speculative_greedy(engine, prompt, n, decode_every=3) == plain_greedy(engine, prompt, n)
    engine.speculation = None
    assert_drafts_as_the_reference(recording.calls[::4],
                                   dflash_draft_fn(bf16_activations(draft_weights), reference_weights, cfg,
                                                   engine.config))


def assert_the_trained_pair_accepts(make_engine, prompts: int = 3, tokens: int = 24) -> None:
    """The shipped tiny pair (lucegen/models/tiny-pycode) on make_engine(target weights, config) (a LayeredEngine)
    with its GPU draft, on held-out code prompts: generate() gives plain greedy's tokens, more tokens a target pass
    than a guessing draft gets (tests/test_tiny_pair.py: a draft that reads the target's features wrongly stays
    near 1), and the rounds draft as the reference draft does."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from pycode_corpus import held_out_prompts
    from test_tiny_pair import GUESSING, TRAINED
    if not TRAINED:
        pytest.skip("the trained pair is not in the checkout")
    target = open_weights(DEFAULT_TARGET)
    cfg, weights = load_draft(DEFAULT_DRAFT, target.config)
    tokenizer = Tokenizer.from_dir(DEFAULT_TARGET)
    engine = make_engine(target, target.config)
    recording = Recording(engine.gpu_draft(cfg, weights))
    speculation = Speculation(recording, cfg.block_size - 1, min(22, engine.spec.tuning.ddtree.capacity))
    greedy, emitted, passes = SamplingParams(temperature=0), 0, 0
    for _, prompt in held_out_prompts(prompts):
        ids = tokenizer.encode(prompt)
        engine.speculation = None
        plain = generate(engine, tokenizer, ids, tokens, greedy, ignore_eos=True)
        engine.speculation = speculation
        got = generate(engine, tokenizer, ids, tokens, greedy, ignore_eos=True)
        assert got.token_ids == plain.token_ids
        emitted, passes = emitted + got.completion_tokens - 1, passes + got.target_passes
    engine.free()
    assert emitted / passes > GUESSING, f"{emitted / passes:.2f} tokens a target pass"
    reference = {k: np.asarray(v, np.float32) for k, v in target.load_all(progress=False).items()}
    assert_drafts_as_the_reference(recording.calls[::3],
                                   dflash_draft_fn(bf16_activations(weights), reference, cfg, target.config))
