// mk_attention.cuh: gated full attention for one decode token, split over blocks by (kv head, chunk of the
// context): flash-decoding. Each work item attends the G = n_heads / n_kv_heads query heads of its kv head over
// its chunk of positions with an online softmax and writes a partial (max, sum, unnormalised output); the last
// item of a kv head to finish (a ticket) merges the partials with their log-sum-exp weights and applies the
// sigmoid output gate. Chunks are as short as the grid allows (but at least MIN_CHUNK positions), so a long
// context keeps every block busy and a short one stays cheap.
//
// KV cache (lucegen/engine/state.py): keys and values bf16 [max_context][n_kv][head_dim] per layer, keys stored
// after k_norm and RoPE. The item holding the current position writes its K and V before reading them.
#pragma once
#include "common.cuh"
#include "grid.cuh"
#include "kv.cuh"
#include "mk_deltanet.cuh"
#include "quant.cuh"

namespace lucegen {

struct AttentionLayer {
    const float* qkv;       // this token's in-projection: per q head [query | gate], then k, then v
    const float* q_norm;    // [head_dim], zero-centred
    const float* k_norm;    // [head_dim], zero-centred
    bf16* keys;             // this layer's cache
    bf16* values;
    float* part_ml;         // [n_kv][chunks][G][2] per-item softmax max and sum
    float* part_acc;        // [n_kv][chunks][G][head_dim] per-item unnormalised outputs
    unsigned* tickets;      // [n_kv], zero between uses
    float* out;             // [n_heads * head_dim] gated attention output
    XRow out_q;             // out's XBlocks (the out-projection's activations), or none (p null)
};

// How the context of n positions is cut: chunk length and count (the same in every block).
template <class M>
__device__ __forceinline__ int2 attention_chunks(int n, int blocks) {
    const int per_head = max(1, blocks / M::ATT_NKV);
    const int len = max(M::ATT_MIN_CHUNK, (n + per_head - 1) / per_head);
    return make_int2(len, (n + len - 1) / len);
}

// A row of HD floats (x, global or shared memory) into a cache row, block-wide: a thread a 32-value block, or a
// warp a group (kv.cuh: KV::GROUP).
template <class KV, int HD, int THREADS>
__device__ __forceinline__ void kv_store_row(const float* x, unsigned char* row) {
    if constexpr (KV::GROUP == 32) {
        for (int b = threadIdx.x; b < HD / 32; b += THREADS) KV::store_block(x + 32 * b, row + b * KV::BLOCK_BYTES);
    } else {
        static_assert(HD % KV::GROUP == 0, "whole groups a row");
        for (int i = threadIdx.x / 32; i < HD / KV::GROUP; i += THREADS / 32)
            KV::store_group(x + KV::GROUP * i, row + i * (KV::GROUP / 32) * KV::BLOCK_BYTES);
    }
}

// Each group of n floats in shared memory (n / KV::GROUP of them) rotated in place, or back (INVERSE), block-wide: a
// warp a group. Ends with the block synchronised.
template <class KV, bool INVERSE, int THREADS>
__device__ __forceinline__ void kv_rotate_groups(float* x, int n) {
    for (int i = threadIdx.x / 32; i < n / KV::GROUP; i += THREADS / 32)
        KV::template rotate_group<INVERSE>(x + KV::GROUP * i);
    __syncthreads();
}

// Offset of kv head g's row at position p in a layer's keys or values.
template <class M>
__device__ __forceinline__ size_t kv_offset(int g, int p) {
    return ((size_t)p * M::ATT_NKV + g) * M::ATT_HD;
}

// The in-projection rows [x, y) the items of kv head g read: its query heads' [query | gate], its key and value.
template <class M>
__device__ __forceinline__ void attention_reads(int g, int2 (&rows)[3]) {
    constexpr int G = M::ATT_NH / M::ATT_NKV, HD = M::ATT_HD, K0 = 2 * M::ATT_NH * HD;
    rows[0] = make_int2(g * G * 2 * HD, (g + 1) * G * 2 * HD);
    rows[1] = make_int2(K0 + g * HD, K0 + (g + 1) * HD);
    rows[2] = make_int2(K0 + (M::ATT_NKV + g) * HD, K0 + (M::ATT_NKV + g + 1) * HD);
}

// The cached positions of an item's chunk (all kv heads' rows: they are interleaved by position).
template <class M>
__device__ __forceinline__ void attention_prefetch(const AttentionLayer& L, int item, int pos) {
    const int2 ch = attention_chunks<M>(pos + 1, gridDim.x);
    if (item >= M::ATT_NKV * ch.y) return;
    const int first = (item % ch.y) * ch.x, last = min(first + ch.x, pos);  // pos itself is written later
    if (last <= first) return;
    const size_t bytes = (size_t)(last - first) * M::ATT_NKV * M::ATT_HD * sizeof(bf16);
    prefetch_l2(L.keys + kv_offset<M>(0, first), bytes);
    prefetch_l2(L.values + kv_offset<M>(0, first), bytes);
}

// RMSNorm (zero-centred weight) of a head_dim vector from global memory into shared memory, by one warp: one
// round trip (the vector stays in registers between the sum and the scaling).
template <int HD>
__device__ __forceinline__ void head_rmsnorm(const float* x, const float* w, float eps, float* y) {
    constexpr int PER_LANE = (HD + 31) / 32;
    const int lane = threadIdx.x % 32;
    float v[PER_LANE], ss = 0.f;
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        const int d = lane + 32 * u;
        v[u] = d < HD ? load_coherent(x + d) : 0.f;
        ss += v[u] * v[u];
    }
    const float rstd = rsqrtf(warp_sum(ss) / HD + eps);
#pragma unroll
    for (int u = 0; u < PER_LANE; ++u) {
        const int d = lane + 32 * u;
        if (d < HD) y[d] = v[u] * rstd * (1.f + w[d]);
    }
}

// Rotates dims [0, ROT) of x in place (half-split pairs i, i + ROT/2); multiplies every dim by `scale`.
template <int HD, int ROT>
__device__ __forceinline__ void rope_in_place(float* x, const float* cs, const float* sn, float scale, int t,
                                              int stride) {
    for (int d = t; d < HD; d += stride) {
        if (d < ROT / 2) {
            const float a = x[d], b = x[d + ROT / 2];
            x[d] = (a * cs[d] - b * sn[d]) * scale;
            x[d + ROT / 2] = (b * cs[d] + a * sn[d]) * scale;
        } else if (d >= ROT) {
            x[d] *= scale;
        }
    }
}

// cos and sin of an fp32 angle, correctly rounded to fp32: computed in double, because the fast-math sincos is
// inaccurate far from zero (RoPE angles reach the position). Out of line: double sincos needs many registers.
__device__ __noinline__ float2 cos_sin(float angle) {
    double s, c;
    sincos(static_cast<double>(angle), &s, &c);
    return make_float2(static_cast<float>(c), static_cast<float>(s));
}

// The floats at the start of an item's shared memory (QueryWork): its queries, this token's key and value, RoPE's
// cos and sin.
template <class M>
constexpr int query_work_floats() {
    return (M::ATT_NH / M::ATT_NKV + 2) * M::ATT_HD + M::ATT_ROT;
}

// Shared memory of one item, in floats: the larger of the carve-ups of attention_item and attention_merge.
template <class M, int WARPS, int BLOCKS>
constexpr int attention_work_floats() {
    constexpr int G = M::ATT_NH / M::ATT_NKV, HD = M::ATT_HD;
    constexpr int item = query_work_floats<M>() + 2 * WARPS + WARPS * HD;
    constexpr int merge = (BLOCKS / M::ATT_NKV > 1 ? BLOCKS / M::ATT_NKV : 1) * G + G;
    return item > merge ? item : merge;
}

// The last item of kv head g to finish: the log-sum-exp weights of the n_chunks partials per head (warp h), then
// the merged, gated outputs, a thread four consecutive outputs of a head at a time (16-byte loads: a thread's batch
// of partials in flight together is 128 bytes, against 32 a float at a time). The partials are added in chunk order,
// each output's on its own, so the bits do not depend on the grouping. A lane's first partial's (max, sum) is loaded
// once for both passes over them. Rows of a ROTATED format (kv.cuh) give outputs in their domain: merged in shared
// memory, rotated back, then gated. Out of line: one block per kv head runs it, and its registers stay its own.
template <class M, int THREADS, class KV = KVBf16>
__device__ void attention_merge(const AttentionLayer& L, int g, int n_chunks, float* work) {
    constexpr int G = M::ATT_NH / M::ATT_NKV, HD = M::ATT_HD, WARPS = THREADS / 32, QUADS = G * HD / 4;
    constexpr int BATCH = 8;  // a thread's partials in flight together
    static_assert(HD % 4 == 0, "outputs in quads of a head");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int max_chunks = max(1, (int)gridDim.x / M::ATT_NKV);
    float* wgt = work;                    // [max_chunks][G] partial weights
    float* total = wgt + max_chunks * G;  // [G] their sums
    float* merged = work + (max_chunks * G + G + 3) / 4 * 4;  // [G][HD] the outputs before the rotation back
                                                              // (ROTATED formats), 16-byte aligned
    const auto gate = [&](int q) {  // quad q's gates (outputs 4q ..), sigmoid applied
        const int e = 4 * q;
        const float4 z = load_coherent(reinterpret_cast<const float4*>(L.qkv + (size_t)(g * G + e / HD) * 2 * HD + HD + e % HD));
        return make_float4(sigmoid(z.x), sigmoid(z.y), sigmoid(z.z), sigmoid(z.w));
    };
    const auto load_batch = [&](int q, int i0, float4 (&part)[BATCH]) {
        const float4* acc = reinterpret_cast<const float4*>(L.part_acc) + ((size_t)g * max_chunks * G * HD + 4 * q) / 4;
#pragma unroll
        for (int j = 0; j < BATCH; ++j)
            part[j] = i0 + j < n_chunks ? __ldcg(acc + (size_t)(i0 + j) * G * HD / 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    };
    if (warp < G) {
        const float2* ml = reinterpret_cast<const float2*>(L.part_ml) + (size_t)g * max_chunks * G;  // (max, sum)
        const float2 own = lane < n_chunks ? __ldcg(ml + lane * G + warp) : make_float2(-__int_as_float(0x7f800000), 0.f);
        float mx = own.x;
        for (int i = lane + 32; i < n_chunks; i += 32) mx = fmaxf(mx, __ldcg(&ml[i * G + warp].x));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float s = 0.f;
        for (int i = lane; i < n_chunks; i += 32) {
            const float2 m = i == lane ? own : __ldcg(ml + i * G + warp);
            const float w = __expf(m.x - mx);
            wgt[i * G + warp] = w;
            s += w * m.y;
        }
        s = warp_sum(s);
        if (lane == 0) total[warp] = s;
    }
    __syncthreads();
    for (int q = threadIdx.x; q < QUADS; q += THREADS) {
        const int h = 4 * q / HD;
        float4 gt = make_float4(0.f, 0.f, 0.f, 0.f), part[BATCH];
        if constexpr (!KV::ROTATED) gt = gate(q);  // loaded before the partials: its latency hides behind theirs
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int i0 = 0; i0 < n_chunks; i0 += BATCH) {
            load_batch(q, i0, part);
#pragma unroll
            for (int j = 0; j < BATCH; ++j)
                if (i0 + j < n_chunks) {
                    const float w = wgt[(i0 + j) * G + h];
                    a.x += w * part[j].x;
                    a.y += w * part[j].y;
                    a.z += w * part[j].z;
                    a.w += w * part[j].w;
                }
        }
        const float r = total[h];
        a = make_float4(a.x / r, a.y / r, a.z / r, a.w / r);
        if constexpr (KV::ROTATED) reinterpret_cast<float4*>(merged)[q] = a;
        else reinterpret_cast<float4*>(L.out + g * G * HD)[q] = make_float4(a.x * gt.x, a.y * gt.y, a.z * gt.z, a.w * gt.w);
    }
    if constexpr (KV::ROTATED) {
        __syncthreads();
        kv_rotate_groups<KV, true, THREADS>(merged, G * HD);
        for (int q = threadIdx.x; q < QUADS; q += THREADS) {
            const float4 a = reinterpret_cast<const float4*>(merged)[q], z = gate(q);
            reinterpret_cast<float4*>(L.out + g * G * HD)[q] = make_float4(a.x * z.x, a.y * z.y, a.z * z.z, a.w * z.w);
        }
    }
    if constexpr (G * HD % 32 == 0)
        if (L.out_q.p != nullptr) {  // kv head g's outputs are whole XBlocks: quantized here, not in a launch of theirs
            __syncthreads();
            for (int i = threadIdx.x; i < G * HD / 32; i += THREADS)
                *L.out_q.at(g * G * HD / 32 + i) = quantize_xblock(L.out + g * G * HD + 32 * i);
        }
    static_assert(G <= WARPS, "one warp per head");
}

// Cache rows by position: the decode step reads position p at row p.
struct SequenceRows {
    __device__ __forceinline__ int operator()(int p) const { return p; }
};

// Waits for nothing: the item's inputs are written before it starts.
struct NoWait {
    __device__ __forceinline__ void operator()() const {}
};

// An item's share of the work: kv head g, chunk c of the kv head's `chunks`, positions [first, last) of the
// pos + 1 it attends; max_chunks: the chunks a kv head's partials have room for.
struct AttentionSpan {
    int g, c, chunks, first, last, max_chunks;
};

template <class M>
__device__ __forceinline__ AttentionSpan attention_span(int item, int pos) {
    const int2 ch = attention_chunks<M>(pos + 1, gridDim.x);
    const int c = item % ch.y, first = c * ch.x;
    return {item / ch.y, c, ch.y, first, min(first + ch.x, pos + 1), max(1, (int)gridDim.x / M::ATT_NKV)};
}

// The start of an item's shared memory `work`: q [G][HD] its query heads (normed, rotated, scaled), k and v [HD]
// this token's key and value (the item holding its position), cos and sin [ROT / 2] each; `rest` the floats past
// them.
template <class M>
struct QueryWork {
    float *q, *k, *v, *cs, *sn, *rest;
    __device__ explicit QueryWork(float* work)
        : q(work), k(q + M::ATT_NH / M::ATT_NKV * M::ATT_HD), v(k + M::ATT_HD), cs(v + M::ATT_HD),
          sn(cs + M::ATT_ROT / 2), rest(sn + M::ATT_ROT / 2) {}
};

// The start of a work item of kv head g: w.q = its query heads, normed, rotated and scaled; with holds_pos, this
// token's K (normed, rotated) and V written to cache row `pos` first (through w.k and w.v), in KV row format KV
// (kv.cuh; rows of a ROTATED format: the queries rotated into their domain too). wait() (block-wide) returns once
// the in-projection rows are written; the RoPE angles are worked out before it. Ends with the block synchronised.
template <class M, int THREADS, class Wait, class KV = KVBf16>
__device__ __forceinline__ void attention_queries(const AttentionLayer& L, int g, int pos, bool holds_pos,
                                                  const QueryWork<M>& w, Wait wait) {
    constexpr int G = M::ATT_NH / M::ATT_NKV, HD = M::ATT_HD, ROT = M::ATT_ROT;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *q = w.q, *k = w.k, *v = w.v, *cs = w.cs, *sn = w.sn;
    // RoPE angles as HF computes them: fp32 position times fp32 inv_freq, then cos/sin of that fp32 angle.
    for (int i = threadIdx.x; i < ROT / 2; i += THREADS) {
        const float2 t = cos_sin(static_cast<float>(pos) * M::inv_freq(i));
        cs[i] = t.x;
        sn[i] = t.y;
    }
    wait();
    const float* qkv_k = L.qkv + 2 * M::ATT_NH * HD + g * HD;
    const float* qkv_v = L.qkv + 2 * M::ATT_NH * HD + M::ATT_NKV * HD + g * HD;
    if (warp < G) head_rmsnorm<HD>(L.qkv + (size_t)(g * G + warp) * 2 * HD, L.q_norm, M::EPS, q + warp * HD);
    if (holds_pos && warp == G) head_rmsnorm<HD>(qkv_k, L.k_norm, M::EPS, k);
    if (holds_pos && warp == G + 1)
        for (int d = lane; d < HD; d += 32) v[d] = load_coherent(qkv_v + d);
    __syncthreads();
    const float scale = rsqrtf(static_cast<float>(HD));
    for (int h = 0; h < G; ++h) rope_in_place<HD, ROT>(q + h * HD, cs, sn, scale, threadIdx.x, THREADS);
    if (holds_pos) {
        rope_in_place<HD, ROT>(k, cs, sn, 1.f, threadIdx.x, THREADS);
        __syncthreads();
        if constexpr (KV::BF16) {
            for (int d = threadIdx.x; d < 2 * HD; d += THREADS)
                (d < HD ? L.keys : L.values)[kv_offset<M>(g, pos) + d % HD] =
                    __float2bfloat16(d < HD ? k[d] : v[d - HD]);
        } else {
            const size_t row = kv_row<KV, M::ATT_NKV, HD>(g, pos);
            kv_store_row<KV, HD, THREADS>(k, reinterpret_cast<unsigned char*>(L.keys) + row);
            kv_store_row<KV, HD, THREADS>(v, reinterpret_cast<unsigned char*>(L.values) + row);
        }
    }
    __syncthreads();  // queries ready; this position's K/V in the cache
    if constexpr (KV::ROTATED) kv_rotate_groups<KV, false, THREADS>(q, G * HD);  // q.k in the rows' domain
}

// One work item (kv head g, chunk c), by one block; then, in the last item of kv head g, the merge. The query at
// `pos` attends positions 0 .. pos, read from cache rows rows(p). With writes_kv the item holding pos first writes
// this token's K and V to row pos; without, they are in the cache already (a tree verify wrote them). wait()
// (block-wide) returns once the item's in-projection rows are written (attention_queries).
// PB: the K/V rows a warp has in flight at once (registers: 16 a row and lane for a head of 256).
template <class M, int THREADS, class Rows = SequenceRows, class Wait = NoWait, int PB = 2>
__device__ void attention_item(const AttentionLayer& L, int item, int pos, float* work, int* flag, Rows rows = {},
                               bool writes_kv = true, Wait wait = {}) {
    constexpr int G = M::ATT_NH / M::ATT_NKV, HD = M::ATT_HD, ROT = M::ATT_ROT, WARPS = THREADS / 32;
    constexpr int CPL = (HD / 8 + 31) / 32;  // 8-value chunks of a head per lane
    static_assert(HD % 8 == 0 && ROT % 2 == 0 && G + 2 <= WARPS, "attention split");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const AttentionSpan sp = attention_span<M>(item, pos);
    const int g = sp.g, c = sp.c, first = sp.first, last = sp.last, max_chunks = sp.max_chunks;
    const QueryWork<M> w(work);
    const float* q = w.q;
    float* wm = w.rest;              // [WARPS] per-warp max, then [WARPS] sum
    float* wl = wm + WARPS;
    float* wacc = wl + WARPS;        // [WARPS][HD]
    attention_queries<M, THREADS>(L, g, pos, writes_kv && last == pos + 1, w, wait);

    // Warp w attends query head h = w % G at positions first + w / G, + count, ... (the `count` warps of a head
    // split its positions), holding one head's online softmax (max, sum, HD/32 outputs per lane) in registers.
    // The G warps that read a K/V row share it through L1 where that is safe: a position's rows are written once,
    // before any block reads them, and L1 starts empty at launch, so a cached line is stale only if it also holds
    // a later position (rows of a position shorter than a 128-byte line); then they are read from L2.
    // PB rows per round have their loads in flight together.
    constexpr bool L1_SAFE = M::ATT_NKV * HD * sizeof(bf16) % 128 == 0;
    const int h = warp % G, count = (WARPS - h + G - 1) / G;
    float m = -__int_as_float(0x7f800000), l = 0.f, acc[CPL][8];
    f32x8 qr[CPL];
#pragma unroll
    for (int u = 0; u < CPL; ++u) {
        const float4* q4 = reinterpret_cast<const float4*>(q + h * HD + min(lane + 32 * u, HD / 8 - 1) * 8);
        qr[u] = f32x8{q4[0], q4[1]};
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
    }
    for (int p0 = first + warp / G; p0 < last; p0 += count * PB) {
        uint4 kr[PB][CPL], vr[PB][CPL];
#pragma unroll
        for (int b = 0; b < PB; ++b) {
            const size_t row = kv_offset<M>(g, rows(min(p0 + b * count, last - 1)));
            const uint4* kp = reinterpret_cast<const uint4*>(L.keys + row);
            const uint4* vp = reinterpret_cast<const uint4*>(L.values + row);
#pragma unroll
            for (int u = 0; u < CPL; ++u) {
                const int cc = min(lane + 32 * u, HD / 8 - 1);
                kr[b][u] = L1_SAFE ? kp[cc] : __ldcg(kp + cc);
                vr[b][u] = L1_SAFE ? vp[cc] : __ldcg(vp + cc);
            }
        }
#pragma unroll
        for (int b = 0; b < PB; ++b) {
            if (p0 + b * count >= last) break;
            float s = 0.f;
#pragma unroll
            for (int u = 0; u < CPL; ++u)
                if (lane + 32 * u < HD / 8) s += dot8_bf16(kr[b][u], qr[u]);
            s = warp_sum(s);
            const float m_new = fmaxf(m, s), corr = __expf(m - m_new), w = __expf(s - m_new);
            m = m_new;
            l = l * corr + w;
#pragma unroll
            for (int u = 0; u < CPL; ++u) {
                const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&vr[b][u]);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 f = __bfloat1622float2(v2[e]);
                    acc[u][2 * e] = acc[u][2 * e] * corr + w * f.x;
                    acc[u][2 * e + 1] = acc[u][2 * e + 1] * corr + w * f.y;
                }
            }
        }
    }

    // The block's partial per head: merge the (max, sum, acc) of the head's warps through shared memory.
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int u = 0; u < CPL; ++u)
        if (lane + 32 * u < HD / 8)
#pragma unroll
            for (int e = 0; e < 8; ++e) wacc[warp * HD + (lane + 32 * u) * 8 + e] = acc[u][e];
    __syncthreads();
    const size_t part = ((size_t)g * max_chunks + c) * G;
    for (int e = threadIdx.x; e < G * HD; e += THREADS) {
        const int head = e / HD, d = e % HD;
        float mx = wm[head];
        for (int w = head + G; w < WARPS; w += G) mx = fmaxf(mx, wm[w]);
        float a = 0.f, sum = 0.f;
#pragma unroll 1
        for (int w = head; w < WARPS; w += G) {
            const float f = __expf(wm[w] - mx);
            a += f * wacc[w * HD + d];
            sum += f * wl[w];
        }
        L.part_acc[(part + head) * HD + d] = a;
        if (d == 0) {
            L.part_ml[(part + head) * 2] = mx;
            L.part_ml[(part + head) * 2 + 1] = sum;
        }
    }

    if (last_to_arrive(L.tickets + g, sp.chunks, flag)) attention_merge<M, THREADS>(L, g, sp.chunks, work);
}

// Shared memory of one attention_item_gqa, in floats: the larger of its carve-up and attention_merge's.
template <class M, int WARPS, int BLOCKS>
constexpr int attention_gqa_work_floats() {
    constexpr int G = M::ATT_NH / M::ATT_NKV, HD = M::ATT_HD;
    constexpr int item = query_work_floats<M>() + WARPS * 32 + 2 * WARPS + WARPS * HD;
    // attention_merge's weights and sums, then its merged outputs (rows of a ROTATED format), 16-byte aligned
    constexpr int merge = ((BLOCKS / M::ATT_NKV > 1 ? BLOCKS / M::ATT_NKV : 1) * G + G + 3) / 4 * 4 + G * HD;
    return item > merge ? item : merge;
}

// The query heads a warp of attention_item_gqa attends: the largest divisor of G up to 6 (a lane holds 16 floats a
// head: its query values and outputs).
template <int G>
constexpr int attention_gqa_heads() {
    int gh = 1;
    for (int d = 1; d <= 6 && d <= G; ++d)
        if (G % d == 0) gh = d;
    return gh;
}

// attention_item with each warp attending GH = attention_gqa_heads query heads of kv head g (grouped-query
// attention): warp w takes head group w % NG (NG = G / GH) and positions first + w / NG, + WARPS / NG, ... in rounds
// of PB rows, each K/V row read and converted once for its GH heads, not once a head. A round's GH x PB partial
// scores are summed across the warp together (warp_sums_spread) and shared through shared memory, where every lane
// takes the round's softmax weights; the running max, and the rescaling of the outputs when it grows, move once a
// round. Then the block's partial per head (over its warps) and, in the last item of kv head g, the merge. Shared
// memory: attention_gqa_work_floats. The cache rows are in format KV (kv.cuh; L.keys and L.values as bytes).
template <class M, int THREADS, class Rows, int PB, class KV = KVBf16>
__device__ void attention_item_gqa(const AttentionLayer& L, int item, int pos, float* work, int* flag, Rows rows,
                                   bool writes_kv) {
    constexpr int G = M::ATT_NH / M::ATT_NKV, HD = M::ATT_HD, ROT = M::ATT_ROT, WARPS = THREADS / 32;
    constexpr int GH = attention_gqa_heads<G>(), NG = G / GH, STREAMS = WARPS / NG;
    constexpr int CPL = (HD / 8 + 31) / 32;  // 8-value chunks of a head per lane
    constexpr int S = GH * PB, N = S <= 1 ? 1 : S <= 2 ? 2 : S <= 4 ? 4 : S <= 8 ? 8 : S <= 16 ? 16 : 32;
    static_assert(S <= 32, "a round's scores are at most a warp's lanes");
    static_assert(WARPS % NG == 0, "whole position streams of warps");
    static_assert(HD % 8 == 0 && ROT % 2 == 0 && G + 2 <= WARPS, "attention split");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, hg = warp % NG, stream = warp / NG;
    const AttentionSpan sp = attention_span<M>(item, pos);
    const int g = sp.g, c = sp.c, first = sp.first, last = sp.last, max_chunks = sp.max_chunks;
    const QueryWork<M> w(work);
    const float* q = w.q;
    float* sc = w.rest;           // [WARPS][32] a round's scores
    float* wm = sc + WARPS * 32;  // [WARPS] a head's per-warp max, then [WARPS] sum
    float* wl = wm + WARPS;
    float* wacc = wl + WARPS;     // [WARPS][HD] a head's per-warp outputs
    attention_queries<M, THREADS, NoWait, KV>(L, g, pos, writes_kv && last == pos + 1, w, NoWait{});

    const auto chunk = [&](int u) { return min(lane + 32 * u, HD / 8 - 1); };  // lanes past HD / 8: dropped
    const unsigned char* keys = reinterpret_cast<const unsigned char*>(L.keys);
    const unsigned char* values = reinterpret_cast<const unsigned char*>(L.values);
    float qr[GH][CPL][8], m[GH], l[GH], acc[GH][CPL][8];
#pragma unroll
    for (int h = 0; h < GH; ++h) {
        m[h] = -__int_as_float(0x7f800000);
        l[h] = 0.f;
#pragma unroll
        for (int u = 0; u < CPL; ++u)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                qr[h][u][e] = q[(hg * GH + h) * HD + chunk(u) * 8 + e];
                acc[h][u][e] = 0.f;
            }
    }
    float* mine = sc + warp * 32;
    for (int p0 = first + stream; p0 < last; p0 += STREAMS * PB) {
        typename KV::Raw kr[PB][CPL], vr[PB][CPL];
#pragma unroll
        for (int b = 0; b < PB; ++b) {
            const size_t row = kv_row<KV, M::ATT_NKV, HD>(g, rows(min(p0 + b * STREAMS, last - 1)));
#pragma unroll
            for (int u = 0; u < CPL; ++u) {
                kr[b][u] = KV::load(keys + row, chunk(u));
                vr[b][u] = KV::load(values + row, chunk(u));
            }
        }
        float part[N];  // [b][h]: this lane's share of row b's score for head h
#pragma unroll
        for (int i = 0; i < N; ++i) part[i] = 0.f;
#pragma unroll
        for (int b = 0; b < PB; ++b)
#pragma unroll
            for (int u = 0; u < CPL; ++u) {
                if (lane + 32 * u >= HD / 8) continue;
                float kf[8];
                if constexpr (KV::SCALED) {  // the chunk's unscaled values times each head's query, then its scale once
                    KV::unscaled(kr[b][u], kf);
                    const float d = KV::scale(kr[b][u]);
#pragma unroll
                    for (int h = 0; h < GH; ++h) {
                        float s = kf[0] * qr[h][u][0];
#pragma unroll
                        for (int e = 1; e < 8; ++e) s = fmaf(kf[e], qr[h][u][e], s);
                        part[b * GH + h] = fmaf(d, s, part[b * GH + h]);
                    }
                } else {
                    KV::values(kr[b][u], kf);
#pragma unroll
                    for (int h = 0; h < GH; ++h)
#pragma unroll
                        for (int e = 0; e < 8; ++e) part[b * GH + h] = fmaf(kf[e], qr[h][u][e], part[b * GH + h]);
                }
            }
        const float own = warp_sums_spread<N>(part);
        if (lane % (32 / N) == 0) mine[lane / (32 / N)] = own;
        __syncwarp();
        float w[PB][GH], corr[GH];
#pragma unroll
        for (int h = 0; h < GH; ++h) {
            float mx = m[h];
#pragma unroll
            for (int b = 0; b < PB; ++b)
                if (p0 + b * STREAMS < last) mx = fmaxf(mx, mine[b * GH + h]);
            corr[h] = __expf(m[h] - mx);
            float sum = 0.f;
#pragma unroll
            for (int b = 0; b < PB; ++b) {
                w[b][h] = p0 + b * STREAMS < last ? __expf(mine[b * GH + h] - mx) : 0.f;
                sum += w[b][h];
            }
            l[h] = l[h] * corr[h] + sum;
            m[h] = mx;
        }
        __syncwarp();  // every lane has read the scores before the next round writes its own
#pragma unroll
        for (int u = 0; u < CPL; ++u) {
#pragma unroll
            for (int h = 0; h < GH; ++h)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[h][u][e] *= corr[h];
#pragma unroll
            for (int b = 0; b < PB; ++b) {
                float vf[8];
                float wd[GH];  // the row's weight per head, times its chunk's scale (SCALED formats)
                if constexpr (KV::SCALED) {
                    KV::unscaled(vr[b][u], vf);
#pragma unroll
                    for (int h = 0; h < GH; ++h) wd[h] = w[b][h] * KV::scale(vr[b][u]);
                } else {
                    KV::values(vr[b][u], vf);
#pragma unroll
                    for (int h = 0; h < GH; ++h) wd[h] = w[b][h];
                }
#pragma unroll
                for (int h = 0; h < GH; ++h)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[h][u][e] = fmaf(wd[h], vf[e], acc[h][u][e]);
            }
        }
    }

    // The block's partial per head: the (max, sum, outputs) of the warps attending it, merged through shared
    // memory; round h takes head h of every head group.
    const size_t part0 = ((size_t)g * max_chunks + c) * G;
#pragma unroll
    for (int h = 0; h < GH; ++h) {
        if (lane == 0) {
            wm[warp] = m[h];
            wl[warp] = l[h];
        }
#pragma unroll
        for (int u = 0; u < CPL; ++u)
            if (lane + 32 * u < HD / 8)
#pragma unroll
                for (int e = 0; e < 8; ++e) wacc[warp * HD + (lane + 32 * u) * 8 + e] = acc[h][u][e];
        __syncthreads();
        for (int o = threadIdx.x; o < NG * HD; o += THREADS) {
            const int grp = o / HD, d = o % HD, head = grp * GH + h;
            float mx = wm[grp];
#pragma unroll
            for (int s2 = 1; s2 < STREAMS; ++s2) mx = fmaxf(mx, wm[s2 * NG + grp]);
            float a = 0.f, sum = 0.f;
#pragma unroll
            for (int s2 = 0; s2 < STREAMS; ++s2) {
                const int w2 = s2 * NG + grp;
                const float f = __expf(wm[w2] - mx);
                a += f * wacc[w2 * HD + d];
                sum += f * wl[w2];
            }
            L.part_acc[(part0 + head) * HD + d] = a;
            if (d == 0) {
                L.part_ml[(part0 + head) * 2] = mx;
                L.part_ml[(part0 + head) * 2 + 1] = sum;
            }
        }
        __syncthreads();
    }

    if (last_to_arrive(L.tickets + g, sp.chunks, flag)) attention_merge<M, THREADS, KV>(L, g, sp.chunks, work);
}

}  // namespace lucegen
