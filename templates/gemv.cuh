// gemv.cuh: y = W x for bf16 W [N, K] (row-major), bf16 x [K], fp32 y [N] -- the workhorse of decode.
//
// A warp owns ROWS rows at a time; each lane reads 16-byte chunks c = lane, lane + 32, ... of every row, so a
// warp's loads are fully coalesced, and it issues ROWS x UNROLL independent loads before the first FMA.
#pragma once
#include "bulk.cuh"
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

// ROWS rows of K bf16 held in shared memory (row r at chunk r*K/8 of `rows`) times x, over the 16-byte chunks
// [c0, c1) of the rows (all of them by default); rows at or past n contribute nothing. The sums end in every lane.
// About eight 16-byte weight loads per lane are in flight.
template <int K, int ROWS, typename XS>
__device__ __forceinline__ void gemv_bf16_smem_rows(const uint4* rows, XS xs, int n, float (&acc)[ROWS], int c0 = 0,
                                                    int c1 = K / 8) {
    static_assert(K % 8 == 0, "GEMV rows must be a whole number of 16-byte chunks");
    constexpr int CHUNKS = K / 8, UNROLL = ROWS >= 8 ? 1 : 8 / ROWS;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll UNROLL
    for (int c = c0 + threadIdx.x % 32; c < c1; c += 32) {
        const auto xv = xs[c];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (r < n) acc[r] += dot8_bf16(rows[r * CHUNKS + c], xv);
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

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// The same GEMV with the weights streamed by the copy engine: each block owns a contiguous range of rows and pulls
// it through STAGES shared-memory tiles of TILE_ROWS rows (one bulk copy per tile), so the bytes in flight do not
// depend on registers. `smem` (dynamic) holds x, the tiles and one mbarrier per stage.
template <int K, int THREADS, int TILE_ROWS, int STAGES>
__device__ void gemv_bf16_bulk(const bf16* __restrict__ W, const bf16* __restrict__ x, float* __restrict__ y, int N,
                               unsigned char* smem) {
    constexpr int WARPS = THREADS / 32;
    constexpr int CHUNKS = K / 8;
    uint4* xs = reinterpret_cast<uint4*>(smem);
    uint4* tiles = xs + CHUNKS;
    auto* bars = reinterpret_cast<unsigned long long*>(tiles + STAGES * TILE_ROWS * CHUNKS);
    const int first = static_cast<int>((long long)N * blockIdx.x / gridDim.x);
    const int rows = static_cast<int>((long long)N * (blockIdx.x + 1) / gridDim.x) - first;
    const int ntiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    auto issue = [&](int t) {  // thread 0 only: tile t into stage t % STAGES
        const int s = t % STAGES, n = min(TILE_ROWS, rows - t * TILE_ROWS);
        mbar_expect_tx(&bars[s], n * K * 2);
        bulk_g2s(tiles + s * TILE_ROWS * CHUNKS, W + (size_t)(first + t * TILE_ROWS) * K, n * K * 2, &bars[s]);
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(&bars[s], 1);
        fence_barrier_init();
        for (int t = 0; t < min(STAGES, ntiles); ++t) issue(t);
    }
    stage_vector<K, THREADS>(x, xs);  // ends with __syncthreads: barriers are initialised for everyone

    for (int t = 0; t < ntiles; ++t) {
        const int s = t % STAGES, n = min(TILE_ROWS, rows - t * TILE_ROWS);
        mbar_wait(&bars[s], (t / STAGES) & 1);
        for (int r = warp; r < n; r += WARPS) {
            const uint4* wr = tiles + (s * TILE_ROWS + r) * CHUNKS;
            float acc = 0.f;
#pragma unroll 4
            for (int c = lane; c < CHUNKS; c += 32) acc += dot8_bf16(wr[c], xs[c]);
            acc = warp_sum(acc);
            if (lane == 0) y[first + t * TILE_ROWS + r] = acc;
        }
        __syncthreads();  // every warp is done with stage s: it may be refilled
        if (threadIdx.x == 0 && t + STAGES < ntiles) {
            fence_proxy_async();
            issue(t + STAGES);
        }
    }
}
#endif

}  // namespace lucegen
