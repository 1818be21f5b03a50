// gemv.cuh: y = W x for bf16 W [N, K] (row-major), bf16 x [K], fp32 y [N] -- the workhorse of decode.
//
// A warp owns ROWS rows at a time; each lane reads 16-byte chunks c = lane, lane + 32, ... of every row, so a
// warp's loads are fully coalesced, and it issues ROWS x UNROLL independent loads before the first FMA.
#pragma once
#include "bulk.cuh"
#include "common.cuh"

namespace lucegen {

// Dot products of ROWS consecutive rows (starting at `row`) with x. xs[c] is x's c-th 8-value chunk: a uint4 of
// bf16 (a plain pointer) or an f32x8 (StagedF32). SPLIT warps may share the rows: warp `part` of them takes chunks
// part*32 + lane + i*32*SPLIT, so together they read each row as one warp SPLIT times as wide would, and each
// returns its partial sums (the full sums when SPLIT is 1). Rows at or past N contribute nothing. The sums are
// in every lane.
template <int K, int ROWS, int UNROLL, int SPLIT = 1, typename XS>
__device__ __forceinline__ void gemv_bf16_rows(const bf16* __restrict__ W, XS xs, int row, int N, float (&acc)[ROWS],
                                               int part = 0) {
    static_assert(K % 8 == 0, "GEMV rows must be a whole number of 16-byte chunks");
    constexpr int CHUNKS = K / 8;
    constexpr int LANES = 32 * SPLIT;
    constexpr int STEP = LANES * UNROLL;
    const int lane = part * 32 + threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll 1
    for (int c0 = 0; c0 < CHUNKS; c0 += STEP) {
        uint4 w[ROWS][UNROLL];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = c0 + u * LANES + lane;
                const bool ok = (row + r < N) && (CHUNKS % STEP == 0 || c < CHUNKS);
                w[r][u] = ok ? load_stream(W + (size_t)(row + r) * K + (size_t)c * 8) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * LANES + lane;
            if (CHUNKS % STEP == 0 || c < CHUNKS) {
                const auto xv = xs[c];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r] += dot8_bf16(w[r][u], xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = warp_sum(acc[r]);
}

// Rows [r0, r1) of W times x by one block of WARPS warps (a persistent kernel's share of a GEMV). The warps form
// WARPS/SPLIT groups of SPLIT; a group takes ROWS rows at a time and its warps split each row's chunks. Split
// partial sums meet in `red` (WARPS * ROWS floats of shared memory) and are added in a fixed order, so results do
// not depend on timing. epilogue(row, acc, n) runs in lane 0 of one warp per row group, with the n <= ROWS sums
// of rows row .. row+n-1 (n < ROWS only at r1).
template <int K, int WARPS, int ROWS, int SPLIT, int UNROLL, typename XS, typename Epilogue>
__device__ __forceinline__ void gemv_bf16_block(const bf16* __restrict__ W, XS xs, int r0, int r1, float* red,
                                                Epilogue&& epilogue) {
    static_assert(WARPS % SPLIT == 0, "SPLIT must divide the warps of a block");
    constexpr int GROUPS = WARPS / SPLIT;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = warp / SPLIT, part = warp % SPLIT;
    if constexpr (SPLIT == 1) {
        for (int row = r0 + group * ROWS; row < r1; row += GROUPS * ROWS) {
            float acc[ROWS];
            gemv_bf16_rows<K, ROWS, UNROLL>(W, xs, row, r1, acc);
            if (lane == 0) epilogue(row, acc, min(ROWS, r1 - row));
        }
    } else {
        // Every warp runs the same number of rounds: the block synchronises inside the loop.
        const int rounds = (r1 - r0 + GROUPS * ROWS - 1) / (GROUPS * ROWS);
        for (int i = 0; i < rounds; ++i) {
            const int row = r0 + (i * GROUPS + group) * ROWS;
            float acc[ROWS];
            gemv_bf16_rows<K, ROWS, UNROLL, SPLIT>(W, xs, row, r1, acc, part);
            if (lane == 0)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) red[warp * ROWS + r] = acc[r];
            __syncthreads();
            if (part == 0 && lane == 0 && row < r1) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    acc[r] = red[warp * ROWS + r];
#pragma unroll
                    for (int p = 1; p < SPLIT; ++p) acc[r] += red[(warp + p) * ROWS + r];
                }
                epilogue(row, acc, min(ROWS, r1 - row));
            }
            __syncthreads();
        }
    }
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
