// gemm_wgmma.cuh: Y = X W^T on Hopper's warpgroup tensor cores (sm_90a), the same contract and epilogues as gemm.cuh.
//
// A block computes BM x BN tiles of Y (BM = 64 per consumer warpgroup, BN = 128 per m64n128k16 column step; or, for
// the token-N tile, BM = TN tokens on the wgmma's N by BN = 64 weight rows per consumer) with 1 + CONSUMERS
// warpgroups, one tile after another (a persistent grid, at most the blocks the SMs hold at once).
// Warpgroup 0 is the producer: one thread streams BK = 64 columns of X and W per k tile through STAGES shared-memory
// stages with 2-D TMA loads (128-byte swizzle; rows past M or N zero-filled), each stage completing on its `full`
// mbarrier. Consumer warpgroup c waits for a stage, issues wgmma over its 64 rows and all BN columns, and hands the
// stage back on its `empty` mbarrier once the wgmma reading it has completed (one k tile later: the wgmma of two k
// tiles overlap). Tiles and slices of K come from gemm_work; a split-K launch runs a tile's slices as one cluster of
// blocks, which add their partials through distributed shared memory (cluster_split_add, below). Under programmatic
// dependent launch (templates/common.cuh) the producer loads the first stages' weights before the kernel ahead has
// finished, and the next kernel launches once the last k tile is done.
#pragma once
#include "cluster.cuh"
#include "gemm.cuh"
#include "wgmma.cuh"

namespace lucegen {

// What both tile shapes share: the stages of BM X rows and BN W rows, the threads, the register split.
template <int BM_, int BN_, int CONSUMERS_, int STAGES_>
struct WgmmaStages {
    static constexpr int BM = BM_, BN = BN_, BK = 64, GROUP_M = 8, CONSUMERS = CONSUMERS_, STAGES = STAGES_;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
    // 1024 bytes of slack to align the tiles for the swizzle, the stages, a full and an empty barrier per stage
    static constexpr int SMEM = 1024 + STAGES * STAGE + STAGES * 2 * 8;
    // registers per thread after the producer gives its own to the consumers: the compiled budget (64K / THREADS, a
    // multiple of 8) of the producer warpgroup moved to the consumers (two consumers of a 384-thread block: 232)
    static constexpr int PRODUCER_REGS = 40;
    static constexpr int CONSUMER_REGS =
        CONSUMERS > 1 ? ((65536 / THREADS / 8 * 8) * (1 + CONSUMERS) - PRODUCER_REGS) / CONSUMERS / 8 * 8 : 0;
    static_assert(STAGES >= 2 && CONSUMERS >= 1, "wgmma GEMM stages");
    static_assert(A_BYTES % 1024 == 0, "stages stay 1024-byte aligned for the swizzle");
};

// BM = 64 tokens per consumer warpgroup (wgmma's M) by BN = 128 W rows per m64n128k16 (its N).
template <int CONSUMERS_, int NT_, int STAGES_>
struct WgmmaShape : WgmmaStages<64 * CONSUMERS_, 128 * NT_, CONSUMERS_, STAGES_> {
    static constexpr bool TOKENS_N = false;
    static constexpr int WGMMAS = NT_, WGMMA_N = 128;  // wgmma a consumer issues per 16 columns of K, and their N
};

// The token-N tile: BM = TN tokens (any multiple of 8 up to 256, so that a short prompt splits into tiles with
// little padding: 520 = 3 x 176 - 8) by BN = 64 x CONSUMERS weight rows. The operands swap roles: consumer c issues
// wgmma m64nTNk16 with its 64 W rows as A and the X tile as B, so its accumulators hold Y^T (rows: outputs, columns:
// tokens) and the epilogue stores them transposed (the functors' `transposed`).
template <int CONSUMERS_, int TN_, int STAGES_>
struct WgmmaTokensNShape : WgmmaStages<TN_, 64 * CONSUMERS_, CONSUMERS_, STAGES_> {
    static constexpr bool TOKENS_N = true;
    static constexpr int WGMMAS = 1, WGMMA_N = TN_;
    static_assert(TN_ % 8 == 0 && TN_ <= 256, "wgmma's N is a multiple of 8 up to 256");
};

// ---- split-K over a cluster ----------------------------------------------------------------------------------
//
// The `add` of a split-K launch: `splits` blocks per tile, launched as one cluster (rank r = slice r of K, block
// tile * splits + r). Each block stores its partial tile p_r (fp32) into its own shared memory, where the stages
// were; after a cluster barrier, block r adds rows r, r + splits, ... of the tile into Y, reading every block's
// partial through distributed shared memory, in slice order:
//     Y = Y0 + ((((p_0 + p_1) + p_2) + ...) + p_{splits-1})
// the sum gemm.cuh's split_k_add makes (so `reference(..., splits)` holds bit for bit given the partials), with no
// workspace, counter or fence. A second cluster barrier keeps each block's shared memory until all reads are done.
struct AddF32Cluster {
    float* y;
};
template <>
struct IsSplitK<AddF32Cluster> {
    static constexpr bool value = true;
};

// A partial tile in shared memory, as Y lays it out: BM rows (tokens) of BN fp32, rows STRIDE floats apart. 8 past
// BN, so that the float2 stores of a warp's 8 rows x 4 column pairs fall in two wavefronts; for the token-N tile,
// whose warps store single floats of 8 outputs x 8 tokens (2t, 2t + 1), 4 past BN, which puts them in 32 banks.
template <class S>
struct ClusterPartial {
    static constexpr int STRIDE = S::BN + (S::TOKENS_N ? 4 : 8), BYTES = S::BM * STRIDE * 4;
    static_assert(BYTES <= S::STAGES * S::STAGE, "a partial tile fits where the stages were");
};

// Consumer threads tid = 0 .. THREADS - 1 of the block of rank `rank` (all must call it, after the barrier that
// follows every block's store of its partial at `mine`): its rows of the tile at (m0, n0) into Y [M, N]. Batches
// of UNROLL column pairs: the partials' and Y0's loads, then the sums and the stores.
template <class S, int THREADS, int MAX_SPLITS>
__device__ __forceinline__ void cluster_split_add(const float* mine, int rank, int splits, int tid, float* Y,
                                                  int m0, int n0, int M, int N) {
    constexpr int PAIRS = S::BN / 2, UNROLL = 4, STRIDE = ClusterPartial<S>::STRIDE;
    unsigned base[MAX_SPLITS];
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; ++s) base[s] = cluster_address(mine, s < splits ? s : 0);
    const int rows = min(S::BM, M - m0), cols = min(S::BN, N - n0);
    const int mine_rows = rank < rows ? (rows - rank + splits - 1) / splits : 0, pairs = mine_rows * PAIRS;
#pragma unroll 1
    for (int e0 = tid; e0 < pairs; e0 += UNROLL * THREADS) {
        float2 p[MAX_SPLITS][UNROLL], y0[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int e = e0 + u * THREADS, r = rank + e / PAIRS * splits, c = e % PAIRS * 2;
            const bool in = e < pairs && c < cols;
            y0[u] = load_cg_if(reinterpret_cast<const float2*>(Y + (size_t)(m0 + r) * N + n0 + c), in,
                               make_float2(0.f, 0.f));
#pragma unroll
            for (int s = 0; s < MAX_SPLITS; ++s)
                p[s][u] = in && s < splits ? cluster_load2(base[s] + (r * STRIDE + c) * 4) : make_float2(-0.f, -0.f);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int e = e0 + u * THREADS, r = rank + e / PAIRS * splits, c = e % PAIRS * 2;
            float2 t = p[0][u];
#pragma unroll
            for (int s = 1; s < MAX_SPLITS; ++s) t = make_float2(t.x + p[s][u].x, t.y + p[s][u].y);
            if (e < pairs && c < cols)
                *reinterpret_cast<float2*>(Y + (size_t)(m0 + r) * N + n0 + c) =
                    make_float2(y0[u].x + t.x, y0[u].y + t.y);
        }
    }
}

// A PAIRWISE epilogue of a tile staged in shared memory (ClusterPartial's layout) by consumer threads tid = 0 ..
// 128 CONSUMERS - 1: a warp stores 32 adjacent column pairs of a row of Y at a time.
template <class S, class Epilogue>
__device__ __forceinline__ void store_staged(const float* tile, const Epilogue& epilogue, int tid, int m0, int n0,
                                             int M, int N) {
    constexpr int PAIRS = S::BN / 2, STRIDE = ClusterPartial<S>::STRIDE, THREADS = 128 * S::CONSUMERS;
    const int pairs = min(S::BM, M - m0) * PAIRS;
#pragma unroll 4
    for (int e = tid; e < pairs; e += THREADS) {
        const int r = e / PAIRS, c = e % PAIRS * 2;
        const float2 v = *reinterpret_cast<const float2*>(tile + r * STRIDE + c);
        epilogue.pair(m0 + r, n0 + c, v.x, v.y, M, N);
    }
}

// Y = X W^T by a persistent grid; xmap and wmap are 2-D bf16 tensor maps of X [M, K] and W [N, K] with boxes of
// BK x BM and BK x BN and the 128-byte swizzle. Work items (gemm_work) are the ceil(M/BM) * ceil(N/BN) tiles, times
// the slices of K for split-K (whose launch has one block per item, in clusters of splits = gridDim.x / tiles:
// block tile * splits + r takes slice r of the tile); else block b takes items b, b + gridDim.x, ... Its producer
// streams the k tiles of all its items through the stages without a break, so the next item's first stages load
// while the consumers finish the last one and run its epilogue. Launched with S::THREADS threads and S::SMEM bytes
// of dynamic shared memory. MAX_SPLITS: the most slices a launch has (the spec's split_k).
template <class S, class Epilogue, int MAX_SPLITS = 1>
__device__ void gemm_wgmma_tn(const TensorMap& xmap, const TensorMap& wmap, int M, int N, int K,
                              const Epilogue& epilogue, unsigned char* smem_raw) {
    unsigned char* smem = smem_raw + ((1024 - shared_addr(smem_raw) % 1024) % 1024);
    auto* full = reinterpret_cast<unsigned long long*>(smem + S::STAGES * S::STAGE);
    auto* empty = full + S::STAGES;
    constexpr bool SPLIT = IsSplitK<Epilogue>::value;
    const int tiles = gemm_tiles<S>(M, N), splits = SPLIT ? gridDim.x / tiles : 1;
    const int rank = SPLIT ? cluster_rank() : 0, item0 = SPLIT ? rank * tiles + blockIdx.x / splits : blockIdx.x;
    const int items = tiles * splits, warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S::STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], S::CONSUMERS * 4);  // lane 0 of every consumer warp
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {  // the producer
        if constexpr (S::CONSUMERS > 1) regs_dealloc<S::PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            // The weights of the first stages stream in while the kernel before still runs (no kernel writes them);
            // X, and everything after, once it has finished.
            const GemmWork first = gemm_work<S>(M, N, K, item0, splits);
            const int ahead = item0 < items ? min(first.k_tiles, S::STAGES) : 0;
            for (int kt = 0; kt < ahead; ++kt) {
                mbar_expect_tx(&full[kt], S::STAGE);
                tma_load_2d(smem + kt * S::STAGE + S::A_BYTES, wmap, (first.kt0 + kt) * S::BK, first.tn * S::BN,
                            &full[kt]);
            }
            wait_for_prior_grids();
            int it = 0;  // k tiles loaded so far, over all items: stage it % STAGES, its (it / STAGES)-th use
            for (int item = item0; item < items; item += gridDim.x) {
                const GemmWork work = gemm_work<S>(M, N, K, item, splits);
                for (int kt = 0; kt < work.k_tiles; ++kt, ++it) {
                    const int s = it % S::STAGES, k0 = (work.kt0 + kt) * S::BK;
                    unsigned char* stage = smem + s * S::STAGE;
                    if (it >= ahead) {
                        if (it >= S::STAGES) mbar_wait(&empty[s], (it / S::STAGES - 1) & 1);  // its last use is done
                        mbar_expect_tx(&full[s], S::STAGE);
                        tma_load_2d(stage + S::A_BYTES, wmap, k0, work.tn * S::BN, &full[s]);
                    }
                    tma_load_2d(stage, xmap, k0, work.tm * S::BM, &full[s]);
                }
            }
        }
        launch_next_grid();  // every load issued (the consumers let it launch after their last k tile)
        if constexpr (SPLIT) {  // the cluster's two barriers around the consumers' sum of the partials
            __syncwarp();
            cluster_barrier();
            cluster_barrier();
        }
        return;
    }
    wait_for_prior_grids();  // the epilogue writes Y, which the kernel before may read

    if constexpr (S::CONSUMERS > 1) regs_alloc<S::CONSUMER_REGS>();
    const int c = warpgroup - 1;
    const int row = c * 64 + threadIdx.x % 128 / 32 * 16;  // this warp's 16 rows of the warpgroup's 64
    int it = 0;  // k tiles consumed so far, over all items
    auto consume = [&](int item) {
        const GemmWork work = gemm_work<S>(M, N, K, item, splits);
        constexpr int NT = S::WGMMAS, WN = S::WGMMA_N, STRIDE = ClusterPartial<S>::STRIDE;
        float acc[NT][1][WN / 8][4];  // the first wgmma (k tile 0, kk 0) overwrites them
#pragma unroll 1
        for (int kt = 0; kt < work.k_tiles; ++kt, ++it) {
            const int s = it % S::STAGES;
            mbar_wait(&full[s], (it / S::STAGES) & 1);
            const unsigned char* x = smem + s * S::STAGE;               // the stage's X rows
            const unsigned char* w = smem + s * S::STAGE + S::A_BYTES;  // and W rows
            // wgmma's A: this consumer's 64 rows (of X, or of W for the token-N tile); B: all the tile's other rows
            const unsigned char* a = (S::TOKENS_N ? w : x) + c * 64 * S::BK * 2;
            const unsigned char* b = S::TOKENS_N ? x : w;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) fence_accumulators(acc[nt][0]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < S::BK / 16; ++kk)  // 16 columns of K = 32 bytes along a swizzled row
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    WgmmaBf16<WN>::mma(acc[nt][0], smem_desc_sw128(a + kk * 32),
                                       smem_desc_sw128(b + nt * WN * S::BK * 2 + kk * 32), kt > 0 || kk > 0);
            wgmma_commit();
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) fence_accumulators(acc[nt][0]);
            wgmma_wait<1>();  // the wgmma of k tile kt - 1 have completed: its stage can be refilled
            if (kt > 0 && threadIdx.x % 32 == 0) mbar_arrive(&empty[(it - 1) % S::STAGES]);
        }
        wgmma_wait<0>();
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) fence_accumulators(acc[nt][0]);
        if (threadIdx.x % 32 == 0) mbar_arrive(&empty[(it - 1) % S::STAGES]);  // the item's last stage
        if (item + gridDim.x >= items) launch_next_grid();  // only the epilogue is left: the next kernel may launch
        const int m0 = work.tm * S::BM, n0 = work.tn * S::BN;
        float* staged = reinterpret_cast<float*>(smem);  // the tile in Y's layout, where the stages were
        auto stage_tile = [&] {
            named_barrier(1, 128 * S::CONSUMERS);  // every consumer's wgmma is done with the stages
            if constexpr (S::TOKENS_N) {
                const TransposedTile tile(row, 0, S::BM, S::BN);
#pragma unroll
                for (int j = 0; j < WN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        staged[tile.token * STRIDE + tile.output + tile.offset(j, e, STRIDE)] = acc[0][0][j][e];
            } else {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    for_each_pair(acc[nt], row, nt * 128, [&](int r, int col, float a, float b) {
                        *reinterpret_cast<float2*>(staged + r * STRIDE + col) = make_float2(a, b);
                    });
            }
        };
        if constexpr (SPLIT) {  // the partials into the blocks' shared memory, then the cluster adds them
            stage_tile();
            cluster_barrier();
            cluster_split_add<S, 128 * S::CONSUMERS, MAX_SPLITS>(staged, rank, splits, threadIdx.x - 128, epilogue.y,
                                                                 m0, n0, M, N);
            cluster_barrier();
        } else if constexpr (S::TOKENS_N) {
            // The block's last tile goes through shared memory, stored in whole rows of Y; before it, the stages are
            // busy with the next tile's loads, and the accumulators go to Y as they lie (8 rows of 16 bytes a store).
            if constexpr (Epilogue::PAIRWISE) {
                if (item + gridDim.x >= items) {
                    stage_tile();
                    named_barrier(1, 128 * S::CONSUMERS);
                    store_staged<S>(staged, epilogue, threadIdx.x - 128, m0, n0, M, N);
                    return;
                }
            }
            epilogue.transposed(acc[0][0], n0 + row, m0, M, N);
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) epilogue(acc[nt], m0 + row, n0 + nt * 128, M, N);
        }
    };
    if constexpr (SPLIT) {
        consume(item0);  // one block per item
    } else {
#pragma unroll 1
        for (int item = blockIdx.x; item < items; item += gridDim.x) consume(item);
    }
}

}  // namespace lucegen
