// draft.cuh: the DFlash draft's own device functions (lucegen/engine/draft_gpu.py, kernels/draft.py): the per-head
// plain RMSNorm + full-head RoPE of its queries and keys, and its attention: the block's queries (block_size of them
// per query head) attend, with no mask, every row of the layer's context K/V ring plus the block's own K/V rows.
// The draft's row kernels (add + RMSNorm, SiLU x up) are layered.cuh's; its projections qgemv.cuh's.
//
// Attention work split: a block takes one kv head g and one range of key chunks (KC = 32 keys a chunk), for all
// ROWS = G x B query rows of g's G query heads (row r = head-in-group (r / B), block query (r % B)); its warps
// take ROWS / WARPS rows each. Per chunk, K and V go to shared memory; lane j scores key j against the warp's rows
// (queries broadcast from shared memory), the warp keeps each row's online softmax (running max uniform across the
// warp, sums per lane), and multiplies the chunk's probabilities into V with each lane owning 4 dims of a row (for
// head dims under 128, several lane classes take the chunk's keys in turn and are added at the end). A block
// writes its unnormalised partial (max, sum, output) per row; draft_merge adds the splits' partials in split order
// (deterministic: the same bits whatever order the blocks finish in).
#pragma once
#include "common.cuh"
#include "mk_attention.cuh"  // rope_in_place, cos_sin

namespace lucegen {

// Keys of a chunk: one per lane when scoring.
constexpr int DRAFT_KC = 32;

// How the S = n_ctx + B keys split over `splits` blocks of a kv head: chunks per split, and the splits that hold any
// (the rest return at once; draft_merge reads only these). Mirrored by kernels/draft.py: split_ranges.
__device__ __forceinline__ int2 draft_splits(int keys, int splits) {
    const int chunks = (keys + DRAFT_KC - 1) / DRAFT_KC;
    const int per = (chunks + splits - 1) / splits;
    return make_int2(per, (chunks + per - 1) / per);
}

// One head vector of HD values from x (global, fp32): y = RoPE(w * x_hat) * scale, the plain (Qwen3) RMSNorm then
// the full-head rotation (half-split pairs, cos/sin cs/sn of HD/2 angles), by one warp; `stage` is the warp's HD
// floats of shared memory. (mk_attention.cuh's head_rmsnorm is the zero-centred 1 + w norm of the target.)
template <int HD>
__device__ __forceinline__ void head_norm_rope(const float* x, const float* __restrict__ w, float eps,
                                               const float* cs, const float* sn, float scale, float* stage,
                                               float* y) {
    const int lane = threadIdx.x % 32;
    float ss = 0.f;
    for (int d = lane; d < HD; d += 32) {
        const float v = x[d];
        stage[d] = v;
        ss += v * v;
    }
    const float rstd = rsqrtf(warp_sum(ss) / HD + eps);
    for (int d = lane; d < HD; d += 32) stage[d] = stage[d] * rstd * w[d];
    __syncwarp();
    rope_in_place<HD, HD>(stage, cs, sn, scale, lane, 32);
    __syncwarp();
    for (int d = lane; d < HD; d += 32) y[d] = stage[d];
    __syncwarp();
}

// cos and sin of the HD/2 angles position * inv_freq[i] (fp32 angle, as HF), into cs, sn, by the block's threads.
template <class M, int THREADS>
__device__ __forceinline__ void rope_angles(int pos, float* cs, float* sn) {
    for (int i = threadIdx.x; i < M::HD / 2; i += THREADS) {
        const float2 t = cos_sin(static_cast<float>(pos) * M::inv_freq(i));
        cs[i] = t.x;
        sn[i] = t.y;
    }
}

// Shared memory of an attention block, in floats: queries [ROWS][HD], keys [KC][HD + 4] (padded: lane j reads row j
// as float4s without bank conflicts), values [KC][HD], probabilities [ROWS][KC].
template <int HD, int ROWS>
constexpr int draft_attention_floats() {
    return ROWS * HD + DRAFT_KC * (HD + 4) + DRAFT_KC * HD + ROWS * DRAFT_KC;
}

struct DraftAttention {
    const float* q;        // [B][NH][HD]: normed, rotated, scaled by HD^-1/2
    const float* bk;       // [B][NKV][HD]: the block's keys (normed, rotated)
    const float* bv;       // [B][NKV][HD]: its values
    const float* keys;     // [window][NKV][HD]: the layer's context ring (rows 0 .. n_ctx - 1 valid)
    const float* values;
    const int* n_ctx;      // context rows in the ring (device: a captured forward replays at any context)
    float* part_o;         // [NKV][SPLITS][ROWS][HD] unnormalised partial outputs
    float* part_ml;        // [NKV][SPLITS][ROWS][2] partial max and sum
};

// Block (kv head g, split s) of the attention; M: NH, NKV, HD, B; THREADS = 32 WARPS; smem: draft_attention_floats.
template <class M, int THREADS, int SPLITS>
__device__ void draft_attention_block(const DraftAttention& A, int g, int s, float* smem) {
    constexpr int HD = M::HD, G = M::NH / M::NKV, B = M::B, ROWS = G * B, WARPS = THREADS / 32;
    constexpr int RW = ROWS / WARPS;                       // rows per warp
    constexpr int D4 = HD / 4;                             // float4s of a row
    constexpr int LD = D4 < 32 ? D4 : 32;                  // lanes across a row's float4s
    constexpr int KQ = 32 / LD;                            // lane classes sharing a chunk's keys in P V
    constexpr int DQ = D4 / LD;                            // float4s of a row per lane
    constexpr int KS = HD + 4;                             // padded key row
    static_assert(ROWS % WARPS == 0 && RW >= 1, "whole rows per warp");
    static_assert(HD % 4 == 0 && (D4 < 32 ? 32 % D4 == 0 : D4 % 32 == 0), "head dim: 16 .. 128 a power of two, or a multiple of 128");
    const int n_ctx = *A.n_ctx, keys = n_ctx + B;
    const int2 sp = draft_splits(keys, SPLITS);
    if (s >= sp.y) return;
    const int k0 = s * sp.x * DRAFT_KC, k1 = min(keys, (s + 1) * sp.x * DRAFT_KC);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d4 = lane % LD, kq = lane / LD;

    float* sq = smem;                        // [ROWS][HD]
    float* sk = sq + ROWS * HD;              // [KC][KS]
    float* sv = sk + DRAFT_KC * KS;          // [KC][HD]
    float* spr = sv + DRAFT_KC * HD;         // [ROWS][KC]
    for (int e = threadIdx.x; e < ROWS * D4; e += THREADS) {
        const int r = e / D4, c = e % D4, hh = r / B, t = r % B;
        reinterpret_cast<float4*>(sq)[e] =
            reinterpret_cast<const float4*>(A.q + ((size_t)t * M::NH + g * G + hh) * HD)[c];
    }

    float m[RW], l[RW];
    float4 o[RW][DQ];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        m[r] = -__int_as_float(0x7f800000);
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < DQ; ++i) o[r][i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int c0 = k0; c0 < k1; c0 += DRAFT_KC) {
        __syncthreads();  // the previous chunk's K, V and probabilities are read (and, first, sq is written)
        for (int e = threadIdx.x; e < DRAFT_KC * D4; e += THREADS) {
            const int j = e / D4, c = e % D4, key = c0 + j;
            float4 kv4 = make_float4(0.f, 0.f, 0.f, 0.f), vv4 = kv4;  // keys past the range: zeros, never NaN
            if (key < k1) {
                const size_t row = key < n_ctx ? ((size_t)key * M::NKV + g) * HD
                                               : ((size_t)(key - n_ctx) * M::NKV + g) * HD;
                kv4 = reinterpret_cast<const float4*>((key < n_ctx ? A.keys : A.bk) + row)[c];
                vv4 = reinterpret_cast<const float4*>((key < n_ctx ? A.values : A.bv) + row)[c];
            }
            reinterpret_cast<float4*>(sk + j * KS)[c] = kv4;
            reinterpret_cast<float4*>(sv + j * HD)[c] = vv4;
        }
        __syncthreads();
        // scores: lane = key
        float sc[RW];
#pragma unroll
        for (int r = 0; r < RW; ++r) sc[r] = 0.f;
#pragma unroll 4
        for (int c = 0; c < D4; ++c) {
            const float4 kk = reinterpret_cast<const float4*>(sk + lane * KS)[c];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const float4 qq = reinterpret_cast<const float4*>(sq + (warp * RW + r) * HD)[c];
                sc[r] = fmaf(qq.x, kk.x, fmaf(qq.y, kk.y, fmaf(qq.z, kk.z, fmaf(qq.w, kk.w, sc[r]))));
            }
        }
        const bool valid = c0 + lane < k1;
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            float cm = valid ? sc[r] : -__int_as_float(0x7f800000);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
            const float m_new = fmaxf(m[r], cm), corr = __expf(m[r] - m_new);
            const float p = valid ? __expf(sc[r] - m_new) : 0.f;
            m[r] = m_new;
            l[r] = l[r] * corr + p;
            spr[(warp * RW + r) * DRAFT_KC + lane] = p;
#pragma unroll
            for (int i = 0; i < DQ; ++i)
                o[r][i] = make_float4(o[r][i].x * corr, o[r][i].y * corr, o[r][i].z * corr, o[r][i].w * corr);
        }
        __syncwarp();
        // P V: lane (kq, d4) takes keys kq, kq + KQ, ... of the chunk, dims 4 (d4 + 32 i) ..
#pragma unroll 2
        for (int j = kq; j < DRAFT_KC; j += KQ) {
            float4 vv[DQ];
#pragma unroll
            for (int i = 0; i < DQ; ++i) vv[i] = reinterpret_cast<const float4*>(sv + j * HD)[d4 + 32 * i];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const float p = spr[(warp * RW + r) * DRAFT_KC + j];
#pragma unroll
                for (int i = 0; i < DQ; ++i)
                    o[r][i] = make_float4(fmaf(p, vv[i].x, o[r][i].x), fmaf(p, vv[i].y, o[r][i].y),
                                          fmaf(p, vv[i].z, o[r][i].z), fmaf(p, vv[i].w, o[r][i].w));
            }
        }
    }
    // the block's partial: lane classes added (butterfly), sums over the warp
    const size_t base = ((size_t)g * SPLITS + s) * ROWS + warp * RW;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
#pragma unroll
        for (int off = LD; off < 32; off <<= 1)
#pragma unroll
            for (int i = 0; i < DQ; ++i) {
                o[r][i].x += __shfl_xor_sync(0xffffffffu, o[r][i].x, off);
                o[r][i].y += __shfl_xor_sync(0xffffffffu, o[r][i].y, off);
                o[r][i].z += __shfl_xor_sync(0xffffffffu, o[r][i].z, off);
                o[r][i].w += __shfl_xor_sync(0xffffffffu, o[r][i].w, off);
            }
        const float lsum = warp_sum(l[r]);
        if (kq == 0)
#pragma unroll
            for (int i = 0; i < DQ; ++i) reinterpret_cast<float4*>(A.part_o + (base + r) * HD)[d4 + 32 * i] = o[r][i];
        if (lane == 0) {
            A.part_ml[(base + r) * 2] = m[r];
            A.part_ml[(base + r) * 2 + 1] = lsum;
        }
    }
}

// out[t][(g G + hh) HD + d] = the merged attention of row r = hh B + t of kv head g: the splits' partials weighted
// by exp(m_s - max) and added in split order, over the sum of their weighted sums. One thread per dim d.
template <class M, int SPLITS>
__device__ void draft_merge_row(const float* part_o, const float* part_ml, const int* n_ctx, int g, int r,
                                float* out) {
    constexpr int HD = M::HD, G = M::NH / M::NKV, B = M::B, ROWS = G * B;
    const int n = draft_splits(*n_ctx + B, SPLITS).y;
    const float* ml = part_ml + ((size_t)g * SPLITS * ROWS + r) * 2;
    float mx = -__int_as_float(0x7f800000);
    for (int s = 0; s < n; ++s) mx = fmaxf(mx, ml[(size_t)s * ROWS * 2]);
    float sum = 0.f;
    for (int s = 0; s < n; ++s) sum += __expf(ml[(size_t)s * ROWS * 2] - mx) * ml[(size_t)s * ROWS * 2 + 1];
    const int hh = r / B, t = r % B;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < n; ++s)
            a += __expf(ml[(size_t)s * ROWS * 2] - mx) * part_o[(((size_t)g * SPLITS + s) * ROWS + r) * HD + d];
        out[((size_t)t * M::NH + g * G + hh) * HD + d] = a / sum;
    }
}

}  // namespace lucegen
