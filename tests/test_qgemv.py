"""Quantized GEMV / GEMM without a GPU: render + NVRTC compile for every spec, the shapes and pairs the units are
made of, and the device decode (templates/quant.cuh) compiled for the host and checked bit for bit against the
gguf package on freshly drawn blocks."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from gguf import quants as gguf_quants
from hypothesis import given, settings, strategies as st

from lucegen.codegen.build import build
from lucegen.codegen.render import TEMPLATES_DIR
from lucegen.kernels import qgemv
from lucegen.model import quants
from lucegen.model.config import load_config, tiny_config
from lucegen.spec import MMA_FORMATS, list_specs, load_spec

from test_quants import random_raw

CHECK_K = 3584  # 14 blocks of 256: a last K-slice of half the lanes for the 1024-value slices


def draw_rows(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of k values in `fmt`: quantized normal values or random blocks with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    f = qgemv.fmt_of(fmt)
    if seed % 2 or fmt == "bf16":
        return qgemv.encode(rng.standard_normal((n, k), dtype=np.float32) * 10 ** rng.uniform(-2, 2), fmt)
    return random_raw(f.ggml, n, k // f.row_step, seed)


@pytest.mark.parametrize("spec_name", list_specs())
def test_every_format_compiles_without_spills(tmp_path, spec_name):
    spec, model = load_spec(spec_name), tiny_config()
    pairs = [(f, CHECK_K) for f in qgemv.FORMATS]
    result = build(spec, model, qgemv.units(spec, model, pairs), root=tmp_path)
    names = {k.name for k in result.kernels}
    for f, fmt in qgemv.FORMATS.items():
        assert {*(t.name(fmt, CHECK_K) for t in qgemv.tunings(spec, fmt, CHECK_K)), f"qdequant_{f}"} <= names
    rings = {t.name(fmt, CHECK_K): t.smem(fmt, CHECK_K, qgemv.sums_by_quads(spec, fmt))
             for fmt in qgemv.FORMATS.values() for t in qgemv.tunings(spec, fmt, CHECK_K)}
    for k in result.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"
        assert k.stack_bytes == 0, f"{k.name} keeps an array in local memory on {spec_name}"
        # shared memory: the warps' rings alone (none without stages; activations come through L1)
        assert k.static_smem == 0 and k.dynamic_smem == rings.get(k.name, 0), k.name
        # a quarter of the SM's threads at least, for the loads in flight
        assert k.coresident_blocks * k.threads >= spec.chip.max_threads_per_sm // 4 * spec.chip.sm_count, k.name


def test_a_k_that_is_not_whole_blocks_is_refused_when_rendering():
    spec, model = load_spec("rtx3090"), tiny_config()
    with pytest.raises(ValueError, match="q4_k rows of K = 1000.*256"):
        qgemv.units(spec, model, [("q4_k", 1000)])
    with pytest.raises(ValueError, match="q8_0 rows of K = 48.*32"):
        qgemv.units(spec, model, [("q8_0", 48)])
    with pytest.raises(ValueError, match="no quantized GEMV for weight format 'iq4_xs'"):
        qgemv.units(spec, model, [("iq4_xs", 256)])


def test_formats_match_the_gguf_block_layouts():
    for f in qgemv.FORMATS.values():
        if f.name == "q6_k":  # pairs of GGUF blocks (kernels/repack.py): 2 x 208 bytes of bodies, 2 d's, padding
            assert (f.block_values, f.block_bytes, f.row_step) == (512, 432, 256)
        elif f.name != "bf16":
            assert quants.block_shape(f.ggml) == (f.block_values, f.block_bytes) and f.row_step == f.block_values
        assert f.slice_values % f.block_values == 0 and f.slot_bytes % 16 == 0
        assert f.aligned16 == (f.block_bytes % 16 == 0)


def test_the_27b_q4_k_m_mix_needs_five_shapes():
    model = load_config("qwen3.5-27b")
    assert qgemv.mix_pairs(model) == [("q4_k", 5120), ("q4_k", 6144), ("q4_k", 17408), ("q6_k", 5120),
                                      ("q6_k", 17408)]
    # the 0.8B ties its embeddings: the Q6_K embedding is the LM head, so it is multiplied (K = 1024)
    assert ("q6_k", 1024) in qgemv.mix_pairs(load_config("qwen3.5-0.8b"))
    assert {f for f, _ in qgemv.mix_pairs(model, "q8_0")} == {"q8_0"}


def test_a_gguf_files_pairs_are_its_matrices(tmp_path):
    from lucegen.model.checkpoint import make_checkpoint
    from lucegen.model.gguf_file import load_gguf
    cfg = tiny_config(hidden_size=256, intermediate_size=512)
    path = make_checkpoint(tmp_path, cfg, formats=("gguf",), progress=False)["gguf"]
    # K = 64 (DeltaNet out_proj) and 128 (attention o_proj) are not whole Q4_K blocks: Q8_0, as llama.cpp falls back
    assert qgemv.gguf_pairs(load_gguf(path)) == qgemv.mix_pairs(cfg) == [
        ("q4_k", 256), ("q4_k", 512), ("q6_k", 256), ("q6_k", 512), ("q8_0", 64), ("q8_0", 128)]


@pytest.mark.parametrize("k", [256, 1024, 5120, 17408])
def test_tunings_are_the_specs_with_the_span_no_longer_than_the_row(k):
    for name in list_specs():
        spec = load_spec(name)
        q = spec.tuning.qgemv
        for f in qgemv.FORMATS.values():
            if k % f.row_step:
                continue
            slices = -(-k // f.slice_values)
            v, *gemms = qgemv.tunings(spec, f, k)
            assert (v.mt, v.rows, v.threads, v.span) == (1, q.rows_per_warp, q.threads, min(q.span, slices))
            mma = q.gemm == "mma" and f.mma
            if mma:  # tensor cores: the last kernels, the format's M-tiles and tiles of 16 rows a block; dp4a's
                tilings = qgemv.mma_tilings(spec, f)  # M-tiles before them unless they take all M
                gemms, mmas = gemms[:-len(tilings)], gemms[-len(tilings):]
                assert [(t.mt, t.rows_per_block() // 16, t.min_blocks) for t in mmas] == list(tilings)
                assert all(t.stages == qgemv.MMA_STAGES and t.mma for t in mmas)
            # dp4a's M-tiles: each one that some M below the format's gemm_mma_from (every M, without mma) takes
            first = q.mma_from_for(f.name) if mma else 66
            takes = {m: qgemv.for_rows((v, *gemms), m, first).mt for m in range(2, first if mma else q.gemm_m_tile + 1)}
            assert [t.mt for t in gemms] == sorted(set(takes.values()))
            assert all(mt >= m or mt == max(takes.values()) for m, mt in takes.items())  # a tile holds its M, or
            # the largest takes it in M-tiles
            assert all(t.span == min(q.gemm_span, slices) and not t.mma for t in gemms)
            assert len({t.name(f, k) for t in (v, *gemms)}) == 1 + len(gemms)


def test_mma_sizes_worked_out_by_hand():
    q4k, q6k = qgemv.FORMATS["q4_k"], qgemv.FORMATS["q6_k"]
    t = qgemv.Tuning(256, 1, 16, 1, 3, mma=True)
    # a stage: a row tile's slice (16 rows x 4 blocks of 144 bytes = 36 words each, block by block: unpadded) and 16
    # activation rows' XBlocks of the slice (32 XBlocks of 48 bytes = 96 words, in the layout's slots of 33 XBlocks =
    # 99 words); 3 stages outgrow the 32 lane classes' sums; then an 8-byte mbarrier a stage
    assert t.smem(q4k, 5120) == 3 * (16 * 36 * 16 + 16 * 99 * 16) + 3 * 8
    assert 3 * (16 * 36 * 16 + 16 * 99 * 16) > 32 * 16 * 16 * 4
    # Q6_K: a slice is 2 pairs of 432 bytes, 54 words a row; 8 activation rows
    assert qgemv.Tuning(256, 1, 8, 1, 2, mma=True).smem(q6k, 5120) == 2 * (16 * 54 * 16 + 8 * 99 * 16) + 2 * 8
    assert t.grid(17408, 40) == 17408 // 16 * 3  # 16 rows a block, M-tiles of 16
    assert t.name(q4k, 5120) == "qgemm_mma_m16_r1_q4_k_k5120_t256_st3"
    # a GEMV with a floor of 6 blocks an SM (a register cap) is a kernel of its own
    assert qgemv.Tuning(256, 1, 1, 1, min_blocks=6).name(q4k, 5120) == "qgemv_q4_k_k5120_r1_s1_t256_mb6"
    # two row tiles: 32 rows' slices a stage; 2 stages outgrow the 32 rows' class sums (64 KB)
    t2 = qgemv.Tuning(256, 2, 16, 1, 2, mma=True)
    assert t2.smem(q4k, 5120) == 2 * (32 * 36 * 16 + 16 * 99 * 16) + 2 * 8
    assert 2 * (32 * 36 * 16 + 16 * 99 * 16) > 32 * 32 * 16 * 4
    assert t2.grid(17408, 40) == 17408 // 32 * 3
    # with sums by quads a warp keeps 8 class sums an output, not 32: the ring outgrows them where the lanes' did not
    t48 = qgemv.Tuning(256, 2, 48, 1, 2, mma=True)
    assert t48.smem(q4k, 5120) == 32 * 32 * 48 * 4 + 2 * 8
    assert t48.smem(q4k, 5120, quads=True) == 2 * (32 * 36 * 16 + 48 * 99 * 16) + 2 * 8


def test_a_call_takes_the_smallest_m_tile_that_holds_its_rows():
    kernels = [qgemv.Tuning(256, 1, mt, 1) for mt in (1, 2, 4, 8)]
    assert [qgemv.for_rows(kernels, m).mt for m in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_the_mma_gemm_takes_calls_from_its_threshold():
    mma = qgemv.Tuning(256, 1, 16, 1, 2, mma=True)
    kernels = [qgemv.Tuning(256, 1, mt, 1) for mt in (1, 2, 4, 8)] + [mma]
    picks = [qgemv.for_rows(kernels, m, mma_from=9) for m in (1, 2, 8, 9, 33, 65)]
    assert [t.mma for t in picks] == [False, False, False, True, True, True]
    assert [t.mt for t in picks[:3]] == [1, 2, 8]
    assert qgemv.for_rows(kernels, 2, mma_from=2) is mma     # from the smallest GEMM
    assert qgemv.for_rows([mma], 1, mma_from=33) is mma       # the only kernel takes every call


def test_the_mma_gemm_with_the_fewest_m_tiles_takes_a_call():
    mt16, mt24 = (qgemv.Tuning(256, 1, mt, 1, 2, mma=True) for mt in (16, 24))
    kernels = [qgemv.Tuning(256, 1, 1, 1), mt16, mt24]
    picks = {m: qgemv.for_rows(kernels, m, mma_from=5).mt for m in (5, 16, 17, 24, 25, 32, 33, 48, 49, 64)}
    # fewer tiles of 24 at 17-24 and 33-48 (2 against 3), 49-64 (3 against 4); ties (1 tile up to 16, 2 at 25-32)
    # go to the smaller tile
    assert picks == {5: 16, 16: 16, 17: 24, 24: 24, 25: 16, 32: 16, 33: 24, 48: 24, 49: 24, 64: 24}


def test_a_block_takes_two_row_tiles_where_the_grid_still_fills_the_gpu():
    one, two, mt24 = (qgemv.Tuning(256, r, mt, 1, 2, mma=True) for r, mt in ((1, 16), (2, 16), (2, 24)))
    kernels = [qgemv.Tuning(128, 2, 1, 1), one, two, mt24]
    pick = lambda m, n: qgemv.for_rows(kernels, m, mma_from=5, n=n, sm_count=132)
    # two row tiles: 34816 / 32 = 1088 blocks, at least 4 an SM (528); 10240 / 32 = 320 are not: one row tile
    assert pick(16, 34816) is two and pick(9, 16896) is two and pick(16, 10240) is one and pick(5, 5120) is one
    assert pick(23, 5120) is mt24  # the only kernel with one M-tile for 23 rows
    assert qgemv.for_rows(kernels, 16, mma_from=5) is two  # N unknown: the most row tiles
    assert pick(1, 5120).mt == 1


def test_ring_sizes_worked_out_by_hand():
    q4k, q8, q6k = (qgemv.FORMATS[f] for f in ("q4_k", "q8_0", "q6_k"))
    # 8 warps x 4 items x 1 row x 2 slices of 4 blocks of 144 bytes
    assert qgemv.Tuning(256, 1, 1, 2, 4).smem(q4k, 5120) == 8 * 4 * 2 * 576
    # Q8_0 slices: 32 blocks of 34 bytes = 1088, widened to 16-byte words from a 2-byte aligned start: 1104
    assert qgemv.Tuning(128, 2, 4, 1, 3).smem(q8, 5120) == 4 * 3 * 2 * 1104
    # Q6_K slices: 4 blocks of 210 bytes = 840, widened: 864
    assert qgemv.Tuning(256, 1, 8, 1, 2).smem(q6k, 5120) == 8 * 2 * 864
    assert qgemv.Tuning(256, 2, 1, 4).smem(q4k, 5120) == 0  # no ring


def test_grid_gives_each_row_group_every_m_tile():
    gemv, gemm = qgemv.Tuning(256, 2, 1, 4), qgemv.Tuning(128, 1, 8, 2)
    assert gemv.grid(17408, 1) == 17408 // 16          # 8 warps x 2 rows a block
    assert gemv.grid(17409, 1) == 17408 // 16 + 1
    assert gemm.grid(5120, 64) == 5120 // 4 * 8        # 4 rows a block, 8 M-tiles of 8
    assert gemm.grid(5120, 9) == 5120 // 4 * 2


class LaunchLog:
    """A module whose kernels record their launches (name, arguments) instead of running."""

    def __init__(self):
        self.launches = []

    def kernel(self, name: str):
        log = self

        class Kernel:
            def set_max_dynamic_smem(self, nbytes: int) -> None:
                pass

            def __call__(self, grid, block, *args, smem=0, stream=None):
                log.launches.append((name, args))
        return Kernel()


def test_the_gemms_take_y_rows_ldy_apart_and_the_gemv_refuses_them(monkeypatch):
    from host_kernels import HostArray, on_host
    spec, k, n = load_spec("h200"), 5120, 96
    with on_host(monkeypatch):
        log = LaunchLog()
        op = qgemv.QMatmul(log, spec, "q4_k", k)
        w = HostArray.empty(qgemv.fmt_of("q4_k").matrix_bytes(n, k), np.uint8)
        x, y = HostArray.empty((16, k), np.float32), HostArray.empty(15 * 200 + n, np.float32)
        for m in (3, 16):  # a dp4a M-tile, the int8 mma GEMM: Y's row stride is their last argument
            op(w, x, y, n, m, ldy=200)
            name, args = log.launches[-1]
            assert name == op.tuning_for(m, n).name(op.fmt, k) and args[3:] == (n, m, 200)
        op(w, x, y, n, 1, ldy=200)  # one row: the GEMV, whose rows are n apart
        assert log.launches[-1][1][3:] == (n, 1)
        with pytest.raises(ValueError, match="apart"):
            op(w, x, y, n, 3, ldy=n - 1)
        with pytest.raises(ValueError, match="rows 300 apart"):
            op(w, x, y, n, 16, ldy=300)  # y holds 15 rows of 200 and one of n
        gemv_only = qgemv.QMatmul(log, spec, "q4_k", k, kernels=(op.tunings[0],))
        with pytest.raises(ValueError, match="writes Y's rows n = 96 apart, not 200"):
            gemv_only(w, x, y, n, 3, ldy=200)


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(sorted(qgemv.FORMATS)), n=st.integers(1, 5), blocks=st.integers(1, 6),
       m=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_reference_is_dequantize_then_matmul(fmt, n, blocks, m, seed):
    k = blocks * qgemv.fmt_of(fmt).row_step
    raw = draw_rows(fmt, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((m, k), dtype=np.float32)
    w = gguf_quants.dequantize(raw, qgemv.fmt_of(fmt).ggml).astype(np.float64)
    np.testing.assert_allclose(qgemv.reference(raw, fmt, x), x.astype(np.float64) @ w.T, rtol=1e-12, atol=0)


# ---- the device decode, compiled for the host ------------------------------------------------------------------
# quant.cuh includes common.cuh (device code) and cuda_fp16.h; in a scratch folder those two are replaced by this
# stand-in, which gives the CUDA intrinsics quant.cuh uses their exact semantics on the host.
HOST_SHIM = r"""
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <algorithm>
#define __device__
#define __host__
#define __forceinline__ inline
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) int2 { int x, y; };
namespace lucegen { struct f32x8 { float4 lo, hi; }; }
#include <math.h>  // fabsf, fmaxf, fmaf: the C library's, exact as the device's
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline int __float2int_rn(float a) { return static_cast<int>(std::nearbyint(a)); }  // ties to even
static inline int __dp4a(int a, int b, int c) {  // signed bytes
    for (int i = 0; i < 4; ++i) c += static_cast<int8_t>(a >> (8 * i)) * static_cast<int8_t>(b >> (8 * i));
    return c;
}
static inline unsigned __vsub4(unsigned a, unsigned b) {  // per byte, modulo 256
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= ((((a >> (8 * i)) & 0xFF) - ((b >> (8 * i)) & 0xFF)) & 0xFF) << (8 * i);
    return r;
}
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // PRMT, default mode
    const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
    unsigned r = 0;
    for (int k = 0; k < 4; ++k) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k);
    return r;
}
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return static_cast<unsigned>(((static_cast<uint64_t>(hi) << 32) | lo) >> (s & 31));
}
struct __half { unsigned short bits; };
static inline __half __ushort_as_half(unsigned short b) { return {b}; }
static inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.bits, 2); return static_cast<float>(f); }
static inline __half __float2half_rn(float a) { const _Float16 f = static_cast<_Float16>(a); __half h; std::memcpy(&h.bits, &f, 2); return h; }
static inline unsigned short __half_as_ushort(__half h) { return h.bits; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
template <class T> static inline T __ldcg(const T* p) { return *p; }
struct float2 { float x, y; };
struct __nv_bfloat16 { unsigned short bits; };
using bf16 = __nv_bfloat16;
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
static inline float bf16_bits_to_float(unsigned short b) { return __uint_as_float(static_cast<unsigned>(b) << 16); }
static inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {bf16_bits_to_float(v.x.bits), bf16_bits_to_float(v.y.bits)}; }
static inline __nv_bfloat16 __float2bfloat16(float a) {  // to nearest, ties to even (finite values)
    unsigned u; std::memcpy(&u, &a, 4);
    return {static_cast<unsigned short>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}
using std::min;
// warp-wide code (the tensor-core GEMM's shuffle, kv.cuh's TQ3_0 encoder and rotation, quantize_xblock_lanes)
// compiles but is not run here: declared only, a use would not link
float __shfl_sync(unsigned mask, float v, int lane);
float __shfl_xor_sync(unsigned mask, float v, int lane_mask);
unsigned __shfl_xor_sync(unsigned mask, unsigned v, int lane_mask);
int __shfl_xor_sync(unsigned mask, int v, int lane_mask);
struct HostDim3 { unsigned x, y, z; };
extern const HostDim3 threadIdx;
float4 make_float4(float x, float y, float z, float w);
int4 make_int4(int x, int y, int z, int w);
unsigned __float_as_uint(float f);
int __float_as_int(float f);
namespace lucegen { float warp_sum(float v); }
"""

HOST_MAIN = r"""
#include HEADER
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>
using namespace lucegen;
// A warp on the host: 32 threads, a lane each, meeting at a barrier around every shuffle (quantize_xblock_lanes).
struct Warp {
    std::mutex mu;
    std::condition_variable cv;
    int waiting = 0, generation = 0;
    uint32_t slot[32];
    void sync() {
        std::unique_lock<std::mutex> lock(mu);
        const int g = generation;
        if (++waiting == 32) {
            waiting = 0;
            ++generation;
            cv.notify_all();
        } else {
            cv.wait(lock, [&] { return generation != g; });
        }
    }
} warp;
thread_local int host_lane;
template <class T> T shfl_xor(T v, int mask) {
    std::memcpy(&warp.slot[host_lane], &v, 4);
    warp.sync();
    T out;
    std::memcpy(&out, &warp.slot[host_lane ^ mask], 4);
    warp.sync();
    return out;
}
float __shfl_xor_sync(unsigned, float v, int mask) { return shfl_xor(v, mask); }
int __shfl_xor_sync(unsigned, int v, int mask) { return shfl_xor(v, mask); }
int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
// argv: rows k offset in out [xin]. Decodes every piece of every row of a matrix in quant.cuh's layout (wblock_offset),
// placed `offset` bytes past a 16-byte boundary, exactly as qdequant does on the device (F::load(block, p)). With xin (XBlocks of one activation row; DOT
// defined): each row's sum from 0 through F::dot with them, piece by piece in K order, after each piece, [rows,
// pieces], its bytes loaded as qgemv's loop does (F::lane, F::load(lane, delta)). With rows = 0: quantize_xblock on
// the floats of `in` (offset 0), or quantize_xblock_lanes, 4 XBlocks a warp of host threads (offset 1). With rows =
// -m: the XBlock layout, xblock_index of XBlock b of row r for rows of k values, [m, k / 32] int64.
template <class F> void dequant(const unsigned char* w, float* out, long n, int k) {
    const int pieces = k / (F::BLOCK_VALUES / F::PIECES);
    for (long r = 0; r < n; ++r)
        for (int t = 0; t < pieces; ++t) {
            const int b = t / F::PIECES, p = t % F::PIECES;
            const auto pc = F::load(w + wblock_offset<F>(r, b, k), p);
            for (int j = 0; j < F::RUNS; ++j) {
                float v[8];
                F::run(pc, j, v);
                for (int i = 0; i < 8; ++i) out[r * k + b * F::BLOCK_VALUES + F::voff(p, j) + i] = v[i];
            }
        }
}
#ifdef DOT
template <class F> long dot(const unsigned char* w, const unsigned char* xb, float* out, long n, int k) {
    const int pieces = k / (F::BLOCK_VALUES / F::PIECES);
    for (long r = 0; r < n; ++r) {
        float acc = 0.f;
        for (int t = 0; t < pieces; ++t) {
            const int b = t / F::PIECES, p = t % F::PIECES;
            // as qgemv.cuh's loop reads them: F::lane made once at the row's first block of b's parity (the same
            // address mod 4), then a block a multiple of 4 bytes further; dot with the piece's activations
            const auto lane = F::lane(w + wblock_offset<F>(r, b % 2, k), p);
            const auto pc = F::load(lane, static_cast<long long>(b - b % 2) * F::TILE * F::BLOCK_BYTES);
            out[r * pieces + t] = acc = F::dot(pc, xb + b * F::XB + p * (F::XB / F::PIECES), acc);
        }
    }
    return n * pieces;
}
#endif
int main(int argc, char** argv) {
    const long n = std::atol(argv[1]);
    if (n < 0) {
        const int blocks = std::atoi(argv[2]) / 32;
        std::vector<long long> at;
        for (int r = 0; r < -n; ++r)
            for (int b = 0; b < blocks; ++b) at.push_back(xblock_index(r, b, (blocks + XSLICE - 1) / XSLICE));
        FILE* f = std::fopen(argv[5], "wb");
        std::fwrite(at.data(), 8, at.size(), f);
        std::fclose(f);
        return 0;
    }
    if (n == 0) {  // quantize: in = floats, out = their XBlocks
        const int k = std::atoi(argv[2]);
        std::vector<float> x(k + 4);
        float* xa = x.data() + (4 - reinterpret_cast<size_t>(x.data()) % 16 / 4) % 4;
        FILE* f = std::fopen(argv[4], "rb");
        const size_t got = std::fread(xa, 4, k, f);
        std::fclose(f);
        std::vector<XBlock> q(k / 32);
        if (std::atoi(argv[3]) == 0) {
            for (int i = 0; i < k / 32; ++i) q[i] = quantize_xblock(xa + 32 * i);
        } else {
            for (int b0 = 0; b0 < k / 32; b0 += 4) {  // lane l: values 4 (l % 8) .. of block b0 + l / 8
                std::vector<std::thread> lanes;
                for (int l = 0; l < 32; ++l)
                    lanes.emplace_back([&, l] {
                        host_lane = l;
                        const int b = b0 + l / 8;
                        const float* v = xa + 32 * std::min(b, k / 32 - 1) + 4 * (l % 8);
                        const XBlockLanes part = quantize_xblock_lanes({v[0], v[1], v[2], v[3]}, l);
                        if (b < k / 32) part.store(&q[b], l);
                    });
                for (auto& t : lanes) t.join();
            }
        }
        f = std::fopen(argv[5], "wb");
        std::fwrite(q.data(), sizeof(XBlock), q.size(), f);
        std::fclose(f);
        return got != static_cast<size_t>(k);
    }
    const int k = std::atoi(argv[2]), offset = std::atoi(argv[3]);
    FILE* f = std::fopen(argv[4], "rb");
    std::vector<unsigned char> buf(1 << 20);
    unsigned char* w = buf.data() + (16 - reinterpret_cast<size_t>(buf.data()) % 16) % 16 + offset;
    const size_t got = std::fread(w, 1, buf.size() - 32, f);
    std::fclose(f);
    std::vector<float> out(n * k);
#ifdef DOT
    if (argc > 6) {
        std::vector<unsigned char> xb(1 << 20);
        f = std::fopen(argv[6], "rb");
        const size_t xgot = std::fread(xb.data(), 1, xb.size(), f);
        std::fclose(f);
        const long count = DOT(w, xb.data(), out.data(), n, k);
        f = std::fopen(argv[5], "wb");
        std::fwrite(out.data(), 4, count, f);
        std::fclose(f);
        return xgot == 0;
    }
#endif
    DEQUANT(w, out.data(), n, k);
    f = std::fopen(argv[5], "wb");
    std::fwrite(out.data(), 4, out.size(), f);
    std::fclose(f);
    return got == 0;
}
"""


def host_decoder(directory, header: str, cls: str, products: bool = False):
    """A host executable running the decode of format `cls` from templates/`header` (argv: rows k offset in out;
    with `products`, also its F::dot and quantize_xblock: see HOST_MAIN), or a pytest skip where there is no host
    C++ compiler."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++ or clang++)")
    for name in ("quant.cuh", header):
        shutil.copy(TEMPLATES_DIR / name, directory)
    (directory / "common.cuh").write_text(HOST_SHIM)
    (directory / "cuda_fp16.h").write_text("#pragma once\n")
    (directory / "main.cpp").write_text(HOST_MAIN)
    exe = directory / f"decode_{cls}"
    dot = [f"-DDOT=dot<{cls}>"] if products else []
    subprocess.run([cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-pthread", f'-DHEADER="{header}"',
                    f"-DDEQUANT=dequant<{cls}>", *dot, f"-I{directory}", str(directory / "main.cpp"), "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


def host_decode(exe, w: np.ndarray, n: int, k: int, offset: int, directory) -> np.ndarray:
    """A matrix of n rows (its bytes as the GPU holds them: Format.device_matrix) through a host decoder, placed
    `offset` bytes past a 16-byte boundary: float32 [n, k]."""
    w.tofile(directory / "in.bin")
    subprocess.run([str(exe), str(n), str(k), str(offset), str(directory / "in.bin"), str(directory / "out.bin")],
                   check=True)
    return np.fromfile(directory / "out.bin", np.float32).reshape(n, k)


@pytest.fixture(scope="module")
def host_decoders(tmp_path_factory):
    """{format: path of a host executable running quant.cuh's decode of that format}."""
    d = tmp_path_factory.mktemp("host_decode")
    return {f.name: host_decoder(d, "quant.cuh", f.cls, products=True) for f in qgemv.FORMATS.values()}


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(sorted(qgemv.FORMATS)), n=st.integers(1, 40), blocks=st.integers(1, 5),
       offset=st.sampled_from([0, 2, 4, 6, 8, 14]), seed=st.integers(0, 2**32 - 1))
def test_device_decode_is_bit_equal_to_gguf(host_decoders, tmp_path_factory, fmt, n, blocks, offset, seed):
    f = qgemv.fmt_of(fmt)
    if f.aligned16:
        offset = 0  # these formats' rows always start on 16-byte boundaries
    k = blocks * (256 if fmt == "bf16" else f.row_step)
    raw = draw_rows(fmt, n, k, seed)
    ours = host_decode(host_decoders[fmt], f.device_matrix(raw), n, k, offset, tmp_path_factory.mktemp("io"))
    theirs = gguf_quants.dequantize(raw, f.ggml)
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def draw_x(m: int, k: int, seed: int) -> np.ndarray:
    """Activations: normal values of a random magnitude, some 32-value blocks all zero, some with one outlier (K need
    not be a multiple of 32: the bf16 format takes any K; the tail past the last whole block stays normal)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32) * np.float32(10 ** rng.uniform(-3, 3))
    whole = k // 32 * 32
    blocks = x[:, :whole].reshape(m, -1, 32)  # a copy where k is not a multiple of 32: written back below
    blocks[rng.random(blocks.shape[:2]) < 0.1] = 0
    outlier = rng.random(blocks.shape[:2]) < 0.1
    blocks[outlier, rng.integers(0, 32)] *= 50
    x[:, :whole] = blocks.reshape(m, whole)
    return x


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), lanes=st.booleans())
def test_device_activation_quantization_is_bit_equal_to_numpy(host_decoders, tmp_path_factory, blocks, seed, lanes):
    """quantize_xblock, and quantize_xblock_lanes (the row kernels': 8 lanes an XBlock, on a warp of host threads)."""
    x = draw_x(1, 32 * blocks, seed)
    d = tmp_path_factory.mktemp("xq")
    x.tofile(d / "x.bin")
    subprocess.run([str(host_decoders["q4_k"]), "0", str(x.size), str(int(lanes)), str(d / "x.bin"), str(d / "xq.bin")],
                   check=True)
    np.testing.assert_array_equal(np.fromfile(d / "xq.bin", np.uint8), qgemv.xblocks(x).ravel())


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 40), blocks=st.integers(1, 100))
def test_the_xblock_layout_is_numpys_and_keeps_an_n_tiles_slice_together(host_decoders, tmp_path_factory, m, blocks):
    """quant.cuh's xblock_index (the kernels') is qgemv.xblock_index; every XBlock of m rows has a place of its own
    inside xblock_bytes, an n-tile's (8 rows') XBlocks of a slice are one run of slots an odd number of 16-byte words
    apart, and place_xblocks / xblocks_of are inverses."""
    k, d = 32 * blocks, tmp_path_factory.mktemp("layout")
    subprocess.run([str(host_decoders["q4_k"]), str(-m), str(k), "0", "-", str(d / "at.bin")], check=True)
    at = np.fromfile(d / "at.bin", np.int64).reshape(m, blocks)
    r, b = np.meshgrid(np.arange(m), np.arange(blocks), indexing="ij")
    np.testing.assert_array_equal(at, qgemv.xblock_index(r, b, k))
    assert len(np.unique(at)) == at.size and at.max() < qgemv.xblock_bytes(m, k) // qgemv.XBLOCK_BYTES
    slot = qgemv.XSLOT * qgemv.XBLOCK_BYTES
    assert slot // 16 % 2 == 1
    for g in range(0, m, qgemv.XGROUP):  # an n-tile's rows of slice s: consecutive slots
        rows = np.arange(g, min(g + qgemv.XGROUP, m))
        for s in range(0, blocks, qgemv.XSLICE):
            np.testing.assert_array_equal(np.diff(at[rows, s]), qgemv.XSLOT)
    rng = np.random.default_rng(m * 1000 + blocks)
    xb = rng.integers(0, 256, (m, blocks * qgemv.XBLOCK_BYTES), np.uint8)
    buf = np.zeros(qgemv.xblock_bytes(m, k), np.uint8)
    qgemv.place_xblocks(buf, xb)
    np.testing.assert_array_equal(qgemv.xblocks_of(buf, m, k), xb)


def test_activation_quantization_worked_by_hand():
    x = np.zeros((1, 64), np.float32)
    x[0, :4] = [254, -127, 0.5, 1.5]  # dx = 2: 127, -63.5 -> -64 (ties to even), 0.25 -> 0, 0.75 -> 1
    x[0, 16:18] = [3.0, 5.0]          # 1.5 -> 2, 2.5 -> 2
    q, dx, sums = qgemv.quantize_x(x)
    assert dx.tolist() == [[2.0, 0.0]]
    assert q[0, :4].tolist() == [127, -64, 0, 1] and q[0, 16:18].tolist() == [2, 2] and not q[0, 32:].any()
    assert sums.tolist() == [[68, 0]]
    # the XBlock bytes: 32 int8, dx, dx times the sum, the sums of each 16 (Q6_K's halves): 64 + 4, and 0 + 0
    b = qgemv.xblocks(x).reshape(2, qgemv.XBLOCK_BYTES)
    assert b[:, :32].view(np.int8)[0, :4].tolist() == [127, -64, 0, 1]
    assert b[:, 32:40].copy().view("<f4").tolist() == [[2.0, 136.0], [0.0, 0.0]]
    assert b[:, 40:48].copy().view("<i4").tolist() == [[64, 4], [0, 0]]


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from([f for f in sorted(qgemv.FORMATS) if f != "bf16"]), n=st.integers(1, 3),
       blocks=st.integers(1, 5), offset=st.sampled_from([0, 2, 6, 14]), seed=st.integers(0, 2**32 - 1))
def test_device_products_are_bit_equal_to_numpy(host_decoders, tmp_path_factory, fmt, n, blocks, offset, seed):
    f = qgemv.fmt_of(fmt)
    if f.aligned16:
        offset = 0
    k = blocks * f.row_step
    raw, x = draw_rows(fmt, n, k, seed), draw_x(1, k, seed + 1)
    d = tmp_path_factory.mktemp("dot")
    f.device_matrix(raw).tofile(d / "in.bin")
    qgemv.xblocks(x).tofile(d / "x.bin")
    subprocess.run([str(host_decoders[fmt]), str(n), str(k), str(offset), str(d / "in.bin"), str(d / "out.bin"),
                    str(d / "x.bin")], check=True)
    ours = np.fromfile(d / "out.bin", np.float32).reshape(n, -1)
    pf, acc, want = qgemv.piece_factors(raw, fmt, x), np.zeros((1, n), np.float32), []
    for t in range(ours.shape[1]):  # one sum through every piece of the row, in K order
        acc = pf.accumulate(acc, t)
        want.append(acc[0])
    np.testing.assert_array_equal(ours.view(np.uint32), np.stack(want, axis=1).view(np.uint32))


@settings(max_examples=40, deadline=None)
@given(sums=st.sampled_from([(f, q) for f in sorted(qgemv.FORMATS) if f != "bf16"
                             for q in (False, True)[:1 + qgemv.fmt_of(f).quad_sums]]),
       n=st.integers(1, 8), blocks=st.integers(1, 6), m=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_quantized_products_stay_within_the_quantization_bound(sums, n, blocks, m, seed):
    fmt, quads = sums  # by lanes, or by quads of lanes where the format takes them
    k = blocks * qgemv.fmt_of(fmt).row_step
    raw, x = draw_rows(fmt, n, k, seed), draw_x(m, k, seed + 1)
    exact = qgemv.reference(raw, fmt, x)
    ours = qgemv.emulate(raw, fmt, x, quads).astype(np.float64)
    bound = qgemv.quantization_bound(raw, fmt, x, quads)
    assert (np.abs(ours - exact) <= bound).all()
    # and the bound is not vacuous: about sum |w| max|x of its block| / 254 (8-bit activations), not more than / 200
    w = np.abs(quants.dequantize(raw, qgemv.fmt_of(fmt).ggml)).astype(np.float64)
    block_max = np.repeat(np.abs(x).reshape(m, -1, 32).max(axis=-1), 32, axis=1).astype(np.float64)
    assert (bound <= block_max @ w.T / 200).all()


def test_the_spec_knows_the_formats_with_the_mma_gemm():
    """spec.MMA_FORMATS (what tuning.qgemv.format_mma_from may name) are the formats whose Format has the mma GEMM."""
    assert {f.name for f in qgemv.FORMATS.values() if f.mma} == set(MMA_FORMATS)
