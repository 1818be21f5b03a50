"""The GPU DFlash draft (lucegen/engine/draft_gpu.py) without a GPU: device arrays on numpy buffers
(tests/host_kernels.py), every kernel launch replaced by its family's numpy reference applied to exactly the
kernel's arguments (the draft family's here, the layered and qgemv ones from tests/host_layered.py), the CUDA graph
by its recorded launches. Checked against lucegen.reference.dflash.draft_forward on the same (bf16-rounded)
weights, the draft's activation buffers in float32 (the `exact` fixture), so that no bf16 rounding lies between the
two: what is left is sums in other orders and the RoPE scale folded into the queries, ~3e-7 relative (with bf16
buffers, an fp32-level difference that happens to cross a bf16 rounding boundary moves a row by ~5e-5, so passing
at 1e-5 would be luck); a wrong index, position, ring slot, head order or split is off by O(0.1..1). The quantized
embedding and LM head test keeps the bf16 buffers and bounds the error by the quantization's own.

Also: the draft family's numpy references (block q/k norm + RoPE, context K/V rows into a ring, the split
attention and its merge) against the plain reference's draft attention on hypothesis-drawn shapes, and the
family's unit compiled (NVRTC) for small draft shapes on every spec (tests/test_codegen.py compiles the bundled
27B draft's with every family)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lucegen.codegen.build import build
from lucegen.engine import draft_gpu
from lucegen.engine.draft_gpu import GpuDraft
from lucegen.engine.layered_weights import LayeredWeights, Source
from lucegen.kernels import draft, qgemv
from lucegen.model.config import tiny_config
from lucegen.model.draft_config import tiny_draft_config
from lucegen.model.quants import GGMLType, dequantize
from lucegen.reference import random_weights, relative_error
from lucegen.reference.dflash import draft_attention, draft_forward, random_draft_weights
from lucegen.reference.ops import rope_cos_sin
from lucegen.spec import list_specs, load_spec

from host_draft import draft_on_host
from host_layered import ActivationQuantized, bf16_activations, bf16_rounded, draft_block, QuantizedSource

RTOL = 1e-5
HOST_SPEC = load_spec("h200").with_prefill(gemm="mma")  # the GEMM's arrays, not TMA descriptors, reach the host
TARGET = tiny_config()
DRAFT = tiny_draft_config(TARGET)


@pytest.fixture
def host(monkeypatch):
    made = []

    def make(draft_cfg=DRAFT):
        ctx, seen = draft_on_host(monkeypatch, draft_cfg)
        made.append(ctx)
        return seen
    yield make
    for ctx in made:
        ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def tiny():
    target_w = bf16_rounded(random_weights(TARGET, seed=1))
    draft_w = bf16_rounded(random_draft_weights(DRAFT, seed=2))
    feats = np.random.default_rng(3).standard_normal((40, DRAFT.fc_in), dtype=np.float32)
    return target_w, draft_w, feats


@pytest.fixture
def exact(host, monkeypatch):
    """host, with the draft's activation buffers in float32 instead of bf16 (draft_gpu.BF16)."""
    monkeypatch.setattr(draft_gpu, "BF16", np.float32)
    return host


def make_draft(target_w, draft_w, target_cfg=TARGET, draft_cfg=DRAFT, source=None, **kw):
    weights = LayeredWeights(source or Source(target_w, target_cfg))
    return GpuDraft(HOST_SPEC, draft_cfg, draft_w, weights, target_cfg, **{"max_context": 256, **kw})


def test_the_forward_is_the_reference_draft_forward(exact, tiny):
    """Context appended in chunks and calls of several sizes (positions continuing), forwards after each: the
    reference's logits of block rows 1 .. B - 1, the graph replayed at the new position and context length."""
    target_w, draft_w, feats = tiny
    seen = exact()
    d = make_draft(target_w, draft_w, chunk=4)
    assert draft.UNIT in seen["units"] and "layered_bf16" in seen["units"]
    d.append_context(feats[:6], 0)  # two chunks of 4 and 2
    for T, token in ((6, 42), (7, 7), (13, 300)):
        if T > d.length:
            d.append_context(feats[d.length:T], np.arange(d.length, T))
        got = d.forward(token, T).numpy()
        want = draft_forward(draft_w, target_w, DRAFT, TARGET,
                             feats[:T], draft_block(DRAFT, token))[1:]
        assert got.shape == (DRAFT.block_size - 1, TARGET.vocab_size)
        err = relative_error(got, want)
        assert err < RTOL, f"context {T}: relative error {err:.2e}"
    assert d.n_ctx == 13
    d.free()


def test_a_forward_of_fewer_depths_multiplies_only_theirs(exact, tiny):
    """forward(.., depths=n): rows 0 .. n - 1 the reference's depths 1 .. n, the rows past n not written (poisoned
    before: the LM head's launch covers n rows), a graph per depth count, replayed when asked again."""
    target_w, draft_w, feats = tiny
    exact()
    d = make_draft(target_w, draft_w)
    d.append_context(feats[:10], 0)
    want = draft_forward(draft_w, target_w, DRAFT, TARGET, feats[:10], draft_block(DRAFT, 77))[1:]
    B = DRAFT.block_size
    assert B >= 4
    for n in (B - 2, 1, B - 1, B - 2):
        d.logits.copy_from(np.full(d.logits.shape, np.nan, np.float32))
        got = d.forward(77, 10, n).numpy()
        assert relative_error(got[:n], want[:n]) < RTOL, f"{n} depths"
        assert np.isnan(got[n:]).all(), f"{n} depths wrote rows past them"
    assert sorted(d.graphs) == [1, B - 2, B - 1]
    for n in (0, B):
        with pytest.raises(ValueError, match="depths"):
            d.forward(77, 10, n)
    d.free()


def test_features_on_the_device_and_a_reset(exact, tiny):
    target_w, draft_w, feats = tiny
    exact()
    d = make_draft(target_w, draft_w, chunk=8)
    d.append_context(feats[:20], 0)
    d.reset()
    from lucegen.runtime import DeviceArray
    d.append_context(DeviceArray.from_numpy(feats[20:31]), 0)  # a new sequence: its own features at 0 ..
    got = d.forward(5, 11).numpy()
    want = draft_forward(draft_w, target_w, DRAFT, TARGET, feats[20:31], draft_block(DRAFT, 5))[1:]
    assert relative_error(got, want) < RTOL


def test_past_the_window_the_draft_attends_the_last_window_tokens(exact, tiny):
    """window 8, 21 tokens appended (the ring wrapped twice): the reference over the last 8 features at their
    positions; and the window is the spec's unless given, capped at max_context."""
    target_w, draft_w, feats = tiny
    exact()
    d = make_draft(target_w, draft_w, window=8, chunk=3)
    d.append_context(feats[:21], 0)
    assert d.n_ctx == 8
    got = d.forward(9, 21).numpy()
    positions = [*range(13, 21), *range(21, 21 + DRAFT.block_size)]
    want = draft_forward(draft_w, target_w, DRAFT, TARGET,
                         feats[13:21], draft_block(DRAFT, 9), positions)[1:]
    assert relative_error(got, want) < RTOL
    full = draft_forward(draft_w, target_w, DRAFT, TARGET, feats[:21], draft_block(DRAFT, 9))[1:]
    assert relative_error(got, full) > 1e-3  # the approximation is real: the dropped rows mattered
    assert make_draft(target_w, draft_w).window == min(256, load_spec("h200").tuning.draft.window)
    assert make_draft(target_w, draft_w, max_context=100).window == 100


def test_a_quantized_embedding_and_lm_head_as_the_target_loaded_them(host):
    """The target's Q4_K embedding gathered by the layered family's kernel, its Q6_K LM head multiplying the final
    norm's XBlocks (written by the draft's norm kernel, read from row 1 on): within 2.5 x the distance activation
    quantization alone makes (tests/test_layered_gguf_host.py's bound) of the reference on the dequantized
    tables, and < RTOL of a reference that quantizes the LM head's activations as the GEMV does."""
    target = tiny_config(name="tiny256", hidden_size=256, intermediate_size=256)
    dcfg = tiny_draft_config(target, head_dim=32, num_attention_heads=4, num_key_value_heads=1)
    host(dcfg)
    target_w = bf16_rounded(random_weights(target, seed=4))
    draft_w = bf16_rounded(random_draft_weights(dcfg, seed=5))
    feats = np.random.default_rng(6).standard_normal((9, dcfg.fc_in), dtype=np.float32)
    src = QuantizedSource(target_w, target)
    d = make_draft(target_w, draft_w, target, dcfg, source=src)
    assert d.hq is not None
    d.append_context(feats, 0)
    got = d.forward(17, 9).numpy()
    ref = dict(target_w)
    for name, fmt in QuantizedSource.FORMATS.items():
        ref[name] = dequantize(qgemv.encode(target_w[name], fmt), getattr(GGMLType, fmt.upper()))
    plain = draft_forward(bf16_activations(draft_w), ref, dcfg, target, feats, draft_block(dcfg, 17))[1:]
    emulated_ref = {**ref, "lm_head.weight": ActivationQuantized(ref["lm_head.weight"])}
    emulated = draft_forward(bf16_activations(draft_w), emulated_ref, dcfg, target, feats, draft_block(dcfg, 17))[1:]
    bound = max(RTOL, 2.5 * relative_error(emulated, plain))
    assert relative_error(got, plain) < bound
    assert relative_error(got, emulated) < 1e-3  # an 8-bit step may flip where h differs in its last bits


def test_bad_calls_fail_clearly(host, tiny):
    target_w, draft_w, feats = tiny
    host()
    d = make_draft(target_w, draft_w, max_context=32)
    with pytest.raises(ValueError, match="features must be"):
        d.append_context(feats[:, :10], 0)
    with pytest.raises(ValueError, match="positions"):
        d.append_context(feats[:3], [0, 1])
    with pytest.raises(ValueError, match="positions must be in"):
        d.append_context(feats[:3], 31)
    with pytest.raises(ValueError, match="exceeds the context"):
        d.forward(1, 30)
    with pytest.raises(ValueError, match="vocabulary"):
        d.forward(TARGET.vocab_size, 0)


# ---- the draft family's references against the plain reference ------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(group=st.sampled_from([1, 2, 4]), nkv=st.integers(1, 3), hd=st.sampled_from([16, 32, 128]),
       B=st.integers(2, 16), T=st.integers(0, 150), window=st.integers(1, 160), appends=st.integers(1, 5),
       splits=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_family_references_are_the_reference_draft_attention(group, nkv, hd, B, T, window, appends, splits, seed):
    """One draft layer's attention through the family's pieces (block_qkv; context_kv into a ring over `appends`
    calls, each at slot (rows so far) % window as GpuDraft makes them; the split partials and their merge; o_proj)
    equals reference.dflash.draft_attention over the context that fits the ring (the last `window` rows) at their
    positions."""
    rng = np.random.default_rng(seed)
    H = 64
    cfg = tiny_draft_config(tiny_config(), num_hidden_layers=1, num_attention_heads=group * nkv,
                            num_key_value_heads=nkv, head_dim=hd, block_size=B)
    p = {k.removeprefix("layers.0.self_attn."): v for k, v in random_draft_weights(cfg, seed=seed % 1000).items()
         if k.startswith("layers.0.self_attn.")}
    h = rng.standard_normal((B, H), dtype=np.float32)
    ctx = rng.standard_normal((T, H), dtype=np.float32)
    position = T + int(rng.integers(0, 50))
    ctx_pos = np.arange(T) + (position - T)
    qkv = h @ np.concatenate([p["q_proj.weight"], p["k_proj.weight"], p["v_proj.weight"]]).T
    q, bk, bv = draft.block_qkv_reference(cfg, qkv, p["q_norm.weight"], p["k_norm.weight"], position)
    ring_k = np.full((window, nkv, hd), np.nan, np.float32)  # never-written slots: NaN, never read
    ring_v = ring_k.copy()
    kv = ctx @ np.concatenate([p["k_proj.weight"], p["v_proj.weight"]]).T
    cuts = sorted(set(rng.integers(0, T + 1, appends - 1).tolist()) | {0, T})
    for t0, t1 in zip(cuts, cuts[1:]):  # each append's rows in order: a later row overwrites its slot
        keys, values = draft.context_kv_reference(cfg, kv[t0:t1], p["k_norm.weight"][None], ctx_pos[t0:t1])
        for i, slot in enumerate(draft.ring_slots(t0 % window, t1 - t0, window)):
            ring_k[slot], ring_v[slot] = keys[i, 0], values[i, 0]
    n_ctx = min(T, window)
    part_o, part_ml = draft.attention_partials(q, bk, bv, ring_k, ring_v, n_ctx, splits)
    out = draft.merge_reference(part_o, part_ml, n_ctx, B, cfg.num_attention_heads) @ p["o_proj.weight"].T
    direct = draft.attention_reference(q, np.concatenate([ring_k[:n_ctx], bk]), np.concatenate([ring_v[:n_ctx], bv]))
    kept = slice(T - n_ctx, T)
    cos, sin = rope_cos_sin(np.concatenate([ctx_pos[kept], position + np.arange(B)]), hd, cfg.rope_theta)
    want = draft_attention(p, cfg, h, ctx[kept], cos, sin)
    assert relative_error(out, want) < RTOL
    assert relative_error(direct @ p["o_proj.weight"].T, want) < RTOL


@settings(max_examples=60, deadline=None)
@given(keys=st.integers(1, 10_000), splits=st.integers(1, 200))
def test_split_ranges_cover_every_key_once_in_whole_chunks(keys, splits):
    r = draft.split_ranges(keys, splits)
    assert r[0][0] == 0 and r[-1][1] == keys and len(r) <= splits
    assert all(a[1] == b[0] for a, b in zip(r, r[1:])) and all(k0 < k1 and k0 % draft.KC == 0 for k0, k1 in r)


def test_split_partials_merge_to_the_attention():
    rng = np.random.default_rng(0)
    cfg = tiny_draft_config(TARGET, block_size=16, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    q = rng.standard_normal((16, 8, 32), dtype=np.float32)
    bk, bv = (rng.standard_normal((16, 2, 32), dtype=np.float32) for _ in range(2))
    rk, rv = (rng.standard_normal((300, 2, 32), dtype=np.float32) * 3 for _ in range(2))
    want = draft.attention_reference(q, np.concatenate([rk[:250], bk]), np.concatenate([rv[:250], bv]))
    for splits in (1, 3, 9, 64):
        po, pml = draft.attention_partials(q, bk, bv, rk, rv, 250, splits)
        assert np.isnan(po[:, len(draft.split_ranges(266, splits)):]).all()
        assert relative_error(draft.merge_reference(po, pml, 250, 16, cfg.num_attention_heads), want) < RTOL


# ---- the unit -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec_name", list_specs())
def test_small_draft_units_compile_for_every_spec(tmp_path, spec_name):
    """Head dims under 128 (several lane classes per key chunk) and few query rows (fewer warps)."""
    spec = load_spec(spec_name)
    for cfg in (DRAFT, tiny_draft_config(TARGET, head_dim=32, num_attention_heads=8, num_key_value_heads=2,
                                         block_size=16)):
        units = draft.units(spec, TARGET, cfg)
        result = build(spec, TARGET, units, root=tmp_path)
        assert {k.name for k in result.kernels} == {k.name for u in units for k in u.kernels}
        for k in result.kernels:
            assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"
            assert k.coresident_blocks >= 1


def test_a_draft_whose_widths_the_gemm_cannot_take_is_refused_naming_them():
    bad = tiny_draft_config(TARGET, intermediate_size=96)
    assert "intermediate 96" in draft.shape_problem(load_spec("h200"), bad)
    assert draft.shape_problem(load_spec("h200"), DRAFT) is None


def test_bundled_drafts_are_the_default_units():
    from lucegen.model.config import load_config
    spec = load_spec("h200")
    assert [u.name for u in draft.units(spec, load_config("qwen3.5-27b"))] == [draft.UNIT]
    assert draft.units(spec, load_config("qwen3.5-0.8b")) == [] and draft.units(spec, TARGET) == []
