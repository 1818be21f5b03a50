// attention_prefill.cuh: the gated full-attention layer of the prefill, after its fused q|gate, k, v projection.
//
// attention_prep, one block per token: q_norm / k_norm (zero-centred RMSNorm over head_dim, fp32), partial RoPE on
// the first ROT dims (NEOX half split; cos / sin of the fp32 angle pos * inv_freq[i], taken in double so that they
// are the correctly rounded values whatever the position), q to a [T][NH][HD] bf16 buffer, k and v into the KV cache
// at the token's position.
// attention_prefill, one block per (64 queries, head): causal flash attention over the cache [0, start + T) with
// mma.sync (bf16 operands, fp32 scores and accumulators), online softmax in fp32 with no T x T matrix, then the
// output gate sigmoid(gate) and a bf16 store of the head's slice of the o_proj input.
//
// Layouts: qkv [T][QW] bf16, a row = [q_0 gate_0 q_1 gate_1 ... (HD each) | k (NKV HD) | v (NKV HD)];
// KV cache [context][NKV][HD] bf16 per layer (the reference State's order); query head h reads KV head h / GROUP.
#pragma once
#include "activation.cuh"
#include "mma.cuh"

namespace lucegen {

template <int HD_, int NH_, int NKV_, int ROT_>
struct AttnShape {
    static constexpr int HD = HD_, NH = NH_, NKV = NKV_, ROT = ROT_, GROUP = NH / NKV;
    static constexpr int K_OFF = 2 * NH * HD, V_OFF = K_OFF + NKV * HD, QW = V_OFF + NKV * HD;
    static constexpr int E = HD / 32;            // prep: values per lane
    static constexpr int PARTNER = ROT / 2 / E;  // prep: lane distance of the RoPE pair (i, i + ROT/2)
    static_assert(HD % 64 == 0 && NH % NKV == 0, "attention head shape");
    static_assert(ROT % (2 * E) == 0 && (PARTNER & (PARTNER - 1)) == 0, "RoPE pairs sit a power-of-two lanes apart");
};

// ---- attention_prep ------------------------------------------------------------------------------------------

// One head vector of HD bf16 per warp (lane holds dims E*lane ..): normalise with (1 + w) and rotate the first ROT
// dims (rope = true), or copy (rope = false); cs holds cos [ROT/2] then sin [ROT/2] of this position.
template <class S>
__device__ __forceinline__ void attention_head_prep(const bf16* __restrict__ src, bf16* __restrict__ dst,
                                                    const float* __restrict__ norm_w, const float* cs, float eps,
                                                    bool norm_rope) {
    constexpr int E = S::E, HALF = S::ROT / 2;
    const int lane = threadIdx.x % 32, d0 = lane * E;
    float x[E];
#pragma unroll
    for (int e = 0; e < E; e += 2) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + d0 + e));
        x[e] = v.x, x[e + 1] = v.y;
    }
    if (norm_rope) {
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) ss += x[e] * x[e];
        const float rstd = rsqrtf(warp_sum(ss) / S::HD + eps);
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = x[e] * rstd * (1.f + norm_w[d0 + e]);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float partner = __shfl_xor_sync(0xffffffffu, x[e], S::PARTNER);  // dim d +- ROT/2
            const int d = d0 + e;
            if (d < HALF) x[e] = x[e] * cs[d] - partner * cs[HALF + d];
            else if (d < S::ROT) x[e] = x[e] * cs[d - HALF] + partner * cs[d];
        }
    }
#pragma unroll
    for (int e = 0; e < E; e += 2)
        *reinterpret_cast<__nv_bfloat162*>(dst + d0 + e) = __floats2bfloat162_rn(x[e], x[e + 1]);
}

// One token at absolute position `pos`: its NH query heads, NKV key heads and NKV value heads, by warps in turn.
// `cs` is ROT floats of shared memory.
template <class S, int THREADS>
__device__ void attention_prep(const bf16* __restrict__ qkv_row, const float* __restrict__ q_norm,
                               const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                               bf16* __restrict__ q_row, bf16* __restrict__ k_row, bf16* __restrict__ v_row,
                               float eps, int pos, float* cs) {
    if (threadIdx.x < S::ROT / 2) {
        double s, c;
        sincos(static_cast<double>(static_cast<float>(pos) * inv_freq[threadIdx.x]), &s, &c);
        cs[threadIdx.x] = static_cast<float>(c);
        cs[S::ROT / 2 + threadIdx.x] = static_cast<float>(s);
    }
    __syncthreads();
    for (int slot = threadIdx.x / 32; slot < S::NH + 2 * S::NKV; slot += THREADS / 32) {
        if (slot < S::NH)
            attention_head_prep<S>(qkv_row + slot * 2 * S::HD, q_row + slot * S::HD, q_norm, cs, eps, true);
        else if (slot < S::NH + S::NKV)
            attention_head_prep<S>(qkv_row + S::K_OFF + (slot - S::NH) * S::HD, k_row + (slot - S::NH) * S::HD,
                                   k_norm, cs, eps, true);
        else
            attention_head_prep<S>(qkv_row + S::V_OFF + (slot - S::NH - S::NKV) * S::HD,
                                   v_row + (slot - S::NH - S::NKV) * S::HD, nullptr, cs, eps, false);
    }
}

// ---- attention_prefill ---------------------------------------------------------------------------------------

constexpr int ATTN_BM = 64, ATTN_BN = 64, ATTN_THREADS = 128;  // queries per block, keys per tile, 4 warps

template <class S>
constexpr int attention_smem() { return (ATTN_BM + 2 * ATTN_BN) * S::HD * 2; }

// Queries [q0, q0 + 64) of head h (absolute positions start + q0 ..) against keys [0, start + T) of its KV head.
// Warp w owns query rows 16w .. 16w+15; a thread holds rows g and g + 8 of them (g = lane / 4).
template <class S>
__device__ void attention_prefill(const bf16* __restrict__ Q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                                  const bf16* __restrict__ qkv, bf16* __restrict__ out, int T, int start, int q0,
                                  int h, unsigned char* smem) {
    using QTile = SwizzledTile<ATTN_BM, S::HD>;
    using KTile = SwizzledTile<ATTN_BN, S::HD>;
    constexpr int NT = S::HD / 8, SN = ATTN_BN / 8;  // 8-column tiles of the output and of the scores
    const QTile qs{smem};
    const KTile ks{smem + QTile::BYTES}, vs{smem + QTile::BYTES + KTile::BYTES};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    const int kvh = h / S::GROUP, kv_len = start + T;
    const int keys = min(start + q0 + ATTN_BM, kv_len);  // the last query of the block sees keys [0, keys)
    const int key_tiles = (keys + ATTN_BN - 1) / ATTN_BN;
    const size_t kv_ld = (size_t)S::NKV * S::HD;
    auto load_keys = [&](KTile tile, const bf16* cache, int j) {
        load_tile_async<ATTN_BN, S::HD, ATTN_THREADS>(tile, cache + (size_t)j * ATTN_BN * kv_ld + kvh * S::HD, kv_ld,
                                                      kv_len - j * ATTN_BN);
    };
    load_tile_async<ATTN_BM, S::HD, ATTN_THREADS>(qs, Q + ((size_t)q0 * S::NH + h) * S::HD, (size_t)S::NH * S::HD,
                                                  T - q0);
    load_keys(ks, kc, 0);
    cp_async_commit();

    const float scale = 1.4426950408889634f * rsqrtf(float(S::HD));  // log2(e) / sqrt(HD): softmax in base 2
    const float neg_inf = -__int_as_float(0x7f800000);
    float o[NT][4] = {}, m[2] = {neg_inf, neg_inf}, l[2] = {0.f, 0.f};
    const int row_pos = start + q0 + 16 * warp + gq;  // position of row g; row g + 8 is 8 further
#pragma unroll 1
    for (int j = 0; j < key_tiles; ++j) {
        cp_async_wait<0>();
        __syncthreads();  // K_j (and Q) have landed; every warp is done with V_{j-1}
        load_keys(vs, vc, j);
        cp_async_commit();

        float s[SN][4] = {};
#pragma unroll 2
        for (int d = 0; d < S::HD; d += 16) {
            unsigned a[4];
            load_a_frag(a, qs, 16 * warp, d);
#pragma unroll
            for (int nt = 0; nt < SN; nt += 2) {
                unsigned b[4];
                load_b_frags_nk(b, ks, 8 * nt, d);
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                mma_bf16(s[nt], a, b0), mma_bf16(s[nt + 1], a, b1);
            }
        }
        const int key0 = j * ATTN_BN;
        if (key0 + ATTN_BN - 1 > start + q0 || key0 + ATTN_BN > kv_len) {  // the causal edge or the cache's end
#pragma unroll
            for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key0 + 8 * nt + 2 * tq + e % 2, pos = row_pos + 8 * (e / 2);
                    if (key > pos || key >= kv_len) s[nt][e] = neg_inf;
                }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // online softmax of rows g (half 0) and g + 8 (half 1)
            float mx = neg_inf;
#pragma unroll
            for (int nt = 0; nt < SN; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[half], mx * scale);
            const float m_use = m_new == neg_inf ? 0.f : m_new;  // a row with no visible key yet stays empty
            const float corr = exp2f(m[half] - m_use);
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const float p = exp2f(s[nt][2 * half + u] * scale - m_use);
                    s[nt][2 * half + u] = p;
                    sum += p;
                }
            l[half] = l[half] * corr + sum;  // this thread's columns only: the quad's partial sums add up at the end
            m[half] = m_new;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) o[nt][2 * half] *= corr, o[nt][2 * half + 1] *= corr;
        }

        cp_async_wait<0>();
        __syncthreads();  // V_j has landed; every warp is done with K_j
        if (j + 1 < key_tiles) load_keys(ks, kc, j + 1);
        cp_async_commit();
#pragma unroll
        for (int kt = 0; kt < ATTN_BN / 16; ++kt) {  // O += P V, P from the score registers as bf16 A fragments
            const unsigned a[4] = {pack_bf16(s[2 * kt][0], s[2 * kt][1]), pack_bf16(s[2 * kt][2], s[2 * kt][3]),
                                   pack_bf16(s[2 * kt + 1][0], s[2 * kt + 1][1]),
                                   pack_bf16(s[2 * kt + 1][2], s[2 * kt + 1][3])};
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                unsigned b[4];
                load_b_frags_kn(b, vs, 16 * kt, 8 * nt);
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
                mma_bf16(o[nt], a, b0), mma_bf16(o[nt + 1], a, b1);
            }
        }
    }
    cp_async_wait<0>();

    // out = O / l * sigmoid(gate), bf16
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float sum = l[half];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int t = q0 + 16 * warp + gq + 8 * half;
        if (t >= T) continue;
        const float inv = 1.f / sum;
        const bf16* gate = qkv + (size_t)t * S::QW + h * 2 * S::HD + S::HD;
        bf16* y = out + ((size_t)t * S::NH + h) * S::HD;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int d = 8 * nt + 2 * tq;
            const float2 gv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gate + d));
            *reinterpret_cast<__nv_bfloat162*>(y + d) = __floats2bfloat162_rn(
                o[nt][2 * half] * inv * sigmoid(gv.x), o[nt][2 * half + 1] * inv * sigmoid(gv.y));
        }
    }
}

}  // namespace lucegen
