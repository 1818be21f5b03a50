// gemm_wgmma.cuh: Y = X W^T on Hopper's warpgroup tensor cores (sm_90a), the same contract and epilogues as gemm.cuh.
//
// A block computes a BM x BN tile of Y (BM = 64 per consumer warpgroup, BN = 128 per m64n128k16 column step) with
// 1 + CONSUMERS warpgroups. Warpgroup 0 is the producer: one thread streams BK = 64 columns of X and W per k tile
// through STAGES shared-memory stages with 2-D TMA loads (128-byte swizzle; rows past M or N zero-filled), each
// stage completing on its `full` mbarrier. Consumer warpgroup c waits for a stage, issues wgmma over its 64 rows and
// all BN columns, and hands the stage back on its `empty` mbarrier once the wgmma reading it has completed (one
// k tile later: the wgmma of two k tiles overlap). Blocks take their tile and slice of K from gemm_block_work; the
// consumers of a split-K block store their partial tile and the tile's last block adds the slices with gemm.cuh's
// split_k_add (named barrier 1: the producer warpgroup has left by then).
#pragma once
#include "gemm.cuh"
#include "wgmma.cuh"

namespace lucegen {

template <int CONSUMERS_, int NT_, int STAGES_>
struct WgmmaShape {
    static constexpr int CONSUMERS = CONSUMERS_, NT = NT_, STAGES = STAGES_;
    static constexpr int BM = 64 * CONSUMERS, BN = 128 * NT, BK = 64, GROUP_M = 8;
    static constexpr int THREADS = 128 * (1 + CONSUMERS);
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
    // 1024 bytes of slack to align the tiles for the swizzle, the stages, a full and an empty barrier per stage
    static constexpr int SMEM = 1024 + STAGES * STAGE + STAGES * 2 * 8;
    // registers per thread after the producer gives its own to the consumers (a multiple of 8; 128 x (PRODUCER_REGS +
    // CONSUMERS x CONSUMER_REGS) <= 64K)
    static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
    static_assert(STAGES >= 2 && NT >= 1 && CONSUMERS >= 1, "wgmma GEMM tile shape");
};

// One block's BM x BN tile of Y = X W^T; xmap and wmap are 2-D bf16 tensor maps of X [M, K] and W [N, K] with
// boxes of BK x BM and BK x BN and the 128-byte swizzle. Launched with splits * ceil(M/BM) * ceil(N/BN) blocks of
// S::THREADS threads and S::SMEM bytes of dynamic shared memory. MAX_SPLITS: see split_k_add.
template <class S, class Epilogue, int MAX_SPLITS = 1>
__device__ void gemm_wgmma_tn(const TensorMap& xmap, const TensorMap& wmap, int M, int N, int K,
                              const Epilogue& epilogue, unsigned char* smem_raw) {
    unsigned char* smem = smem_raw + ((1024 - shared_addr(smem_raw) % 1024) % 1024);
    auto* full = reinterpret_cast<unsigned long long*>(smem + S::STAGES * S::STAGE);
    auto* empty = full + S::STAGES;
    const GemmWork work = gemm_block_work<S>(M, N, K);
    const int m0 = work.tm * S::BM, n0 = work.tn * S::BN, k_tiles = work.k_tiles, warpgroup = threadIdx.x / 128;
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
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % S::STAGES;
                if (kt >= S::STAGES) mbar_wait(&empty[s], (kt / S::STAGES - 1) & 1);  // k tile kt - STAGES is done
                unsigned char* stage = smem + s * S::STAGE;
                mbar_expect_tx(&full[s], S::STAGE);
                tma_load_2d(stage, xmap, (work.kt0 + kt) * S::BK, m0, &full[s]);
                tma_load_2d(stage + S::A_BYTES, wmap, (work.kt0 + kt) * S::BK, n0, &full[s]);
            }
        }
        return;
    }

    if constexpr (S::CONSUMERS > 1) regs_alloc<S::CONSUMER_REGS>();
    const int c = warpgroup - 1;
    float acc[S::NT][1][16][4];  // the first wgmma (k tile 0, kk 0) overwrites them

#pragma unroll 1
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % S::STAGES;
        mbar_wait(&full[s], (kt / S::STAGES) & 1);
        const unsigned char* a = smem + s * S::STAGE + c * 64 * S::BK * 2;
        const unsigned char* b = smem + s * S::STAGE + S::A_BYTES;
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt) fence_accumulators(acc[nt][0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < S::BK / 16; ++kk)  // 16 columns of K = 32 bytes along a swizzled row
#pragma unroll
            for (int nt = 0; nt < S::NT; ++nt)
                wgmma_m64n128k16(acc[nt][0], smem_desc_sw128(a + kk * 32),
                                 smem_desc_sw128(b + nt * 128 * S::BK * 2 + kk * 32), kt > 0 || kk > 0);
        wgmma_commit();
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt) fence_accumulators(acc[nt][0]);
        wgmma_wait<1>();  // the wgmma of k tile kt - 1 have completed: its stage can be refilled
        if (kt > 0 && threadIdx.x % 32 == 0) mbar_arrive(&empty[(kt - 1) % S::STAGES]);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int nt = 0; nt < S::NT; ++nt) fence_accumulators(acc[nt][0]);
    const int row = c * 64 + threadIdx.x % 128 / 32 * 16;  // this warp's 16 rows of the warpgroup's 64
    if constexpr (IsSplitK<Epilogue>::value) {  // the partial to the block's slot, then the tile's last block adds
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt)
            StoreF32{epilogue.partials + (size_t)blockIdx.x * S::BM * S::BN}(acc[nt], row, nt * 128, S::BM, S::BN);
        split_k_add<S::BM, S::BN, 128 * S::CONSUMERS, MAX_SPLITS>(work, threadIdx.x - 128, 1, epilogue.partials,
                                                                  epilogue.counters, epilogue.y, m0, n0, M, N);
    } else {
#pragma unroll
        for (int nt = 0; nt < S::NT; ++nt) epilogue(acc[nt], m0 + row, n0 + nt * 128, M, N);
    }
}

}  // namespace lucegen
