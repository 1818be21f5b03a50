// gemv.cuh: y = W x for bf16 W [N, K] (row-major), bf16 x [K], fp32 y [N] -- the workhorse of decode.
//
// A warp owns ROWS rows at a time; each lane reads 16-byte chunks c = lane, lane + 32, ... of every row, so a
// warp's loads are fully coalesced, and it issues ROWS x UNROLL independent loads before the first FMA.
#pragma once
#include "common.cuh"

namespace lucegen {

// Dot products of ROWS consecutive rows (starting at `row`) with x (in shared memory as 16-byte chunks).
// Rows at or past N contribute nothing. Returns the full sums in every lane.
template <int K, int ROWS, int UNROLL>
__device__ __forceinline__ void gemv_bf16_rows(const bf16* __restrict__ W, const uint4* __restrict__ xs,
                                               int row, int N, float (&acc)[ROWS]) {
    static_assert(K % 8 == 0, "GEMV rows must be a whole number of 16-byte chunks");
    constexpr int CHUNKS = K / 8;
    constexpr int STEP = 32 * UNROLL;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll 1
    for (int c0 = 0; c0 < CHUNKS; c0 += STEP) {
        uint4 w[ROWS][UNROLL];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = c0 + u * 32 + lane;
                const bool ok = (row + r < N) && (CHUNKS % STEP == 0 || c < CHUNKS);
                w[r][u] = ok ? load_stream(W + (size_t)(row + r) * K + (size_t)c * 8) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * 32 + lane;
            if (CHUNKS % STEP == 0 || c < CHUNKS) {
                const uint4 xv = xs[c];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r] += dot8_bf16(w[r][u], xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
}

// Copy x (K bf16) into shared memory as 16-byte chunks.
template <int K, int THREADS>
__device__ __forceinline__ void stage_vector(const bf16* __restrict__ x, uint4* xs) {
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (int c = threadIdx.x; c < K / 8; c += THREADS) xs[c] = x4[c];
    __syncthreads();
}

// The whole GEMV as a grid-stride loop over groups of ROWS rows, one group per warp.
template <int K, int THREADS, int ROWS, int UNROLL>
__device__ void gemv_bf16(const bf16* __restrict__ W, const bf16* __restrict__ x, float* __restrict__ y, int N,
                          uint4* xs) {
    stage_vector<K, THREADS>(x, xs);
    constexpr int WARPS = THREADS / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int stride = gridDim.x * WARPS * ROWS;
    for (int row = (blockIdx.x * WARPS + warp) * ROWS; row < N; row += stride) {
        float acc[ROWS];
        gemv_bf16_rows<K, ROWS, UNROLL>(W, xs, row, N, acc);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                if (row + r < N) y[row + r] = acc[r];
        }
    }
}

}  // namespace lucegen
