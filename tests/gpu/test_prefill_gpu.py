"""The prefill kernels on the GPU against their numpy references on fresh inputs, and the whole prefill against the
reference model (logits and every piece of state), chunked against one-shot, continued by further tokens, and
against HF transformers.

Outputs are poisoned (all bits set: NaN) before every launch so an element a kernel fails to write shows; state a
kernel must not read at position 0 is poisoned too. Tolerances (relative error ||out - ref|| / ||ref||):
  bf16 outputs of fp32 math          8e-3   (rounding to bf16: <= 2^-9 = 2e-3 per element, ~1.1e-3 RMS)
  fp32 outputs of bf16-input GEMMs   1e-5   (exact products, fp32 sums in another order)
  the chunked delta rule             2e-3   (tf32 operands for every product with S, v' and T: a numpy emulation of
                                             the kernel's algorithm with tf32 rounding gives 3e-4 .. 4.3e-4 for
                                             T = 1 .. 4097, strong and weak decay, without growth over chunks)
  attention                          1e-2   (bf16 probabilities into P V, bf16 output)
  whole prefill                      see E2E_RTOL: a numpy emulation of the prefill's bf16 rounding points (bf16
                                             activations into every GEMM and attention, bf16 weights on both sides)
                                             measured the error a correct kernel set has against the fp32 reference.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from host_kernels import assert_state_close, on_host, order_sensitive_gemm, state_errors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from lucegen.codegen.build import build
from lucegen.engine.decode import PREFILL_FROM, DecodeEngine
from lucegen.engine.prefill import Prefill, units
from lucegen.engine.state import DeviceState
from lucegen.engine.weights import DeviceWeights
from lucegen.kernels import attention, conv1d, gdn, gemm, rows
from lucegen.model.config import load_config, tiny_config
from lucegen.reference import State, decode_step, random_weights, relative_error
from lucegen.reference.model import decoder_layer, lm_head
from lucegen.reference.ops import rms_norm
from lucegen.runtime import DeviceArray, Graph, observe_launches, synchronize
from lucegen.spec import GEMM_METHODS, gemm_methods, spec_for_current_device

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LENGTHS = st.one_of(st.sampled_from([1, 63, 64, 65, 520]), st.integers(1, 700))

# The real structure (3 DeltaNet : 1 attention, 2 value heads per key head, 2 query heads per KV head) with the head
# dims the tensor-core tiles take (64).
TINY = tiny_config(name="tiny-prefill", hidden_size=128, intermediate_size=256, head_dim=64,
                   linear_key_head_dim=64, linear_value_head_dim=64)
MODELS = {"tiny": lambda: TINY, "0.8b": lambda: load_config("qwen3.5-0.8b"), "27b": lambda: load_config("qwen3.5-27b")}
# Whole-prefill tolerances per model: ~2.5x what a numpy emulation of the prefill's bf16 rounding points measured
# against the fp32 reference on logits and states (tiny: 0.4 .. 2.0 %, 0.8B: 1.6 .. 2.7 %; T = 1 .. 4097, and the
# token after the prompt), far below the O(1) error of a wrong index, position, mask or state layout.
E2E_RTOL = {"tiny": 5e-2, "0.8b": 7e-2}


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out).astype(np.float32)
    assert np.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return relative_error(out, ref)


def poisoned(shape, dtype) -> DeviceArray:
    a = DeviceArray.empty(shape, dtype)
    a.fill_bytes(0xFF)
    return a


def dev(a: np.ndarray) -> DeviceArray:
    return DeviceArray.from_numpy(np.ascontiguousarray(a))


def bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(BF16)


@pytest.fixture(scope="module")
def spec():
    return spec_for_current_device()


@pytest.fixture(scope="module")
def kernels(spec, tmp_path_factory):
    """kernels(model) -> the prefill's kernel objects for that model shape, built once."""
    root = tmp_path_factory.mktemp("build")

    @cache
    def get(name: str):
        cfg = MODELS[name]()
        result = build(spec, cfg, units(spec, cfg), root=root)
        mods = {u.unit.template: result.module(u.unit.name) for u in result.units}
        return SimpleNamespace(
            cfg=cfg, gemm=gemm.Gemm(mods["prefill_gemm.cu.j2"], spec), rows=rows.Rows(mods["prefill_rows.cu.j2"], spec, cfg),
            gdn=gdn.ChunkedDeltaRule(mods["prefill_gdn.cu.j2"], spec, cfg),
            attn=attention.Attention(mods["prefill_attention.cu.j2"], spec, cfg),
            split_attn=lambda: split_attention(name))

    @cache
    def split_attention(name: str):
        """The attention with a query tile's keys over a cluster of SPLIT blocks, whatever the spec's split; None
        without clusters (before sm_90)."""
        if spec.chip.cc < 90:
            return None
        cfg, s = MODELS[name](), spec.with_prefill(attention_split=SPLIT)
        unit, = attention.units(s, cfg)
        return attention.Attention(build(s, cfg, [unit], root=root).module(unit.name), s, cfg)
    return get


SPLIT = 3  # blocks of a cluster sharing a query tile's keys in the attention tests


# ---- GEMM --------------------------------------------------------------------------------------------------------

GEMM_KS = [64, 128, 1024, 3584, 5120]


@pytest.fixture(scope="module")
def gemms(spec, tmp_path_factory):
    """gemms(method) -> (the GEMM launcher, the spec) for each GEMM method this chip allows, built once; with
    split-K allowed up to 8 slices (the most a spec may give), so an `add` with fewer tiles than SMs runs the split
    kernel, with wgmma's large tile in clusters of up to 6 blocks on the 0.8B's shapes."""
    root = tmp_path_factory.mktemp("gemm")

    @cache
    def get(method: str):
        if method not in gemm_methods(spec):
            pytest.skip(f"{spec.name} ({spec.chip.arch}) cannot run the {method} GEMM")
        s = spec.with_prefill(gemm=method, split_k=8)
        return gemm.Gemm(build(s, TINY, gemm.units(s), root=root).module("prefill_gemm"), s), s
    return get


@pytest.mark.parametrize("epilogue", list(gemm.EPILOGUES))
@pytest.mark.parametrize("tile", ["large", "small"])
@pytest.mark.parametrize("method", GEMM_METHODS)
@SETTINGS
@given(m=LENGTHS, n16=st.integers(1, 80), k=st.sampled_from(GEMM_KS), seed=st.integers(0, 2**32 - 1))
def test_gemm_matches_numpy(gemms, method, epilogue, tile, m, n16, k, seed):
    op, spec = gemms(method)
    config = gemm.tile_configs(spec)[tile == "small"]
    check_gemm(op, config, m, 16 * n16 - 2 * (seed % 8), k, epilogue, seed)  # every even N mod 16: partial tiles


def check_gemm(op, config, m: int, n: int, k: int, epilogue: str, seed: int) -> None:
    """One launch on fresh inputs (the output poisoned, but for `add`) against gemm.reference."""
    rng = np.random.default_rng(seed)
    x = bf16(rng.standard_normal((m, k), dtype=np.float32))
    w = bf16(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
    width = n // 2 if epilogue == "silu" else n
    y0 = rng.standard_normal((m, width), dtype=np.float32)
    out_dtype = BF16 if epilogue in ("bf16", "silu") else np.float32
    y = dev(y0) if epilogue == "add" else poisoned((m, width), out_dtype)
    op(dev(x), dev(w), y, m, n, k, epilogue, config=config)
    assert rel_err(y.numpy(), gemm.reference(x, w, epilogue, y0)) < (8e-3 if out_dtype == BF16 else 1e-5)


@pytest.mark.parametrize("epilogue", list(gemm.EPILOGUES))
@SETTINGS
@given(m=LENGTHS, n16=st.integers(1, 200), k=st.sampled_from(GEMM_KS), seed=st.integers(0, 2**32 - 1))
def test_token_n_gemm_matches_numpy(gemms, epilogue, m, n16, k, seed):
    """wgmma's token-N tiles (tokens on the instruction's N, the accumulators stored transposed), each of them, on
    prompts of 1 .. 700 tokens and outputs of up to 3200 rows (partial tiles of both)."""
    op, spec = gemms("wgmma")
    for config in (c for c in gemm.tile_configs(spec) if c.tokens_n):
        check_gemm(op, config, m, 16 * n16 - 2 * (seed % 8), k, epilogue, seed)


@pytest.mark.parametrize("epilogue", list(gemm.EPILOGUES))
@pytest.mark.parametrize("tile", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("method", GEMM_METHODS)
@pytest.mark.parametrize("m, n, k", [(4097, 2560, 1024), (1500, 10240, 192)])
def test_gemm_with_more_tiles_than_blocks_matches_numpy(gemms, method, epilogue, tile, m, n, k):
    """Shapes of more tiles than the SMs hold blocks at once (several waves; wgmma's persistent blocks each take
    several tiles in turn, the next one's loads overlapping the last one's epilogue), K of 3 .. 16 k tiles; with
    each tile config of the method (large, small, and wgmma's token-N tiles)."""
    op, spec = gemms(method)
    configs = gemm.tile_configs(spec)
    if tile >= len(configs):
        pytest.skip(f"{method} has {len(configs)} tile configs")
    config = configs[tile]
    assert config.tiles(m, n) > 2 * spec.chip.sm_count * config.min_blocks  # the test can tell
    check_gemm(op, config, m, n, k, epilogue, m + n + k)


# the 0.8B's out_proj and MLP down at pp520, the 27B draft's o_proj at its block of 16 tokens (M, N, K)
SPLIT_SHAPES = [(520, 1024, 2048), (520, 1024, 3584), (16, 5120, 4096)]


# gemm.tile_configs' order; the token-N tiles are wgmma's only
SPLIT_TILES = ["large", "small", "token_n_192", "token_n_128", "token_n_88", "token_n_16"]


def split_tile(spec, tile: str):
    configs = gemm.tile_configs(spec)
    if SPLIT_TILES.index(tile) >= len(configs):
        pytest.skip(f"{spec.name} ({spec.tuning.prefill.gemm}) has no {tile} tile")
    return configs[SPLIT_TILES.index(tile)]


@pytest.mark.parametrize("tile", SPLIT_TILES)
@pytest.mark.parametrize("method", GEMM_METHODS)
@pytest.mark.parametrize("m, n, k", SPLIT_SHAPES)
def test_split_k_gemm_sums_its_slices_in_slice_order(gemms, method, tile, m, n, k):
    """On host_kernels' order-sensitive inputs (each slice's partial exact in fp32, the slices' scales far apart) the
    split kernel gives gemm.reference(..., splits) bit for bit, launch after launch: Y0 + ((p_0 + p_1) + ...). Summing
    the slices in any other order, or adding them into Y one by one, gives other bits on these inputs."""
    op, spec = gemms(method)
    config = split_tile(spec, tile)
    s = gemm.splits(spec, config, m, n, k, "add")
    if s == 1:
        pytest.skip(f"{spec.name}: no split of {m}x{n}x{k} with {config.name} tiles")
    x, w, y0 = order_sensitive_gemm(m, n, k, s, seed=k + s)
    ref = gemm.reference(x, w, "add", y0, splits=s)
    parts = [x[:, k0:k1].astype(np.float32) @ w[:, k0:k1].astype(np.float32).T for k0, k1 in gemm.slices(k, s)]
    chain, backwards = y0.copy(), parts[-1]
    for p in parts:
        chain = chain + p
    for p in parts[-2::-1]:
        backwards = backwards + p
    # the test can tell (two slices summed backwards are the same sum: addition commutes)
    assert not np.array_equal(ref, chain) and (s == 2 or not np.array_equal(ref, y0 + backwards))
    dx, dw = dev(x), dev(w)
    for launch in range(3):
        y = dev(y0)
        op(dx, dw, y, m, n, k, "add", config=config)
        out = y.numpy()
        assert np.array_equal(out, ref), (f"launch {launch}: {np.count_nonzero(out != ref)} of {out.size} differ "
                                          f"from the slice-order sum of {s} slices")


@pytest.mark.parametrize("tile", SPLIT_TILES)
@pytest.mark.parametrize("method", GEMM_METHODS)
@SETTINGS
@given(m=st.one_of(st.sampled_from([520, 64, 1000]), st.integers(1, 1100)), n16=st.integers(1, 80),
       k=st.sampled_from([1024, 2048, 3584, 5120]), seed=st.integers(0, 2**32 - 1))
def test_split_k_gemm_is_deterministic(gemms, method, tile, m, n16, k, seed):
    """A split `add` launched again on the same inputs gives the same bits (run to run; the counters left at zero by
    each launch), within the fp32 tolerance of the reference."""
    op, spec = gemms(method)
    config = split_tile(spec, tile)
    n = 16 * n16 - 2 * (seed % 8)
    s = gemm.splits(spec, config, m, n, k, "add")
    rng = np.random.default_rng(seed)
    x = bf16(rng.standard_normal((m, k), dtype=np.float32))
    w = bf16(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
    y0 = rng.standard_normal((m, n), dtype=np.float32)
    dx, dw = dev(x), dev(w)
    outs = []
    for _ in range(3):
        y = dev(y0)
        op(dx, dw, y, m, n, k, "add", config=config)
        outs.append(y.numpy())
    assert all(np.array_equal(o, outs[0]) for o in outs[1:]), f"{s} slices: launches differ"
    assert rel_err(outs[0], gemm.reference(x, w, "add", y0, splits=s)) < 1e-5


# ---- rows --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny", "0.8b", "27b"])
@SETTINGS
@given(T=LENGTHS, scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**32 - 1))
def test_embed_and_rmsnorm_match_numpy(kernels, model, T, scale, seed):
    k = kernels(model)
    H, V = k.cfg.hidden_size, 1000
    rng = np.random.default_rng(seed)
    table = bf16(rng.standard_normal((V, H), dtype=np.float32))
    ids = rng.integers(0, V, T).astype(np.int32)
    x = poisoned((T, H), np.float32)
    k.rows.embed(dev(ids), dev(table), x, T)
    assert np.array_equal(x.numpy(), rows.embed_reference(table, ids))
    xs = (scale * rng.standard_normal((T, H))).astype(np.float32)
    w = (0.5 * rng.standard_normal(H)).astype(np.float32)
    y = poisoned((T, H), BF16)
    k.rows.rmsnorm(dev(xs), dev(w), y, T, 1e-6)
    assert rel_err(y.numpy(), rows.rmsnorm_reference(xs, w, 1e-6)) < 8e-3


# ---- the DeltaNet front (conv1d + gates) and the chunked delta rule ------------------------------------------

def front_inputs(cfg, T: int, rng, weak_decay: bool = False):
    """mixed [T, C + VD + 2 Hv], conv_w [C, K], a_log, dt_bias [Hv] and a conv ring [K, C], drawn."""
    K, C, hv = cfg.linear_conv_kernel_dim, cfg.conv_dim, cfg.linear_num_value_heads
    mixed = rng.standard_normal((T, C + cfg.value_dim + 2 * hv), dtype=np.float32)
    conv_w = (rng.standard_normal((C, K)) / 2).astype(np.float32)
    a_log = np.log(np.full(hv, 1e-3) if weak_decay else rng.uniform(1, 16, hv)).astype(np.float32)
    dt_bias = (0.1 * rng.standard_normal(hv)).astype(np.float32)
    ring = rng.standard_normal((K, C), dtype=np.float32)
    return mixed, conv_w, a_log, dt_bias, ring


def run_gdn(k, T: int, start: int, mixed, conv_w, a_log, dt_bias, ring0, s0):
    """The prep and scan on fresh device copies, outputs poisoned; at start 0 the ring and state are NaN (neither may
    be read). -> (qkv, o, ring, state, scratch.fac) as numpy arrays."""
    c = k.cfg
    hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    ring = dev(ring0 if start else np.full_like(ring0, np.nan))
    state = dev(s0) if start else poisoned((hv, dv, dk), np.float32)
    qkv, o, scratch = poisoned((T, c.conv_dim), BF16), poisoned((T, hv, dv), np.float32), gdn.Scratch(c, T)
    scratch.fac.fill_bytes(0xFF)
    k.gdn(dev(mixed), dev(conv_w), dev(a_log), dev(dt_bias), ring, qkv, state, o, scratch, T, start)
    out = qkv.numpy(), o.numpy(), ring.numpy(), state.numpy(), scratch.fac.numpy()
    scratch.free()
    return out


@pytest.mark.parametrize("model", ["tiny", "0.8b", "27b"])
@SETTINGS
@given(T=st.one_of(st.sampled_from([1, 2, 3, 4, 63, 64, 65, 520]), st.integers(1, 300)),
       start=st.sampled_from([0, 1, 2, 3, 5, 64, 1001]), seed=st.integers(0, 2**32 - 1))
def test_deltanet_front_matches_numpy(kernels, model, T, start, seed):
    """qkv (conv1d + SiLU), the new conv state and beta (in the prep's factors) against conv1d.reference."""
    k = kernels(model)
    c = k.cfg
    K, hv = c.linear_conv_kernel_dim, c.linear_num_value_heads
    rng = np.random.default_rng(seed)
    mixed, conv_w, a_log, dt_bias, ring0 = front_inputs(c, T, rng)
    s0 = (0.1 * rng.standard_normal((hv, c.linear_value_head_dim, c.linear_key_head_dim))).astype(np.float32)
    qkv, _, ring, _, fac = run_gdn(k, T, start, mixed, conv_w, a_log, dt_bias, ring0, s0)
    ref_qkv, _, ref_beta, ref_ring = conv1d.reference(c, mixed, conv_w, a_log, dt_bias,
                                                      ring0 if start else np.zeros_like(ring0), start)
    assert rel_err(qkv, ref_qkv) < 8e-3
    chunks = -(-T // gdn.CHUNK)
    beta = fac.reshape(-1, hv, gdn.FAC)[:chunks, :, :gdn.CHUNK].transpose(0, 2, 1).reshape(-1, hv)
    assert rel_err(beta[:T], ref_beta) < 1e-5
    assert not beta[T:].any(), "padding tokens have beta 0"
    # the new state (slots of positions start+T-K+1 .. start+T-1 at or after 0) is the reference's, bit for bit
    for p in range(max(0, start + T - K + 1), start + T):
        assert np.array_equal(ring[p % K], ref_ring[p % K]), f"conv state of position {p}"


@pytest.mark.parametrize("model", ["tiny", "0.8b", "27b"])
@SETTINGS
@given(T=LENGTHS, has_state=st.booleans(), weak_decay=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_chunked_delta_rule_matches_numpy(kernels, model, T, has_state, weak_decay, seed):
    """o and the new recurrent state against the reference's chunked rule on the front's outputs (qkv as the kernel
    wrote it, checked against the reference by test_deltanet_front_matches_numpy; g and beta the reference's)."""
    k = kernels(model)
    c = k.cfg
    hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    rng = np.random.default_rng(seed)
    mixed, conv_w, a_log, dt_bias, ring0 = front_inputs(c, T, rng, weak_decay)
    start = int(rng.integers(1, 5000)) if has_state else 0
    s0 = (0.1 * rng.standard_normal((hv, dv, dk))).astype(np.float32)
    qkv, o, _, state, _ = run_gdn(k, T, start, mixed, conv_w, a_log, dt_bias, ring0, s0)
    _, g, beta, _ = conv1d.reference(c, mixed, conv_w, a_log, dt_bias, ring0 if start else np.zeros_like(ring0), start)
    ref_o, ref_s = gdn.reference(c, qkv, g, beta, s0 if has_state else None)
    assert rel_err(o, ref_o) < 2e-3
    assert rel_err(state, ref_s) < 2e-3


@pytest.mark.parametrize("model", ["tiny", "0.8b"])
@SETTINGS
@given(T=LENGTHS, seed=st.integers(0, 2**32 - 1))
def test_gated_norm_matches_numpy(kernels, model, T, seed):
    k = kernels(model)
    c = k.cfg
    hv, dv, C = c.linear_num_value_heads, c.linear_value_head_dim, c.conv_dim
    rng = np.random.default_rng(seed)
    o = rng.standard_normal((T, hv, dv), dtype=np.float32)
    mixed = rng.standard_normal((T, C + c.value_dim + 2 * hv), dtype=np.float32)
    w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    y = poisoned((T, hv * dv), BF16)
    k.gdn.gated_norm(dev(o), dev(mixed), dev(w), y, T, 1e-6)
    ref = gdn.gated_norm_reference(o, mixed[:, C:C + c.value_dim].reshape(T, hv, dv), w, 1e-6)
    assert rel_err(y.numpy(), ref) < 8e-3


# ---- attention ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny", "0.8b", "27b"])
@SETTINGS
@given(T=st.one_of(st.sampled_from([1, 63, 64, 65]), st.integers(1, 200)),
       start=st.sampled_from([0, 1, 1000, 65535, 200_000]), seed=st.integers(0, 2**32 - 1))
def test_attention_prep_matches_numpy(kernels, model, T, start, seed):
    k = kernels(model)
    c = k.cfg
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rng = np.random.default_rng(seed)
    qkv = bf16(3 * rng.standard_normal((T, c.q_proj_rows + 2 * c.kv_dim), dtype=np.float32))
    qn, kn = (0.1 * rng.standard_normal((2, hd))).astype(np.float32)
    q = poisoned((T, nh, hd), BF16)
    kc, vc = poisoned((start + T, nkv, hd), BF16), poisoned((start + T, nkv, hd), BF16)
    k.attn.prep(dev(qkv), dev(qn), dev(kn), q, kc, vc, T, start)
    ref_q, ref_k, ref_v = attention.prep_reference(c, qkv, qn, kn, start)
    written = lambda cache: cache.view((T, nkv, hd), offset_bytes=start * nkv * hd * 2).numpy()
    assert rel_err(q.numpy(), ref_q) < 8e-3
    assert rel_err(written(kc), ref_k) < 8e-3
    assert np.array_equal(written(vc), bf16(ref_v))


@pytest.mark.parametrize("model", ["tiny", "0.8b", "27b"])
@SETTINGS
@given(T=LENGTHS, start=st.sampled_from([0, 1, 37, 64, 1000]), sharp=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_flash_attention_matches_numpy(kernels, model, T, start, sharp, seed):
    k = kernels(model)
    c = k.cfg
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rng = np.random.default_rng(seed)
    q = bf16((4.0 if sharp else 1.0) * rng.standard_normal((T, nh, hd), dtype=np.float32))
    keys = bf16(rng.standard_normal((start + T, nkv, hd), dtype=np.float32))
    values = bf16(rng.standard_normal((start + T, nkv, hd), dtype=np.float32))
    qkv = bf16(rng.standard_normal((T, c.q_proj_rows + 2 * c.kv_dim), dtype=np.float32))  # the gates
    kc = DeviceArray.empty((start + T + 70, nkv, hd), BF16)  # rows past the cache's end hold NaN: never used
    kc.fill_bytes(0xFF)
    vc = DeviceArray.empty((start + T + 70, nkv, hd), BF16)
    vc.fill_bytes(0xFF)
    kc.view(keys.shape).copy_from(keys)
    vc.view(values.shape).copy_from(values)
    _, gate, _, _ = attention.split_qkv(c, qkv)
    ref = attention.reference(c, q, keys, values, gate)
    dq, dqkv = dev(q), dev(qkv)
    # a block a query tile (the wgmma kernel where the spec says), and the cluster split where the chip has clusters
    split = k.split_attn()
    for attn, n in ((k.attn, 1), *(((split, SPLIT),) if split else ())):
        out = poisoned((T, nh * hd), BF16)
        with mock.patch.object(attention, "splits", lambda *_: n):
            attn.attend(dq, kc, vc, dqkv, out, T, start)
        assert rel_err(out.numpy(), ref) < 1e-2, f"{n} blocks a query tile"


# ---- the whole prefill -------------------------------------------------------------------------------------------

@cache
def model_weights(name: str, seed: int = 3) -> dict[str, np.ndarray]:
    """Random weights with the matrices rounded to bf16 (what the GPU holds), as float32 for the reference."""
    w = random_weights(MODELS[name](), seed=seed)
    return {n: bf16(a).astype(np.float32) if a.ndim == 2 else a for n, a in w.items()}


@pytest.fixture(scope="module")
def engine(spec, tmp_path_factory):
    """engine(model, chunk_tokens) -> (Prefill, DeviceWeights), built and uploaded once."""
    root = tmp_path_factory.mktemp("engine")
    uploaded = {}

    @cache
    def get(name: str, chunk_tokens: int | None = None):
        cfg = MODELS[name]()
        if name not in uploaded:
            uploaded[name] = DeviceWeights.upload(cfg, spec, model_weights(name))
        return Prefill(spec, cfg, chunk_tokens=chunk_tokens, root=root), uploaded[name]
    return get


def reference_last_logits(weights, cfg, ids, state: State) -> np.ndarray:
    """The reference forward of ids after `state` (advanced in place), logits of the last token only."""
    x = weights["embed_tokens.weight"][np.asarray(ids)]
    for i in range(cfg.num_hidden_layers):
        x = decoder_layer(weights, cfg, i, x, state)
    state.position += len(ids)
    return rms_norm(x[-1], weights["norm.weight"], cfg.rms_norm_eps) @ lm_head(weights).T


def run(engine_and_weights, state: DeviceState, ids) -> np.ndarray:
    prefill, weights = engine_and_weights
    logits = prefill(weights, state, ids).numpy()
    synchronize()
    return logits


# 16: the longest prompt on gemm's 16-token tiles (the 0.8B's residual adds split K in 4 over clusters there)
@pytest.mark.parametrize("model, T", [(m, T) for m in ("tiny", "0.8b") for T in (1, 16, 63, 64, 65, 520, 4097)])
def test_prefill_matches_the_reference(engine, model, T):
    cfg, w = MODELS[model](), model_weights(model)
    ids = np.random.default_rng(T).integers(0, cfg.vocab_size, T)
    state = DeviceState(cfg, T + 16)
    logits = run(engine(model), state, ids)
    ref_state = State()
    ref = reference_last_logits(w, cfg, ids, ref_state)
    assert rel_err(logits, ref) < E2E_RTOL[model]
    assert_state_close(state, ref_state, E2E_RTOL[model])
    state.free()


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("method", GEMM_METHODS)
def test_prefill_with_every_gemm_variant_matches_the_reference(spec, method, split_k, tmp_path):
    """The whole 0.8B prefill of 520 tokens with each GEMM method the chip allows, without and with split-K (the
    0.8B's N = 1024 residual adds at 520 tokens have fewer tiles than SMs, so split_k 4 splits them), twice: the
    second run's logits and state are the first's, bit for bit."""
    if method not in gemm_methods(spec):
        pytest.skip(f"{spec.name} ({spec.chip.arch}) cannot run the {method} GEMM")
    variant, cfg, w, T = spec.with_prefill(gemm=method, split_k=split_k), MODELS["0.8b"](), model_weights("0.8b"), 520
    ids = np.random.default_rng(T).integers(0, cfg.vocab_size, T)
    state = DeviceState(cfg, T + 16)
    prefill, weights = Prefill(variant, cfg, root=tmp_path), DeviceWeights.upload(cfg, variant, w)
    logits = run((prefill, weights), state, ids)
    ref_state = State()
    ref = reference_last_logits(w, cfg, ids, ref_state)
    assert rel_err(logits, ref) < E2E_RTOL["0.8b"]
    assert_state_close(state, ref_state, E2E_RTOL["0.8b"])
    again = DeviceState(cfg, T + 16)  # the same prompt again: the same bits, split-K or not
    assert np.array_equal(run((prefill, weights), again, ids), logits)
    first, second = state.to_reference(), again.to_reference()
    for table in ("conv", "recurrent", "keys", "values"):
        for i, a in getattr(first, table).items():
            assert np.array_equal(getattr(second, table)[i], a), f"{table} of layer {i} differs between two runs"
    for a in (state, again, prefill, weights):
        a.free()


def test_programmatic_launches_change_no_bit(spec, tmp_path):
    """The 0.8B prefill of 520 tokens with programmatic dependent launch (every kernel's blocks start while the one
    before finishes; the GEMM loads its first weight tiles then), launched one by one and replayed from a graph,
    equals the prefill without it bit for bit: every kernel waits where it reads what the one before wrote."""
    if spec.chip.cc < 90:
        pytest.skip(f"programmatic dependent launch needs sm_90; {spec.name} is {spec.chip.arch}")
    cfg, T = MODELS["0.8b"](), 520
    ids = np.random.default_rng(11).integers(0, cfg.vocab_size, T)
    plain, programmatic = (Prefill(spec.with_prefill(pdl=pdl, model_pdl=()), cfg, root=tmp_path)
                           for pdl in (False, True))
    weights = DeviceWeights.upload(cfg, spec, model_weights("0.8b"))
    states = [DeviceState(cfg, T + 16) for _ in range(3)]
    want = run((plain, weights), states[0], ids).copy()
    got = run((programmatic, weights), states[1], ids).copy()
    device_ids = DeviceArray.from_numpy(ids.astype(np.int32))
    with Graph.capture(programmatic.stream) as graph:  # nothing runs yet; the state's position moves to T
        programmatic.enqueue(weights, states[2], device_ids, programmatic.stream)
    programmatic.logits.fill_bytes(0xFF)
    synchronize()  # the poison is in place before the replay (the prefill's stream does not wait for the null one)
    graph.launch()
    programmatic.stream.synchronize()
    replayed = programmatic.logits.numpy()
    assert np.isfinite(want).all()
    for what, logits in (("launched one by one", got), ("replayed from a graph", replayed)):
        assert np.array_equal(logits, want), f"logits {what} differ from the prefill without programmatic launches"
    first = states[0].to_reference()
    for state in states[1:]:
        other = state.to_reference()
        for table in ("conv", "recurrent", "keys", "values"):
            for i, a in getattr(first, table).items():
                assert np.array_equal(getattr(other, table)[i], a), f"{table} of layer {i} differs"
    graph.destroy()
    for a in (*states, plain, programmatic, weights, device_ids):
        a.free()


@pytest.mark.parametrize("model", ["tiny", "0.8b"])
def test_chunked_prefill_equals_one_shot(engine, spec, model, tmp_path):
    """Without split-K (which groups a GEMM's K slices by the pass's length), chunking changes no arithmetic."""
    cfg = MODELS[model]()
    unsplit = spec.with_prefill(split_k=1)
    _, weights = engine(model)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 520)
    one, two = DeviceState(cfg, 600), DeviceState(cfg, 600)
    whole, chunked = Prefill(unsplit, cfg, root=tmp_path), Prefill(unsplit, cfg, chunk_tokens=256, root=tmp_path)
    a = run((whole, weights), one, ids)
    b = run((chunked, weights), two, ids)  # passes of 256 + 256 + 8 tokens
    assert two.position == one.position == 520
    assert rel_err(b, a) < 1e-5  # the same arithmetic (chunk-aligned DeltaNet rule, the same K loop per element)
    assert_state_close(two, one.to_reference(), 1e-5)
    for x in (one, two, whole, chunked):
        x.free()


def continuation_errors(make, upload, cfg, w, ids, T) -> list[float]:
    """Errors against the reference of: the token after a T-token prefill, the state then, and the next token from
    the reference's own state (make() -> Prefill, upload(w) -> DeviceWeights)."""
    prefill, weights = make(), upload(w)
    state = DeviceState(cfg, T + 16)
    prefill(weights, state, ids[:T])
    step = prefill(weights, state, ids[T:T + 1]).numpy()  # a blocking copy after the launches
    ref_state = State()
    reference_last_logits(w, cfg, ids[:T], ref_state)
    errors = [rel_err(step, decode_step(w, cfg, int(ids[T]), ref_state)), max(state_errors(state, ref_state).values())]
    state.load_reference(ref_state)  # continue the reference's own state
    nxt = prefill(weights, state, ids[T + 1:]).numpy()
    errors.append(rel_err(nxt, decode_step(w, cfg, int(ids[T + 1]), ref_state)))
    state.free()
    return errors


@pytest.mark.parametrize("model", ["tiny", "0.8b"])
@pytest.mark.parametrize("T", [1, 65, 520])
def test_decode_continues_the_prefill(engine, spec, model, T, monkeypatch):
    """prefill(T) then one more token (the DeltaNet state read back, the KV cache extended) equals the reference's
    prefill + decode_step (recurrent rule), and a state taken over from the reference continues like it.

    The token right after a short prompt is where bf16 rounding is worst conditioned (a DeltaNet head's q and k
    nearly orthogonal at position 0, amplified by the gated norm: the host emulation gives 6.7 % for T = 1 on the
    tiny model), so each check here is bounded by the error the numpy emulation of the prefill's rounding points
    (tests/host_kernels.py) has on this very case, with E2E_RTOL's margin of 2.5 over it, E2E_RTOL at least."""
    cfg, w = MODELS[model](), model_weights(model)
    ids = np.random.default_rng(T + 1).integers(0, cfg.vocab_size, T + 2)
    with on_host(monkeypatch):
        # the host kernels stand in for mma.sync's launches (wgmma's take tensor maps of device memory)
        host = spec.with_prefill(gemm="mma", split_k=1, attention="mma")
        emulated = continuation_errors(lambda: Prefill(host, cfg), lambda w: DeviceWeights.upload(cfg, host, w),
                                       cfg, w, ids, T)
    prefill, weights = engine(model)
    got = continuation_errors(lambda: prefill, lambda _: weights, cfg, w, ids, T)
    for what, error, bound in zip(("next token", "state", "next token from the reference's state"), got, emulated):
        assert error < max(E2E_RTOL[model], 2.5 * bound), f"{what}: {error:.4f} (emulated: {bound:.4f})"


@pytest.mark.parametrize("model", ["tiny", "0.8b"])
def test_decode_engine_prefills_on_tensor_cores(spec, model, tmp_path):
    """DecodeEngine.prefill (the cuda backend's engine for a bf16 checkpoint) of a prompt of PREFILL_FROM tokens or
    more runs the tensor-core prefill over the megakernel's own weight arena, and the megakernel decodes on from the
    state it leaves: the prompt's logits and state, and two decode steps after it, against the reference. A shorter
    prompt goes through the megakernel."""
    cfg, w, T = MODELS[model](), model_weights(model), 300
    ids = np.random.default_rng(17).integers(0, cfg.vocab_size, T + 2)
    engine = DecodeEngine(w, cfg, spec, max_context=1024, build_root=tmp_path)
    launched = []
    with observe_launches(lambda kernel, args, stream, launch: (launched.append(kernel.name), launch())):
        logits = engine.prefill(ids[:T])
    assert "gdn_chunk_scan" in launched and "mk_decode" not in launched
    ref_state = State()
    ref = reference_last_logits(w, cfg, ids[:T], ref_state)
    assert engine.position == T
    assert rel_err(logits, ref) < E2E_RTOL[model]
    assert_state_close(engine.state, ref_state, E2E_RTOL[model])
    for t in ids[T:]:
        assert rel_err(engine.decode(int(t)), decode_step(w, cfg, int(t), ref_state)) < E2E_RTOL[model]
    engine.reset()
    launched.clear()
    with observe_launches(lambda kernel, args, stream, launch: (launched.append(kernel.name), launch())):
        engine.prefill(ids[:PREFILL_FROM - 1])
    assert launched == ["mk_decode"]
    engine.free()


HF_LOGITS = Path(__file__).resolve().parents[2] / "tools" / "hf_logits.py"


def hf_last_logits(cfg, weights: dict[str, np.ndarray], ids: np.ndarray, tmp: Path) -> np.ndarray:
    """HF's float32 logits of the last token of `ids`, computed by tools/hf_logits.py in a process of its own: torch
    is never imported into the pytest process (there, `import torch` 2.11 fails while torch registers its own
    custom ops: "expected ident but found ')' here: annotate(strtag) -> ()")."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("HF comparison needs torch and transformers")
    paths = {name: tmp / name for name in ("config.json", "weights.safetensors", "ids.txt", "logits.safetensors")}
    paths["config.json"].write_text(json.dumps(cfg.to_hf_dict()))
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(paths["weights.safetensors"]))
    paths["ids.txt"].write_text(" ".join(str(int(i)) for i in ids))
    proc = subprocess.run([sys.executable, str(HF_LOGITS), *map(str, paths.values()), "--device", "cuda"],
                          check=False, capture_output=True, text=True, timeout=900, cwd=HF_LOGITS.parents[1])
    assert proc.returncode == 0, f"tools/hf_logits.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return load_file(str(paths["logits.safetensors"]))["logits"]


@pytest.mark.parametrize("model, T", [("tiny", 65), ("tiny", 520), ("0.8b", 520)])
def test_prefill_matches_hf(engine, model, T, tmp_path):
    """Against HF transformers' float32 Qwen3_5ForCausalLM (eager attention, torch DeltaNet ops) with the same
    weights: the reference's own parity with HF is 1e-5 (tools/hf_parity.py), so the bf16 tolerance applies."""
    cfg, w = MODELS[model](), model_weights(model)
    ids = np.random.default_rng(T + 7).integers(0, cfg.vocab_size, T)
    hf = hf_last_logits(cfg, w, ids, tmp_path)
    state = DeviceState(cfg, T)
    assert rel_err(run(engine(model), state, ids), hf) < E2E_RTOL[model]
    state.free()
