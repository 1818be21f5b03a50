// qgemm_tc.cuh: Y = X W^T for Q4_K or Q6_K weights W [N, K] as the GGUF file stores them and fp16 activations
// X [M, K], on fp16 tensor cores (mma.sync m16n8k16, fp32 accumulators): one kernel for every M, the decode GEMV
// (M = 1) and the GEMM of a tree verify alike, batch-invariant (a token's outputs do not depend on M or on its place
// in a tile), so that a verify row equals the decode row by construction. docs/design.md, "Session 9", has the design.
//
// The weights are the mma's A operand (16 rows a tile) and the tokens its B (8 a tile), so an mma does useful work
// for up to 8 tokens and the decode GEMV wastes only B's columns. A block of WARPS warps computes 16 output rows for
// NT x 8 tokens; warp w takes a contiguous share of the K / 256 super-blocks, and the warps' partial sums are added
// in warp order. Lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of the A tile: 4 values of one scale
// group each an mma, dequantised in registers (TcQ4K, TcQ6K below say which). An mma's 16 k slots hold the group's
// values out of order: lane t's slots 2t, 2t+1 hold its values 0 and 2 (bytes 0 and 2 of a word), slots 2t+8, 2t+9
// its values 1 and 3. B takes the activations in the same order: qgemm_tc_x16 stores each 4 fp16 of X as e0 e2 e1
// e3, so that a uint2 of token g's row is lane (g, t)'s B fragment as it is.
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

// Where lane (g, t)'s B columns start: token g of each 8-token tile of X. X holds whole tiles (the launcher pads it
// with zero rows), so no row is out of range and none needs a select.
template <int NT>
struct XCols {
    const __half* row[NT];
    __device__ __forceinline__ XCols(const __half* X, int K) {
        const int g = threadIdx.x % 32 / 4;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) row[nt] = X + (size_t)(8 * nt + g) * K;
    }
};

// One mma per 8-token tile of acc: A = the lane's weights (rows g, g + 8; slots 2t, 2t+1 | 2t+8, 2t+9), B = its
// token's 4 activations at k0 (a uint2 of the permuted fp16 X).
template <int NT>
__device__ __forceinline__ void qgemm_tc_mma(float (&acc)[NT][4], const unsigned (&a)[4], const XCols<NT>& x, size_t k0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(x.row[nt] + k0));
        const unsigned b[2] = {v.x, v.y};
        mma_f16(acc[nt], a, b);
    }
}

// ---- Q4_K: [0:2] d | [2:4] dmin | [4:16] scales[12] | [16:144] qs[128] -------------------------------------------
// Lane (g, t) loads, for each of its rows, bytes 8t .. 8t+7 of each 32-byte run c of qs: sub-block 2c (low nibbles)
// and 2c + 1 (high) values 8t .. 8t+7 of each, two mmas a sub-block (values 8t .. 8t+3, then 8t+4 .. 8t+7). The 4
// lanes of a row decode two sub-blocks' scales each and pass them round. Weights fl16(q s + b), s = fl16(d sc),
// b = fl16(-(dmin m)).
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

    // the nibbles at bits SHIFT and SHIFT + 16 of w as fp16 weights, scaled by the word sb (scale | bias << 16)
    template <int SHIFT>
    __device__ static unsigned pair(unsigned w, unsigned sb) {
        unsigned h;  // (w >> SHIFT) & 0x000F000F | 0x64006400 in one LOP3 (the compiler makes two of it)
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(w >> SHIFT), "r"(0x000F000Fu), "r"(0x64006400u));
        const unsigned scale_w = __byte_perm(sb, 0u, 0x1010), bias_w = __byte_perm(sb, 0u, 0x3232);
        const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x6400)));
        const __half2 r = __hfma2(q, *reinterpret_cast<const __half2*>(&scale_w),
                                  *reinterpret_cast<const __half2*>(&bias_w));
        return *reinterpret_cast<const unsigned*>(&r);
    }

    // super-block s of the lane's rows: blk[0] (row g) and blk[1] (row g + 8)
    template <int NT>
    __device__ static void superblock(const unsigned char* const (&blk)[2], size_t k_base, const XCols<NT>& x,
                                      float (&acc)[NT][4]) {
        const int lane = threadIdx.x % 32, t = lane % 4;
        uint4 h[2];
        uint2 qs[2][4];
        unsigned own[2][2];  // [row][sub-block 2t, 2t + 1]
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            h[r] = __ldg(reinterpret_cast<const uint4*>(blk[r]));
#pragma unroll
            for (int c = 0; c < 4; ++c) qs[r][c] = __ldg(reinterpret_cast<const uint2*>(blk[r] + 16 + 32 * c + 8 * t));
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) own[r][0] = scale_bias(2 * t, h[r]), own[r][1] = scale_bias(2 * t + 1, h[r]);
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {  // sub-block 2c + hf: the low (hf 0) or high nibbles
                unsigned sb[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) sb[r] = __shfl_sync(0xFFFFFFFFu, own[r][hf], (lane & ~3) | c);
                unsigned a0[4], a1[4];  // values 8t .. 8t+3, then 8t+4 .. 8t+7: rows g, g+8 of slots 2t.., 2t+8..
                if (hf == 0) {
                    a0[0] = pair<0>(qs[0][c].x, sb[0]), a0[1] = pair<0>(qs[1][c].x, sb[1]);
                    a0[2] = pair<8>(qs[0][c].x, sb[0]), a0[3] = pair<8>(qs[1][c].x, sb[1]);
                    a1[0] = pair<0>(qs[0][c].y, sb[0]), a1[1] = pair<0>(qs[1][c].y, sb[1]);
                    a1[2] = pair<8>(qs[0][c].y, sb[0]), a1[3] = pair<8>(qs[1][c].y, sb[1]);
                } else {
                    a0[0] = pair<4>(qs[0][c].x, sb[0]), a0[1] = pair<4>(qs[1][c].x, sb[1]);
                    a0[2] = pair<12>(qs[0][c].x, sb[0]), a0[3] = pair<12>(qs[1][c].x, sb[1]);
                    a1[0] = pair<4>(qs[0][c].y, sb[0]), a1[1] = pair<4>(qs[1][c].y, sb[1]);
                    a1[2] = pair<12>(qs[0][c].y, sb[0]), a1[3] = pair<12>(qs[1][c].y, sb[1]);
                }
                const size_t k0 = k_base + 32 * (2 * c + hf) + 8 * t;
                qgemm_tc_mma<NT>(acc, a0, x, k0);
                qgemm_tc_mma<NT>(acc, a1, x, k0 + 4);
            }
    }
};

// ---- Q6_K: [0:128] ql | [128:192] qh | [192:208] int8 scales[16] | [208:210] d -------------------------------------
// Value 32r + l of half hh (r = 0..3, l = 0..31): the low (r < 2) or high nibble of ql[64 hh + 32 (r % 2) + l] and
// bits 2r, 2r+1 of qh[32 hh + l], q = that - 32; group 8 hh + 2r + (l >= 16) of 16 values has scale sc. Lane (g, t)
// takes l = 4t .. 4t+3 of each group (16 values, one mma each: 16 a super-block) of each of its rows. Blocks are
// 210 bytes, so words come from 2-byte aligned addresses (load_words_a2). Weights fl16((q - 32) s), s = fl16(d sc).
struct TcQ6K {
    static constexpr int BLOCK_BYTES = 210;

    template <int NT>
    __device__ static void superblock(const unsigned char* const (&blk)[2], size_t k_base, const XCols<NT>& x,
                                      float (&acc)[NT][4]) {
        const int t = threadIdx.x % 4;
        const __half2 offset = __half2half2(__ushort_as_half(0x6420));  // 1024 + 32
        float d[2];
        unsigned sc[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            d[r] = __half2float(__ldg(reinterpret_cast<const __half*>(blk[r] + 208)));
            load_words_a2<4>(blk[r] + 192, sc[r]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            unsigned ql[2][2][2], qh[2][2];  // [row][run % 2][l >= 16], [row][l >= 16]
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    unsigned w[1];
                    load_words_a2<1>(blk[r] + 128 + 32 * hh + 16 * i + 4 * t, w);
                    qh[r][i] = w[0];
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        load_words_a2<1>(blk[r] + 64 * hh + 32 * j + 16 * i + 4 * t, w);
                        ql[r][j][i] = w[0];
                    }
                }
#pragma unroll
            for (int run = 0; run < 4; ++run)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int grp = 8 * hh + 2 * run + i;
                    unsigned a[4];  // rows g, g+8 of slots 2t, 2t+1 (bytes 0 and 2), then 2t+8, 2t+9 (bytes 1 and 3)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int s8 = static_cast<signed char>((sc[r][grp / 4] >> (8 * (grp % 4))) & 0xFFu);
                        const __half2 scale = __half2half2(__float2half_rn(__fmul_rn(d[r], float(s8))));
                        // the 4 values q as bytes: ql's nibble, qh's two bits above it (shifted from bits 2 run)
                        const unsigned hi = (run < 2 ? qh[r][i] << (4 - 2 * run) : qh[r][i] >> (2 * run - 4)) &
                                            0x30303030u;
                        unsigned q;
                        asm("lop3.b32 %0, %1, %2, %3, 0xEA;"  // (ql & 0x0F0F0F0F) | hi
                            : "=r"(q) : "r"(ql[r][run % 2][i] >> (4 * (run / 2))), "r"(0x0F0F0F0Fu), "r"(hi));
#pragma unroll
                        for (int e = 0; e < 2; ++e) {  // bytes e and e + 2 under the fp16 exponent of 1024
                            const unsigned h = __byte_perm(q, 0x64646464u, e ? 0x4341 : 0x4240);
                            const __half2 v = __hmul2(__hsub2(*reinterpret_cast<const __half2*>(&h), offset), scale);
                            a[2 * e + r] = *reinterpret_cast<const unsigned*>(&v);
                        }
                    }
                    qgemm_tc_mma<NT>(acc, a, x, k_base + 128 * hh + 32 * run + 16 * i + 4 * t);
                }
        }
    }
};

// A launch: N / 16 blocks of WARPS * 32 threads; rows 0 .. 8 NT - 1 of X (zeros past M) and 0 .. M - 1 of Y.
template <class F, int NT, int WARPS>
__device__ void qgemm_tc(const unsigned char* __restrict__ W, const __half* __restrict__ X, float* __restrict__ Y,
                         int M, int N, int K) {
    __shared__ float partial[WARPS][NT][32][4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    const int n0 = blockIdx.x * 16, blocks = K / 256;
    const int s0 = warp * blocks / WARPS, s1 = (warp + 1) * blocks / WARPS;
    const size_t row_bytes = (size_t)blocks * F::BLOCK_BYTES;
    const unsigned char* rows[2] = {W + (n0 + g) * row_bytes, W + (n0 + g + 8) * row_bytes};
    const XCols<NT> x(X, K);
    float acc[NT][4] = {};
#pragma unroll 1
    for (int s = s0; s < s1; ++s) {
        const unsigned char* const blk[2] = {rows[0] + (size_t)s * F::BLOCK_BYTES, rows[1] + (size_t)s * F::BLOCK_BYTES};
        F::template superblock<NT>(blk, (size_t)s * 256, x, acc);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) partial[warp][nt][lane][e] = acc[nt][e];
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 32 * 4; i += WARPS * 32) {  // the warps' partials added in warp order
        const int nt = i / 128, ln = i / 4 % 32, e = i % 4;
        float sum = partial[0][nt][ln][e];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) sum += partial[w][nt][ln][e];
        // c0, c1: row g, tokens 2t, 2t+1; c2, c3: row g + 8
        const int token = 8 * nt + 2 * (ln % 4) + e % 2, n = n0 + ln / 4 + 8 * (e / 2);
        if (token < M) Y[(size_t)token * N + n] = sum;
    }
}

}  // namespace lucegen
