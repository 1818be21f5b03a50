// attention_wgmma.cuh: the prefill's causal flash attention on Hopper's warpgroup tensor cores (sm_90a), for prompts
// whose (query tile, head) blocks fill the SMs; the same contract, masking, online softmax and gated store as
// attention_prefill.cuh's mma.sync kernel (its device functions).
//
// A block takes 128 queries of one head: warpgroup 0 is the producer (one thread: Q once, then each 64-key tile's K
// and V through STAGES stages by 3-D TMA loads with the 128-byte swizzle, positions past the cache's end read as
// zeros), warpgroups 1 and 2 take query rows 0-63 and 64-127. Per key tile a consumer issues S = Q K^T as
// HD / 16 wgmma m64n64k16 (Q and K from shared memory, K-major), masks and rescales in registers (the accumulator
// layout is mma.sync's per warp), then O += P V as 4 wgmma m64nHDk16 with P from the score registers and V from
// shared memory MN-major (its rows are keys: the B operand transposed). Every consumer warp hands each stage back on
// its `empty` barrier; a tile past a warpgroup's last query is skipped but handed back too.
//
// Shared memory: a [rows][HD] tile is HD / 64 sub-tiles of [rows][64] (128-byte rows, swizzled), sub-tile c at
// c * rows * 128 bytes: the box a TMA load of 64 columns writes, and the K-major layout wgmma reads with 32-byte
// steps along K; for V the sub-tiles are the MN-major operand's 64-column groups (8 KB apart).
#pragma once
#include "attention_prefill.cuh"
#include "wgmma.cuh"

namespace lucegen {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

template <class S>
struct AttnWgmma {
    static constexpr int BM = 128, BN = ATTN_BN, STAGES = 2, THREADS = 384;
    static constexpr int SUB = S::HD / 64, SUB_BYTES = 64 * 128;  // 64-column sub-tiles of 64 rows
    static constexpr int Q_BYTES = BM * S::HD * 2, KV_BYTES = BN * S::HD * 2, STAGE = 2 * KV_BYTES;
    // 1024 bytes of slack to align the tiles for the swizzle, Q, the stages, Q's barrier and a full and an empty one
    // per stage
    static constexpr int SMEM = 1024 + Q_BYTES + STAGES * STAGE + (1 + 2 * STAGES) * 8;
    static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;  // 128 x 40 + 256 x 232 <= 64K
    static_assert(S::HD % 64 == 0 && S::HD <= 256, "wgmma's N (the head dim of P V) is at most 256");
};

// Queries [q0, q0 + 128) of head h (tile index `tile` of the block, most keys first) against keys [0, kv_len) of
// its KV head. qmap: q [T][NH][HD]; kmap, vmap: the layer's caches [kv_len][NKV][HD]; boxes 64 x 1 x 64.
template <class S>
__device__ void attention_prefill_tma(const TensorMap& qmap, const TensorMap& kmap, const TensorMap& vmap,
                                      const bf16* __restrict__ qkv, bf16* __restrict__ out, int T, int start,
                                      int tile, int h, unsigned char* smem_raw) {
    using A = AttnWgmma<S>;
    unsigned char* smem = smem_raw + ((1024 - shared_addr(smem_raw) % 1024) % 1024);
    unsigned char* qs = smem;
    unsigned char* stages = smem + A::Q_BYTES;
    auto* qbar = reinterpret_cast<unsigned long long*>(stages + A::STAGES * A::STAGE);
    auto* full = qbar + 1;
    auto* empty = full + A::STAGES;
    const int q0 = tile * A::BM, kv_len = start + T, kvh = h / S::GROUP, warpgroup = threadIdx.x / 128;
    const int key_tiles = (min(start + q0 + A::BM, kv_len) + A::BN - 1) / A::BN;
    if (threadIdx.x == 0) {
        mbar_init(qbar, 1);
        for (int s = 0; s < A::STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8);  // lane 0 of every consumer warp
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {  // the producer
        regs_dealloc<A::PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            mbar_expect_tx(qbar, A::Q_BYTES);
            for (int half = 0; half < 2; ++half)
                for (int c = 0; c < A::SUB; ++c)
                    tma_load_3d(qs + half * 64 * S::HD * 2 + c * A::SUB_BYTES, qmap, 64 * c, h, q0 + 64 * half, qbar);
            for (int j = 0; j < key_tiles; ++j) {
                const int s = j % A::STAGES;
                unsigned char* k = stages + s * A::STAGE;
                if (j >= A::STAGES) mbar_wait(&empty[s], (j / A::STAGES - 1) & 1);  // its last use is done
                mbar_expect_tx(&full[s], A::STAGE);
                for (int c = 0; c < A::SUB; ++c) {
                    tma_load_3d(k + c * A::SUB_BYTES, kmap, 64 * c, kvh, j * A::BN, &full[s]);
                    tma_load_3d(k + A::KV_BYTES + c * A::SUB_BYTES, vmap, 64 * c, kvh, j * A::BN, &full[s]);
                }
            }
        }
        return;
    }
    regs_alloc<A::CONSUMER_REGS>();
    constexpr int NT = S::HD / 8, SN = A::BN / 8;
    const int c = warpgroup - 1, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32, gq = lane / 4;
    const int first = q0 + 64 * c;  // this warpgroup's first query
    const int row_pos = start + first + 16 * warp + gq;
    const int own_tiles = (min(start + first + 64, kv_len) + A::BN - 1) / A::BN;  // key tiles its queries see
    const unsigned char* q = qs + c * 64 * S::HD * 2;
    const float scale = attention_scale<S>(), neg_inf = -__int_as_float(0x7f800000);
    float o[NT][4] = {}, m[2] = {neg_inf, neg_inf}, l[2] = {0.f, 0.f};
    mbar_wait(qbar, 0);
#pragma unroll 1
    for (int j = 0; j < key_tiles; ++j) {
        const int s = j % A::STAGES;
        mbar_wait(&full[s], (j / A::STAGES) & 1);
        if (j < own_tiles && first < T) {
            const unsigned char* k = stages + s * A::STAGE;
            float sc[SN][4];
            fence_accumulators(sc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < S::HD / 16; ++kk) {  // 16 dims = 32 bytes along a swizzled row of a sub-tile
                const int off = kk / 4 * A::SUB_BYTES + kk % 4 * 32;
                WgmmaBf16<A::BN>::mma(sc, smem_desc_sw128(q + off), smem_desc_sw128(k + off), kk > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_accumulators(sc);
            attention_softmax_tile(sc, o, m, l, j * A::BN, start + first, row_pos, kv_len, scale);
            fence_accumulators(o);
            wgmma_fence();
#pragma unroll
            for (int kt = 0; kt < A::BN / 16; ++kt) {  // 16 keys = 2 groups of 8 rows of V, 2048 bytes
                unsigned a[4];
                attention_p_frag(a, sc, kt);
                WgmmaBf16RegA<S::HD>::mma(o, a, smem_desc_sw128_mn(k + A::KV_BYTES + kt * 2048, A::SUB_BYTES));
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_accumulators(o);
        }
        if (lane == 0) mbar_arrive(&empty[s]);
    }
    launch_next_grid();
    attention_quad_sums(l);
    attention_store_rows<S>(qkv, out, o, l, first + 16 * warp + gq, T, h);
}

#endif

}  // namespace lucegen
