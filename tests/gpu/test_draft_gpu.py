"""The DFlash draft on the GPU (lucegen/engine/draft_gpu.py; kernels/draft.py, templates/draft.cuh): its kernels
against their numpy references on fresh inputs (outputs and the attention's partial buffers poisoned: all bits
set, NaN, so an element a kernel fails to write, or a partial the merge must not read, shows), and whole forwards
against lucegen.reference.dflash.draft_forward: on small drafts (head dim 16: several lane classes per key chunk;
the 27B's heads (32 q / 8 kv of 128, block 16) at hidden 256), past the window, with a Q4_K embedding and a Q6_K
LM head, and once on the real 27B draft shape (random weights, a bf16 target embedding and LM head of the 27B's
vocabulary) at a context long enough to split the attention over every SM.

Tolerances (relative error ||out - ref|| / ||ref||):
  KERNEL_RTOL 1e-5  a kernel against its reference on the same inputs: fp32 with fast exp / rsqrt, sums in another
                    order (the tree attention's bound, tests/gpu/test_tree_gpu.py); RoPE's cos/sin in double
  FORWARD_RTOL 1e-4 a whole forward against draft_forward run on the device's own weight values (bf16-rounded
                    matrices, fp32 vectors) multiplying bf16-rounded activations, as the tensor-core GEMM does
                    (host_layered.bf16_activations), so neither is a source of error: the host emulation
                    (tests/test_draft_gpu_host.py) lands below 1e-5 on the tiny draft; the GPU adds fast-math rounding
                    in 5 layers of norms and softmax, each ~1e-6 relative, and fp32 sums in another order.
  bf16 flips:       once any of those puts one activation on the other side of a bf16 rounding (2^-8 of it), the
                    difference reaches the next layers' roundings and flips a share of them too, so two correct
                    forwards can differ by up to the bf16 rounding's own effect: measured, 1.2e-3 .. 3.3e-3 on the
                    H200 (session 11), and the host emulation itself 1.5e-3 on some head layouts (32 q heads to 2 kv),
                    against a distance of ~3e-3 between the references with bf16 and with fp32 activations. The bound
                    is 2.5 x that distance (the E2E margin of the prefill tests), and FORWARD_RTOL at least
  bf16 weights:     against draft_forward on the fp32 weights and fp32 activations, the bound is 2.5 x (E2E margin
                    of the prefill tests) the distance the bf16 rounding of both alone makes between the two
                    references (an entry moves by up to 2^-9 of itself), and FORWARD_RTOL at least
A wrong index, position, ring slot, head order or split is off by O(0.1 .. 1).
"""
from __future__ import annotations

from functools import cache
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucegen.codegen.build import build
from lucegen.engine.draft_gpu import GpuDraft
from lucegen.engine.layered_weights import LayeredWeights, Source
from lucegen.kernels import draft, qgemv
from lucegen.model.config import load_config, tiny_config
from lucegen.model.draft_config import DraftConfig, tiny_draft_config
from lucegen.model.quants import GGMLType, dequantize
from lucegen.reference import random_weights, relative_error
from lucegen.reference.dflash import draft_forward, random_draft_weights
from lucegen.reference.weights import tensor_rng
from lucegen.runtime import DeviceArray, synchronize
from lucegen.spec import spec_for_current_device
from xblocks import assert_xblocks_of
from host_layered import bf16_activations, bf16_rounded, draft_block, QuantizedSource

pytestmark = pytest.mark.gpu
KERNEL_RTOL, FORWARD_RTOL, ROW_RTOL = 1e-5, 1e-4, 1e-6
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DRAFT_JSON = Path(__file__).resolve().parents[2] / "lucegen" / "model" / "configs" / "drafts" / \
    "qwen3.5-27b-dflash-draft.json"

TINY_T = tiny_config()
TINY_D = tiny_draft_config(TINY_T)                                   # head dim 16, 2 q heads per kv head, block 4
RATIO_T = tiny_config(name="tiny256", hidden_size=256, intermediate_size=256)
RATIO_D = tiny_draft_config(RATIO_T, num_attention_heads=32, num_key_value_heads=8, head_dim=128, block_size=16,
                            intermediate_size=512)                   # the 27B draft's attention at hidden 256
CASES = {"tiny": (TINY_T, TINY_D), "ratio": (RATIO_T, RATIO_D)}


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return relative_error(out, ref)


def dev(a: np.ndarray) -> DeviceArray:
    return DeviceArray.from_numpy(np.ascontiguousarray(a))


def poisoned(shape, dtype=np.float32) -> DeviceArray:
    a = DeviceArray.empty(shape, dtype)
    a.fill_bytes(0xFF)
    return a


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("build")


@pytest.fixture(scope="module")
def kernels(root):
    spec = spec_for_current_device()

    @cache
    def get(name: str) -> draft.DraftKernels:
        target, cfg = CASES[name]
        (unit,) = draft.units(spec, target, cfg)
        return draft.DraftKernels(build(spec, target, [unit], root=root).module(unit.name), spec, cfg)
    return get


# ---- kernels ------------------------------------------------------------------------------------------------------
def attention_inputs(cfg: DraftConfig, window: int, rng):
    B, nh, nkv, hd = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    normal = lambda *s: rng.standard_normal(s, dtype=np.float32)
    return normal(B, nh, hd) * np.float32(hd ** -0.5), normal(B, nkv, hd), normal(B, nkv, hd), \
        normal(window, nkv, hd) * 2, normal(window, nkv, hd)


@pytest.mark.parametrize("case", list(CASES))
@SETTINGS
@given(n_ctx=st.one_of(st.sampled_from([0, 1, 31, 32, 33, 1000]), st.integers(0, 3000)), seed=st.integers(0, 2**32 - 1))
def test_attention_and_merge_match_their_references(kernels, case, n_ctx, seed):
    """The split partials of every non-empty split (empty ones are not written, and the merge does not read
    them: their poison would show), the merged output against the unmasked attention, and the same bits again."""
    k = kernels(case)
    cfg, rng = k.cfg, np.random.default_rng(seed)
    window = max(n_ctx, 1) + int(rng.integers(0, 40))  # rows past n_ctx: NaN, never read
    q, bk, bv, rk, rv = attention_inputs(cfg, window, rng)
    rk[n_ctx:], rv[n_ctx:] = np.nan, np.nan
    n = dev(np.array([n_ctx], np.int32))
    po_size, pml_size = k.partial_sizes()
    part_o, part_ml = poisoned(po_size), poisoned(pml_size)
    out = poisoned((cfg.block_size, cfg.num_attention_heads * cfg.head_dim))
    args = [dev(a) for a in (q, bk, bv, rk, rv)]
    k.attention(*args, n, part_o, part_ml)
    k.merge(part_o, part_ml, n, out)
    synchronize()
    got = out.numpy()
    want = draft.attention_reference(q, np.concatenate([rk[:n_ctx], bk]), np.concatenate([rv[:n_ctx], bv]))
    assert rel_err(got, want) < KERNEL_RTOL
    ref_o, ref_ml = draft.attention_partials(q, bk, bv, rk, rv, n_ctx, k.splits)
    done = len(draft.split_ranges(n_ctx + cfg.block_size, k.splits))
    nkv, rows = cfg.num_key_value_heads, k.rows
    po = part_o.numpy().reshape(nkv, k.splits, rows, cfg.head_dim)
    pml = part_ml.numpy().reshape(nkv, k.splits, rows, 2)
    assert np.isnan(po[:, done:]).all() and np.isnan(pml[:, done:]).all(), "an empty split wrote its partial"
    # a partial is exp(s - m)-weighted: m itself to fp32 rounding of the scores, sums and outputs relative
    assert rel_err(pml[:, :done, :, 0], ref_ml[:, :done, :, 0]) < KERNEL_RTOL
    assert rel_err(pml[:, :done, :, 1], ref_ml[:, :done, :, 1]) < KERNEL_RTOL
    assert rel_err(po[:, :done], ref_o[:, :done]) < KERNEL_RTOL
    out.fill_bytes(0xFF)
    k.attention(*args, n, part_o, part_ml)
    k.merge(part_o, part_ml, n, out)
    synchronize()
    np.testing.assert_array_equal(out.numpy(), got)  # deterministic: the splits merge in split order


@pytest.mark.parametrize("case", list(CASES))
@SETTINGS
@given(position=st.one_of(st.sampled_from([0, 1, 4095, 100_000]), st.integers(0, 262_000)),
       T=st.integers(1, 40), slot0=st.integers(0, 100), seed=st.integers(0, 2**32 - 1))
def test_block_qkv_and_context_kv_match_their_references(kernels, case, position, T, slot0, seed):
    k = kernels(case)
    cfg, rng = k.cfg, np.random.default_rng(seed)
    B, nh, nkv, hd, L = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, \
        cfg.num_hidden_layers
    qkv = rng.standard_normal((B, (nh + 2 * nkv) * hd), dtype=np.float32) * 3
    q_norm, k_norm = (1 + 0.1 * rng.standard_normal((2, hd), dtype=np.float32))
    io = dev(np.array([position, *range(B), 0], np.int32))
    q, kk, vv = poisoned((B, nh, hd)), poisoned((B, nkv, hd)), poisoned((B, nkv, hd))
    k.block_qkv(dev(qkv), dev(q_norm), dev(k_norm), io, q, kk, vv)
    window = T + int(rng.integers(0, 20))
    kv = rng.standard_normal((T, L * 2 * nkv * hd), dtype=np.float32)
    k_norms = (1 + 0.1 * rng.standard_normal((L, hd), dtype=np.float32))
    pos = rng.integers(0, 262_000, T).astype(np.int32)
    keys, values = poisoned((L, window, nkv, hd)), poisoned((L, window, nkv, hd))
    k.context_kv(dev(kv), dev(k_norms), dev(pos), slot0, window, keys, values, T)
    synchronize()
    for got, want in zip((q, kk, vv), draft.block_qkv_reference(cfg, qkv, q_norm, k_norm, position)):
        assert rel_err(got.numpy(), want) < KERNEL_RTOL
    ref_k, ref_v = draft.context_kv_reference(cfg, kv, k_norms, pos)
    slots = draft.ring_slots(slot0, T, window)
    got_k, got_v = keys.numpy(), values.numpy()
    assert rel_err(got_k[:, slots], ref_k.transpose(1, 0, 2, 3)) < KERNEL_RTOL
    np.testing.assert_array_equal(got_v[:, slots], ref_v.transpose(1, 0, 2, 3))
    untouched = np.setdiff1d(np.arange(window), slots)
    assert np.isnan(got_k[:, untouched]).all() and np.isnan(got_v[:, untouched]).all()


@pytest.mark.parametrize("case", list(CASES))
def test_row_kernels_match_their_references(kernels, case):
    k = kernels(case)
    cfg, rng, m = k.cfg, np.random.default_rng(5), 5
    H, I = cfg.hidden_size, cfg.intermediate_size
    x, y = rng.standard_normal((2, m, H), dtype=np.float32)
    w = 1 + 0.1 * rng.standard_normal(H, dtype=np.float32)
    xsum, h = poisoned((m, H)), poisoned((m, H))
    xq = poisoned(qgemv.xblock_bytes(m, H), np.uint8) if H % 32 == 0 else None
    h16 = poisoned((m, H), ml_dtypes.bfloat16)
    k.rmsnorm(dev(x), dev(y), dev(w), xsum, h, m, xq=xq, h16=h16)
    z = rng.standard_normal(m * I, dtype=np.float32)
    z16 = poisoned(m * I, ml_dtypes.bfloat16)
    k.to_bf16(dev(z), z16, m * I)
    synchronize()
    x1, h1 = draft.rmsnorm_reference(x, y, w, cfg.rms_norm_eps)
    assert rel_err(xsum.numpy(), x1) < ROW_RTOL and rel_err(h.numpy(), h1) < ROW_RTOL
    if xq is not None:
        assert_xblocks_of(xq.numpy(), h.numpy())
    np.testing.assert_array_equal(h16.numpy(), h.numpy().astype(ml_dtypes.bfloat16))  # h's own bits, rounded
    np.testing.assert_array_equal(z16.numpy(), z.astype(ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="another buffer"):
        k.rmsnorm(xsum, None, dev(w), xsum, h, m)


# ---- whole forwards ---------------------------------------------------------------------------------------------
def poison(d: GpuDraft) -> None:
    for a in (d.x, d.x_next, d.h, d.h16, d.proj, d.att, d.att16, d.act16, d.q, d.bk, d.bv, d.part_o, d.part_ml, d.hq,
              d.logits, d.keys, d.values, d.feats, d.feats16, d.c_raw, d.c_sum, d.c, d.c16, d.ctx_rows):
        if a is not None:
            a.fill_bytes(0xFF)


@pytest.fixture(scope="module")
def small(request):
    out = {}
    for name, (target, cfg) in CASES.items():
        fp32_t, fp32_d = random_weights(target, seed=1), random_draft_weights(cfg, seed=2)
        feats = np.random.default_rng(3).standard_normal((300, cfg.fc_in), dtype=np.float32)
        out[name] = (target, cfg, fp32_t, fp32_d, bf16_rounded(fp32_t), bf16_rounded(fp32_d), feats)
    return out


def check_forward(got, draft_w, target_w, cfg, target, feats, token, positions=None, fp32=None) -> None:
    want = draft_forward(bf16_activations(draft_w), target_w, cfg, target,
                         feats, draft_block(cfg, token), positions)[1:]
    fp32_activations = draft_forward(draft_w, target_w, cfg, target, feats, draft_block(cfg, token), positions)[1:]
    err, flips = rel_err(got, want), 2.5 * relative_error(want, fp32_activations)
    assert err < max(FORWARD_RTOL, flips), f"relative error {err:.2e} against the reference on the device's weights" \
        f" (bf16 flips' bound {flips:.2e})"
    if fp32 is not None:  # the same against the fp32 weights: within what bf16 rounding alone makes
        fp32_d, fp32_t = fp32
        exact = draft_forward(fp32_d, fp32_t, cfg, target, feats, draft_block(cfg, token), positions)[1:]
        bound = max(FORWARD_RTOL, 2.5 * relative_error(want, exact))
        assert rel_err(got, exact) < bound


@pytest.mark.parametrize("case", list(CASES))
def test_forwards_match_the_reference_as_the_context_grows(small, root, case):
    """Appends of 5, 60, 1 and 200 tokens (several chunks), a forward after each at the next position: the graph
    captured once replays at every position and context length."""
    target, cfg, fp32_t, fp32_d, target_w, draft_w, feats = small[case]
    spec = spec_for_current_device()
    weights = LayeredWeights(Source(target_w, target))
    d = GpuDraft(spec, cfg, draft_w, weights, target, max_context=1024, chunk=64, root=root)
    poison(d)
    T = 0
    for n, token in ((5, 11), (60, 400), (1, 3), (200, 77)):
        d.append_context(feats[T:T + n], T)
        T += n
        got = d.forward(token, T)
        check_forward(d.logits_numpy(), draft_w, target_w, cfg, target, feats[:T], token, fp32=(fp32_d, fp32_t))
        assert got.shape == (cfg.block_size - 1, target.vocab_size)
    d.free()
    weights.free()


def test_past_the_window_and_features_on_the_device(small, root):
    """A window of 64 rows, 150 tokens appended from device features: the reference over the last 64."""
    target, cfg, _, _, target_w, draft_w, feats = small["ratio"]
    weights = LayeredWeights(Source(target_w, target))
    d = GpuDraft(spec_for_current_device(), cfg, draft_w, weights, target, max_context=1024, window=64, chunk=32,
                 root=root)
    poison(d)
    dfeats = dev(feats[:150])
    d.append_context(dfeats, 0)
    d.forward(9, 150)
    positions = [*range(86, 150), *range(150, 150 + cfg.block_size)]
    check_forward(d.logits_numpy(), draft_w, target_w, cfg, target, feats[86:150], 9, positions)
    d.reset()
    d.append_context(feats[:10], 0)
    d.forward(4, 10)
    check_forward(d.logits_numpy(), draft_w, target_w, cfg, target, feats[:10], 4)
    d.free()
    weights.free()
    dfeats.free()


def test_a_quantized_embedding_and_lm_head(small, root):
    """The target's tables as loaded: the Q4_K gather and the Q6_K LM head on the final norm's XBlocks, within
    2.5 x the distance activation quantization alone makes (tests/gpu/test_layered_gpu.py's bound) of the reference
    on the dequantized tables; and forwards of fewer depths, row for row the same bits."""
    from host_layered import ActivationQuantized
    target, cfg, _, _, target_w, draft_w, feats = small["ratio"]
    weights = LayeredWeights(QuantizedSource(target_w, target))
    d = GpuDraft(spec_for_current_device(), cfg, draft_w, weights, target, max_context=1024, root=root)
    assert d.hq is not None
    poison(d)
    d.append_context(feats[:40], 0)
    d.forward(17, 40)
    got = d.logits_numpy()
    ref = dict(target_w)
    for name, fmt in QuantizedSource.FORMATS.items():
        ref[name] = dequantize(qgemv.encode(target_w[name], fmt), getattr(GGMLType, fmt.upper()))
    plain = draft_forward(bf16_activations(draft_w), ref, cfg, target, feats[:40], draft_block(cfg, 17))[1:]
    quantized_head = {**ref, "lm_head.weight": ActivationQuantized(ref["lm_head.weight"])}
    emulated = draft_forward(bf16_activations(draft_w), quantized_head, cfg, target,
                             feats[:40], draft_block(cfg, 17))[1:]
    assert rel_err(got, plain) < max(FORWARD_RTOL, 2.5 * relative_error(emulated, plain))
    # forwards of fewer depths (a round of a smaller budget): the LM head over those rows alone, on the GEMV, the
    # dp4a or the mma GEMM as the count asks, each row the full forward's bit for bit; the rows past them unwritten
    for n in (1, 4, 7, 9):
        d.logits.fill_bytes(0xFF)
        d.forward(17, 40, n)
        rows = d.logits_numpy()
        np.testing.assert_array_equal(rows[:n], got[:n])
        assert np.isnan(rows[n:]).all(), f"{n} depths wrote rows past them"
    d.free()
    weights.free()


def test_the_real_27b_draft_shape(root):
    """The 27B draft (5 layers, hidden 5120, fc 25600 -> 5120, 32 q / 8 kv heads of 128, intermediate 17408, block
    16) with random bf16 weights, a bf16 embedding and LM head of the 27B's vocabulary (248,320), 1500 context
    tokens (47 key chunks: the attention split over most of the kv heads' blocks): the reference on the device's
    weights within check_forward's bound, twice the same bits. ~15 GB of host memory for the fp32 reference weights."""
    target = load_config("qwen3.5-27b")
    cfg = DraftConfig.from_json(DRAFT_JSON)
    V, H = target.vocab_size, cfg.hidden_size
    draft_w = bf16_rounded(random_draft_weights(cfg, seed=7))
    table = lambda name, scale: (tensor_rng(8, name).standard_normal((V, H), dtype=np.float32) * np.float32(scale)
                                 ).astype(ml_dtypes.bfloat16).astype(np.float32)
    target_w = {"embed_tokens.weight": table("embed_tokens.weight", 1.0),
                "lm_head.weight": table("lm_head.weight", H ** -0.5)}
    embed, lm_head = (LayeredWeights._projection(Source(target_w, target), [n])
                      for n in ("embed_tokens.weight", "lm_head.weight"))
    weights = SimpleNamespace(embed=embed, lm_head=lm_head)
    feats = np.random.default_rng(9).standard_normal((1500, cfg.fc_in), dtype=np.float32)
    d = GpuDraft(spec_for_current_device(), cfg, draft_w, weights, target, max_context=4096, root=root)
    poison(d)
    d.append_context(feats[:1000], 0)
    d.append_context(feats[1000:], np.arange(1000, 1500))
    d.forward(1234, 1500)
    got = d.logits_numpy()
    check_forward(got, draft_w, target_w, cfg, target, feats, 1234)
    d.forward(1234, 1500)
    np.testing.assert_array_equal(d.logits_numpy(), got)
    d.free()
    for p in (embed, lm_head):
        for part in p.parts:
            part.w.free()
