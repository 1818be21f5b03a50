// topk.cuh: the k best entries of each row of fp32 logits [n, vocab] and their log-softmax values, in one launch.
//
// Order: larger value first, the lower token id on ties (numpy's np.argsort(-row, kind="stable")); -0 ties +0;
// NaN ranks below -inf. A value is compared through its key (topk_key), an unsigned integer in the same order, and
// an entry (key, position) is a composite that no two entries share, so every selection below is exact and its
// result a function of the input alone, never of timing.
//
// Grid (blocks, n): block b of row r takes the slice [b * SLICE, (b + 1) * SLICE) of the row, THREADS threads x
// PER values (thread t holds positions j * THREADS + t, j < PER: coalesced loads, and thread groups that interleave).
//   1. its max m_b and s_b = sum exp(x - m_b) over the slice (each thread its values in order, then fixed trees);
//   2. its top k, exactly: the threads' maxima are reduced to GROUPS group maxima (GROUPS >= KMAX >= k); L, the
//      k-th best of them, is found by counting, and k groups have a maximum >= L, so the slice's top k are all >= L
//      and at most k * SLICE / GROUPS entries are (typically about k + k / 2 on random rows; k - 1 + GROUP_THREADS * k
//      at most when the whole row ties). They are gathered into shared memory, and each one's rank among them
//      (the number of better ones) is its place in the block's list: KMAX (key, token id) entries, best first, the
//      places from k on left as none.
// The last block of a row to finish (an atomic ticket per row, reset by that block, so the next launch needs no
// memset) merges the row's lists: lse = M + log(sum_b s_b exp(m_b - M)), M the largest m_b (blocks in index order
// per thread, then a fixed tree), and the top k of the lists by bitonic merges (a warp holds a list of KMAX entries,
// KMAX / 32 per lane; merging a sorted list A into it keeps, place by place, the better of R[i] and A[KMAX - 1 - i],
// a bitonic sequence holding the top KMAX of both, then sorts it with log2(KMAX) half-cleaners). The top k of a
// union is one set whatever order the lists are merged in, so the result does not depend on which block came last.
#pragma once
#include "common.cuh"

namespace lucegen {

// (key, id) ordered as the result: the larger key first, then the lower id. Within a block, id is the position in
// the slice; in the lists and the result, the token id.
struct TopKEntry {
    unsigned key;
    unsigned id;
};

constexpr unsigned TOPK_NONE_ID = 0x7fffffffu;

// Below every real entry, a NaN (key 0) included: it pads lists of a slice shorter than k.
__device__ __forceinline__ TopKEntry topk_none() { return TopKEntry{0u, TOPK_NONE_ID}; }

__device__ __forceinline__ bool topk_better(TopKEntry a, TopKEntry b) {
    return a.key > b.key || (a.key == b.key && a.id < b.id);
}

// An fp32 value as an unsigned key in the same order. -0 is taken as +0 (they compare equal, so numpy ranks them
// by index); every NaN is key 0, below -inf (0x007fffff), as numpy sorts NaN last.
__device__ __forceinline__ unsigned topk_key(float x) {
    unsigned u = __float_as_uint(x);
    if (u == 0x80000000u) u = 0u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The value of a key (key 0 gives a NaN).
__device__ __forceinline__ float topk_value(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ TopKEntry topk_shfl_xor(TopKEntry e, int o) {
    return TopKEntry{__shfl_xor_sync(0xffffffffu, e.key, o), __shfl_xor_sync(0xffffffffu, e.id, o)};
}

__device__ __forceinline__ TopKEntry topk_load(const TopKEntry* p) {  // written by other blocks of this launch
    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(p));
    return TopKEntry{v.x, v.y};
}

__device__ __forceinline__ void topk_store(TopKEntry* p, TopKEntry e) {
    *reinterpret_cast<uint2*>(p) = make_uint2(e.key, e.id);
}

// Largest unsigned over a block; every thread gets it. scratch: THREADS / 32 words.
template <int THREADS>
__device__ __forceinline__ unsigned block_max_u32(unsigned v, unsigned* scratch) {
    constexpr int WARPS = THREADS / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < WARPS ? scratch[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Bitonic half-cleaners, strides KMAX/2 .. 1: sort a bitonic sequence of KMAX = 32 * E entries best first. Entry i
// of the sequence is v[i / 32] of lane i % 32.
template <int E>
__device__ __forceinline__ void topk_bitonic_sort(TopKEntry (&v)[E]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int s = E / 2; s >= 1; s >>= 1)  // strides of 32 * s: two entries of the same lane
#pragma unroll
        for (int e = 0; e < E; ++e)
            if ((e & s) == 0 && topk_better(v[e | s], v[e])) {
                const TopKEntry t = v[e];
                v[e] = v[e | s];
                v[e | s] = t;
            }
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1)  // strides below 32: the same entry of two lanes; the lower place keeps the better
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const TopKEntry o = topk_shfl_xor(v[e], s);
            if (((lane & s) == 0) == topk_better(o, v[e])) v[e] = o;
        }
}

// r <- the top KMAX of r and the list at `list` (both sorted best first), sorted best first. One warp.
template <int E, bool SHARED>
__device__ __forceinline__ void topk_merge_list(TopKEntry (&r)[E], const TopKEntry* list) {
    constexpr int KMAX = 32 * E;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const TopKEntry* p = list + (KMAX - 1 - (e * 32 + lane));
        const TopKEntry a = SHARED ? *p : topk_load(p);
        if (topk_better(a, r[e])) r[e] = a;
    }
    topk_bitonic_sort<E>(r);
}

// Warp w's part of a row's top k: the top KMAX of lists w, w + WARPS, ... (lists: `blocks` lists of KMAX entries).
template <int E, int WARPS, bool SHARED>
__device__ __forceinline__ void topk_warp_merge(TopKEntry (&r)[E], const TopKEntry* lists, int blocks) {
    constexpr int KMAX = 32 * E;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const TopKEntry* p = lists + warp * KMAX + e * 32 + lane;
        r[e] = warp < blocks ? (SHARED ? *p : topk_load(p)) : topk_none();
    }
    for (int b = warp + WARPS; b < blocks; b += WARPS) topk_merge_list<E, SHARED>(r, lists + b * KMAX);
}

template <int THREADS, int SLICE, int KMAX>
struct TopKShape {
    static constexpr int WARPS = THREADS / 32;
    static constexpr int PER = SLICE / THREADS;                            // values per thread
    static constexpr int GROUPS = 2 * KMAX < THREADS ? 2 * KMAX : THREADS;  // thread groups whose maxima bound L
    static constexpr int GROUP_THREADS = THREADS / GROUPS;
    static constexpr int CAP = KMAX * (SLICE / GROUPS);                     // entries >= L: at most k per group
    static constexpr int E = KMAX / 32;                                     // list entries per lane
    static_assert(THREADS % 32 == 0 && THREADS >= 64 && THREADS <= 1024 && (THREADS & (THREADS - 1)) == 0,
                  "THREADS: a power of two from 64 to 1024");
    static_assert(SLICE % THREADS == 0 && PER >= 1, "a slice is whole rows of THREADS values");
    static_assert(KMAX % 32 == 0 && (KMAX & (KMAX - 1)) == 0 && KMAX <= THREADS, "KMAX: 32, 64, 128 ... <= THREADS");
    static_assert(GROUPS >= KMAX && GROUP_THREADS <= 32, "every k <= KMAX needs k groups");
};

// logits: fp32 [n, vocab]; 1 <= k <= KMAX, k <= vocab. lists: KMAX entries per (row, block); stats: (m_b, s_b) per
// (row, block); tickets: n zero-initialised counters that the kernel leaves at zero. ids, logprobs: [n, k]; where
// given, values: [n, k], the logits themselves.
template <int THREADS, int SLICE, int KMAX>
__device__ void topk_f32(const float* __restrict__ logits, int vocab, int k, TopKEntry* lists, float2* stats,
                         unsigned* tickets, int* __restrict__ ids, float* __restrict__ logprobs,
                         float* __restrict__ values) {
    using S = TopKShape<THREADS, SLICE, KMAX>;
    constexpr int PER = S::PER, GT = S::GROUP_THREADS, E = S::E, WARPS = S::WARPS;
    __shared__ TopKEntry cand[S::CAP];
    __shared__ TopKEntry group_max[S::GROUPS];
    __shared__ TopKEntry warp_lists[WARPS][KMAX];
    __shared__ unsigned scratch_u[WARPS];
    __shared__ float scratch_f[WARPS];
    __shared__ TopKEntry kth;
    __shared__ unsigned n_cand;
    __shared__ bool last;

    const int row = blockIdx.y, block = blockIdx.x, blocks = gridDim.x;
    const int t = threadIdx.x, lane = t % 32, warp = t / 32;
    const int base = block * SLICE, len = min(SLICE, vocab - base);
    const float* x = logits + static_cast<size_t>(row) * vocab + base;
    TopKEntry* row_lists = lists + static_cast<size_t>(row) * blocks * KMAX;
    float2* row_stats = stats + static_cast<size_t>(row) * blocks;
    if (t == 0) n_cand = 0;

    // keys of this thread's values; positions past the row are key 0 (with positions above every real one)
    unsigned key[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int p = j * THREADS + t;
        key[j] = p < len ? topk_key(__ldg(x + p)) : 0u;
    }

    // 1. max and sum of exponentials (an all -inf slice: m = -inf, s = 0)
    unsigned kmax = 0u;
#pragma unroll
    for (int j = 0; j < PER; ++j) kmax = max(kmax, key[j]);
    kmax = block_max_u32<THREADS>(kmax, scratch_u);
    const float m = topk_value(kmax);
    float s = 0.f;
    if (kmax != topk_key(-__int_as_float(0x7f800000))) {
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (j * THREADS + t < len) s += __expf(topk_value(key[j]) - m);
    }
    s = block_sum<THREADS>(s, scratch_f);

    // 2a. this thread's best (the first of equal keys), then its group's (GT neighbouring lanes)
    TopKEntry mine{key[0], static_cast<unsigned>(t)};
#pragma unroll
    for (int j = 1; j < PER; ++j)
        if (key[j] > mine.key) mine = TopKEntry{key[j], static_cast<unsigned>(j * THREADS + t)};
#pragma unroll
    for (int o = 1; o < GT; o <<= 1) {
        const TopKEntry other = topk_shfl_xor(mine, o);
        if (topk_better(other, mine)) mine = other;
    }
    const int group = t / GT, sub = t % GT;
    if (sub == 0) group_max[group] = mine;
    __syncthreads();

    // 2b. L: the group maximum with exactly k group maxima >= it (they are all distinct); GT threads count a group's
    int ge = 0;
    for (int h = sub; h < S::GROUPS; h += GT) ge += !topk_better(mine, group_max[h]);
#pragma unroll
    for (int o = 1; o < GT; o <<= 1) ge += __shfl_xor_sync(0xffffffffu, ge, o);
    if (sub == 0 && ge == k) kth = mine;
    __syncthreads();

    // 2c. gather the entries >= L (their order in cand is of no consequence: the ranks below are)
    const TopKEntry L = kth;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const TopKEntry e{key[j], static_cast<unsigned>(j * THREADS + t)};
        const bool take = !topk_better(L, e);
        const unsigned mask = __ballot_sync(0xffffffffu, take);
        if (mask) {
            const int leader = __ffs(mask) - 1;
            unsigned at = 0;
            if (lane == leader) at = atomicAdd(&n_cand, static_cast<unsigned>(__popc(mask)));
            at = __shfl_sync(0xffffffffu, at, leader);
            if (take) cand[at + __popc(mask & ((1u << lane) - 1u))] = e;
        }
    }
    __syncthreads();

    // 2d. each gathered entry's rank among them is its place in the block's list
    const int count = static_cast<int>(n_cand);
    TopKEntry* my_list = row_lists + static_cast<size_t>(block) * KMAX;
    for (int i = t; i < count; i += THREADS) {
        const TopKEntry e = cand[i];
        int rank = 0;
#pragma unroll 4
        for (int c = 0; c < count; ++c) rank += topk_better(cand[c], e);
        if (rank < k)
            topk_store(my_list + rank, e.id < static_cast<unsigned>(len) ? TopKEntry{e.key, base + e.id} : topk_none());
    }
    for (int r = k + t; r < KMAX; r += THREADS) topk_store(my_list + r, topk_none());
    if (t == 0) row_stats[block] = make_float2(m, s);

    // the last block of the row merges
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(tickets + row, 1u) == static_cast<unsigned>(blocks - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();

    // the row's lists into shared memory at once where they fit (cand is free now; up to CAP * SLICE / KMAX logits a
    // row: 524,288 at the default tuning), so that the warps' merges below wait on one round trip to L2, not many
    const bool staged = blocks * KMAX <= S::CAP;
    if (staged)
        for (int i = t; i < blocks * KMAX; i += THREADS) cand[i] = topk_load(row_lists + i);

    // lse over the blocks' (m_b, s_b)
    unsigned mk = 0u;
    for (int b = t; b < blocks; b += THREADS) mk = max(mk, topk_key(__ldcg(&row_stats[b].x)));
    const float M = topk_value(block_max_u32<THREADS>(mk, scratch_u));
    float ss = 0.f;
    for (int b = t; b < blocks; b += THREADS) {
        const float2 st = __ldcg(row_stats + b);
        if (st.x != -__int_as_float(0x7f800000)) ss += st.y * __expf(st.x - M);  // an all -inf slice adds nothing
    }
    const float lse = M + __logf(block_sum<THREADS>(ss, scratch_f));

    // top k of the lists: warp w merges lists w, w + WARPS, ...; then the warps' lists pairwise through shared memory
    __syncthreads();  // the staged lists
    TopKEntry r[E];
    if (staged)
        topk_warp_merge<E, WARPS, true>(r, cand, blocks);
    else
        topk_warp_merge<E, WARPS, false>(r, row_lists, blocks);
#pragma unroll
    for (int step = 1; step < WARPS; step <<= 1) {
        if (warp % (2 * step) == step)
#pragma unroll
            for (int e = 0; e < E; ++e) warp_lists[warp][e * 32 + lane] = r[e];
        __syncthreads();
        if (warp % (2 * step) == 0 && warp + step < WARPS) topk_merge_list<E, true>(r, warp_lists[warp + step]);
        __syncthreads();
    }
    if (warp == 0) {
        const size_t out = static_cast<size_t>(row) * k;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int i = e * 32 + lane;
            if (i < k) {
                ids[out + i] = static_cast<int>(r[e].id);
                logprobs[out + i] = topk_value(r[e].key) - lse;
                if (values) values[out + i] = topk_value(r[e].key);
            }
        }
    }
    if (t == 0) tickets[row] = 0u;
}

}  // namespace lucegen
