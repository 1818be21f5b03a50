// h16 (session 52 prototype, speed only): Q4_K rows repacked at load for fp16 mma.sync m16n8k16, Marlin's way, one
// kernel for M = 1 .. 24 (the same arithmetic for every M: a token's outputs do not depend on the others).
//
// Layout, per (row tile of 16 rows, super-block of 256 values), TSB bytes:
//   2048 bytes of nibbles, as words [c 0..3][lane 0..31][i 0..3]: word (c, lane, i) holds k16 step kk = 4c + i of
//     lane (g, t): nibble 0 row g value 16kk + 2t, 4 row g value 16kk + 2t + 1, 1 and 5 row g + 8 the same values,
//     2 / 6 row g values 16kk + 2t + 8 / + 9, 3 / 7 row g + 8 those: so (w & 0x000f000f) | 0x64006400 is mma's
//     a0 as two halves 1024 + q, (w & 0x00f000f0) | .. a1 as 1024 + 16 q, and the same of w >> 8 a2 and a3.
//   256 bytes of scales: [pair g 0..7][sub-block j 0..7] words sc_j(g) | m_j(g) << 8 | sc_j(g+8) << 16 |
//     m_j(g+8) << 24,
//   64 bytes: [pair g] (d_g, d_g+8) and (dmin_g, dmin_g+8) as half2.
// A weight is fl16(q fl16(d sc) - fl16(dmin m)): one rounding after exact q (1024 + q less 1024, or (1024 + 16 q) / 16
// less 64) and the two scales.
#include <cuda_fp16.h>

constexpr int SBV = 256, NIB = 2048, SCL = 256, DMS = 64, TSB = NIB + SCL + DMS;

__device__ __forceinline__ unsigned lop_magic(unsigned w, unsigned mask) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(mask), "r"(0x64006400u));  // (w & mask) | magic
    return r;
}
__device__ __forceinline__ __half2 h2(unsigned u) { return *reinterpret_cast<__half2*>(&u); }
__device__ __forceinline__ unsigned u32(__half2 h) { return *reinterpret_cast<unsigned*>(&h); }

__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool real) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(real ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

struct SB {  // a lane's super-block of its tile: 4 nibble quads, its pair's 8 scale words, its d's
    uint4 nib[4];
    uint4 sc[2];
    uint2 dm;
};

__device__ __forceinline__ SB load_sb(const unsigned char* tsb, int lane) {
    SB r;
    const uint4* n = reinterpret_cast<const uint4*>(tsb);
#pragma unroll
    for (int c = 0; c < 4; ++c) r.nib[c] = __ldg(n + 32 * c + lane);
    const uint4* s = reinterpret_cast<const uint4*>(tsb + NIB) + 2 * (lane / 4);
    r.sc[0] = __ldg(s), r.sc[1] = __ldg(s + 1);
    r.dm = __ldg(reinterpret_cast<const uint2*>(tsb + NIB + SCL) + lane / 4);
    return r;
}

// X_PITCH: an activation row's halves in a stage (256 + 8: rows 16 bytes apart mod 128, ldmatrix without conflicts)
constexpr int X_PITCH = SBV + 8;

// Y[ks][m][n] (ks: blockIdx.y's part of K) = the sum over the block's super-blocks of W[n] . X[m].
// Block: WARPS warps, warp w the row tile blockIdx.x * WARPS + w; X's super-blocks through a ring of STAGES.
template <int MT, int WARPS, int STAGES>
__device__ void h16_gemm(const unsigned char* __restrict__ W, const __half* __restrict__ X, float* __restrict__ Y,
                         int N, int M, int K, int ksplit) {
    constexpr int NT = MT / 8, THREADS = 32 * WARPS;
    extern __shared__ __align__(128) unsigned char smem[];
    __half* xs = reinterpret_cast<__half*>(smem);  // [STAGES][MT][X_PITCH]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int SBS = K / SBV;
    const int sb0 = static_cast<int>((long long)SBS * blockIdx.y / ksplit);
    const int sb1 = static_cast<int>((long long)SBS * (blockIdx.y + 1) / ksplit);
    const int tile = blockIdx.x * WARPS + warp, tiles = (N + 15) / 16;
    const unsigned char* wt = W + ((long long)min(tile, tiles - 1) * SBS) * TSB;

    // X super-block s into stage s % STAGES: MT rows x 512 bytes, 32 words a row, rows past M zeros. A thread's
    // copies (C of them) are worked out once: word c = threadIdx.x + THREADS i.
    constexpr int C = (MT * 32 + THREADS - 1) / THREADS;
    const __half* xsrc[C];
    unsigned xdst[C];
    bool xreal[C], xuse[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
        const int c = threadIdx.x + THREADS * i, m = c / 32, w = c % 32;
        xuse[i] = c < MT * 32, xreal[i] = m < M;
        xsrc[i] = X + (long long)min(m, M - 1) * K + 8 * w;
        xdst[i] = smem_u32(xs + min(m, MT - 1) * X_PITCH + 8 * w);
    }
    const auto issue = [&](int s) {
        if (s < sb1) {
            const unsigned off = (s % STAGES) * MT * X_PITCH * 2;
#pragma unroll
            for (int i = 0; i < C; ++i)
                if (xuse[i]) cp_async16(xdst[i] + off, xsrc[i] + s * SBV, xreal[i]);
        }
        cp_commit();
    };
    asm volatile("griddepcontrol.wait;" ::: "memory");  // X (and the parts' buffer) as the kernel before left them
    for (int s = sb0; s < sb0 + STAGES - 1; ++s) issue(s);

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;

    const __half2 k1024 = __float2half2_rn(1024.f), k16 = __float2half2_rn(0.0625f), km64 = __float2half2_rn(-64.f);
    // ldmatrix x4: lanes 8i .. 8i+7 address matrix i's rows: n-tile rows g8 = lane % 8, values 8 (i % 2) of k16 step
    // 2 (..) + i / 2: one x4 gives b0, b1 of two k16 steps
    const int lrow = lane % 8, lcol = 8 * (lane / 8);  // matrices: (k 0-7, step a), (8-15, a), (0-7, a+1), (8-15, a+1)
    const unsigned xlane = smem_u32(xs + lrow * X_PITCH + lcol);
    // super-block s from `cur` (its weights loaded one super-block ahead, into the other buffer)
    const auto step = [&](const SB& cur, int s) {
        cp_wait<STAGES - 2>();
        __syncthreads();
        issue(s + STAGES - 1);
        const unsigned xst = xlane + (s % STAGES) * MT * X_PITCH * 2;  // this lane's ldmatrix row in the stage
        const __half2 d2 = h2(cur.dm.x), dm2 = h2(cur.dm.y);
        const __half2 nd2 = __hmul2(d2, __hneg2(k1024)), pdm2 = __hmul2(dm2, k1024);
        const unsigned scw[8] = {cur.sc[0].x, cur.sc[0].y, cur.sc[0].z, cur.sc[0].w,
                                 cur.sc[1].x, cur.sc[1].y, cur.sc[1].z, cur.sc[1].w};
        const unsigned nw[16] = {cur.nib[0].x, cur.nib[0].y, cur.nib[0].z, cur.nib[0].w,
                                 cur.nib[1].x, cur.nib[1].y, cur.nib[1].z, cur.nib[1].w,
                                 cur.nib[2].x, cur.nib[2].y, cur.nib[2].z, cur.nib[2].w,
                                 cur.nib[3].x, cur.nib[3].y, cur.nib[3].z, cur.nib[3].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // sub-block j: k16 steps 2j, 2j + 1
            // bytes 0 / 2 (sc) or 1 / 3 (m) of the word under 0x64: the halves 1024 + sc, 1024 + m of rows g, g + 8
            const __half2 s2 = __hfma2(h2(__byte_perm(scw[j], 0x64u, 0x4240u)), d2, nd2);          // (s_g, s_g8)
            const __half2 no2 = __hfma2(h2(__byte_perm(scw[j], 0x64u, 0x4341u)), __hneg2(dm2), pdm2);  // -(o)
            const __half2 sg = __low2half2(s2), ng = __low2half2(no2);
            const __half2 sg8 = __high2half2(s2), ng8 = __high2half2(no2);
            unsigned b[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                ldsm_x4(b[nt], xst + 2 * ((8 * nt) * X_PITCH + 32 * j));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned w = nw[2 * j + h], w8 = w >> 8;
                unsigned a[4];
                a[0] = u32(__hfma2(__hsub2(h2(lop_magic(w, 0x000F000Fu)), k1024), sg, ng));
                a[1] = u32(__hfma2(__hfma2(h2(lop_magic(w, 0x00F000F0u)), k16, km64), sg8, ng8));
                a[2] = u32(__hfma2(__hsub2(h2(lop_magic(w8, 0x000F000Fu)), k1024), sg, ng));
                a[3] = u32(__hfma2(__hfma2(h2(lop_magic(w8, 0x00F000F0u)), k16, km64), sg8, ng8));
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma16816(acc[nt], a, b[nt][2 * h], b[nt][2 * h + 1]);
            }
        }
    };
    SB a = load_sb(wt + (long long)sb0 * TSB, lane), b;
    int s = sb0;
#pragma unroll 1
    for (; s + 1 < sb1; s += 2) {
        b = load_sb(wt + (long long)(s + 1) * TSB, lane);
        step(a, s);
        if (s + 2 < sb1) a = load_sb(wt + (long long)(s + 2) * TSB, lane);
        step(b, s + 1);
    }
    if (s < sb1) step(a, s);
    const int r = 16 * tile + g;
    float* y = Y + (long long)blockIdx.y * M * N;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int m = 8 * nt + 2 * t + e % 2, row = r + 8 * (e / 2);
            if (m < M && row < N && tile < tiles) y[(long long)m * N + row] = acc[nt][e];
        }
}

// The parts of K added in order (ksplit > 1).
extern "C" __global__ void h16_reduce(const float* __restrict__ parts, float* __restrict__ y, int n, int ksplit) {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the parts are the kernel before's (programmatic streams)
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = parts[i];
        for (int k = 1; k < ksplit; ++k) v += parts[(long long)k * n + i];
        y[i] = v;
    }
}

#define H16(MT, WARPS, STAGES)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) h16_m##MT##_w##WARPS##_s##STAGES(                  \
        const unsigned char* W, const __half* X, float* Y, int N, int M, int K, int ksplit) {                  \
        h16_gemm<MT, WARPS, STAGES>(W, X, Y, N, M, K, ksplit);                                                 \
    }
H16(8, 8, 3)
H16(16, 8, 3)
H16(24, 8, 3)
H16(8, 4, 3)
H16(16, 4, 3)
H16(24, 4, 3)
