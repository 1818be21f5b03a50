// attention_prefill.cuh: the gated full-attention layer of the prefill, after its fused q|gate, k, v projection.
//
// attention_prep, one block per token: q_norm / k_norm (zero-centred RMSNorm over head_dim, fp32), partial RoPE on
// the first ROT dims (NEOX half split; cos / sin of the fp32 angle pos * inv_freq[i], taken in double so that they
// are the correctly rounded values whatever the position), q to a [T][NH][HD] bf16 buffer, k and v into the KV cache
// at the token's position.
// attention_prefill, one block per (64 queries, head): causal flash attention over the cache [0, start + T) with
// mma.sync (bf16 operands, fp32 scores and accumulators), online softmax in fp32 with no T x T matrix, then the
// output gate sigmoid(gate) and a bf16 store of the head's slice of the o_proj input. A short prompt has few query
// tiles, and the last one walks every key tile alone: on sm_90 its keys can go to a cluster of SPLIT blocks, a span
// each (flash-decoding's split), their partials (o, row max m, row sum l) merged through the cluster's shared
// memory in span order.
//
// Layouts: qkv [T][QW] bf16, a row = [q_0 gate_0 q_1 gate_1 ... (HD each) | k (NKV HD) | v (NKV HD)];
// KV cache [context][NKV][HD] bf16 per layer (the reference State's order); query head h reads KV head h / GROUP.
#pragma once
#include "activation.cuh"
#include "cluster.cuh"
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

// One head vector of HD bf16 per warp: lane l holds dims E l .. E l + E - 1 of it in x (fp32).
template <class S>
__device__ __forceinline__ void attention_head_load(const bf16* __restrict__ src, float (&x)[S::E]) {
    const int d0 = threadIdx.x % 32 * S::E;
#pragma unroll
    for (int e = 0; e < S::E; e += 2) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + d0 + e));
        x[e] = v.x, x[e + 1] = v.y;
    }
}

// A loaded head vector normalised with (1 + w) and its first ROT dims rotated (norm_rope = true), or copied (false),
// into dst; cs holds cos [ROT/2] then sin [ROT/2] of this position.
template <class S>
__device__ __forceinline__ void attention_head_store(float (&x)[S::E], bf16* __restrict__ dst,
                                                     const float* __restrict__ norm_w, const float* cs, float eps,
                                                     bool norm_rope) {
    constexpr int E = S::E, HALF = S::ROT / 2;
    const int d0 = threadIdx.x % 32 * E;
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

// One token at absolute position `pos`: its NH query heads, NKV key heads and NKV value heads (slots, in that
// order), a warp taking slots warp, warp + WARPS, ... Every slot of the warp is loaded first, so that the loads are
// in flight while the first ROT/2 threads take the angles. `cs` is ROT floats of shared memory.
template <class S, int THREADS>
__device__ void attention_prep(const bf16* __restrict__ qkv_row, const float* __restrict__ q_norm,
                               const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                               bf16* __restrict__ q_row, bf16* __restrict__ k_row, bf16* __restrict__ v_row,
                               float eps, int pos, float* cs) {
    constexpr int SLOTS = S::NH + 2 * S::NKV, WARPS = THREADS / 32, PER_WARP = (SLOTS + WARPS - 1) / WARPS;
    const int warp = threadIdx.x / 32;
    auto src = [&](int slot) {  // q heads sit beside their gates; the k heads, then the v heads, from K_OFF on
        return slot < S::NH ? qkv_row + slot * 2 * S::HD : qkv_row + S::K_OFF + (slot - S::NH) * S::HD;
    };
    float x[PER_WARP][S::E];
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i)
        if (warp + i * WARPS < SLOTS) attention_head_load<S>(src(warp + i * WARPS), x[i]);
    if (threadIdx.x < S::ROT / 2) {
        double s, c;
        sincos(static_cast<double>(static_cast<float>(pos) * inv_freq[threadIdx.x]), &s, &c);
        cs[threadIdx.x] = static_cast<float>(c);
        cs[S::ROT / 2 + threadIdx.x] = static_cast<float>(s);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PER_WARP; ++i) {
        const int slot = warp + i * WARPS;
        if (slot < S::NH)
            attention_head_store<S>(x[i], q_row + slot * S::HD, q_norm, cs, eps, true);
        else if (slot < S::NH + S::NKV)
            attention_head_store<S>(x[i], k_row + (slot - S::NH) * S::HD, k_norm, cs, eps, true);
        else if (slot < SLOTS)
            attention_head_store<S>(x[i], v_row + (slot - S::NH - S::NKV) * S::HD, nullptr, cs, eps, false);
    }
}

// ---- attention_prefill ---------------------------------------------------------------------------------------

constexpr int ATTN_BM = 64, ATTN_BN = 64, ATTN_THREADS = 128;  // queries per block, keys per tile, 4 warps

template <class S>
constexpr int attention_smem() { return (ATTN_BM + 2 * ATTN_BN) * S::HD * 2; }

// log2(e) / sqrt(HD): the scores' scale, the softmax taken in base 2
template <class S>
__device__ __forceinline__ float attention_scale() { return 1.4426950408889634f * rsqrtf(float(S::HD)); }

// One tile of 64 keys (key0 ..) against a warp's 16 query rows: s holds the thread's scores of rows g and g + 8
// (positions row_pos and row_pos + 8; 8 columns a block, the mma.sync / wgmma accumulator layout). Keys past the
// causal edge or the cache's end (kv_len) are masked (only where the tile reaches past first_pos, the position of
// the block's first query, or past kv_len); then the online softmax in place: s becomes P = 2^(s scale - m), the
// row max m and this thread's part of the row sum l are updated, and o rescaled.
template <int NT>
__device__ __forceinline__ void attention_softmax_tile(float (&s)[ATTN_BN / 8][4], float (&o)[NT][4], float (&m)[2],
                                                       float (&l)[2], int key0, int first_pos, int row_pos,
                                                       int kv_len, float scale) {
    constexpr int SN = ATTN_BN / 8;
    const int tq = threadIdx.x % 4;
    const float neg_inf = -__int_as_float(0x7f800000);
    if (key0 + ATTN_BN - 1 > first_pos || key0 + ATTN_BN > kv_len) {  // the causal edge or the cache's end
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
}

// P's bf16 A fragment for keys 16 kt .. 16 kt + 15 (mma.sync m16n8k16, and wgmma's A from registers) from the
// probabilities in the score registers.
__device__ __forceinline__ void attention_p_frag(unsigned (&a)[4], const float (&p)[ATTN_BN / 8][4], int kt) {
    a[0] = pack_bf16(p[2 * kt][0], p[2 * kt][1]), a[1] = pack_bf16(p[2 * kt][2], p[2 * kt][3]);
    a[2] = pack_bf16(p[2 * kt + 1][0], p[2 * kt + 1][1]), a[3] = pack_bf16(p[2 * kt + 1][2], p[2 * kt + 1][3]);
}

// A query tile's keys split over the SPLIT blocks of a cluster (sm_90 clusters; SPLIT = 1: one block, no cluster).
// Query tile `tile` (the tiles with the most keys first: block x / SPLIT = 0 is the last tile), its key tiles
// [j0, j1): the tile's `key_tiles` cut into SPLIT spans of ceil(key_tiles / SPLIT) (the last ones may be empty).
struct AttnKeys {
    int tile, j0, j1;
};

template <int SPLIT>
__device__ __forceinline__ AttnKeys attention_keys(int block, int T, int start) {
    const int tiles = (T + ATTN_BM - 1) / ATTN_BM, tile = tiles - 1 - block / SPLIT, rank = block % SPLIT;
    const int key_tiles = (min(start + (tile + 1) * ATTN_BM, start + T) + ATTN_BN - 1) / ATTN_BN;
    const int span = (key_tiles + SPLIT - 1) / SPLIT, j0 = min(rank * span, key_tiles);
    return {tile, j0, min(j0 + span, key_tiles)};
}

// out row t of head h = o / l * sigmoid(gate), bf16, for dims d and d + 1.
template <class S>
__device__ __forceinline__ void attention_store(const bf16* __restrict__ qkv, bf16* __restrict__ out, int t, int h,
                                                int d, float o0, float o1, float inv_l) {
    const bf16* gate = qkv + (size_t)t * S::QW + h * 2 * S::HD + S::HD;
    const float2 gv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gate + d));
    *reinterpret_cast<__nv_bfloat162*>(out + ((size_t)t * S::NH + h) * S::HD + d) =
        __floats2bfloat162_rn(o0 * inv_l * sigmoid(gv.x), o1 * inv_l * sigmoid(gv.y));
}

// The rows' sums of exponentials over the quad of threads holding their columns.
__device__ __forceinline__ void attention_quad_sums(float (&l)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
        l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    }
}

// out rows t and t + 8 (the thread's rows g and g + 8; those past T skipped) of head h = O / l * sigmoid(gate).
template <class S>
__device__ __forceinline__ void attention_store_rows(const bf16* __restrict__ qkv, bf16* __restrict__ out,
                                                     const float (&o)[S::HD / 8][4], const float (&l)[2], int t,
                                                     int T, int h) {
    const int tq = threadIdx.x % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        if (t + 8 * half >= T) continue;
        const float inv = 1.f / l[half];
#pragma unroll
        for (int nt = 0; nt < S::HD / 8; ++nt)
            attention_store<S>(qkv, out, t + 8 * half, h, 8 * nt + 2 * tq, o[nt][2 * half], o[nt][2 * half + 1], inv);
    }
}

// A block's partial in its shared memory once its keys are done: o [64][HD] unnormalised, then the row max m (in
// the base-2 units of the scores times log2(e) / sqrt(HD); -inf where the span held no visible key) and the row
// sum l of the exponentials relative to it [64].
template <class S>
struct AttnPartial {
    static constexpr int BYTES = (ATTN_BM * S::HD + 2 * ATTN_BM) * 4;
    static_assert(BYTES <= attention_smem<S>(), "the partial fits the tiles' shared memory");
    float* o;
    __device__ __forceinline__ float* m() const { return o + ATTN_BM * S::HD; }
    __device__ __forceinline__ float* l() const { return m() + ATTN_BM; }
};

// Queries [q0, q0 + 64) of head h (absolute positions start + q0 ..) against key tiles [j0, j1) of its KV head (keys
// past start + T or the causal edge masked). Warp w owns query rows 16w .. 16w+15; a thread holds rows g and g + 8
// of them (g = lane / 4). SPLIT = 1: the block stores the output. Else the block is rank keys.j0 / span of a
// cluster of SPLIT taking the tile's spans: each stores its partial in its shared memory, and block r merges rows
// r, r + SPLIT, ... from the cluster's partials in span order (the sum does not depend on which block ran first).
template <class S, int SPLIT>
__device__ void attention_prefill(const bf16* __restrict__ Q, const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                                  const bf16* __restrict__ qkv, bf16* __restrict__ out, int T, int start,
                                  const AttnKeys& keys, int h, unsigned char* smem) {
    using QTile = SwizzledTile<ATTN_BM, S::HD>;
    using KTile = SwizzledTile<ATTN_BN, S::HD>;
    constexpr int NT = S::HD / 8, SN = ATTN_BN / 8;  // 8-column tiles of the output and of the scores
    const QTile qs{smem};
    const KTile ks{smem + QTile::BYTES}, vs{smem + QTile::BYTES + KTile::BYTES};
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
    const int q0 = keys.tile * ATTN_BM, kvh = h / S::GROUP, kv_len = start + T;
    const size_t kv_ld = (size_t)S::NKV * S::HD;
    auto load_keys = [&](KTile tile, const bf16* cache, int j) {
        load_tile_async<ATTN_BN, S::HD, ATTN_THREADS>(tile, cache + (size_t)j * ATTN_BN * kv_ld + kvh * S::HD, kv_ld,
                                                      kv_len - j * ATTN_BN);
    };
    load_tile_async<ATTN_BM, S::HD, ATTN_THREADS>(qs, Q + ((size_t)q0 * S::NH + h) * S::HD, (size_t)S::NH * S::HD,
                                                  T - q0);
    if (keys.j0 < keys.j1) load_keys(ks, kc, keys.j0);
    cp_async_commit();

    const float scale = attention_scale<S>(), neg_inf = -__int_as_float(0x7f800000);
    float o[NT][4] = {}, m[2] = {neg_inf, neg_inf}, l[2] = {0.f, 0.f};
    const int row_pos = start + q0 + 16 * warp + gq;  // position of row g; row g + 8 is 8 further
#pragma unroll 1
    for (int j = keys.j0; j < keys.j1; ++j) {
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
        attention_softmax_tile(s, o, m, l, j * ATTN_BN, start + q0, row_pos, kv_len, scale);

        cp_async_wait<0>();
        __syncthreads();  // V_j has landed; every warp is done with K_j
        if (j + 1 < keys.j1) load_keys(ks, kc, j + 1);
        cp_async_commit();
#pragma unroll
        for (int kt = 0; kt < ATTN_BN / 16; ++kt) {  // O += P V, P from the score registers as bf16 A fragments
            unsigned a[4];
            attention_p_frag(a, s, kt);
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

    attention_quad_sums(l);
    if constexpr (SPLIT == 1) {  // out = O / l * sigmoid(gate), bf16
        attention_store_rows<S>(qkv, out, o, l, q0 + 16 * warp + gq, T, h);
    } else {
        __syncthreads();  // every warp is done with the tiles: the partial takes their place
        const AttnPartial<S> mine{reinterpret_cast<float*>(smem)};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = 16 * warp + gq + 8 * half;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                *reinterpret_cast<float2*>(mine.o + r * S::HD + 8 * nt + 2 * tq) =
                    make_float2(o[nt][2 * half], o[nt][2 * half + 1]);
            if (tq == 0) mine.m()[r] = m[half], mine.l()[r] = l[half];
        }
        cluster_barrier();  // every span's partial is in its block's shared memory

        // This block's rows r = rank + SPLIT i: each span's weight 2^(m_s - max) / sum, then o summed in span order.
        constexpr int ROWS = (ATTN_BM + SPLIT - 1) / SPLIT, V4 = S::HD / 4;
        __shared__ float weight[ROWS][SPLIT];
        const int rank = blockIdx.x % SPLIT;
        if (threadIdx.x < ROWS && rank + SPLIT * threadIdx.x < ATTN_BM) {
            const int r = rank + SPLIT * threadIdx.x;
            float ms[SPLIT], mx = neg_inf, sum = 0.f;
#pragma unroll
            for (int s = 0; s < SPLIT; ++s)
                ms[s] = cluster_load(cluster_address(mine.m() + r, s)), mx = fmaxf(mx, ms[s]);
#pragma unroll
            for (int s = 0; s < SPLIT; ++s) {
                ms[s] = ms[s] == neg_inf ? 0.f : exp2f(ms[s] - mx);
                sum += ms[s] * cluster_load(cluster_address(mine.l() + r, s));
            }
#pragma unroll
            for (int s = 0; s < SPLIT; ++s) weight[threadIdx.x][s] = ms[s] / sum;
        }
        __syncthreads();
#pragma unroll 2
        for (int e = threadIdx.x; e < ROWS * V4; e += ATTN_THREADS) {
            const int i = e / V4, r = rank + SPLIT * i, d = e % V4 * 4, t = q0 + r;
            if (r >= ATTN_BM || t >= T) continue;
            float4 v[SPLIT];
#pragma unroll
            for (int s = 0; s < SPLIT; ++s) v[s] = cluster_load4(cluster_address(mine.o + r * S::HD + d, s));
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int s = 0; s < SPLIT; ++s) {
                const float w = weight[i][s];
                acc.x += w * v[s].x, acc.y += w * v[s].y, acc.z += w * v[s].z, acc.w += w * v[s].w;
            }
            attention_store<S>(qkv, out, t, h, d, acc.x, acc.y, 1.f);
            attention_store<S>(qkv, out, t, h, d + 2, acc.z, acc.w, 1.f);
        }
        cluster_barrier();  // the cluster's reads of this block's partial are done before it exits
    }
}

}  // namespace lucegen
