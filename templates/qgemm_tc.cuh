// qgemm_tc.cuh: Y = X W^T for Q4_K or Q6_K weights W [N, K] as the GGUF file stores them and fp16 activations
// X [M, K], on fp16 tensor cores (mma.sync m16n8k16, fp32 accumulators): one kernel for every M, the decode GEMV
// (M = 1) and the GEMM of a tree verify alike, batch-invariant (a token's outputs do not depend on M or on its row in
// a tile), so that a verify row equals the decode row by construction. docs/design.md, "Session 9", has the design.
//
// A block of WARPS warps computes 8 output rows (one mma n-tile) for MT x 16 tokens; warp w takes a contiguous share
// of the K / 256 super-blocks, and the warps' partial sums are added in warp order. Lane (g, t) = (lane / 4,
// lane % 4) holds the B fragment of row g: 4 values of one scale group a mma, dequantised in registers (TcQ4K,
// TcQ6K below say which). An mma's 16 k slots hold the group's values out of order: lane t's slots 2t, 2t+1 hold
// its values 0 and 2 (bytes 0 and 2 of a word), slots 2t+8, 2t+9 its values 1 and 3, and the A fragment takes the
// activations in the same order: qgemm_tc_x16 stores each 4 fp16 of X as e0 e2 e1 e3, so that a uint2 of it is the
// lane's A words as they are.
//
// Dequantisation (as Marlin does it): (q | 0x6400) is the fp16 1024 + q; the 1024 (and Q6_K's offset 32) come off
// exactly, then one HFMA2 (HMUL2) rounds the weight once. (Folding the 1024 into the bias would round away half a
// quantisation step.) lucegen/kernels/qgemm_tc.py's dequantize_fp16 gives the same fp16 weights in numpy.
#pragma once
#include <cuda_fp16.h>

#include "mma.cuh"
#include "quant.cuh"

namespace lucegen {

// Where qgemm_tc_x16 puts element i of X: within each 4, positions 1 and 2 swap places.
__host__ __device__ constexpr int qgemm_x_slot(int i) {
    const int j = i & 3;
    return (i & ~3) | (j == 1 ? 2 : j == 2 ? 1 : j);
}

// One mma per 16-token tile of acc: rows g and g + 8 of each tile take their 4 activations at k0 (a uint2 of the
// permuted fp16 X: slots 2t, 2t+1 | 2t+8, 2t+9), B is the lane's fragment. Rows past M read row M - 1 (no
// predicated loads) and count as zeros; HALF: the tile's rows 8 .. 15 are zeros, not loads.
template <int MT, bool HALF>
__device__ __forceinline__ void qgemm_tc_mma(float (&acc)[MT][4], const unsigned (&b)[2], const __half* __restrict__ X,
                                             int M, int K, size_t k0) {
    const int g = threadIdx.x % 32 / 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int r0 = 16 * mt + g, r1 = r0 + 8;
        const uint2 v0 = __ldg(reinterpret_cast<const uint2*>(X + (size_t)min(r0, M - 1) * K + k0));
        const uint2 x0 = r0 < M ? v0 : make_uint2(0u, 0u);
        uint2 x1 = make_uint2(0u, 0u);
        if constexpr (!HALF) {
            const uint2 v1 = __ldg(reinterpret_cast<const uint2*>(X + (size_t)min(r1, M - 1) * K + k0));
            x1 = r1 < M ? v1 : x1;
        }
        const unsigned a[4] = {x0.x, x1.x, x0.y, x1.y};
        mma_f16(acc[mt], a, b);
    }
}

// ---- Q4_K: [0:2] d | [2:4] dmin | [4:16] scales[12] | [16:144] qs[128] -------------------------------------------
// Lane (g, t) loads bytes 8t .. 8t+7 of each 32-byte run c of qs: sub-block 2c (low nibbles) and 2c + 1 (high)
// values 8t .. 8t+7 of each, two mmas a sub-block (values 8t .. 8t+3, then 8t+4 .. 8t+7). The lanes of a row decode
// two sub-blocks' scales each and pass them round. Weights fl16(q s + b), s = fl16(d sc), b = fl16(-(dmin m)).
struct TcQ4K {
    static constexpr int BLOCK_BYTES = 144;

    // sub-block j's fp16 scale and bias as one word (scale in the low half)
    __device__ static unsigned scale_bias(int j, const uint4& h) {
        const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x & 0xFFFFu)));
        const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x >> 16)));
        const unsigned scm = scale_min_k4(j, h);
        const __half2 sb = __floats2half2_rn(__fmul_rn(d, float(scm & 0xFFu)), -__fmul_rn(dmin, float(scm >> 8)));
        return *reinterpret_cast<const unsigned*>(&sb);
    }

    // the nibbles at bits SHIFT and SHIFT + 16 of w as fp16 weights
    template <int SHIFT>
    __device__ static unsigned pair(unsigned w, __half2 scale, __half2 bias) {
        unsigned h;  // (w >> SHIFT) & 0x000F000F | 0x64006400 in one LOP3 (the compiler makes two of it)
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(w >> SHIFT), "r"(0x000F000Fu), "r"(0x64006400u));
        const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x6400)));
        const __half2 r = __hfma2(q, scale, bias);
        return *reinterpret_cast<const unsigned*>(&r);
    }

    template <int MT, bool HALF>
    __device__ static void superblock(const unsigned char* blk, size_t k_base, const __half* __restrict__ X, int M,
                                      int K, float (&acc)[MT][4]) {
        const int lane = threadIdx.x % 32, t = lane % 4;
        const uint4 h = __ldg(reinterpret_cast<const uint4*>(blk));
        uint2 qs[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) qs[c] = __ldg(reinterpret_cast<const uint2*>(blk + 16 + 32 * c + 8 * t));
        const unsigned own_lo = scale_bias(2 * t, h), own_hi = scale_bias(2 * t + 1, h);
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {  // sub-block 2c + hf: the low (hf 0) or high nibbles
                const unsigned sbw = __shfl_sync(0xFFFFFFFFu, hf ? own_hi : own_lo, (lane & ~3) | c);
                const unsigned scale_w = __byte_perm(sbw, 0u, 0x1010), bias_w = __byte_perm(sbw, 0u, 0x3232);
                const __half2 scale = *reinterpret_cast<const __half2*>(&scale_w);
                const __half2 bias = *reinterpret_cast<const __half2*>(&bias_w);
                unsigned b0[2], b1[2];
                if (hf == 0) {
                    b0[0] = pair<0>(qs[c].x, scale, bias), b0[1] = pair<8>(qs[c].x, scale, bias);
                    b1[0] = pair<0>(qs[c].y, scale, bias), b1[1] = pair<8>(qs[c].y, scale, bias);
                } else {
                    b0[0] = pair<4>(qs[c].x, scale, bias), b0[1] = pair<12>(qs[c].x, scale, bias);
                    b1[0] = pair<4>(qs[c].y, scale, bias), b1[1] = pair<12>(qs[c].y, scale, bias);
                }
                const size_t k0 = k_base + 32 * (2 * c + hf) + 8 * t;
                qgemm_tc_mma<MT, HALF>(acc, b0, X, M, K, k0);
                qgemm_tc_mma<MT, HALF>(acc, b1, X, M, K, k0 + 4);
            }
    }
};

// ---- Q6_K: [0:128] ql | [128:192] qh | [192:208] int8 scales[16] | [208:210] d -------------------------------------
// Value 32r + l of half hh (r = 0..3, l = 0..31): the low (r < 2) or high nibble of ql[64 hh + 32 (r % 2) + l] and
// bits 2r, 2r+1 of qh[32 hh + l], q = that - 32; group 8 hh + 2r + (l >= 16) of 16 values has scale sc. Lane (g, t)
// takes l = 4t .. 4t+3 of each group (16 values, one mma each: 16 a super-block). Blocks are 210 bytes, so words come
// from 2-byte aligned addresses (load_words_a2). Weights fl16((q - 32) s), s = fl16(d sc).
struct TcQ6K {
    static constexpr int BLOCK_BYTES = 210;

    template <int MT, bool HALF>
    __device__ static void superblock(const unsigned char* blk, size_t k_base, const __half* __restrict__ X, int M,
                                      int K, float (&acc)[MT][4]) {
        const int t = threadIdx.x % 4;
        const float d = __half2float(__ldg(reinterpret_cast<const __half*>(blk + 208)));
        unsigned sc[4];
        load_words_a2<4>(blk + 192, sc);
        const __half2 offset = __half2half2(__ushort_as_half(0x6420));  // 1024 + 32
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            unsigned ql[2][2], qh[2];  // [run % 2][l >= 16], [l >= 16]
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                unsigned w[1];
                load_words_a2<1>(blk + 128 + 32 * hh + 16 * i + 4 * t, w);
                qh[i] = w[0];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    load_words_a2<1>(blk + 64 * hh + 32 * j + 16 * i + 4 * t, w);
                    ql[j][i] = w[0];
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int grp = 8 * hh + 2 * r + i;
                    const int s8 = static_cast<signed char>((sc[grp / 4] >> (8 * (grp % 4))) & 0xFFu);
                    const __half2 scale = __half2half2(__float2half_rn(__fmul_rn(d, float(s8))));
                    const unsigned wl = ql[r % 2][i] >> (4 * (r / 2)), wh = qh[i] >> (2 * r);
                    unsigned b[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {  // bytes 0 and 2 (values 4t, 4t+2), then 1 and 3
                        const unsigned h = ((wl >> (8 * e)) & 0x000F000Fu) | (((wh >> (8 * e)) & 0x00030003u) << 4) |
                                           0x64006400u;
                        const __half2 v = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&h), offset), scale);
                        b[e] = *reinterpret_cast<const unsigned*>(&v);
                    }
                    qgemm_tc_mma<MT, HALF>(acc, b, X, M, K, k_base + 128 * hh + 32 * r + 16 * i + 4 * t);
                }
        }
    }
};

// A launch: N / 8 blocks of WARPS * 32 threads; rows 0 .. min(M, 16 MT) - 1 of X and Y (HALF: M <= 8).
template <class F, int MT, int WARPS, bool HALF>
__device__ void qgemm_tc(const unsigned char* __restrict__ W, const __half* __restrict__ X, float* __restrict__ Y,
                         int M, int N, int K) {
    __shared__ float partial[WARPS][MT][32][4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const int n0 = blockIdx.x * 8, blocks = K / 256;
    const int s0 = warp * blocks / WARPS, s1 = (warp + 1) * blocks / WARPS;
    const unsigned char* row = W + (size_t)(n0 + g) * blocks * F::BLOCK_BYTES;
    float acc[MT][4] = {};
#pragma unroll 1
    for (int s = s0; s < s1; ++s)
        F::template superblock<MT, HALF>(row + (size_t)s * F::BLOCK_BYTES, (size_t)s * 256, X, M, K, acc);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) partial[warp][mt][lane][e] = acc[mt][e];
    __syncthreads();
    for (int i = threadIdx.x; i < MT * 32 * 4; i += WARPS * 32) {  // the warps' partials added in warp order
        const int mt = i / 128, ln = i / 4 % 32, e = i % 4;
        float sum = partial[0][mt][ln][e];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) sum += partial[w][mt][ln][e];
        const int token = 16 * mt + ln / 4 + 8 * (e / 2), n = n0 + 2 * (ln % 4) + e % 2;
        if (token < M) Y[(size_t)token * N + n] = sum;
    }
}

}  // namespace lucegen
