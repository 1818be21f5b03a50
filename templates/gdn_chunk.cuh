// gdn_chunk.cuh: the chunked gated delta rule of the prefill (chunks of 64 tokens, WY form, tensor cores), and the
// gated RMSNorm of its output.
//
// Per value head (q, k l2-normalised in fp32, q scaled by dk^-1/2; c = inclusive cumsum of the log-decay g in the
// chunk; P[i][j] = exp(c_i - c_j) for j <= i):
//     A = strictly_lower((beta k) k^T o P),  T = (I + A)^-1,  Aqk = lower(q k^T o P)
//     per chunk, from the state S [dk, dv]:
//       v' = T (beta o (v - e^c o (k S)))            (= U - W S of the reference, with U = T beta v, W = T beta e^c k)
//       o  = e^c o (q S) + Aqk v'
//       S  = e^(c_last) S + (e^(c_last - c) o k)^T v'
// Two kernels. gdn_prep, parallel over (chunk, value head): norms, cumsum, A and Aqk (bf16 mma on the raw bf16 q, k:
// exact products), T by blocked forward substitution in fp32, written to scratch (T and Aqk rounded to tf32, the
// scan's operands) with the per-token factors. gdn_scan, parallel over (value head, BV-column slice of dv) -- the
// columns of S are independent -- walks the chunks in order with its state slice in registers (a grid of one wave:
// 8 warps in two roles, the state update and the output beside it); its products with S, v' and T use tf32 mma (fp32 operands
// rounded to 10-bit mantissas, fp32 accumulation; q and k are bf16, exact in tf32), the state itself is only ever
// accumulated in fp32.
//
// Layouts: qkv [T][CW] bf16 after conv + SiLU (q heads, k heads, v heads: value head h reads key head h / (HV/HK));
// g, beta [T][HV] fp32; the recurrent state [HV][DV][DK] fp32 (S transposed: column j of S is DK consecutive floats,
// the decode path's layout); o [T][HV][DV] fp32. Scratch per (chunk n, head h): wy (T) and aqk [64][64] fp32,
// fac [5][64] fp32 = beta, a = e^c |k|^-1, qf = e^c |q|^-1 dk^-1/2, kf = e^(c_last - c) |k|^-1, and [4][0] = e^c_last
// (|x|^-1 meaning 1 / sqrt(sum x^2 + 1e-6), the l2norm of HF and FLA).
#pragma once
#include "activation.cuh"
#include "conv1d.cuh"
#include "mma.cuh"

namespace lucegen {

constexpr int GDN_BT = 64;        // tokens per chunk
constexpr int GDN_MAT_LD = 68;    // padded row of a 64 x 64 fp32 matrix in shared memory (conflict-free fragments)
constexpr int GDN_FAC = 5 * 64;   // floats of per-token factors per (chunk, head)

template <int DK_, int DV_, int HK_, int HV_>
struct GdnShape {
    static constexpr int DK = DK_, DV = DV_, HK = HK_, HV = HV_;
    static constexpr int KD = HK * DK;           // width of the q (and of the k) block of a qkv row
    static constexpr int CW = 2 * KD + HV * DV;  // a qkv row
    static constexpr int RATIO = HV / HK;        // value heads per key head
    static_assert(DK % 64 == 0 && DK <= 256 && DV % 32 == 0 && HV % HK == 0, "GDN head shape");
};

// Where chunk n of value head h keeps its scratch, and the qkv columns of its q, k and v.
template <class S>
struct GdnChunk {
    const bf16* q;  // row 0 of the chunk's q (key head h / RATIO); rows are CW apart
    const bf16* k;
    const bf16* v;  // column 0 of value head h
    int t0, valid;  // first token, tokens in the chunk (<= 64)
    size_t scratch; // index of (n, h) in the scratch arrays
    __device__ __forceinline__ GdnChunk(const bf16* qkv, int n, int h, int T) {
        t0 = n * GDN_BT;
        valid = min(GDN_BT, T - t0);
        const bf16* row = qkv + (size_t)t0 * S::CW;
        q = row + (h / S::RATIO) * S::DK;
        k = row + S::KD + (h / S::RATIO) * S::DK;
        v = row + 2 * S::KD + h * S::DV;
        scratch = (size_t)n * S::HV + h;
    }
};

// Copy a 64 x 64 fp32 matrix (global, dense) into padded shared rows.
template <int THREADS>
__device__ __forceinline__ void load_mat64_async(float* dst, const float* src) {
#pragma unroll
    for (int i = threadIdx.x; i < 64 * 16; i += THREADS)
        cp_async16(dst + (i / 16) * GDN_MAT_LD + (i % 16) * 4, src + i * 4, true);
}

// tf32 A fragment (rows row0.., columns k0..k0+7) of a padded 64 x 64 matrix of tf32 values (the prep rounds T and
// Aqk once as it stores them, so the scan's loads are the operands).
__device__ __forceinline__ void mat64_a_frag(unsigned (&a)[4], const float* m, int row0, int k0) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    a[0] = __float_as_uint(m[(row0 + g) * GDN_MAT_LD + k0 + t]);
    a[1] = __float_as_uint(m[(row0 + g + 8) * GDN_MAT_LD + k0 + t]);
    a[2] = __float_as_uint(m[(row0 + g) * GDN_MAT_LD + k0 + t + 4]);
    a[3] = __float_as_uint(m[(row0 + g + 8) * GDN_MAT_LD + k0 + t + 4]);
}

// ---- gdn_prep ------------------------------------------------------------------------------------------------

template <class S>
struct GdnPrepSmem {
    static constexpr int BYTES = 2 * 64 * S::DK * 2 + 2 * 64 * GDN_MAT_LD * 4 + 5 * 64 * 4;
    SwizzledTile<64, S::DK> q, k;
    float* a;                          // [64][GDN_MAT_LD]: A, strictly lower
    float* t;                          // [64][GDN_MAT_LD]: T = (I + A)^-1
    float *g, *beta, *c, *qn, *kn;     // [64] each: log-decay, beta, cumsum, q and k norm factors
    __device__ __forceinline__ explicit GdnPrepSmem(unsigned char* p)
        : q{p}, k{p + 64 * S::DK * 2}, a(reinterpret_cast<float*>(p + 2 * 64 * S::DK * 2)) {
        t = a + 64 * GDN_MAT_LD;
        g = t + 64 * GDN_MAT_LD, beta = g + 64, c = beta + 64, qn = c + 64, kn = qn + 64;
    }
};

// Sum of squares of each of rows 16w .. 16w+15 of a swizzled 64 x DK bf16 tile, in warp w: out(row, sum).
template <int DK, class F>
__device__ __forceinline__ void row_sumsq(SwizzledTile<64, DK> tile, F&& out) {
    constexpr int CPR = DK / 8;  // 16-byte chunks per row; CPR lanes share a row
    static_assert(32 % CPR == 0, "a row is 8, 16 or 32 chunks");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int i = lane; i < 16 * CPR; i += 32) {
        const int r = 16 * warp + i / CPR;
        const uint4 v = *reinterpret_cast<const uint4*>(tile.chunk(r, i % CPR));
        float ss = dot8_bf16(v, v);
#pragma unroll
        for (int o = CPR / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane % CPR == 0) out(r, ss);
    }
}

// The barrier of the prep's warps 0-3 (warps 4-7 leave after the front).
__device__ __forceinline__ void prep_sync() { named_barrier(1, 128); }

// T = (I + A)^-1 for a strictly lower A (64 x 64, padded rows) in fp32, by the block's four warps (FLA's solve_tril):
// warp w inverts diagonal block w by forward substitution (lane l < 16: column l, 16 steps), then the blocks below
// the diagonal follow one distance at a time, T_ij = -T_ii (sum_{k=j}^{i-1} A_ik T_kj), the sum staged in A's unused
// block (j, i) above its diagonal. T is written whole (zeros above the diagonal) to t (64 x 64, padded rows). The
// other 16 lanes of each warp run `side(r)` for r = 16 w .. 16 w + 15 during the diagonal blocks. Ends with
// prep_sync().
template <class F>
__device__ __forceinline__ void unit_lower_inverse(float* a, float* t, F&& side) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d0 = 16 * warp;
    for (int e = lane; e < 16 * (48 - d0); e += 32)  // the blocks right of the diagonal block: zero
        t[(d0 + e / (48 - d0)) * GDN_MAT_LD + d0 + 16 + e % (48 - d0)] = 0.f;
    if (lane < 16) {
        float x[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            const float* row = a + (d0 + r) * GDN_MAT_LD + d0;
            float s = r == lane ? 1.f : 0.f;
#pragma unroll
            for (int m = 0; m < r; ++m) s = fmaf(-row[m], x[m], s);
            x[r] = s;
        }
#pragma unroll
        for (int r = 0; r < 16; ++r) t[(d0 + r) * GDN_MAT_LD + d0 + lane] = x[r];
    } else {
        side(d0 + lane - 16);
    }
    prep_sync();
    const int r = lane / 2, c0 = lane % 2 * 8;  // this lane's row and 8 columns of a 16 x 16 block
#pragma unroll 1
    for (int d = 1; d < 4; ++d) {
        if (warp < 4 - d) {
            const int j = warp, i = warp + d;
            float p[8] = {};
            for (int k = j; k < i; ++k)
#pragma unroll
                for (int m = 0; m < 16; ++m) {
                    const float aim = a[(16 * i + r) * GDN_MAT_LD + 16 * k + m];
                    const float* tk = t + (16 * k + m) * GDN_MAT_LD + 16 * j + c0;
                    const float4 lo = *reinterpret_cast<const float4*>(tk), hi = *reinterpret_cast<const float4*>(tk + 4);
                    p[0] = fmaf(aim, lo.x, p[0]), p[1] = fmaf(aim, lo.y, p[1]);
                    p[2] = fmaf(aim, lo.z, p[2]), p[3] = fmaf(aim, lo.w, p[3]);
                    p[4] = fmaf(aim, hi.x, p[4]), p[5] = fmaf(aim, hi.y, p[5]);
                    p[6] = fmaf(aim, hi.z, p[6]), p[7] = fmaf(aim, hi.w, p[7]);
                }
            float* stage = a + (16 * j + r) * GDN_MAT_LD + 16 * i + c0;  // above A's diagonal: never read as A
#pragma unroll
            for (int u = 0; u < 8; ++u) stage[u] = p[u];
            __syncwarp();
            float o[8] = {};
#pragma unroll
            for (int m = 0; m < 16; ++m) {  // T_ii is lower triangular: its zeros above the diagonal add nothing
                const float tim = t[(16 * i + r) * GDN_MAT_LD + 16 * i + m];
                const float* pm = a + (16 * j + m) * GDN_MAT_LD + 16 * i + c0;
#pragma unroll
                for (int u = 0; u < 8; ++u) o[u] = fmaf(-tim, pm[u], o[u]);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) t[(16 * i + r) * GDN_MAT_LD + 16 * j + c0 + u] = o[u];
        }
        prep_sync();
    }
}

// The DeltaNet front of chunk n for value head h (conv1d.cuh), by the prep's 256 threads: q and k of its key head,
// convolved and SiLU'd from the in-projection rows `mixed`, into the prep's tiles in bf16 (rows past the prompt zero)
// and into qkv (by the first value head of the key head only: the others compute the same values); the gates into
// sm.g and sm.beta (zero past the prompt: no decay, no update, as the reference pads). Reads the conv ring for the
// tokens before `start` and does not write it: the scan does, after every prep block has read it. Ends with
// __syncthreads(); gdn_front_v then convolves v.
constexpr int GDN_FRONT_TOKENS = 16;  // a thread's token range (19 loads in flight for K = 4)

template <class S, class F>
__device__ __forceinline__ void gdn_front_qk(const float* __restrict__ mixed, const float* __restrict__ conv_w,
                                             const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                             const float* __restrict__ ring, bf16* __restrict__ qkv, int T,
                                             int start, int t0, int valid, int h, const GdnPrepSmem<S>& sm) {
    constexpr int THREADS = 256, QK = S::DK / 4;
    static_assert(F::C == S::CW, "the conv channels are the qkv row");
    const int kh = h / S::RATIO;
    const bool writes_qk = h % S::RATIO == 0;
    for (int e = threadIdx.x; e < (64 - valid) * S::DK / 8; e += THREADS) {
        const int r = valid + e / (S::DK / 8), c = e % (S::DK / 8);
        *reinterpret_cast<uint4*>(sm.q.chunk(r, c)) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(sm.k.chunk(r, c)) = make_uint4(0, 0, 0, 0);
    }
    if (threadIdx.x < 64) {
        const float2 gb = threadIdx.x < valid ? deltanet_gates<F>(mixed, a_log, dt_bias, t0 + threadIdx.x, h)
                                              : make_float2(0.f, 0.f);
        sm.g[threadIdx.x] = gb.x, sm.beta[threadIdx.x] = gb.y;
    }
#pragma unroll 1
    for (int item = threadIdx.x; item < 2 * QK * (64 / GDN_FRONT_TOKENS); item += THREADS) {
        const int quad = item % (2 * QK), first = t0 + item / (2 * QK) * GDN_FRONT_TOKENS;
        if (first >= T) continue;
        const bool is_k = quad >= QK;
        const int col = 4 * (quad % QK), c = (is_k ? S::KD : 0) + kh * S::DK + col;
        const SwizzledTile<64, S::DK> tile = is_k ? sm.k : sm.q;
        conv1d_silu_quad<F, GDN_FRONT_TOKENS>(mixed, conv_w, ring, c, first, T, start, [&](int t, float4 y) {
            const uint2 u = bf16x4(y);
            *reinterpret_cast<uint2*>(tile.chunk(t - t0, col / 8) + col % 8 * 2) = u;
            if (writes_qk) *reinterpret_cast<uint2*>(qkv + (size_t)t * S::CW + c) = u;
        });
    }
    __syncthreads();
}

// v of value head h over chunk n, into qkv, by `threads` threads (thread index `tid`).
template <class S, class F>
__device__ __forceinline__ void gdn_front_v(const float* __restrict__ mixed, const float* __restrict__ conv_w,
                                            const float* __restrict__ ring, bf16* __restrict__ qkv, int T, int start,
                                            int t0, int h, int tid, int threads) {
    constexpr int VQ = S::DV / 4;
#pragma unroll 1
    for (int item = tid; item < VQ * (64 / GDN_FRONT_TOKENS); item += threads) {
        const int first = t0 + item / VQ * GDN_FRONT_TOKENS, c = 2 * S::KD + h * S::DV + 4 * (item % VQ);
        if (first >= T) continue;
        conv1d_silu_quad<F, GDN_FRONT_TOKENS>(mixed, conv_w, ring, c, first, T, start, [&](int t, float4 y) {
            *reinterpret_cast<uint2*>(qkv + (size_t)t * S::CW + c) = bf16x4(y);
        });
    }
}

// The new conv state of the channels value head h reads (conv_ring_update), by the scan's first slice of h: q and k
// by the first value head of their key head. Runs after the prep, whose blocks read the old state.
template <class S, class F>
__device__ __forceinline__ void gdn_conv_state(const float* __restrict__ mixed, float* __restrict__ ring, int T,
                                               int start, int h) {
    constexpr int QK = S::DK / 4, QUADS = 2 * QK + S::DV / 4;
    const int kh = h / S::RATIO;
    for (int quad = h % S::RATIO == 0 ? threadIdx.x : 2 * QK + threadIdx.x; quad < QUADS; quad += blockDim.x) {
        const bool is_v = quad >= 2 * QK, is_k = !is_v && quad >= QK;
        const int col = 4 * (is_v ? quad - 2 * QK : is_k ? quad - QK : quad);
        conv_ring_update<F>(mixed, ring, is_v ? 2 * S::KD + h * S::DV + col : (is_k ? S::KD : 0) + kh * S::DK + col,
                            T, start);
    }
}

// One (chunk, value head) of the prep, by a block of 256 threads with GdnPrepSmem::BYTES of dynamic shared memory:
// the front of q and k (gdn_front_qk), then warps 4-7 convolve v and leave, while warps 0-3 compute the chunk's
// WY quantities (their barriers: named barrier 1 of 128 threads, prep_sync).
template <class S, class F>
__device__ void gdn_prep(const float* __restrict__ mixed, const float* __restrict__ conv_w,
                         const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                         const float* __restrict__ ring, bf16* __restrict__ qkv, float* __restrict__ wy,
                         float* __restrict__ aqk, float* __restrict__ fac, int T, int start, int n, int h,
                         unsigned char* smem) {
    constexpr int THREADS = 128;  // after the front
    const GdnChunk<S> ch(qkv, n, h, T);
    const GdnPrepSmem<S> sm(smem);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    gdn_front_qk<S, F>(mixed, conv_w, a_log, dt_bias, ring, qkv, T, start, ch.t0, ch.valid, h, sm);
    if (threadIdx.x >= THREADS) {
        gdn_front_v<S, F>(mixed, conv_w, ring, qkv, T, start, ch.t0, h, threadIdx.x - THREADS, THREADS);
        return;
    }

    // l2 norm factors (q's with dk^-1/2) and the cumulative log-decay
    row_sumsq<S::DK>(sm.q, [&](int r, float ss) { sm.qn[r] = rsqrtf(ss + 1e-6f) * rsqrtf(float(S::DK)); });
    row_sumsq<S::DK>(sm.k, [&](int r, float ss) { sm.kn[r] = rsqrtf(ss + 1e-6f); });
    if (warp == 0) {  // lane l: tokens 2l, 2l+1, after the others' sums by a warp scan (not 64 dependent steps)
        const float g0 = sm.g[2 * lane], g1 = sm.g[2 * lane + 1];
        float incl = g0 + g1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float u = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += u;
        }
        float before = __shfl_up_sync(0xffffffffu, incl, 1);
        if (lane == 0) before = 0.f;
        sm.c[2 * lane] = before + g0;
        sm.c[2 * lane + 1] = (before + g0) + g1;
    }
    prep_sync();

    // k k^T and q k^T for rows 16 warp .. 16 warp + 15, all 64 columns (bf16 products are exact in fp32)
    float kk[8][4] = {}, qk[8][4] = {};
#pragma unroll
    for (int d = 0; d < S::DK; d += 16) {
        unsigned ak[4], aq[4];
        load_a_frag(ak, sm.k, 16 * warp, d);
        load_a_frag(aq, sm.q, 16 * warp, d);
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2) {
            unsigned b[4];
            load_b_frags_nk(b, sm.k, 8 * nt, d);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_bf16(kk[nt], ak, b0), mma_bf16(kk[nt + 1], ak, b1);
            mma_bf16(qk[nt], aq, b0), mma_bf16(qk[nt + 1], aq, b1);
        }
    }
    // A (strictly lower, into shared memory) and Aqk (lower with the diagonal, to scratch), with the decays
    float* aqk_out = aqk + ch.scratch * 64 * 64;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            const int i = 16 * warp + gq + 8 * (e / 2), j = 8 * nt + 2 * tq;
            float av[2], qv[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const float decay = j + u <= i ? __expf(sm.c[i] - sm.c[j + u]) : 0.f;
                av[u] = j + u < i ? sm.beta[i] * sm.kn[i] * sm.kn[j + u] * kk[nt][e + u] * decay : 0.f;
                qv[u] = sm.qn[i] * sm.kn[j + u] * qk[nt][e + u] * decay;
            }
            *reinterpret_cast<float2*>(sm.a + i * GDN_MAT_LD + j) = make_float2(av[0], av[1]);
            *reinterpret_cast<uint2*>(aqk_out + i * 64 + j) = make_uint2(tf32(qv[0]), tf32(qv[1]));  // the scan's operand
        }
    prep_sync();

    float* f = fac + ch.scratch * GDN_FAC;
    unit_lower_inverse(sm.a, sm.t, [&](int r) {  // the per-token factors, beside the diagonal blocks
        const float last = sm.c[63], ec = __expf(sm.c[r]);
        f[r] = sm.beta[r];
        f[64 + r] = ec * sm.kn[r];
        f[128 + r] = ec * sm.qn[r];
        f[192 + r] = __expf(last - sm.c[r]) * sm.kn[r];
        f[256 + r] = r == 0 ? __expf(last) : 0.f;
    });
    uint4* out = reinterpret_cast<uint4*>(wy + ch.scratch * 64 * 64);  // T rounded to tf32, the scan's operand
    for (int e = threadIdx.x; e < 64 * 16; e += THREADS) {
        const float4 t = *reinterpret_cast<const float4*>(sm.t + e / 16 * GDN_MAT_LD + e % 16 * 4);
        out[e] = make_uint4(tf32(t.x), tf32(t.y), tf32(t.z), tf32(t.w));
    }
}

// ---- gdn_scan ------------------------------------------------------------------------------------------------

// Shared memory of the scan: STAGES chunk stages (q, k, the v slice, T, Aqk, factors), then the state slice
// (transposed, tf32) and the r / v' slice (transposed, fp32).
template <class S, int BV, int STAGES>
struct GdnScanSmem {
    static constexpr int VLD = BV + 8;      // padded v rows (bf16)
    static constexpr int STLD = S::DK + 4;  // padded S^T rows
    static constexpr int Q_BYTES = 64 * S::DK * 2, V_BYTES = 64 * VLD * 2, MAT_BYTES = 64 * GDN_MAT_LD * 4;
    static constexpr int STAGE = 2 * Q_BYTES + V_BYTES + 2 * MAT_BYTES + GDN_FAC * 4;
    static constexpr int BYTES = STAGES * STAGE + BV * STLD * 4 + BV * GDN_MAT_LD * 4;
    static_assert(V_BYTES % 16 == 0 && STAGE % 16 == 0, "stages stay 16-byte aligned");

    unsigned char* base;
    __device__ __forceinline__ SwizzledTile<64, S::DK> q(int s) const { return {base + s * STAGE}; }
    __device__ __forceinline__ SwizzledTile<64, S::DK> k(int s) const { return {base + s * STAGE + Q_BYTES}; }
    __device__ __forceinline__ bf16* v(int s) const { return reinterpret_cast<bf16*>(base + s * STAGE + 2 * Q_BYTES); }
    __device__ __forceinline__ float* wy(int s) const {
        return reinterpret_cast<float*>(base + s * STAGE + 2 * Q_BYTES + V_BYTES);
    }
    __device__ __forceinline__ float* aqk(int s) const { return wy(s) + 64 * GDN_MAT_LD; }
    __device__ __forceinline__ float* fac(int s) const { return aqk(s) + 64 * GDN_MAT_LD; }
    __device__ __forceinline__ unsigned* st() const { return reinterpret_cast<unsigned*>(base + STAGES * STAGE); }
    __device__ __forceinline__ float* xt() const { return reinterpret_cast<float*>(st() + BV * STLD); }
};

// rows S for NR 64-row tiles of bf16 rows (k, q) against the tf32 state copy st, tf32 mmas: warp rows r0 ..
// r0+15 of each, all the slice's columns. 16 dims at a time: the rows by ldmatrix as bf16 A fragments (the
// thread's dims 2t, 2t+1, 2t+8, 2t+9; bf16 -> tf32 is exact), split over two tf32 mmas whose k slots t, t+4 stand
// for dims 2t, 2t+8 and 2t+1, 2t+9; S's B fragments take the same dims, two adjacent per load, shared by the tiles.
template <class S, int BV, int STAGES, int NR>
__device__ __forceinline__ void gdn_rows_times_state(const GdnScanSmem<S, BV, STAGES>& sm,
                                                     const SwizzledTile<64, S::DK> (&rows)[NR],
                                                     float (&acc)[NR][BV / 8][4], int r0) {
    constexpr int NB = BV / 8;
    using Sm = GdnScanSmem<S, BV, STAGES>;
    const int lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    const unsigned* st = sm.st();
#pragma unroll(4 / NR)
    for (int d = 0; d < S::DK; d += 16) {
        unsigned a0[NR][4], a1[NR][4];
#pragma unroll
        for (int t = 0; t < NR; ++t) {
            unsigned r[4];
            load_a_frag(r, rows[t], r0, d);
#pragma unroll
            for (int i = 0; i < 4; ++i) a0[t][i] = r[i] << 16, a1[t][i] = r[i] & 0xffff0000u;
        }
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const unsigned* row = st + (8 * nb + gq) * Sm::STLD + d + 2 * tq;
            const uint2 lo = *reinterpret_cast<const uint2*>(row), hi = *reinterpret_cast<const uint2*>(row + 8);
            const unsigned b0[2] = {lo.x, hi.x}, b1[2] = {lo.y, hi.y};
#pragma unroll
            for (int t = 0; t < NR; ++t) mma_tf32(acc[t][nb], a0[t], b0), mma_tf32(acc[t][nb], a1[t], b1);
        }
    }
}

// f(accumulator, i, j) for each of a state warp's accumulators acc_s[ms][nb][e] of S^T: row i of S (of DK, from the
// warp's i_base), column j of the v slice (of BV).
template <int MS, int NB, class F>
__device__ __forceinline__ void for_each_state(float (&acc_s)[MS][NB][4], int i_base, F&& f) {
    const int lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                f(acc_s[ms][nb][e], i_base + 16 * ms + gq + 8 * (e / 2), 8 * nb + 2 * tq + e % 2);
}

// The state warps' step of the scan: S = e^(c_last) S + (kf o k)^T v' on their rows of S (acc_s), v' in xt, and
// the new state's tf32 copy st (every warp read st before the chunk's first barrier).
template <class S, int BV, int STAGES>
__device__ __forceinline__ void gdn_scan_update(const GdnScanSmem<S, BV, STAGES>& sm, int s,
                                                float (&acc_s)[S::DK / 64][BV / 8][4], int i_base) {
    constexpr int NB = BV / 8, MS = S::DK / 64;
    using Sm = GdnScanSmem<S, BV, STAGES>;
    const int lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    const float* f = sm.fac(s);
    const float* xt = sm.xt();
    unsigned* st = sm.st();
    const float decay = f[256];
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[ms][nb][e] *= decay;
    // 16 tokens at a time: k^T's A fragments by a transposing ldmatrix of the k tile (r[0]: dims g, tokens 2t,
    // 2t+1; r[1]: g, 2t+8..; r[2]: g+8, 2t..; r[3]: g+8, 2t+8..), split over two tf32 mmas as in k S above.
    const SwizzledTile<64, S::DK> k = sm.k(s);
#pragma unroll 2
    for (int kt = 0; kt < 64; kt += 16) {
        const float2 kf_lo = *reinterpret_cast<const float2*>(f + 192 + kt + 2 * tq);
        const float2 kf_hi = *reinterpret_cast<const float2*>(f + 192 + kt + 2 * tq + 8);
        unsigned b0[NB][2], b1[NB][2];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const float* x = xt + (8 * nb + gq) * GDN_MAT_LD + kt + 2 * tq;
            const float2 lo = *reinterpret_cast<const float2*>(x), hi = *reinterpret_cast<const float2*>(x + 8);
            b0[nb][0] = tf32(kf_lo.x * lo.x), b0[nb][1] = tf32(kf_hi.x * hi.x);
            b1[nb][0] = tf32(kf_lo.y * lo.y), b1[nb][1] = tf32(kf_hi.y * hi.y);
        }
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
            unsigned r[4];
            load_b_frags_kn(r, k, kt, i_base + 16 * ms);
            const unsigned a0[4] = {r[0] << 16, r[2] << 16, r[1] << 16, r[3] << 16};
            const unsigned a1[4] = {r[0] & 0xffff0000u, r[2] & 0xffff0000u, r[1] & 0xffff0000u,
                                    r[3] & 0xffff0000u};
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) mma_tf32(acc_s[ms][nb], a0, b0[nb]), mma_tf32(acc_s[ms][nb], a1, b1[nb]);
        }
    }
    // the new state as the next chunk's tf32 operand (every warp read st before the first barrier above)
    for_each_state(acc_s, i_base, [&](float a, int i, int j) { st[j * Sm::STLD + i] = tf32(a); });
}

// The scan's block: WARPS = 4, each warp taking token rows 16w .. 16w+15 of every token-row product and rows (dk)
// w DK/4 .. of S; or WARPS = 8 in two roles of 4, for a grid of one wave, where each block's chain of products is
// the whole time: the state warps (0-3) hold S and take k S, r and the state update, the query warps (4-7) the same
// token rows of q S and the output, beside the state update; v' = T r is split by n-tile between the two.
template <class S, int BV, int STAGES, int WARPS>
__device__ void gdn_scan(const bf16* __restrict__ qkv, const float* __restrict__ wy, const float* __restrict__ aqk,
                         const float* __restrict__ fac, float* __restrict__ state, float* __restrict__ o, int T,
                         bool has_state, int h, int slice, unsigned char* smem) {
    constexpr int THREADS = 32 * WARPS, NB = BV / 8, MS = S::DK / 64;  // n-tiles of the slice; S row tiles a warp
    constexpr bool ROLES = WARPS == 8;
    using Sm = GdnScanSmem<S, BV, STAGES>;
    static_assert(WARPS == 4 || WARPS == 8, "four warps, or two roles of four");
    static_assert(BV % 16 == 0, "v slices are whole 16-byte chunks of two 8-column tiles");
    const Sm sm{smem};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    const bool query_warp = ROLES && warp >= 4;
    const bool state_work = !query_warp, query_work = !ROLES || query_warp;
    const int w4 = warp % 4, r0 = 16 * w4;  // this warp's token rows in the token-row products
    const int j0 = slice * BV, chunks = (T + GDN_BT - 1) / GDN_BT;
    unsigned* st = sm.st();
    float* xt = sm.xt();
    float* state_h = state + ((size_t)h * S::DV + j0) * S::DK;  // S^T rows j0 .. j0+BV-1

    auto load = [&](int n) {  // chunk n into stage n % STAGES; always one commit
        if (n < chunks) {
            const GdnChunk<S> ch(qkv, n, h, T);
            const int s = n % STAGES;
            load_tile_async<64, S::DK, THREADS>(sm.q(s), ch.q, S::CW, ch.valid);
            load_tile_async<64, S::DK, THREADS>(sm.k(s), ch.k, S::CW, ch.valid);
            for (int i = threadIdx.x; i < 64 * (BV / 8); i += THREADS) {
                const int r = i / (BV / 8), c = i % (BV / 8);
                const bool in = r < ch.valid;
                cp_async16(sm.v(s) + r * Sm::VLD + c * 8, in ? ch.v + (size_t)r * S::CW + j0 + c * 8 : ch.v, in);
            }
            load_mat64_async<THREADS>(sm.wy(s), wy + ch.scratch * 64 * 64);
            load_mat64_async<THREADS>(sm.aqk(s), aqk + ch.scratch * 64 * 64);
            for (int i = threadIdx.x; i < GDN_FAC / 4; i += THREADS)
                cp_async16(sm.fac(s) + 4 * i, fac + ch.scratch * GDN_FAC + 4 * i, true);
        }
        cp_async_commit();
    };

    // The state slice (the state warps' accumulators) and its tf32 copy st, the B operand of k S and q S.
    float acc_s[MS][NB][4];
    const int i_base = w4 * (S::DK / 4);
    if (state_work)
        for_each_state(acc_s, i_base, [&](float& a, int i, int j) {
            a = has_state ? state_h[(size_t)j * S::DK + i] : 0.f;
            st[j * Sm::STLD + i] = tf32(a);
        });

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load(s);
#pragma unroll 1
    for (int n = 0; n < chunks; ++n) {
        if constexpr (STAGES == 1) load(n);
        cp_async_wait<STAGES == 1 ? 0 : STAGES - 2>();
        __syncthreads();  // chunk n has landed; every warp is done with chunk n - 1 (and st holds its state)
        if constexpr (STAGES > 1) load(n + STAGES - 1);
        const int s = n % STAGES, t0 = n * GDN_BT, valid = min(GDN_BT, T - t0);
        const bf16* v = sm.v(s);
        const float* f = sm.fac(s);

        // k S and q S: both in each warp of four, the warp's role's one of them with two roles
        constexpr int NR = ROLES ? 1 : 2;
        SwizzledTile<64, S::DK> rows[NR];
        if constexpr (ROLES) rows[0] = query_warp ? sm.q(s) : sm.k(s);
        else rows[0] = sm.k(s), rows[1] = sm.q(s);
        float xs[NR][NB][4] = {};
        gdn_rows_times_state<S, BV, STAGES, NR>(sm, rows, xs, r0);
        float (&ks)[NB][4] = xs[0];
        float (&qs)[NB][4] = xs[NR - 1];
        if (state_work) {  // r = beta (v - a o kS), transposed into xt as tf32 (the B operand of T r)
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = r0 + gq + 8 * (e / 2), j = 8 * nb + 2 * tq + e % 2;
                    xt[j * GDN_MAT_LD + i] = __uint_as_float(
                        tf32(f[i] * (__bfloat162float(v[i * Sm::VLD + j]) - f[64 + i] * ks[nb][e])));
                }
        }
        if (query_work) {  // q S's factor qf
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) qs[nb][e] *= f[128 + r0 + gq + 8 * (e / 2)];
        }
        __syncthreads();
        // v' = T r (T is tf32 already: the prep rounded it); with two roles, each warp takes half of the n-tiles
        constexpr int VB = ROLES ? NB / 2 : NB;
        const int nb0 = query_warp ? VB : 0;
        float vn[VB][4] = {};
#pragma unroll
        for (int kt = 0; kt < 64; kt += 8) {
            unsigned a[4];
            mat64_a_frag(a, sm.wy(s), r0, kt);
#pragma unroll
            for (int nb = 0; nb < VB; ++nb) {
                const float* x = xt + (8 * (nb0 + nb) + gq) * GDN_MAT_LD + kt + tq;
                const unsigned b[2] = {__float_as_uint(x[0]), __float_as_uint(x[4])};
                mma_tf32(vn[nb], a, b);
            }
        }
        __syncthreads();  // every warp has read r
#pragma unroll
        for (int nb = 0; nb < VB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                xt[(8 * (nb0 + nb) + 2 * tq + e % 2) * GDN_MAT_LD + r0 + gq + 8 * (e / 2)] = vn[nb][e];
        __syncthreads();

        if (query_work) {  // o = qf o (q S) + Aqk v'
#pragma unroll
            for (int kt = 0; kt < 64; kt += 8) {
                unsigned a[4];
                mat64_a_frag(a, sm.aqk(s), r0, kt);
#pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    const unsigned b[2] = {tf32(xt[(8 * nb + gq) * GDN_MAT_LD + kt + tq]),
                                           tf32(xt[(8 * nb + gq) * GDN_MAT_LD + kt + tq + 4])};
                    mma_tf32(qs[nb], a, b);
                }
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int i = r0 + gq + 8 * half;
                    if (i < valid)
                        *reinterpret_cast<float2*>(o + ((size_t)(t0 + i) * S::HV + h) * S::DV + j0 + 8 * nb + 2 * tq) =
                            make_float2(qs[nb][2 * half], qs[nb][2 * half + 1]);
                }
        }
        if (state_work) {  // S = e^(c_last) S + (kf o k)^T v' (beside the output, with two roles)
            gdn_scan_update<S, BV, STAGES>(sm, s, acc_s, i_base);
        }
        if constexpr (STAGES == 1) __syncthreads();  // the next load overwrites this chunk's stage
    }
    cp_async_wait<0>();
    if (state_work)
        for_each_state(acc_s, i_base, [&](float a, int i, int j) { state_h[(size_t)j * S::DK + i] = a; });
}
// ---- gated RMSNorm of the output ------------------------------------------------------------------------------

// One (token, head) per warp: y = w * (o * rsqrt(mean(o^2) + eps)) * silu(z), bf16. o and z are DV fp32 values,
// w the DV fp32 weights (plain w: this norm is not zero-centred).
template <int DV>
__device__ __forceinline__ void gated_rmsnorm_warp(const float* __restrict__ o, const float* __restrict__ z,
                                                   const float* __restrict__ w, bf16* __restrict__ y, float eps) {
    constexpr int E = DV / 32;
    const int lane = threadIdx.x % 32;
    float v[E], ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        v[e] = o[e * 32 + lane];
        ss += v[e] * v[e];
    }
    const float rstd = rsqrtf(warp_sum(ss) / DV + eps);
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = e * 32 + lane;
        y[d] = __float2bfloat16(w[d] * (v[e] * rstd) * silu(z[d]));
    }
}

}  // namespace lucegen
