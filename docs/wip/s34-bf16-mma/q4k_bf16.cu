// (session 34 lab prototype, kept in git history only: see docs/design.md, session 34; run from a lab copy of the
// tree as `python3 ../bf16/bench.py` next to this file)
// Lab prototype: Q4_K rows (GGUF bytes as loaded) x bf16 activations on bf16 tensor cores (mma m16n8k16, fp32
// accumulators), the weights decoded to bf16 in registers (magic-number nibbles, scale and min per 32 values):
// no per-piece fp32 terms. Block: RT row tiles of 16 rows x MT activation rows; KS warps split K (super-block
// s of a stage to warp s % KS); a stage holds KS super-blocks of every row and the activations over them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define DEV __device__ __forceinline__

DEV unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
DEV void cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
DEV void commit() { asm volatile("cp.async.commit_group;"); }
template <int N> DEV void wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

DEV void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DEV unsigned bf2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
DEV unsigned hsub2(unsigned a, unsigned b) {
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<unsigned*>(&r);
}
// a * so.lo + so.hi, both halves (the scale and the offset broadcast by the instruction's operand selectors)
DEV unsigned scale2(unsigned a, unsigned so) {
    const __nv_bfloat162 p = *reinterpret_cast<__nv_bfloat162*>(&so);
    __nv_bfloat162 r = __hfma2(*reinterpret_cast<__nv_bfloat162*>(&a), __low2bfloat162(p), __high2bfloat162(p));
    return *reinterpret_cast<unsigned*>(&r);
}

constexpr int SB_BYTES = 144, SB_VALUES = 256;
constexpr unsigned MAGIC = 0x43004300u;  // bf16 128.0 twice: 128 + q for q < 128 in the low mantissa bits

// The lane's 4 consecutive values (bytes 4t..4t+3 of a 16-byte half-chunk, low or high nibbles) as two bf16x2
// of 128 + q: (values 0, 1) and (values 2, 3).
DEV void nibbles(unsigned word, unsigned& p01, unsigned& p23) {
    p01 = (__byte_perm(word, 0, 0x4140) & 0x000F000Fu) | MAGIC;
    p23 = (__byte_perm(word, 0, 0x4342) & 0x000F000Fu) | MAGIC;
}

// Sub-block j's 6-bit scale and min of a Q4_K super-block (scales: its 12 bytes as 3 words).
DEV void scale_min(const unsigned (&sc)[3], int j, int& s, int& m) {
    const auto byte = [&](int i) { return static_cast<int>((sc[i / 4] >> (8 * (i % 4))) & 0xFF); };
    if (j < 4) {
        s = byte(j) & 63, m = byte(j + 4) & 63;
    } else {
        s = (byte(j + 4) & 0xF) | ((byte(j - 4) >> 6) << 4);
        m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
    }
}

// The same, sub-block j a runtime index (a lane's own).
DEV void scale_min_at(uint4 h, int j, int& s, int& m) {
    const auto byte = [&](int i) {
        const unsigned w = i < 4 ? h.y : (i < 8 ? h.z : h.w);
        return static_cast<int>((w >> (8 * (i % 4))) & 0xFF);
    };
    if (j < 4) {
        s = byte(j) & 63, m = byte(j + 4) & 63;
    } else {
        s = (byte(j + 4) & 0xF) | ((byte(j - 4) >> 6) << 4);
        m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
    }
}

template <int MT, int RT, int KS, int STAGES>
struct Geo {
    static constexpr int ROWS = 16 * RT, NT = MT / 8, WARPS = RT * KS, THREADS = 32 * WARPS;
    static constexpr int W_SLOT = KS * SB_BYTES + ((KS * SB_BYTES / 16) % 2 ? 0 : 16);  // odd 16-byte words
    static constexpr int X_BYTES = KS * SB_VALUES * 2;
    static constexpr int X_SLOT = X_BYTES + 32;  // rows 8 words apart mod 32 banks: a fragment's 8-byte loads
    static constexpr int STAGE = ROWS * W_SLOT + MT * X_SLOT;
    static constexpr int RING = STAGES * STAGE;
    static constexpr int RED = (KS - 1) * RT * NT * 32 * 4 * 4;
    static constexpr int SCALES = WARPS * 16 * 8 * 4;  // a warp's 16 rows x 8 sub-blocks of (s, o) bf16 pairs
    static constexpr int SMEM = RING + SCALES > RED ? RING + SCALES : RED;
};

// W [N, K] Q4_K rows, X [M, K] bf16, Y [M, N] fp32. N a multiple of 16 RT, K of 256 KS.
template <int MT, int RT, int KS, int STAGES, int SHARE>
__device__ void q4k_bf16(const unsigned char* __restrict__ W, const __nv_bfloat16* __restrict__ X,
                         float* __restrict__ Y, int N, int K, int M) {
    using G = Geo<MT, RT, KS, STAGES>;
    extern __shared__ __align__(16) unsigned char smem[];
    const int mtiles = (M + MT - 1) / MT;
    const int m0 = (blockIdx.x % mtiles) * MT, r0 = (blockIdx.x / mtiles) * G::ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int rt = warp % RT, kq = warp / RT;
    const long long row_bytes = (long long)K / SB_VALUES * SB_BYTES;
    const int stages_k = K / (SB_VALUES * KS);
    constexpr int W_WORDS = KS * SB_BYTES / 16, X_WORDS = G::X_BYTES / 16;
    // Copies worked out once: W_TPR threads a weight row (words wt + W_TPR u), X_TPR an activation row.
    constexpr int W_TPR = G::THREADS / G::ROWS, W_PER = (W_WORDS + W_TPR - 1) / W_TPR;
    constexpr int XP = MT <= 8 ? 8 : (MT <= 16 ? 16 : 32), X_TPR = G::THREADS / XP, X_PER = X_WORDS / X_TPR;
    static_assert(G::THREADS % G::ROWS == 0 && X_WORDS % X_TPR == 0, "whole copies");
    const int wrow = threadIdx.x / W_TPR, wt = threadIdx.x % W_TPR;
    const int xrow = threadIdx.x / X_TPR, xt = threadIdx.x % X_TPR;
    const unsigned char* w_src = W + (long long)(r0 + wrow) * row_bytes + 16 * wt;
    const unsigned w_dst = smem_u32(smem) + wrow * G::W_SLOT + 16 * wt;
    const unsigned char* x_src =
        reinterpret_cast<const unsigned char*>(X + (long long)min(m0 + xrow, M - 1) * K) + 16 * xt;
    const unsigned x_dst = smem_u32(smem) + G::ROWS * G::W_SLOT + xrow * G::X_SLOT + 16 * xt;
    const auto issue = [&](int s) {
        if (s < stages_k) {
            const unsigned st = (s % STAGES) * G::STAGE;
            const long long wo = (long long)s * KS * SB_BYTES, xo = (long long)s * G::X_BYTES;
#pragma unroll
            for (int u = 0; u < W_PER; ++u)
                if (wt + W_TPR * u < W_WORDS) cp16(w_dst + st + 16 * W_TPR * u, w_src + wo + 16 * W_TPR * u);
            if (xrow < MT)
#pragma unroll
                for (int u = 0; u < X_PER; ++u) cp16(x_dst + st + 16 * X_TPR * u, x_src + xo + 16 * X_TPR * u);
        }
        commit();
    };
    float acc[G::NT][4];
#pragma unroll
    for (int n = 0; n < G::NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    const int nts = min(G::NT, (M - m0 + 7) / 8);
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
#pragma unroll 1
    for (int s = 0; s < stages_k; ++s) {
        wait_group<STAGES - 2>();
        __syncthreads();
        issue(s + STAGES - 1);
        const unsigned char* st = smem + (s % STAGES) * G::STAGE;
        // the warp's super-block kq of the stage, rows 16 rt + g and + 8
        const unsigned char* wr[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) wr[i] = st + (16 * rt + g + 8 * i) * G::W_SLOT + kq * SB_BYTES;
        const unsigned char* xs = st + G::ROWS * G::W_SLOT + kq * SB_VALUES * 2;
        // scales: s_j = d sc_j, o_j = -dmin m_j per row, as bf16 pairs
        unsigned so[2][8];  // (s_j, o_j) as a bf16 pair
        if constexpr (SHARE) {  // each (row, sub-block) pair made once by one lane of the warp, read by its 4
            unsigned* sw = reinterpret_cast<unsigned*>(smem + G::RING + warp * 512);
            __syncwarp();  // the last super-block's reads are done
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int row = lane / 8 + 4 * u, j = lane % 8;
                const uint4 h = *reinterpret_cast<const uint4*>(st + (16 * rt + row) * G::W_SLOT + kq * SB_BYTES);
                const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x & 0xFFFF)));
                const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x >> 16)));
                int a, b;
                scale_min_at(h, j, a, b);
                const float sv = d * static_cast<float>(a), ov = -dmin * static_cast<float>(b);
                sw[row * 8 + j] = bf2(sv, ov);
            }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const uint4 v = *reinterpret_cast<const uint4*>(sw + (g + 8 * i) * 8 + 4 * q);
                    so[i][4 * q] = v.x, so[i][4 * q + 1] = v.y, so[i][4 * q + 2] = v.z, so[i][4 * q + 3] = v.w;
                }
        } else {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const uint4 h = *reinterpret_cast<const uint4*>(wr[i]);
                const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x & 0xFFFF)));
                const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x >> 16)));
                const unsigned sc[3] = {h.y, h.z, h.w};
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    int a, b;
                    scale_min(sc, j, a, b);
                    const float sv = d * static_cast<float>(a), ov = -dmin * static_cast<float>(b);
                    so[i][j] = bf2(sv, ov);
                }
            }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c)  // 32-byte group c of qs: sub-blocks 2c (low nibbles), 2c + 1 (high)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {  // its half: values 16 hf .. 16 hf + 15 of each sub-block
                unsigned wlo[2], whi[2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const unsigned w = *reinterpret_cast<const unsigned*>(wr[i] + 16 + 32 * c + 16 * hf + 4 * t);
                    wlo[i] = w, whi[i] = w >> 4;
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int j = 2 * c + h;
                    unsigned a[4];
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        unsigned p01, p23;
                        nibbles(h ? whi[i] : wlo[i], p01, p23);
                        a[i] = scale2(hsub2(p01, MAGIC), so[i][j]);      // (row g + 8 i, slots 2t, 2t+1)
                        a[2 + i] = scale2(hsub2(p23, MAGIC), so[i][j]);  // (slots 2t + 8, 2t + 9)
                    }
                    const int k0 = 32 * j + 16 * hf + 4 * t;  // the lane's values in the super-block
#pragma unroll
                    for (int n = 0; n < G::NT; ++n) {
                        if (n >= nts) break;
                        const uint2 b = *reinterpret_cast<const uint2*>(xs + (8 * n + g) * G::X_SLOT + 2 * k0);
                        mma_bf16(acc[n], a, b.x, b.y);
                    }
                }
            }
    }
    wait_group<0>();
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem);
    if (kq > 0)
#pragma unroll
        for (int n = 0; n < G::NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[(((kq - 1) * RT + rt) * G::NT + n) * 128 + e * 32 + lane] = acc[n][e];
    __syncthreads();
    if (kq == 0)
#pragma unroll
        for (int n = 0; n < G::NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = acc[n][e];
                for (int q = 1; q < KS; ++q) v += red[(((q - 1) * RT + rt) * G::NT + n) * 128 + e * 32 + lane];
                const int row = r0 + 16 * rt + g + 8 * (e / 2), m = m0 + 8 * n + 2 * t + e % 2;
                if (m < M && row < N) Y[(long long)m * N + row] = v;
            }
}

#define KERNEL(MT, RT, KS, ST, SH)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * RT * KS)                                              \
        q4k_bf16_m##MT##_r##RT##_k##KS##_s##ST##_h##SH(const unsigned char* W, const __nv_bfloat16* X, float* Y, \
                                                       int N, int K, int M) {                               \
        q4k_bf16<MT, RT, KS, ST, SH>(W, X, Y, N, K, M);                                                     \
    }
KERNEL(16, 4, 2, 3, 0)
KERNEL(16, 4, 2, 3, 1)
KERNEL(16, 2, 4, 3, 1)
KERNEL(16, 2, 4, 2, 1)
KERNEL(8, 2, 4, 2, 1)
KERNEL(24, 4, 2, 3, 0)
KERNEL(24, 4, 2, 3, 1)
KERNEL(8, 4, 2, 3, 0)
KERNEL(8, 4, 2, 3, 1)
