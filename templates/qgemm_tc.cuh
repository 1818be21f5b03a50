// qgemm_tc.cuh: Y = X W^T for Q4_K weights W [N, K] and fp16 activations X [M, K], on fp16 tensor cores (mma.sync
// m16n8k16, fp32 sums): one kernel for every M, the decode GEMV (M = 1) and the GEMM of a tree verify alike,
// batch-invariant (a token's outputs do not depend on M or on its place in a tile: each mma column is its own
// token's, and nothing else is summed across tokens), so that a verify row equals the decode row by construction.
// docs/design.md, sessions 9-10 (the first design), 52-53 (this layout), has the measurements.
//
// The weights are the mma's A operand (16 rows a tile), the tokens its B (8 a tile). W is repacked at load
// (lucegen/kernels/qgemm_tc.py's repack), Marlin's way, so that a lane's A fragments come out of one word each: per
// row tile of 16 rows and super-block of 256 values, TC_SB_BYTES bytes:
//   [0, 2048)     the nibbles as words [c 0..3][lane 0..31][i 0..3]: word (c, lane, i) holds k16 step kk = 4c + i of
//                 lane (g, t) = (lane / 4, lane % 4): nibbles 0 / 4 row g values 16kk + 2t / + 1, 1 / 5 row g + 8
//                 the same values, 2 / 6 row g values 16kk + 2t + 8 / + 9, 3 / 7 row g + 8 those. So
//                 (w & 0x000F000F) | 0x64006400 is the mma's a0 as the two halves 1024 + q, (w & 0x00F000F0) | ..
//                 a1 as 1024 + 16 q, and the same of w >> 8 a2 and a3.
//   [2048, 2304)  the scales and mins as words [pair g 0..7][sub-block j 0..7]: sc_j(g) | m_j(g) << 8 |
//                 sc_j(g + 8) << 16 | m_j(g + 8) << 24 (6 bits each)
//   [2304, 2368)  [pair g] (d_g, d_g+8) and (dmin_g, dmin_g+8) as half2
// A weight is fl16(q s + b), s = fl16(d sc), b = fl16(-(dmin m)): q exact first (1024 + q less 1024, or
// (1024 + 16 q) / 16 less 64), then one HFMA2, one rounding (folding the 1024 into b would round away half a step);
// s and b by one HFMA2 each from the bytes put under 0x64 (1024 + sc) against d and -1024 d. The weights are
// qgemm_tc.py's dequantize_fp16 bit for bit.
//
// A launch: grid (ceil(N / 16 / WARPS), KSPLIT); warp w of block (x, y) takes row tile x WARPS + w over the
// y-th of KSPLIT shares of K's super-blocks, its weights straight into registers one super-block ahead, X's
// super-blocks through a ring of STAGES in shared memory (cp.async; rows past M zero-filled), B fragments by
// ldmatrix. KSPLIT 1 stores Y = the sums times the token's scale S (qgemm_tc_x16); else each share stores its sums
// in parts and qgemm_tc_reduce adds them in share order. KSPLIT is the shape's (qgemm_tc.py's ksplit), never M's.
#pragma once
#include <cuda_fp16.h>

#include "common.cuh"
#include "mma.cuh"

namespace lucegen {

constexpr int TC_SB_VALUES = 256, TC_NIB_BYTES = 2048, TC_SCALE_BYTES = 256, TC_D_BYTES = 64;
constexpr int TC_SB_BYTES = TC_NIB_BYTES + TC_SCALE_BYTES + TC_D_BYTES;
constexpr int TC_X_PITCH = TC_SB_VALUES + 8;  // an X row's halves in a stage: rows 16 bytes apart mod 128 (ldmatrix)

// X's rows go to fp16 scaled by 2^-e, e = this of the row's largest |x|: the least e >= 0 that brings it below 2^15,
// so that no activation overflows fp16 (65504); the product's row is multiplied by 2^e, exactly. A power of two
// changes no rounding in fp16's normal range, and e depends on the token's own row alone (batch invariance).
__device__ __forceinline__ int qgemm_x_exponent(float most) {
    int ex;
    frexpf(most, &ex);  // most = f 2^ex, f in [0.5, 1)
    return min(max(ex - 15, 0), 126);
}

__device__ __forceinline__ __half2 as_half2(unsigned u) { return *reinterpret_cast<const __half2*>(&u); }
__device__ __forceinline__ unsigned as_u32(__half2 h) { return *reinterpret_cast<const unsigned*>(&h); }

// (w & mask) | 0x64006400 in one LOP3: the masked nibbles under fp16's 1024
__device__ __forceinline__ unsigned tc_magic(unsigned w, unsigned mask) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(mask), "r"(0x64006400u));
    return r;
}

// A lane's share of a row tile's super-block: its 16 nibble words, its row pair's 8 scale words, its d's.
struct TcSuperBlock {
    uint4 nib[4];
    uint4 sc[2];
    uint2 dm;

    __device__ __forceinline__ void load(const unsigned char* sb, int lane) {
        const uint4* n = reinterpret_cast<const uint4*>(sb);
#pragma unroll
        for (int c = 0; c < 4; ++c) nib[c] = __ldg(n + 32 * c + lane);
        const uint4* s = reinterpret_cast<const uint4*>(sb + TC_NIB_BYTES) + 2 * (lane / 4);
        sc[0] = __ldg(s), sc[1] = __ldg(s + 1);
        dm = __ldg(reinterpret_cast<const uint2*>(sb + TC_NIB_BYTES + TC_SCALE_BYTES) + lane / 4);
    }

    // The 4 A registers of k16 step kk (rows g, g + 8) with sub-block scales (s_g, s_g8) and biases (b_g, b_g8).
    __device__ __forceinline__ void step_a(int kk, __half2 sg, __half2 bg, __half2 sg8, __half2 bg8,
                                           unsigned (&a)[4]) const {
        const __half2 k1024 = __float2half2_rn(1024.f), k16 = __float2half2_rn(0.0625f), km64 = __float2half2_rn(-64.f);
        const uint4& q = nib[kk / 4];
        const unsigned w = kk % 4 == 0 ? q.x : kk % 4 == 1 ? q.y : kk % 4 == 2 ? q.z : q.w, w8 = w >> 8;
        a[0] = as_u32(__hfma2(__hsub2(as_half2(tc_magic(w, 0x000F000Fu)), k1024), sg, bg));
        a[1] = as_u32(__hfma2(__hfma2(as_half2(tc_magic(w, 0x00F000F0u)), k16, km64), sg8, bg8));
        a[2] = as_u32(__hfma2(__hsub2(as_half2(tc_magic(w8, 0x000F000Fu)), k1024), sg, bg));
        a[3] = as_u32(__hfma2(__hfma2(as_half2(tc_magic(w8, 0x00F000F0u)), k16, km64), sg8, bg8));
    }
};

template <int NT, int WARPS, int STAGES>
__device__ void qgemm_tc(const unsigned char* __restrict__ W, const __half* __restrict__ X,
                         const float* __restrict__ S, float* __restrict__ Y, float* __restrict__ parts, int M, int N,
                         int K, int ldy) {
    constexpr int MT = 8 * NT, THREADS = 32 * WARPS;
    extern __shared__ __align__(128) unsigned char smem[];
    __half* const xs = reinterpret_cast<__half*>(smem);  // [STAGES][MT][TC_X_PITCH]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int blocks = K / TC_SB_VALUES, ksplit = gridDim.y;
    const int s0 = static_cast<int>((long long)blocks * blockIdx.y / ksplit);
    const int s1 = static_cast<int>((long long)blocks * (blockIdx.y + 1) / ksplit);
    const int tiles = (N + 15) / 16, tile = blockIdx.x * WARPS + warp;
    const unsigned char* const wt = W + (size_t)min(tile, tiles - 1) * blocks * TC_SB_BYTES;

    TcSuperBlock cur, next;
    cur.load(wt + (size_t)s0 * TC_SB_BYTES, lane);  // weights: no kernel writes them, so before the wait
    follow_prior_grids();                            // X, S and the parts as the kernels before left them

    // X's super-block s into stage s % STAGES: MT rows of 32 16-byte words, rows past M zeros. A thread's copies
    // (COPIES of them: word c = threadIdx.x + THREADS i) are worked out once.
    constexpr int COPIES = (MT * 32 + THREADS - 1) / THREADS;
    const __half* xsrc[COPIES];
    unsigned xdst[COPIES];
    bool xreal[COPIES], xuse[COPIES];
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
        const int c = threadIdx.x + THREADS * i, m = c / 32, w = c % 32;
        xuse[i] = c < MT * 32, xreal[i] = m < M;
        xsrc[i] = X + (size_t)min(m, M - 1) * K + 8 * w;
        xdst[i] = shared_addr(xs + min(m, MT - 1) * TC_X_PITCH + 8 * w);
    }
    const auto issue = [&](int s) {
        if (s < s1) {
            const unsigned off = (s % STAGES) * MT * TC_X_PITCH * 2;
#pragma unroll
            for (int i = 0; i < COPIES; ++i)
                if (xuse[i]) cp_async16(xdst[i] + off, xsrc[i] + (size_t)s * TC_SB_VALUES, xreal[i]);
        }
        cp_async_commit();  // empty past the share: every step waits on the same group count
    };
#pragma unroll
    for (int s = s0; s < s0 + STAGES - 1; ++s) issue(s);

    float acc[NT][4] = {};
    // ldmatrix x4, lanes 8i .. 8i+7 address matrix i: token rows lane % 8 of an n-tile, values 8 (i % 2) .. of k16
    // step 2j + i / 2, so one x4 gives b0, b1 of the sub-block's two steps
    const __half* const xlane = xs + (lane % 8) * TC_X_PITCH + 8 * (lane / 8);
    const auto multiply = [&](const TcSuperBlock& sb, int s) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // every thread's copies of s have landed; every warp is done with s - 1's stage
        issue(s + STAGES - 1);
        const __half* const xst = xlane + (s % STAGES) * MT * TC_X_PITCH;
        const __half2 d2 = as_half2(sb.dm.x), dmin2 = as_half2(sb.dm.y);
        const __half2 nd2 = __hmul2(d2, __float2half2_rn(-1024.f)), pdmin2 = __hmul2(dmin2, __float2half2_rn(1024.f));
        const unsigned scw[8] = {sb.sc[0].x, sb.sc[0].y, sb.sc[0].z, sb.sc[0].w,
                                 sb.sc[1].x, sb.sc[1].y, sb.sc[1].z, sb.sc[1].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // sub-block j: k16 steps 2j, 2j + 1
            // bytes 0 / 2 (sc) or 1 / 3 (m) of the word under 0x64: 1024 + sc, 1024 + m of rows g, g + 8
            const __half2 s2 = __hfma2(as_half2(__byte_perm(scw[j], 0x64u, 0x4240u)), d2, nd2);
            const __half2 b2 = __hfma2(as_half2(__byte_perm(scw[j], 0x64u, 0x4341u)), __hneg2(dmin2), pdmin2);
            const __half2 sg = __low2half2(s2), bg = __low2half2(b2), sg8 = __high2half2(s2), bg8 = __high2half2(b2);
            unsigned b[NT][2][2];  // [n-tile][step 2j + h][b0, b1]
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                unsigned r[4];
                ldmatrix_x4(r, xst + 8 * nt * TC_X_PITCH + 32 * j);
                b[nt][0][0] = r[0], b[nt][0][1] = r[1], b[nt][1][0] = r[2], b[nt][1][1] = r[3];
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                unsigned a[4];
                sb.step_a(2 * j + h, sg, bg, sg8, bg8, a);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_f16(acc[nt], a, b[nt][h]);
            }
        }
    };
    int s = s0;
#pragma unroll 1
    for (; s + 1 < s1; s += 2) {
        next.load(wt + (size_t)(s + 1) * TC_SB_BYTES, lane);
        multiply(cur, s);
        if (s + 2 < s1) cur.load(wt + (size_t)(s + 2) * TC_SB_BYTES, lane);
        multiply(next, s + 1);
    }
    if (s < s1) multiply(cur, s);

    if (tile >= tiles) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // c0, c1: row g, tokens 2t, 2t + 1; c2, c3: row g + 8
            const int m = 8 * nt + 2 * t + e % 2, n = 16 * tile + g + 8 * (e / 2);
            if (m >= M || n >= N) continue;
            if (ksplit == 1) Y[(size_t)m * ldy + n] = acc[nt][e] * S[m];
            else parts[((size_t)blockIdx.y * M + m) * N + n] = acc[nt][e];
        }
}

}  // namespace lucegen
