// qgemm_tc.cuh: Y = X W^T for Q4_K weights W [N, K] as the GGUF file stores them and fp16 activations X [M, K], on
// fp16 tensor cores (mma.sync m16n8k16, fp32 accumulators): one kernel for every M, the decode GEMV (M = 1) and the
// GEMM of a tree verify alike, batch-invariant (a token's outputs do not depend on M or on its row in a tile), so
// that a verify row equals the decode row by construction. docs/design.md, "Session 9", has the design.
//
// A block of WARPS warps computes 8 output rows (one mma n-tile) for MT x 16 tokens; warp w takes a contiguous share
// of the K / 256 super-blocks, and the warps' partial sums are added in warp order. The 4 lanes of a row decode two
// sub-blocks' scales each and pass them round (shuffles). Lane (g, t) = (lane / 4,
// lane % 4) holds the B fragment of row g: per 32-byte run c of a super-block's qs (sub-blocks 2c, low nibbles, and
// 2c + 1, high nibbles) it loads bytes 8t .. 8t+7, whose nibbles feed four mmas: sub-block 2c values 8t .. 8t+3 and
// 8t+4 .. 8t+7, and the same of 2c + 1. An mma's 16 k slots hold 16 values of one sub-block (one scale), not in
// order: slots 2t, 2t+1 hold values 8t, 8t+2 (bytes 0 and 2 of a word), slots 2t+8, 2t+9 values 8t+1, 8t+3, and the
// A fragment takes the activations in the same order: qgemm_tc_x16 stores each 8 fp16 of X as e0 e2 e1 e3 e4 e6 e5
// e7, so that a uint4 of it is the A words of two mmas as they are.
//
// Dequantisation (as Marlin does it): (nibble | 0x6400) is the fp16 1024 + q; 1024 comes off exactly, then one HFMA2
// gives fl16(q s + b) with s = fl16(fl(d sc)), b = fl16(-fl(dmin m)). (Folding the 1024 into b would round away half
// a quantisation step.) lucegen/kernels/qgemm_tc.py's dequantize_fp16 gives the same fp16 weights in numpy.
#pragma once
#include <cuda_fp16.h>

#include "mma.cuh"
#include "quant.cuh"

namespace lucegen {

constexpr int QK4_BLOCK_BYTES = 144, QK4_QS = 16;

// Values 2q, 2q + 2 of a run as fp16 pairs: the nibbles at bits `shift` and `shift` + 16 of word w, dequantised.
template <int SHIFT>
__device__ __forceinline__ unsigned qgemm_nibbles_fp16(unsigned w, __half2 scale, __half2 bias) {
    unsigned h;  // (w >> SHIFT) & 0x000F000F | 0x64006400 in one LOP3 (the compiler makes two of it)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(w >> SHIFT), "r"(0x000F000Fu), "r"(0x64006400u));
    const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x6400)));
    const __half2 r = __hfma2(q, scale, bias);
    return *reinterpret_cast<const unsigned*>(&r);
}

// Where qgemm_tc_x16 puts element i of X: within each 8, positions 1 and 2 swap places, and 5 and 6.
__host__ __device__ constexpr int qgemm_x_slot(int i) {
    const int j = i & 7;
    return (i & ~7) | (j == 1 || j == 5 ? j + 1 : j == 2 || j == 6 ? j - 1 : j);
}

// Sub-block j's fp16 scale and bias, fl16(fl(d sc)) and fl16(-fl(dmin m)), as one word (scale in the low half).
__device__ __forceinline__ unsigned qgemm_scale_bias(int j, const uint4& h) {
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x & 0xFFFFu)));
    const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x >> 16)));
    const unsigned scm = scale_min_k4(j, h);
    const __half2 sb = __floats2half2_rn(__fmul_rn(d, float(scm & 0xFFu)), -__fmul_rn(dmin, float(scm >> 8)));
    return *reinterpret_cast<const unsigned*>(&sb);
}

// A launch: N / 8 blocks of WARPS * 32 threads; rows m0 .. m0 + min(M, 16 MT) - 1 of X and Y. HALF (MT = 1, M <= 8):
// the tile's rows 8 .. 15 are zeros, not loads.
template <int MT, int WARPS, bool HALF>
__device__ void qgemm_tc_q4k(const unsigned char* __restrict__ W, const __half* __restrict__ X, float* __restrict__ Y,
                             int M, int N, int K) {
    __shared__ float partial[WARPS][MT][32][4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * 8, blocks = K / 256;
    const int s0 = warp * blocks / WARPS, s1 = (warp + 1) * blocks / WARPS;
    const unsigned char* row = W + (size_t)(n0 + g) * blocks * QK4_BLOCK_BYTES;
    float acc[MT][4] = {};
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll 1
    for (int s = s0; s < s1; ++s) {
        const unsigned char* blk = row + (size_t)s * QK4_BLOCK_BYTES;
        const uint4 h = __ldg(reinterpret_cast<const uint4*>(blk));
        uint2 qs[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) qs[c] = __ldg(reinterpret_cast<const uint2*>(blk + QK4_QS + 32 * c + 8 * t));
        // the 4 lanes of a row decode 2 sub-blocks' scales each and pass them round
        const unsigned own_lo = qgemm_scale_bias(2 * t, h), own_hi = qgemm_scale_bias(2 * t + 1, h);
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {  // sub-block 2c + hf: the low (hf 0) or high nibbles
                const int sb = 2 * c + hf;
                const unsigned sbw = __shfl_sync(0xFFFFFFFFu, hf ? own_hi : own_lo, (lane & ~3) | c);
                const unsigned scale_w = __byte_perm(sbw, 0u, 0x1010), bias_w = __byte_perm(sbw, 0u, 0x3232);
                const __half2 scale = *reinterpret_cast<const __half2*>(&scale_w);
                const __half2 bias = *reinterpret_cast<const __half2*>(&bias_w);
                unsigned b0[2], b1[2];
                if (hf == 0) {
                    b0[0] = qgemm_nibbles_fp16<0>(qs[c].x, scale, bias), b0[1] = qgemm_nibbles_fp16<8>(qs[c].x, scale, bias);
                    b1[0] = qgemm_nibbles_fp16<0>(qs[c].y, scale, bias), b1[1] = qgemm_nibbles_fp16<8>(qs[c].y, scale, bias);
                } else {
                    b0[0] = qgemm_nibbles_fp16<4>(qs[c].x, scale, bias), b0[1] = qgemm_nibbles_fp16<12>(qs[c].x, scale, bias);
                    b1[0] = qgemm_nibbles_fp16<4>(qs[c].y, scale, bias), b1[1] = qgemm_nibbles_fp16<12>(qs[c].y, scale, bias);
                }
                const size_t k0 = (size_t)s * 256 + 32 * sb + 8 * t;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const int r0 = 16 * mt + g, r1 = r0 + 8;
                    // rows past M read row M - 1 (no predicated loads) and count as zeros
                    const uint4 v0 = __ldg(reinterpret_cast<const uint4*>(X + (size_t)min(r0, M - 1) * K + k0));
                    const uint4 x0 = r0 < M ? v0 : zero;
                    uint4 x1 = zero;
                    if constexpr (!HALF) {
                        const uint4 v1 = __ldg(reinterpret_cast<const uint4*>(X + (size_t)min(r1, M - 1) * K + k0));
                        x1 = r1 < M ? v1 : zero;
                    }
                    const unsigned a_lo[4] = {x0.x, x1.x, x0.y, x1.y}, a_hi[4] = {x0.z, x1.z, x0.w, x1.w};
                    mma_f16(acc[mt], a_lo, b0);
                    mma_f16(acc[mt], a_hi, b1);
                }
            }
    }
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
