"""How many warp instructions of a kind an SM of this GPU completes a cycle: int8 mma.sync (m16n8k32, the verify
GEMM's IMMA), FFMA, IMAD, the int-to-float conversion (I2FP) and its replacement by an integer and a float add
(quant.cuh's question in session 51), each in a kernel of independent chains per thread, so that only the pipe's
rate bounds it. Every block times its own loop with clock64; a rate is the SM's warps' instructions over the
slowest block's cycles. For weighing a kernel's instruction mix before writing it (docs/design.md, session 51:
the verify GEMM is mostly issue-bound at 16-23 rows, and an IMAD costs the FMA pipe twice an FFMA's share): an IMMA
is 4,096 int8 multiply-adds.

    python3 tools/pipe_rates.py [--iters 4096] [--warps 8 16 32]

Prints one JSON line a kind and occupancy: warp instructions an SM-cycle (and int8 MACs an SM-cycle for the IMMA).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHAINS = 8  # independent chains a thread: enough to hide each pipe's latency at 8 warps an SM

# One kernel a kind: CHAINS dependent chains a thread, ITERS rounds; the chains' values are stored (nothing is dead).
SOURCE = r'''
#define CHAINS %(chains)d
__device__ __forceinline__ void imma(int (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%%0, %%1, %%2, %%3}, {%%4, %%5, %%6, %%7}, "
                 "{%%8, %%9}, {%%0, %%1, %%2, %%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void finish(long long t0, int v, int* sink, long long* cycles) {
    const long long t1 = clock64();
    sink[blockIdx.x * blockDim.x + threadIdx.x] = v;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

extern "C" __global__ void rate_imma(int iters, int seed, int* sink, long long* cycles) {
    int c[CHAINS][4] = {};
    const unsigned a[4] = {seed * 0x01010101u, threadIdx.x, seed + threadIdx.x, 7u}, b[2] = {threadIdx.x, 3u};
    const long long t0 = clock64();
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) imma(c[j], a, b);
    int v = 0;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) v += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    finish(t0, v, sink, cycles);
}

extern "C" __global__ void rate_ffma(int iters, int seed, int* sink, long long* cycles) {
    float x[CHAINS];
    const float m = 1.f + seed * 1e-9f, k = 0.5f * seed;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) x[j] = threadIdx.x + j;
    const long long t0 = clock64();
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) x[j] = fmaf(x[j], m, k);
    float v = 0.f;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) v += x[j];
    finish(t0, __float_as_int(v), sink, cycles);
}

extern "C" __global__ void rate_imad(int iters, int seed, int* sink, long long* cycles) {
    int x[CHAINS];
    const int m = seed | 1, k = seed + 7;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) x[j] = threadIdx.x + j;
    const long long t0 = clock64();
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) x[j] = x[j] * m + k;
    int v = 0;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) v += x[j];
    finish(t0, v, sink, cycles);
}

// each round a conversion of the chain's integer (its float's bits become the next integer)
extern "C" __global__ void rate_i2f(int iters, int seed, int* sink, long long* cycles) {
    int x[CHAINS];
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) x[j] = threadIdx.x + j + seed;
    const long long t0 = clock64();
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) x[j] = __float_as_int(static_cast<float>(x[j]));
    int v = 0;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) v += x[j];
    finish(t0, v, sink, cycles);
}

// the same chain by an integer add and a float add (exact for |x| < 2^22; the values do not matter here)
extern "C" __global__ void rate_magic(int iters, int seed, int* sink, long long* cycles) {
    int x[CHAINS];
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) x[j] = threadIdx.x + j + seed;
    const long long t0 = clock64();
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int j = 0; j < CHAINS; ++j)
            x[j] = __float_as_int(__fsub_rn(__int_as_float(0x4B400000 + x[j]), 12582912.f));
    int v = 0;
#pragma unroll
    for (int j = 0; j < CHAINS; ++j) v += x[j];
    finish(t0, v, sink, cycles);
}
''' % {"chains": CHAINS}
KINDS = ("imma", "ffma", "imad", "i2f", "magic")
IMMA_MACS = 16 * 8 * 32


def compile_source(arch: str) -> bytes:
    """The kinds' kernels for `arch` (sm_80 on: mma.sync's int8 shape)."""
    from lucegen.codegen.nvrtc import base_options, compile_cubin
    return compile_cubin(SOURCE, "pipe_rates.cu", arch, base_options(arch), {}).cubin


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=4096, help="rounds of CHAINS instructions a thread (default 4096)")
    ap.add_argument("--warps", type=int, nargs="+", default=[8, 16, 32], help="warps an SM (default 8 16 32)")
    a = ap.parse_args()
    from lucegen.runtime import DeviceArray, device_info, synchronize
    from lucegen.runtime.module import Module
    info = device_info()
    module = Module(compile_source(info.arch))
    for kind in KINDS:
        kernel = module.kernel(f"rate_{kind}")
        for warps in a.warps:
            blocks, threads = info.sm_count * max(1, warps // 32), 32 * min(warps, 32)
            sink = DeviceArray.empty(blocks * threads, np.int32)
            cycles = DeviceArray.empty(blocks, np.int64)
            for _ in range(2):  # the first launch warms the clocks up
                kernel(blocks, threads, a.iters, 1, sink, cycles)
                synchronize()
            per_sm = warps * a.iters * CHAINS / float(cycles.numpy().max())
            row = {"kind": kind, "warps_per_sm": warps, "warp_instr_per_sm_cycle": round(per_sm, 3)}
            if kind == "imma":
                row["int8_macs_per_sm_cycle"] = round(per_sm * IMMA_MACS)
            print(json.dumps(row), flush=True)
            sink.free()
            cycles.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
