// tree.cuh: verifying a draft tree of N nodes in one target forward (DDTree, research/algorithms.md §4), per layer,
// and committing the accepted path. Nodes are topologically ordered (parents[n] < n, parents[0] = -1); node n
// holds the token at absolute position start + depth[n] and is computed exactly as the decode step at that
// position after the committed sequence and n's ancestors, with the decode step's own device functions
// (mk_deltanet.cuh, mk_attention.cuh): a 1-node tree is the decode step, so speculative decoding stays lossless.
//
// Gated DeltaNet. Node n's recurrence starts from its parent's state. Items (value head, slice of value columns)
// first compute every node's front (conv, l2norm, gates: independent of the state) in parallel, then run the
// recurrence, depth-first in a host-made schedule that visits each node's largest child subtree last: a node
// with several children saves its state to a stack level (shared memory, each thread its own registers' values)
// that its other children restore, and the last child frees it, so the stack holds at most log2(N) levels (6 at
// N = 64) and a chain none. Per layer the states then move no bytes beyond the committed state's one read, where
// keeping every node's state in global scratch would write and read N of them (64 MiB for Qwen3.5-0.8B at N = 64).
// Node n's conv window runs along its parent chain (the ancestors' raw inputs, rows of `mixed`) and past the root
// into the committed conv ring. Commit replays the accepted path, a chain, through the same schedule code with the
// state written back, and the last block to finish writes the path's raw inputs into the ring (a one-step commit,
// the decode step: each block its own channels').
//
// Attention. tree_attention_kv writes node n's K (k_norm, RoPE at start + depth[n]) and V to cache row start + n;
// tree_attention runs a flash-decoding item (attention_item_gqa, whose 1-node tree is the layer-by-layer step's decode
// step) for node n over positions 0 .. start + depth[n], reading position p >= start from the row of n's ancestor at
// depth p - start (the ancestor mask). Commit moves the accepted rows to start .. start + len - 1.
#pragma once
#include "mk_attention.cuh"
#include "quant.cuh"

namespace lucegen {

// A schedule step, one int: the node (bits 0-15); the stack level its parent's state is restored from, plus one
// (bits 16-23; 0: the parent is the previous step's node and its state is still in registers); the level the
// node's state is saved to, plus one (bits 24-30; 0: none).
__device__ __forceinline__ int step_node(int code) { return code & 0xffff; }
__device__ __forceinline__ int step_restore(int code) { return (code >> 16 & 0xff) - 1; }
__device__ __forceinline__ int step_save(int code) { return (code >> 24 & 0x7f) - 1; }

// The committed position of a launch: start, plus io[0] where the position lives on the device (io non-null).
__device__ __forceinline__ int tree_start(const int* io, int start) { return io ? io[0] + start : start; }

struct TreeDeltaNet {
    const float* mixed;     // [N][stride] the nodes' in-projections: [q | k | v (conv channels) | z | b | a]
    int stride;
    const float* conv_w;    // [conv_dim][K]
    const float* a_log;     // [Hv]
    const float* dt_bias;   // [Hv]
    float* conv_ring;       // [K][conv_dim] committed: read; on commit the path's inputs are written
    float* state;           // [Hv][dv][dk] committed: read; on commit the last step's state is written
    const int* parents;     // [N]
    const int* depth;       // [N]
    const int* schedule;    // [steps] codes (step_node ..)
    const int* io;          // the position of node 0 is io[0] + start (io null: start)
    int nodes, steps, levels, start;  // levels: the stack levels the schedule uses
    float* out;             // [N][Hv * dv] raw head outputs
    unsigned* ticket;       // zero between uses (commit: picks the block that writes the ring)
    const float* norm_w;    // [dv] the gated RMSNorm's weight
    float* normed;          // [N][Hv * dv] the nodes' gated RMSNorm of out (with z), or null: out alone
    XBlock* normed_q;       // normed's XBlocks (the out-projection's activations; node n's as row n of quant.cuh's
                            // layout), or null
    unsigned* norm_tickets; // [Hv / heads a group] zero between uses (see deltanet_norm_heads)
};

// The value heads whose gated norms one block writes together: whole XBlocks of a row (32 values) are whole heads
// (dv a multiple of 32), or a run of 32 / dv heads.
template <class M>
constexpr int deltanet_norm_heads() {
    static_assert(M::LIN_DV % 32 == 0 || 32 % M::LIN_DV == 0, "value heads of whole XBlocks, or XBlocks of whole heads");
    return M::LIN_DV % 32 == 0 ? 1 : 32 / M::LIN_DV;
}

// Dynamic shared memory of a tree DeltaNet item, in floats: `levels` stack levels, or while the fronts are made
// (before the stack's first use) the raw inputs they read, K - 1 + steps rows of COLS (tree_deltanet_stage),
// whichever is larger; then per step its gates, its sums q.q, k.k and k.q, and its front (q, k and the slice's v
// after conv + SiLU).
template <class M, int THREADS>
struct TreeDeltaNetSmem {
    using P = DeltaNetSplit<M, THREADS>;
    static constexpr int LEVEL = P::WARP_COLS * P::LANE_ROWS * THREADS;
    static constexpr int FRONT = 2 * M::LIN_DK + M::LIN_SLICE;
    static constexpr int COLS = FRONT + 2;                          // a raw row: the conv channels, then b and a
    static constexpr int THREAD_COLS = (COLS + THREADS - 1) / THREADS;  // raw columns a thread (tree_deltanet_fronts)
    static constexpr int PER_STEP = 8 + 3 + FRONT;
    static_assert(sizeof(DeltaNetGates) == 32 && LEVEL % 4 == 0, "gates are float4-aligned");
    __device__ static int before_steps(int levels, int steps) {  // the stack levels or the raw rows
        return max(levels * LEVEL, (M::LIN_CONV_K - 1 + steps) * COLS + 3) / 4 * 4;
    }
};

// Column c of an item's raw rows in an in-projection row: conv channel c (c < FRONT), or b (FRONT) or a (FRONT + 1) of
// value head vh.
template <class M, int THREADS>
__device__ __forceinline__ int tree_deltanet_column(int c, int kh, int vh, int j0) {
    constexpr int F = TreeDeltaNetSmem<M, THREADS>::FRONT;
    return c < F ? deltanet_channel<M>(c, kh, vh, j0) : M::LIN_CONV_DIM + M::LIN_VALUE_DIM + (c - F) * M::LIN_HV + vh;
}

// Front column c of step s from its raw input x and its window (past, as deltanet_conv's): conv + SiLU into
// fronts[s][c] (c < FRONT), b and a as they are into gates[s].beta and .decay.
template <class M, int THREADS, class Past>
__device__ __forceinline__ void tree_deltanet_front(const float (&w)[M::LIN_CONV_K], int c, int s, float x,
                                                    float* fronts, DeltaNetGates* gates, Past past) {
    constexpr int F = TreeDeltaNetSmem<M, THREADS>::FRONT;
    if (c < F)
        fronts[s * F + c] = deltanet_conv<M>(w, x, past);
    else
        (c == F ? gates[s].beta : gates[s].decay) = x;
}

// The raw inputs of item (vh, slice)'s fronts into shared memory, each read from global memory once (a node's inputs
// are in the conv windows of its descendants up to K - 1 levels down): raw row r < K - 1 holds the committed ring's
// position start - (K - 1) + r (its conv channels; nothing before the sequence), row K - 1 + s step s's in-projection
// inputs (offsets[s]: its row in mixed), COLS of them (tree_deltanet_column). Thread t stages the columns it makes the
// fronts of (t, t + THREADS, ..: tree_deltanet_fronts reads no other, so no barrier between the two), BATCH rows of
// them at a time with their loads in flight together (a store to raw may alias them for the compiler), each load an
// add to a column's offset worked out once (a unit (row, column) a thread cost ~120 instructions a load). ring_slot >=
// 0 (a one-step commit): the step's conv inputs of the channels the item writes (deltanet_writes_channel) also go
// into that slot of the ring: it is in no window of this launch. One step (a decode step, a one-step commit): its
// window is the first batch's K - 1 ring rows, so its fronts are made from the registers (w: the thread's columns'
// conv taps) and nothing is staged.
template <class M, int THREADS>
__device__ __forceinline__ void tree_deltanet_stage(
        const TreeDeltaNet& T, int vh, int slice, int start, int steps, const int* offsets, float* raw, int ring_slot,
        const float (&w)[TreeDeltaNetSmem<M, THREADS>::THREAD_COLS][M::LIN_CONV_K], float* fronts,
        DeltaNetGates* gates) {
    using Smem = TreeDeltaNetSmem<M, THREADS>;
    constexpr int K = M::LIN_CONV_K, C = M::LIN_CONV_DIM, F = Smem::FRONT, COLS = Smem::COLS, TC = Smem::THREAD_COLS;
    constexpr int BATCH = 8;
    static_assert(K <= BATCH, "a step's window in one batch");
    const int kh = deltanet_key_head<M>(vh), j0 = slice * M::LIN_SLICE, rows = K - 1 + steps;
    int col[TC];
#pragma unroll
    for (int i = 0; i < TC; ++i)
        col[i] = tree_deltanet_column<M, THREADS>(min(static_cast<int>(threadIdx.x) + i * THREADS, COLS - 1), kh, vh, j0);
    for (int r0 = 0; r0 < rows; r0 += BATCH) {
        float v[BATCH][TC];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int r = r0 + b, p = start - (K - 1) + r;  // p: a ring row's position
            const float* row = r >= rows ? nullptr
                             : r >= K - 1 ? T.mixed + offsets[r - (K - 1)]
                             : p >= 0 ? T.conv_ring + (size_t)(p % K) * C : nullptr;
#pragma unroll
            for (int i = 0; i < TC; ++i) {
                const int c = threadIdx.x + i * THREADS;
                v[b][i] = row != nullptr && c < COLS && (r >= K - 1 || c < F) ? load_coherent(row + col[i]) : 0.f;
            }
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b)
#pragma unroll
            for (int i = 0; i < TC; ++i) {
                const int r = r0 + b, c = threadIdx.x + i * THREADS;
                if (r >= rows || c >= COLS) continue;
                if (steps > 1) raw[r * COLS + c] = v[b][i];
                if (ring_slot >= 0 && r == K - 1 && c < F && deltanet_writes_channel<M>(c, vh, slice))
                    T.conv_ring[(size_t)ring_slot * C + col[i]] = v[b][i];
            }
        if (steps == 1)
#pragma unroll
            for (int i = 0; i < TC; ++i) {
                const int c = threadIdx.x + i * THREADS;
                if (c < COLS)
                    tree_deltanet_front<M, THREADS>(w[i], c, 0, v[K - 1][i], fronts, gates, [&](int t, float& y) {
                        y = v[t][i];
                        return start - (K - 1) + t >= 0;
                    });
            }
    }
}

// The fronts from the raw rows: thread t takes raw columns t, t + THREADS, .. (w: their conv taps) through every step,
// SB steps of all of them at a time with their loads first: conv + SiLU into fronts[s][c] (c < F), b and a as they
// are into gates[s].beta and .decay. taps: [steps][K - 1] where each step's window lies in raw (a row's first
// element), oldest first (-1: before the sequence).
template <class M, int THREADS>
__device__ __forceinline__ void tree_deltanet_fronts(
        const float* raw, const int* taps, int steps,
        const float (&w)[TreeDeltaNetSmem<M, THREADS>::THREAD_COLS][M::LIN_CONV_K], float* fronts,
        DeltaNetGates* gates) {
    using Smem = TreeDeltaNetSmem<M, THREADS>;
    constexpr int K = M::LIN_CONV_K, F = Smem::FRONT, COLS = Smem::COLS, TC = Smem::THREAD_COLS, SB = 2;
    for (int s0 = 0; s0 < steps; s0 += SB) {
        int r[SB][K - 1];
#pragma unroll
        for (int b = 0; b < SB; ++b)
#pragma unroll
            for (int t = 0; t < K - 1; ++t) r[b][t] = taps[min(s0 + b, steps - 1) * (K - 1) + t];
        float x[TC][SB], past[TC][SB][K - 1];
#pragma unroll
        for (int i = 0; i < TC; ++i) {
            const int c = min(static_cast<int>(threadIdx.x) + i * THREADS, COLS - 1);
#pragma unroll
            for (int b = 0; b < SB; ++b) {
                x[i][b] = raw[(K - 1 + min(s0 + b, steps - 1)) * COLS + c];
#pragma unroll
                for (int t = 0; t < K - 1; ++t) past[i][b][t] = raw[max(r[b][t], 0) + c];
            }
        }
#pragma unroll
        for (int i = 0; i < TC; ++i) {
            const int c = threadIdx.x + i * THREADS;
#pragma unroll
            for (int b = 0; b < SB; ++b) {
                const int s = s0 + b;
                if (c >= COLS || s >= steps) break;
                tree_deltanet_front<M, THREADS>(w[i], c, s, x[i][b], fronts, gates, [&](int t, float& y) {
                    y = past[i][b][t];
                    return r[b][t] >= 0;
                });
            }
        }
    }
}

// Item (vh, slice) over the schedule: first every step's front (conv + SiLU, l2norm sums, gates: they do not depend
// on the state) spread over the block, then the recurrence step after step, each warp on its own columns with no
// barrier. mode (tree.cu.j2's commit): 0 a verify; 1 a decode step, 2 a path commit (no wait for the kernel before):
// with either the final state is written back and the ring updated. `ints` holds 5 MAX_NODES + MAX_NODES K ints of
// shared memory (the tree's parents, depth and schedule, the step of each node, each step's row offset, taps and
// ring slot), `flag` one.
template <class M, int THREADS, int MAX_NODES>
__device__ void tree_deltanet_item(const TreeDeltaNet& T, int mode, int vh, int slice, float* smem, int* ints,
                                   int* flag) {
    constexpr int DK = M::LIN_DK, DV = M::LIN_DV, K = M::LIN_CONV_K, C = M::LIN_CONV_DIM, HV = M::LIN_HV;
    using P = DeltaNetSplit<M, THREADS>;
    using Smem = TreeDeltaNetSmem<M, THREADS>;
    constexpr int F = Smem::FRONT;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kh = deltanet_key_head<M>(vh), j0 = slice * M::LIN_SLICE, steps = T.steps;
    const bool commit = mode != 0;
    float* state = T.state + ((size_t)vh * DV + j0) * DK;
    float* stack = smem;
    float* raw = smem;  // the fronts' inputs, before the stack's first use
    DeltaNetGates* gates = reinterpret_cast<DeltaNetGates*>(smem + Smem::before_steps(T.levels, steps));
    float* sums = reinterpret_cast<float*>(gates + steps);  // [steps][3] (deltanet_qk_sum)
    float* fronts = sums + 3 * steps;                        // [steps][F]
    int* parents = ints;
    int* depth = parents + MAX_NODES;
    int* schedule = depth + MAX_NODES;
    int* step_of = schedule + MAX_NODES;  // [nodes] the step that visits the node (the schedule's nodes')
    int* offsets = step_of + MAX_NODES;   // [steps] the step's row in mixed, as an offset
    int* taps = offsets + MAX_NODES;      // [steps][K-1] each step's window in raw (tree_deltanet_fronts)
    int* slots = taps + MAX_NODES * (K - 1);  // [steps] the ring slot of each step's position (the commit's; kept
                                              // here, the position need not stay in a register to the end)
    __shared__ float head_gate[2];  // the head's A_log and dt_bias (the gates')
    // The tree, the schedule and the conv taps are read before the wait for the kernel before (a decode step's tree
    // is the one-node tree uploaded before any launch, a verify's is uploaded before its forward), so that their round
    // trip runs under that kernel's end.
    for (int i = threadIdx.x; i < T.nodes; i += THREADS) {
        parents[i] = T.parents[i];
        depth[i] = T.depth[i];
    }
    for (int i = threadIdx.x; i < steps; i += THREADS) schedule[i] = T.schedule[i];
    if (threadIdx.x < 2) head_gate[threadIdx.x] = (threadIdx.x == 0 ? T.a_log : T.dt_bias)[vh];
    float w[Smem::THREAD_COLS][K];
#pragma unroll
    for (int i = 0; i < Smem::THREAD_COLS; ++i) {
        const int c = min(static_cast<int>(threadIdx.x) + i * THREADS, F - 1);
#pragma unroll
        for (int t = 0; t < K; ++t) w[i][t] = T.conv_w[deltanet_channel<M>(c, kh, vh, j0) * K + t];
    }
    if (mode != 2) wait_for_prior_grids();
    const int start = tree_start(T.io, T.start);
    float S[P::WARP_COLS][P::LANE_ROWS];
    deltanet_load_state<M, THREADS>(S, state, start > 0);  // first: the latency overlaps the fronts
    __syncthreads();
    for (int s = threadIdx.x; s < steps; s += THREADS) {
        const int node = step_node(schedule[s]);
        step_of[node] = s;
        offsets[s] = node * T.stride;
        slots[s] = (start + depth[node]) % K;
    }
    __syncthreads();
    // One step (a decode step, or a commit of one token): each item writes its own channels' inputs into the ring
    // as it reads them (deltanet_writes_channel, as the megakernel does). More steps: the last item to finish writes
    // the path's (below).
    const bool own_ring = commit && steps == 1;
    tree_deltanet_stage<M, THREADS>(T, vh, slice, start, steps, offsets, raw,
                                    own_ring ? slots[0] : -1, w, fronts, gates);
    if (steps > 1) {
        for (int s = threadIdx.x; s < steps; s += THREADS) {  // a tap at distance d: an ancestor's step, or a ring row
            const int node = step_node(schedule[s]), d0 = depth[node];
            int a = node;
            for (int d = 1; d < K; ++d) {
                a = a >= 0 ? parents[a] : -1;
                const int r = a >= 0 ? K - 1 + step_of[a] : start + d0 - d >= 0 ? K - 1 + d0 - d : -1;
                taps[s * (K - 1) + K - 1 - d] = r >= 0 ? r * Smem::COLS : -1;
            }
        }
        __syncthreads();
        tree_deltanet_fronts<M, THREADS>(raw, taps, steps, w, fronts, gates);
    }
    __syncthreads();
    for (int task = warp; task < 3 * steps; task += P::WARPS) {  // q.q, k.k and k.q of every step
        const float sum = deltanet_qk_sum<M>(fronts + (task / 3) * F, task % 3);
        if (lane == 0) sums[task] = sum;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < steps; s += THREADS)  // from b and a, stored raw in beta and decay by the fronts
        gates[s] = deltanet_gates_of<M>(gates[s].beta, gates[s].decay, head_gate[0], head_gate[1],
                                        {sums[3 * s], sums[3 * s + 1], sums[3 * s + 2]});
    __syncthreads();

    for (int s = 0; s < steps; ++s) {
        const int code = schedule[s], node = step_node(code), restore = step_restore(code), save = step_save(code);
        if (restore >= 0)
#pragma unroll
            for (int w = 0; w < P::WARP_COLS; ++w)
#pragma unroll
                for (int r = 0; r < P::LANE_ROWS; ++r)
                    S[w][r] = stack[restore * Smem::LEVEL + (w * P::LANE_ROWS + r) * THREADS + threadIdx.x];
        deltanet_update<M, THREADS, false>(S, fronts + s * F, gates[s], nullptr,
                                           T.out + (size_t)node * HV * DV + vh * DV + j0);
        if (save >= 0)
#pragma unroll
            for (int w = 0; w < P::WARP_COLS; ++w)
#pragma unroll
                for (int r = 0; r < P::LANE_ROWS; ++r)
                    stack[save * Smem::LEVEL + (w * P::LANE_ROWS + r) * THREADS + threadIdx.x] = S[w][r];
    }
    if (commit)
#pragma unroll
        for (int w = 0; w < P::WARP_COLS; ++w)
#pragma unroll
            for (int r = 0; r < P::LANE_ROWS; ++r) {
                const int j = warp + w * P::WARPS, i = lane + 32 * r;
                if (j < P::SLICE && i < DK) state[(size_t)j * DK + i] = S[w][r];
            }
    // Every block has read the ring's committed inputs: the last one writes the path's (its last K steps: a step's
    // slot may be in another's window), RING_BATCH loads in flight per thread (the ring and the rows may alias for
    // the compiler, which would otherwise wait for each load before the next store: ~80 round trips a row on the
    // 27B).
    if (commit && !own_ring && last_to_arrive(T.ticket, gridDim.x * gridDim.y, flag))
        for (int s = max(0, steps - K); s < steps; ++s) {
            const float* row = T.mixed + (size_t)step_node(schedule[s]) * T.stride;
            float* ring = T.conv_ring + (size_t)slots[s] * C;
            constexpr int RING_BATCH = 16;
            for (int c0 = threadIdx.x; c0 < C; c0 += RING_BATCH * THREADS) {
                float v[RING_BATCH];
#pragma unroll
                for (int b = 0; b < RING_BATCH; ++b)
                    v[b] = c0 + b * THREADS < C ? load_coherent(row + c0 + b * THREADS) : 0.f;
#pragma unroll
                for (int b = 0; b < RING_BATCH; ++b)
                    if (c0 + b * THREADS < C) ring[c0 + b * THREADS] = v[b];
            }
        }
    // The gated RMSNorm of the nodes' outputs, here rather than in a launch of its own: the last of the blocks of a
    // group of heads (deltanet_norm_heads) to finish norms the group in every node, a warp NB nodes at a time (their
    // loads in flight together), and writes its XBlocks: a head's own from the registers, a group's of several heads
    // from the values written.
    constexpr int HG = deltanet_norm_heads<M>(), NB = 4;
    const int h0 = vh / HG * HG;
    const auto row = [&](int s) { return (size_t)step_node(schedule[s]) * M::LIN_VALUE_DIM; };
    if (T.normed != nullptr && last_to_arrive(T.norm_tickets + vh / HG, HG * gridDim.y, flag))
        for (int s0 = warp; s0 < steps; s0 += NB * P::WARPS) {
            GatedNormHead<M> g[NB][HG];
#pragma unroll
            for (int i = 0; i < NB; ++i) {  // steps past the last: the last one's loads again, not stored
                const int s = min(s0 + i * P::WARPS, steps - 1);
                const float* z = T.mixed + (size_t)step_node(schedule[s]) * T.stride + C;
#pragma unroll
                for (int h = 0; h < HG; ++h) g[i][h].load(T.out + row(s), z, T.norm_w, h0 + h);
            }
#pragma unroll
            for (int i = 0; i < NB; ++i) {
                const int s = s0 + i * P::WARPS;
                if (s >= steps) break;
                const XRow xq = xrow(T.normed_q, step_node(schedule[s]), M::LIN_VALUE_DIM / 32);
                float* normed = T.normed + row(s);
#pragma unroll
                for (int h = 0; h < HG; ++h)
                    g[i][h].store(GlobalQuads{reinterpret_cast<float4*>(normed)}, h0 + h, HG == 1 ? xq : XRow{});
                if constexpr (HG > 1) {
                    __syncwarp();  // the group's values are written before its XBlocks read them
                    if (T.normed_q != nullptr && lane < HG * DV / 32)
                        *xq.at(h0 * DV / 32 + lane) = quantize_xblock(normed + h0 * DV + 32 * lane);
                }
            }
        }
}

struct TreeAttention {
    const float* qkv;       // [N][stride] the nodes' in-projections: per q head [query | gate], then k, then v
    int stride;
    const float* q_norm;    // [head_dim], zero-centred
    const float* k_norm;
    unsigned char* keys;    // this layer's cache [context][n_kv] rows (kv.cuh: a KV row format); node n's row at
    unsigned char* values;  // start + n
    const int* parents;     // [N]
    const int* depth;       // [N]
    int nodes, start;
    float* part_ml;         // [N][n_kv][chunks][G][2]
    float* part_acc;        // [N][n_kv][chunks][G][head_dim]
    unsigned* tickets;      // [N][n_kv], zero between uses
    float* out;             // [N][n_heads * head_dim] gated attention outputs
    XBlock* out_q;          // their XBlocks (node n's as row n of quant.cuh's layout), or null
};

// Node n's K and V row of kv head g into cache row start + n (format KV), as the decode step's item computes its
// own. `work` holds head_dim + rotary_dim floats.
template <class M, int THREADS, class KV>
__device__ void tree_attention_kv(const TreeAttention& T, int node, int g, float* work) {
    constexpr int NH = M::ATT_NH, NKV = M::ATT_NKV, HD = M::ATT_HD, ROT = M::ATT_ROT;
    float* k = work;
    float* cs = k + HD;
    float* sn = cs + ROT / 2;
    const int pos = T.start + T.depth[node];
    for (int i = threadIdx.x; i < ROT / 2; i += THREADS) {
        const float2 t = cos_sin(static_cast<float>(pos) * M::inv_freq(i));
        cs[i] = t.x;
        sn[i] = t.y;
    }
    const float* row = T.qkv + (size_t)node * T.stride + 2 * NH * HD;
    if (threadIdx.x / 32 == 0) head_rmsnorm<HD>(row + g * HD, T.k_norm, M::EPS, k);
    __syncthreads();
    rope_in_place<HD, ROT>(k, cs, sn, 1.f, threadIdx.x, THREADS);
    __syncthreads();
    const size_t at = kv_row<KV, NKV, HD>(g, T.start + node);
    if constexpr (KV::BF16) {
        for (int d = threadIdx.x; d < 2 * HD; d += THREADS)
            reinterpret_cast<bf16*>((d < HD ? T.keys : T.values) + at)[d % HD] =
                __float2bfloat16(d < HD ? k[d] : load_coherent(row + NKV * HD + g * HD + d - HD));
    } else {
        kv_store_row<KV, HD, THREADS>(k, T.keys + at);
        kv_store_row<KV, HD, THREADS>(row + NKV * HD + g * HD, T.values + at);
    }
}

// Work item `item` of node n (gridDim.x items per node, as the decode step's grid): attention_item_gqa. `ints`
// holds 2 N ints. writes_kv (a 1-node tree: the decode step): the item holding the node's position writes its K/V
// row first, as the decode item does, instead of tree_attention_kv. ROWS: the K/V rows each warp has in flight (a
// round of attention_item_gqa). The cache rows are in format KV.
template <class M, int THREADS, int ROWS, class KV>
__device__ void tree_attention_item(const TreeAttention& T, int item, int node, bool writes_kv, float* work, int* ints,
                                    int* flag) {
    constexpr int G = M::ATT_NH / M::ATT_NKV, NKV = M::ATT_NKV, HD = M::ATT_HD;
    const int depth = T.depth[node], pos = T.start + depth, start = T.start;
    if (item >= NKV * attention_chunks<M>(pos + 1, gridDim.x).y) return;
    int* parents = ints;      // the tree in shared memory, walked from node to the root
    int* anc = ints + T.nodes;  // [depth + 1] node's ancestors by depth, node last
    for (int i = threadIdx.x; i < T.nodes; i += THREADS) parents[i] = T.parents[i];
    __syncthreads();
    if (threadIdx.x == 0)
        for (int d = depth, a = node; d >= 0; --d, a = parents[a]) anc[d] = a;
    __syncthreads();
    const size_t chunks = max(1, (int)gridDim.x / NKV);
    const AttentionLayer L{T.qkv + (size_t)node * T.stride, T.q_norm, T.k_norm, reinterpret_cast<bf16*>(T.keys),
                           reinterpret_cast<bf16*>(T.values),
                           T.part_ml + node * NKV * chunks * G * 2, T.part_acc + node * NKV * chunks * G * HD,
                           T.tickets + node * NKV, T.out + (size_t)node * M::ATT_NH * HD,
                           xrow(T.out_q, node, M::ATT_NH * HD / 32)};
    const auto rows = [=](int p) { return p < start ? p : start + anc[p - start]; };
    attention_item_gqa<M, THREADS, decltype(rows), ROWS, KV>(L, item, pos, work, flag, rows, writes_kv);
}

// Rows start + path[i] to start + i (format KV) for the accepted path (root first) of kv head g. Each thread owns
// 2-byte units of the rows and moves them in path order: path[i] >= i, so a row is read before any move overwrites
// it.
template <class M, int THREADS, class KV>
__device__ void tree_kv_commit(unsigned char* keys, unsigned char* values, const int* path, int len, int start, int g) {
    constexpr int NKV = M::ATT_NKV, HD = M::ATT_HD, UNITS = HD / 32 * KV::BLOCK_BYTES / 2;
    for (int d = threadIdx.x; d < 2 * UNITS; d += THREADS) {
        unsigned short* cache = reinterpret_cast<unsigned short*>(d < UNITS ? keys : values);
        for (int i = 1; i < len; ++i)
            if (path[i] != i)
                cache[kv_row<KV, NKV, HD>(g, start + i) / 2 + d % UNITS] =
                    cache[kv_row<KV, NKV, HD>(g, start + path[i]) / 2 + d % UNITS];
    }
}

}  // namespace lucegen
