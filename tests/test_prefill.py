"""The prefill without a GPU: its kernels compile spill-free for every chip (for the 0.8B / 27B shapes
tests/test_codegen.py builds them through kernels.FAMILIES; here the small test model of tests/gpu), the launch
configurations fit each chip, and the host-side layouts (fused weights, conv ring, state) agree with the reference.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lucegen.codegen.build import build
from lucegen.engine.prefill import shape_problem, units
from lucegen.kernels import attention, conv1d, gdn, gemm
from lucegen.kernels.megakernel import pack_layer_tensor
from lucegen.model.config import load_config, tiny_config
from lucegen.reference import random_weights
from lucegen.reference.deltanet import causal_conv1d
from lucegen.reference.ops import silu
from lucegen.spec import SpecError, all_specs, gemm_methods, list_specs, load_spec
from host_kernels import HostArray, HostModule, gemm_tiles, on_host, order_sensitive_gemm, split_add

TINY = tiny_config(name="tiny-prefill", hidden_size=128, intermediate_size=256, head_dim=64,
                   linear_key_head_dim=64, linear_value_head_dim=64)  # tests/gpu/test_prefill_gpu.py's model
REAL = [load_config("qwen3.5-0.8b"), load_config("qwen3.5-27b")]


@pytest.mark.parametrize("spec_name", list_specs())
def test_prefill_kernels_compile_for_the_test_model(tmp_path, spec_name):
    spec = load_spec(spec_name)
    result = build(spec, TINY, units(spec, TINY), root=tmp_path)
    names = {k.name for k in result.kernels}
    small_add = gemm.kernel_name(gemm.tile_configs(spec)[1], "add")  # of the spec's GEMM method
    assert {small_add, "gdn_chunk_prep", "gdn_chunk_scan", "attention_prefill_causal"} <= names
    for k in result.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"
        assert k.coresident_blocks >= 1, f"{k.name} cannot run on {spec_name}"
        assert k.static_smem + k.dynamic_smem <= spec.chip.smem_per_block


@pytest.mark.parametrize("spec", [s.with_prefill(gemm=m) for s in all_specs() for m in gemm_methods(s)
                                  if m != s.tuning.prefill.gemm], ids=lambda s: f"{s.name}-{s.tuning.prefill.gemm}")
def test_every_gemm_method_the_chip_allows_compiles(tmp_path, spec):
    """The GEMM methods a spec does not select (mma on the Hopper specs, which run wgmma) compile spill-free, with
    every tile and epilogue, each tile as many blocks to an SM as its launch bounds promise;
    test_prefill_kernels_compile_for_the_test_model covers the selected one."""
    result = build(spec, TINY, gemm.units(spec), root=tmp_path)
    reports = {k.name: k for k in result.kernels}
    configs = {gemm.kernel_name(c, e): c for c in gemm.tile_configs(spec) for e in gemm.KERNEL_EPILOGUES}
    assert reports.keys() == configs.keys()
    for name, c in configs.items():
        k = reports[name]
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{name} spills on {spec.name}"
        assert k.coresident_blocks >= c.min_blocks * spec.chip.sm_count, name


@pytest.mark.parametrize("spec", [s.with_prefill(gemm=m) for s in all_specs() for m in gemm_methods(s)],
                         ids=lambda s: f"{s.name}-{s.tuning.prefill.gemm}")
def test_launch_configurations_fit_every_chip(spec):
    for c in gemm.tile_configs(spec):
        assert c.smem <= spec.chip.smem_per_block and c.stages >= 2 and c.threads <= 1024
        assert c.method == spec.tuning.prefill.gemm
    for cfg in REAL + [TINY]:
        bv, stages = gdn.scan_config(spec, cfg)
        assert cfg.linear_value_head_dim % bv == 0 and gdn.scan_smem(cfg, bv, stages) <= spec.chip.smem_per_block
        assert gdn.prep_smem(cfg) <= spec.chip.smem_per_block
        assert shape_problem(spec, cfg) is None


@pytest.mark.parametrize("method", ["mma", "wgmma"])
def test_gemm_picks_large_tiles_for_long_prompts_and_small_ones_for_short(method):
    h200 = load_spec("h200").with_prefill(gemm=method)
    large, small, *tokens_n = gemm.tile_configs(h200)
    assert bool(tokens_n) == (method == "wgmma")  # token-N tiles are wgmma's
    assert gemm.choose(h200, 8192, 17408) == large
    assert gemm.choose(h200, 64, 1024) == small


def test_wgmma_takes_token_n_tiles_for_the_wide_projections_of_a_short_prompt():
    """At 520 tokens (3 token tiles of 176) the 0.8B's in-projection is one wave of 176x192 tiles, its attention
    qkv one of 176x128, and its residual adds 88x128 tiles split along K in two (96 blocks, as many as 176x128 tiles
    in four slices: the tie goes to the fewer slices); at 4096 tokens the 128x256 tile takes every projection."""
    h200, cfg = load_spec("h200"), REAL[0]
    in_rows = cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads
    wide = gemm.choose(h200, 520, in_rows, cfg.hidden_size, "f32")
    assert wide.tokens_n and wide.name == "wt176x192" and wide.tiles(520, in_rows) <= h200.chip.sm_count
    qkv = gemm.choose(h200, 520, cfg.q_proj_rows + 2 * cfg.kv_dim, cfg.hidden_size, "bf16")
    assert qkv.tokens_n and qkv.name == "wt176x128"
    assert gemm.choose(h200, 4096, in_rows, cfg.hidden_size, "f32") == gemm.tile_configs(h200)[0]
    for k in (2048, 3584):  # the residual adds: token-N tiles, K split over a cluster
        add = gemm.choose(h200, 520, 1024, k, "add")
        assert add.name == "wt88x128" and gemm.splits(h200, add, 520, 1024, k, "add") == 2
        assert add.tiles(520, 1024) * 2 == 96 <= h200.chip.sm_count


def test_wgmma_takes_16_token_tiles_for_a_draft_block_alone():
    """The DFlash draft's projections at its block of 16 tokens: the 16-token tile (64 weight rows, two blocks an
    SM), so that the 27B draft's narrowest projection (5,120 rows) spreads over 80 blocks and its [q | k | v] over 96,
    where 64x128 tiles made 40 and 48 (most SMs idle while the weights stream); the residual adds split K over a
    cluster where that fills the SMs. Past 16 tokens the tile is not a candidate."""
    h200 = load_spec("h200")
    draft = {"qkv": (6144, 5120, "f32"), "o": (5120, 4096, "add"), "gate_up": (34816, 5120, "silu"),
             "down": (5120, 17408, "add")}
    for m in (1, 8, 16):
        for name, (n, k, epilogue) in draft.items():
            c = gemm.choose(h200, m, n, k, epilogue)
            assert c.tokens_n and c.bm == 16 and c.most_tokens == 16, (m, name, c)
            blocks = c.tiles(m, n) * gemm.splits(h200, c, m, n, k, epilogue)
            assert blocks >= 0.7 * h200.chip.sm_count, (m, name, blocks)
    for name, (n, k, epilogue) in draft.items():
        assert gemm.choose(h200, 17, n, k, epilogue).bm != 16
    assert gemm.splits(h200, gemm.choose(h200, 16, 5120, 4096, "add"), 16, 5120, 4096, "add") == 3  # 240 blocks
    assert gemm.choose(h200.with_prefill(gemm="mma"), 16, 6144, 5120, "f32").bm != 16  # wgmma's only


@pytest.mark.parametrize("spec", [s.with_prefill(gemm=m, split_k=sk) for s in all_specs() for m in gemm_methods(s)
                                  for sk in (1, 4, 8)],
                         ids=lambda s: f"{s.name}-{s.tuning.prefill.gemm}-split{s.tuning.prefill.split_k}")
@given(m=st.integers(1, 8192), n2=st.integers(1, 9000), kt=st.integers(1, 300),
       epilogue=st.sampled_from(list(gemm.EPILOGUES)))
@settings(max_examples=50, deadline=None)
def test_gemm_splits_k_only_for_adds_that_leave_sms_idle(spec, m, n2, kt, epilogue):
    n, k = 2 * n2, kt * gemm.BK
    c = gemm.choose(spec, m, n, k, epilogue)
    s = gemm.splits(spec, c, m, n, k, epilogue)
    assert 1 <= s <= spec.tuning.prefill.split_k
    assert not c.slices or s == c.slices  # a config with its own count of slices is taken only for that split
    if s > 1:
        assert epilogue == "add" and c.tiles(m, n) < spec.chip.sm_count and kt // s >= gemm.MIN_SLICE
        # a split pays for its partials' round trip only by unloading the busiest SM
        assert math.ceil(c.tiles(m, n) * s / spec.chip.sm_count) / s < 1
        assert c.tiles(m, n) * s <= spec.chip.sm_count * c.min_blocks  # one wave of resident blocks
        partials, counters = gemm.workspace(spec)
        if spec.tuning.prefill.gemm == "wgmma":  # a tile's cluster keeps its partials in its shared memory
            assert (partials, counters) == (0, 0)
        else:  # the launcher's workspace holds the wave's partial tiles and its tiles' counters
            assert c.tiles(m, n) * s * c.bm * c.bn <= partials and c.tiles(m, n) <= counters
    assert [k1 - k0 for k0, k1 in gemm.slices(k, s)] == [(i + 1) * kt // s * 64 - i * kt // s * 64 for i in range(s)]
    assert gemm.slices(k, s)[0][0] == 0 and gemm.slices(k, s)[-1][1] == k


def test_the_0_8b_residual_gemms_at_pp520_split_k_and_the_27b_ones_at_pp4096_do_not():
    h200 = load_spec("h200").with_prefill(split_k=4)
    for k in (2048, 3584):  # DeltaNet out_proj (value_dim) and MLP down (intermediate) of the 0.8B, N = 1024
        c = gemm.choose(h200, 520, 1024, k, "add")
        assert gemm.splits(h200, c, 520, 1024, k, "add") > 1
        assert gemm.splits(h200, c, 520, 1024, k, "bf16") == 1
        assert gemm.splits(h200.with_prefill(split_k=1), c, 520, 1024, k, "add") == 1  # split_k 1: no split
    for n, k in ((34816, 5120), (5120, 17408)):  # the 27B's gate/up and down at 520: unsplit, not on the split tile
        assert gemm.choose(h200, 520, n, k, "silu" if n > k else "add").slices == 0
    big = gemm.choose(h200, 4096, 5120, 17408, "add")
    assert gemm.splits(h200, big, 4096, 5120, 17408, "add") == 1


def fold(start, parts):
    """((start + parts[0]) + parts[1]) + ... in float32."""
    for p in parts:
        start = start + p if start is not None else p
    return start


@pytest.mark.parametrize("splits", [2, 3, 4, 8])
def test_split_k_reference_sums_the_slices_in_slice_order_then_adds_once(splits):
    """gemm.reference(..., splits) is Y0 + ((p_0 + p_1) + ...) (gemm.py's docstring); on host_kernels'
    order-sensitive inputs (what the GPU test checks the kernel with, bit for bit) every other order of summing the
    partials, and adding them into Y0 one by one, gives other bits: a kernel summing out of order fails there."""
    m, n, k = 70, 96, 64 * gemm.MIN_SLICE * splits
    x, w, y0 = order_sensitive_gemm(m, n, k, splits, seed=splits)
    parts = [x[:, k0:k1].astype(np.float32) @ w[:, k0:k1].astype(np.float32).T for k0, k1 in gemm.slices(k, splits)]
    ref = gemm.reference(x, w, "add", y0, splits=splits)
    assert np.array_equal(ref, y0 + fold(None, parts))
    for p, (k0, k1) in zip(parts, gemm.slices(k, splits)):  # exact, however a kernel orders a slice's products
        assert np.array_equal(p, x[:, k0:k1].astype(np.float64) @ w[:, k0:k1].astype(np.float64).T)
    assert not np.array_equal(ref, fold(y0, parts)), "adding the slices into Y one by one"
    orders = itertools.permutations(range(splits)) if splits <= 4 else [tuple(reversed(range(splits)))] + [
        tuple(np.random.default_rng(i).permutation(splits)) for i in range(20)]
    for order in orders:
        if sorted(order[:2]) == [0, 1] and list(order[2:]) == list(range(2, splits)):
            continue  # p_1 + p_0 = p_0 + p_1: the same sum
        assert not np.array_equal(ref, y0 + fold(None, [parts[i] for i in order])), f"slices summed in order {order}"


@pytest.mark.parametrize("bm, bn", [(64, 128), (128, 256)])
@given(m=st.integers(1, 300), n2=st.integers(1, 300), splits=st.integers(2, 5), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_split_k_blocks_finishing_in_any_order_give_the_reference_bits(bm, bn, m, n2, splits, seed):
    """host_kernels.split_add, the split kernel block by block (partials to slots, the tile's counter, the last block
    adding the slots in slice order): whatever order the blocks finish in, y is gemm.reference(..., splits) bit for
    bit and every counter is back at zero for the next launch."""
    n, k = 2 * n2, 64 * gemm.MIN_SLICE * splits
    x, w, y0 = order_sensitive_gemm(m, n, k, splits, seed)
    tiles = gemm_tiles(m, n, bm, bn)
    ref = gemm.reference(x, w, "add", y0, splits=splits)
    partials = np.full(splits * tiles * bm * bn, np.nan, np.float32)
    counters = np.zeros(tiles + 3, np.uint32)
    rng = np.random.default_rng(seed)
    for blocks in (np.arange(splits * tiles), np.arange(splits * tiles)[::-1], rng.permutation(splits * tiles)):
        y = y0.copy()
        split_add(x, w, y, bm, bn, splits, partials, counters, blocks)
        assert np.array_equal(y, ref) and not counters.any()


def test_the_gemm_launcher_hands_split_launches_its_workspace(monkeypatch):
    """Gemm on host memory (host_kernels' stand-ins) with split-K: the 0.8B's residual adds at 520 tokens launch the
    split kernel with tiles x splits blocks, the workspace and the counters, and give gemm.reference(..., splits)'s
    bits, launch after launch, with the counters left at zero."""
    with on_host(monkeypatch):
        spec = load_spec("h200").with_prefill(gemm="mma", split_k=4)  # host kernels stand in for mma.sync's
        op = gemm.Gemm(HostModule(TINY), spec)
        for k in (2048, 3584):
            x, w, y0 = order_sensitive_gemm(520, 1024, k, 4, seed=k)
            c = gemm.choose(spec, 520, 1024, k, "add")
            s = gemm.splits(spec, c, 520, 1024, k, "add")
            assert s > 1
            ref = gemm.reference(x, w, "add", y0, splits=s)
            for _ in range(2):
                y = HostArray.from_numpy(y0)
                op(HostArray.from_numpy(x), HostArray.from_numpy(w), y, 520, 1024, k, "add")
                assert np.array_equal(y.numpy(), ref) and not op.counters.numpy().any()
    assert gemm.workspace(load_spec("h200").with_prefill(split_k=1)) == (0, 0)  # no split-K: no workspace


def test_shapes_the_tiles_cannot_take_are_refused_with_a_reason():
    h200 = load_spec("h200")
    assert "dk a multiple of 64" in shape_problem(h200, tiny_config())   # dk = 16
    assert "head_dim a multiple of 64" in shape_problem(h200, tiny_config(linear_key_head_dim=64,
                                                                          linear_value_head_dim=64))
    assert not gdn.units(h200, tiny_config()) and len(gdn.units(h200, TINY)) == 1


@pytest.mark.parametrize("cfg", [TINY, tiny_config(name="ratio3", linear_num_value_heads=6, hidden_size=128,
                                                   intermediate_size=256, head_dim=64, linear_key_head_dim=64,
                                                   linear_value_head_dim=64)], ids=lambda c: c.name)
def test_the_megakernels_packing_feeds_the_prefill_gemms(cfg):
    """The prefill reads the decode megakernel's weight arena: its fused in-projections are the separate ones
    concatenated in the order the prefill's kernels split them, and its paired gate/up rows give the MLP through
    the `silu` epilogue."""
    w = random_weights(cfg, seed=1)
    x = np.random.default_rng(2).standard_normal((5, cfg.hidden_size), dtype=np.float32)
    for i in range(cfg.num_hidden_layers):
        packed = lambda name: pack_layer_tensor(w, cfg, i, name).astype(np.float32)
        p = lambda n: w[f"layers.{i}.{n}"].astype(np.float32)
        names = ([f"linear_attn.in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")] if i in cfg.linear_layers
                 else [f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")])
        assert np.allclose(x @ packed("in").T, np.concatenate([x @ p(n).T for n in names], -1), atol=1e-5)
        mlp = silu(x @ p("mlp.gate_proj.weight").T) * (x @ p("mlp.up_proj.weight").T)
        assert np.allclose(gemm.reference(x, packed("gate_up"), "silu"), mlp, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(position=st.integers(0, 200), seed=st.integers(0, 2**16))
def test_conv_ring_holds_the_reference_conv_state(position, seed):
    state = np.random.default_rng(seed).standard_normal((3, 8), dtype=np.float32)
    state[:max(0, 3 - position)] = 0  # positions before 0 are zeros in the reference
    assert np.array_equal(conv1d.ring_to_state(conv1d.state_to_ring(state, position), position), state)


@settings(max_examples=20, deadline=None)
@given(t1=st.integers(1, 9), t2=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_conv_reference_on_a_ring_continues_like_the_layer(t1, t2, seed):
    """Two prompts through conv1d.reference (ring in, ring out) give the reference conv over both at once."""
    cfg = TINY
    rng = np.random.default_rng(seed)
    C, W = cfg.conv_dim, cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads
    mixed = rng.standard_normal((t1 + t2, W), dtype=np.float32)
    conv_w = rng.standard_normal((C, cfg.linear_conv_kernel_dim), dtype=np.float32)
    a_log, dt_bias = rng.standard_normal((2, cfg.linear_num_value_heads), dtype=np.float32)
    ring = np.full((cfg.linear_conv_kernel_dim, C), np.nan, np.float32)  # never read at position 0
    first = conv1d.reference(cfg, mixed[:t1], conv_w, a_log, dt_bias, np.nan_to_num(ring), 0)
    second = conv1d.reference(cfg, mixed[t1:], conv_w, a_log, dt_bias, first[3], t1)
    whole, state = causal_conv1d(mixed[:, :C], conv_w, np.zeros((3, C), np.float32))
    assert np.allclose(np.concatenate([first[0], second[0]]), silu(whole), rtol=1e-6, atol=1e-6)
    assert np.array_equal(conv1d.ring_to_state(second[3], t1 + t2), state)


def blocked_inverse_model(a: np.ndarray) -> np.ndarray:
    """templates/gdn_chunk.cuh's unit_lower_inverse in numpy, step by step: (I + A)^-1 for a strictly lower 64 x 64
    A, from the 16 x 16 diagonal blocks' forward substitution (warp w, lane l: column l of block w, in fp32 fmaf
    order) and then, one distance d at a time, T_ij = -T_ii (sum_k A_ik T_kj), the sum staged in A's block (j, i)."""
    a = a.astype(np.float32).copy()
    t = np.full((64, 64), np.nan, np.float32)
    for w in range(4):
        d0 = 16 * w
        t[d0:d0 + 16, d0 + 16:] = 0
        for lane in range(16):
            x = np.zeros(16, np.float32)
            for r in range(16):
                s = np.float32(1.0 if r == lane else 0.0)
                for m in range(r):
                    s = np.float32(np.float64(-a[d0 + r, d0 + m]) * x[m] + s)
                x[r] = s
            t[d0:d0 + 16, d0 + lane] = x
    for d in range(1, 4):
        for j in range(4 - d):
            i = j + d
            p = sum(a[16 * i:16 * i + 16, 16 * k:16 * k + 16].astype(np.float64) @ t[16 * k:16 * k + 16, 16 * j:16 * j + 16]
                    for k in range(j, i))
            a[16 * j:16 * j + 16, 16 * i:16 * i + 16] = p
            t[16 * i:16 * i + 16, 16 * j:16 * j + 16] = -(t[16 * i:16 * i + 16, 16 * i:16 * i + 16].astype(np.float64)
                                                          @ a[16 * j:16 * j + 16, 16 * i:16 * i + 16])
    return t


@pytest.mark.parametrize("seed", range(3))
def test_the_blocked_inverse_is_the_inverse(seed):
    """The prep's blocked T = (I + A)^-1 (every element written, the blocks joined in the right order): against
    numpy's inverse in float64 on an A as the delta rule makes it (beta k k^T with decays, strictly lower)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((64, 128))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    decay = np.exp(-0.02 * np.subtract.outer(np.arange(64), np.arange(64)))  # below the diagonal: e^(c_i - c_j) <= 1
    a = np.tril(rng.uniform(0, 1, (64, 1)) * (k @ k.T) * decay, -1)
    t = blocked_inverse_model(a)
    assert not np.isnan(t).any()
    want = np.linalg.inv(np.eye(64) + a)
    assert np.abs(t - want).max() / np.abs(want).max() < 1e-5


def test_attention_shares_a_short_prompts_keys_over_a_cluster_where_the_spec_says():
    """The 0.8B at 520 tokens: 9 query tiles x 8 heads leave most of the H200's SMs idle, so with attention_split
    each tile's keys go to a cluster of that many blocks; at 4096 tokens, and on a chip without clusters, one block a
    query tile. (specs/h200 takes none: its wgmma attention is faster at 520 tokens.)"""
    h200, cfg = load_spec("h200").with_prefill(attention_split=3), REAL[0]
    assert attention.splits(h200, cfg, 520) == 3
    assert attention.splits(load_spec("h200"), cfg, 520) == 1
    assert attention.splits(h200, cfg, 4096) == 1
    assert attention.splits(load_spec("rtx3090"), cfg, 520) == 1
    with pytest.raises(SpecError, match="attention_split"):
        load_spec("rtx3090").with_prefill(attention_split=2)
    with pytest.raises(SpecError, match="tuning.prefill.attention"):
        load_spec("rtx3090").with_prefill(attention="wgmma")


def test_the_scan_takes_two_roles_of_warps_only_where_its_blocks_fit_one_wave():
    """On the H200 the 0.8B's scan is 128 blocks of 16 columns (8 warps: the output beside the state update), the
    27B's 192 blocks of 32 (4 warps, each doing both)."""
    h200 = load_spec("h200")
    for cfg, bv, warps in ((REAL[0], 16, 8), (REAL[1], 32, 4)):
        assert gdn.scan_config(h200, cfg)[0] == bv and gdn.scan_warps(h200, cfg, bv) == warps
