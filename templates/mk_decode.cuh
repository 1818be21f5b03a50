// mk_decode.cuh: the decode megakernel of a Qwen3.5-family model: one persistent cooperative launch runs one or
// many decode steps, each through every layer, the final norm, the LM head and the argmax (or a draw at a
// temperature: sample.cuh), and feeds that token back as the next step's (multi-step: tg128 is one launch, greedy or
// sampled; EOS stops every block at once).
//
// Shapes come from M (the model, rendered from its config) and launch parameters from G (rendered from the chip
// spec); nothing here knows a particular model size. See megakernel.cu.j2 for both.
//
// Phases. A step is 5 phases per layer plus the LM head. Each is ended by a grid barrier, because it wrote in
// pieces a whole vector the next one reads, except the in-projection: a recurrence or attention item reads only its
// head's rows of it, so it waits for the few blocks that write those rows (ReadyFlags in grid.cuh: per-block
// counters, release/acquire) instead of all of them. 4L + 1 barriers a token (97 for 24 layers):
//
//   phase   linear_attention layer                         full_attention layer            split over blocks
//   0 IN    RMSNorm + [qkv | z | b | a] in-projection       RMSNorm + [q,gate | k | v]      rows
//   1       conv + SiLU + l2norm + gates + recurrence       q/k norm, RoPE, K/V into the    (value head, column
//           (raw head outputs; state read, written once)    cache, flash-decoding split     slice) / (kv head,
//                                                           + log-sum-exp merge (ticket)    context chunk)
//   2 OUT   gated RMSNorm (per head, redundant) +           out-projection + residual       rows
//           out-projection + residual
//   3 GU    RMSNorm + interleaved gate/up rows -> SiLU(gate) * up                           row pairs
//   4 DOWN  down-projection + residual                                                      rows
//   LM      final RMSNorm + LM head + per-block argmax (sampled: the block's softmax part     rows
//           of its rows); after the barrier every block merges the blocks' argmax (sampled:
//           draws the token from the parts and the logits), so the next token and EOS are
//           known everywhere
//
// What does not take a barrier either: every block recomputes the small things it needs (the residual's RMSNorm, the
// q/k of its DeltaNet head, the RoPE angles, a DeltaNet head's norm in the out-projection) instead of waiting for
// one block to publish them; the last attention item of a kv head merges the partials (a ticket, not a barrier);
// the argmax merge rides on the LM head's barrier. Barriers count arrivals on one ever-growing counter (grid.cuh):
// no reset, no memset, and the last block out returns it to zero for the next launch.
//
// Weights never wait for a barrier: each block streams its rows of every matrix, in the order it uses them,
// through a ring of G::SLOTS shared-memory slots (ring.cuh; bulk copies on sm_90+). Warp 0 produces (it keeps
// the ring full during GEMVs, barriers and the recurrence / attention phases); warps 1.. consume. So DRAM keeps
// streaming the next phase's weights while blocks synchronise, as long as a stall is shorter than the ring's
// lookahead (SLOTS x SLOT_BYTES per SM: 192 KB, ~6 us of an H200 SM's share of DRAM). It is not: at 952 tok/s
// DRAM was busy a third of a token (1.5 GB at 1.4 of 4.4 TB/s), the ring full the rest of it, waiting for the
// phases' chain of barriers. So when warp 0 hands tile t to the ring it also asks L2 for tile
// t + G::WEIGHT_PREFETCH_TILES (WeightStream; the spec's weight_prefetch_tiles): L2 holds that much more of the
// stream (4 tiles: 128 KB an SM, 17 MB of the H200's 60 MB), and the ring's copies of it hit L2. At the barrier ending
// phase k, warp 0 also prefetches into L2 the non-weight data of phase k + G::PREFETCH (the spec's
// prefetch_distance; 1: the next phase): the recurrent state and conv inputs of the block's items, its KV chunk,
// norm weights, so those phases start on L2 latency.
//
// Time per token on the H200 (Qwen3.5-0.8B, 1.506 GB of weights): the weights at the measured 4.39 TB/s take
// 343 us; the consumers' FMAs from shared memory ~60 us and the 97 barriers ~1 us each run under that stream
// as long as the ring does not drain. Expected 360-400 us (2,500-2,800 tok/s); `lucegen bench decode` measures
// it and attributes it per phase kind (skip_mask) and to the barriers alone.
//
// Numerics: bf16 weights and bf16 KV cache (whatever the spec's kv_format: the state layout, shared with the
// prefill, is bf16); fp32 everything else (residual, activations between phases, conv and recurrent state,
// accumulation), so logits differ from the fp32 reference by the KV cache's rounding only.
#pragma once
#include "argmax.cuh"
#include "mk_attention.cuh"
#include "mk_deltanet.cuh"
#include "norm.cuh"
#include "ring.cuh"
#include "sample.cuh"

namespace lucegen {

// Phase kinds: bit k of skip_mask leaves kind k's work (and weight reads) out, for timing; barriers stay.
enum PhaseKind { LIN_IN, LIN_REC, LIN_OUT, ATT_IN, ATT_CORE, ATT_OUT, MLP_GU, MLP_DOWN, LM_HEAD };

struct DecodeParams {
    const unsigned char* weights;   // the packed arena (lucegen/kernels/megakernel.py: Layout)
    void* const* state;             // per-layer state arrays (lucegen/engine/state.py: DeviceState), by slot:
                                    // conv rings [K][conv_dim] and recurrent states [Hv][dv][dk] of the linear
                                    // layers, then keys and values [max_context][n_kv][head_dim] of the full ones
    float* act;                     // activations between phases (offsets M::ACT_*)
    unsigned* sync;                 // [0] barrier arrivals, [1] blocks left, [2, 2 + ATT_NKV) attention tickets,
                                    // then gridDim.x ready counters; zero at launch, and left at zero
    const int* prompt;              // step s < n_prompt reads prompt[s]; later steps read the previous token
    int n_prompt;
    int position;                   // position of step 0
    int n_steps;
    int eos;                        // stop after a generated step (s >= n_prompt - 1) whose token is eos; -1: never
    int* tokens;                    // [n_steps] the token of each step: its argmax, or its draw
    float* logits;                  // logits of step s at logits + s * logits_stride, or null
    int logits_stride;
    int* n_done;                    // steps completed
    int phase_limit;                // >= 0: the last step runs only its first phase_limit phases (tests)
    int skip_mask;                  // PhaseKind bits (timing)
    int prefetch;                   // L2 prefetches: 0 none (timing); > 0 on, and the weight tiles asked for beyond
                                    // the ring where G::WEIGHT_PREFETCH_TILES > 0 (the spec's, or a sweep's)
    unsigned long long* trace;      // null, or a timeline (timing; G::TRACE builds): TRACE_FIELDS values per (step,
                                    // phase, block)
    const double* uniforms;         // the sampled kernel: step s draws its token from softmax(logits / temperature)
    double inv_temperature;         // with uniforms[s] (sample.cuh), 1 / temperature; the greedy one reads neither
};

// The timeline a traced launch writes (lucegen/bench/decode.py reads it): per step, phase and block, the global
// timer (ns) when the block starts the phase (its wait for the previous one over), when its GEMV starts and ends
// (warp 1: the first consumer), and when every warp has finished the phase's work; then how many of the GEMV's
// weight tiles had landed in the ring when it started, and how many it takes. No GEMV: zeros.
enum TraceField { T_START, T_GEMV, T_GEMV_END, T_DONE, T_TILES_READY, T_TILES, TRACE_FIELDS };

// This block's rows of one GEMV of a step: rows [r0, r1) of w (k wide), tile_rows rows per ring slot.
struct Segment {
    const bf16* w;
    int k, r0, r1, tile_rows;
};

// This block's share [x, y) of n rows (sample.cuh's slice_of; n * gridDim.x < 2^32: 32-bit division).
// Layout.block_rows in lucegen/kernels/megakernel.py is the same split.
__device__ __forceinline__ int2 block_rows(int n) { return slice_of(n, blockIdx.x, gridDim.x); }

// The first and the last block whose shares (block_rows) of n rows hold rows [r.x, r.y), r.x < r.y: row i is
// block b's for the largest b with n b / gridDim.x <= i, i.e. n b < (i + 1) gridDim.x.
__device__ __forceinline__ int2 row_blocks(int n, int2 r) {
    return make_int2(static_cast<int>((unsigned(r.x + 1) * gridDim.x - 1) / unsigned(n)),
                     static_cast<int>((unsigned(r.y) * gridDim.x - 1) / unsigned(n)));
}

// This block's weight segments of a step, in consumption order: per layer IN, OUT, GU, DOWN; then the LM head.
// Phases whose kind is skipped have empty segments (their weights are not read either). The block works them out
// once per launch into a table in shared memory (fill): the producer warp looks one up per tile it issues, and
// working one out (block shares, the layer tables in constant memory) costs it about a microsecond.
template <class M, class G>
struct SegmentMap {
    static constexpr int COUNT = 4 * M::LAYERS + 1;
    const unsigned char* weights;
    int skip_mask;

    __device__ bool skipped(PhaseKind k) const { return (skip_mask >> k) & 1; }

    // The table: COUNT entries at G::SMEM_SEGMENTS of the dynamic shared memory (an address the compiler knows,
    // not a pointer held in registers).
    __device__ static Segment* table() {
        extern __shared__ __align__(128) unsigned char dynamic_smem[];
        return reinterpret_cast<Segment*>(dynamic_smem + G::SMEM_SEGMENTS);
    }

    __device__ const Segment& operator()(int seg) const { return table()[seg]; }

    // Block-wide, once, before the first lookup: the table (ends with __syncthreads).
    __device__ void fill() const {
        for (int seg = threadIdx.x; seg < COUNT; seg += blockDim.x) table()[seg] = compute(seg);
        __syncthreads();
    }

    __device__ Segment compute(int seg) const {
        constexpr int ATT_K = M::ATT_NH * M::ATT_HD;
        if (seg == 4 * M::LAYERS) {
            const int2 r = block_rows(M::VOCAB);
            return {reinterpret_cast<const bf16*>(weights + M::LM_HEAD), M::HIDDEN, r.x,
                    skipped(LM_HEAD) ? r.x : r.y, G::tile_rows(M::HIDDEN)};
        }
        const int l = seg / 4, which = seg % 4;
        const bool full = M::kind(l);
        const unsigned char* base = weights + M::layer_offset(l);
        Segment s;
        PhaseKind kind;
        int n;
        if (which == 0) {
            kind = full ? ATT_IN : LIN_IN;
            n = full ? M::ATT_IN_ROWS : M::LIN_IN_ROWS;
            s = {reinterpret_cast<const bf16*>(base + (full ? M::FULL_IN : M::LIN_IN)), M::HIDDEN, 0, 0,
                 G::tile_rows(M::HIDDEN)};
        } else if (which == 1) {
            kind = full ? ATT_OUT : LIN_OUT;
            n = M::HIDDEN;
            s = full ? Segment{reinterpret_cast<const bf16*>(base + M::FULL_OUT), ATT_K, 0, 0,
                               G::tile_rows(ATT_K)}
                     : Segment{reinterpret_cast<const bf16*>(base + M::LIN_OUT), M::LIN_VALUE_DIM, 0, 0,
                               G::tile_rows(M::LIN_VALUE_DIM)};
        } else if (which == 2) {  // gate and up rows interleaved: a block takes whole pairs
            kind = MLP_GU;
            n = M::INTER;
            s = {reinterpret_cast<const bf16*>(base + (full ? M::FULL_GATE_UP : M::LIN_GATE_UP)), M::HIDDEN, 0, 0,
                 G::tile_rows(M::HIDDEN)};
        } else {
            kind = MLP_DOWN;
            n = M::HIDDEN;
            s = {reinterpret_cast<const bf16*>(base + (full ? M::FULL_DOWN : M::LIN_DOWN)), M::INTER, 0, 0,
                 G::tile_rows(M::INTER)};
        }
        const int2 r = block_rows(n);
        const int pair = which == 2 ? 2 : 1;
        s.r0 = r.x * pair;
        s.r1 = skipped(kind) ? s.r0 : r.y * pair;
        return s;
    }
};

// A position in a block's tile sequence over n_steps steps of segments.
template <class M, class G>
struct TileCursor {
    static constexpr int SEGMENTS = SegmentMap<M, G>::COUNT;
    int step = 0, seg = 0, row = -1;  // row: the next tile's first row in segment seg (-1: its first tile's)

    // The next tile (false past the last step).
    __device__ bool next(const SegmentMap<M, G>& segments, int n_steps, const void*& src, unsigned& bytes) {
        for (;;) {
            if (step >= n_steps) return false;
            const Segment& s = segments(seg);
            if (row < 0) row = s.r0;
            if (row < s.r1) {
                src = s.w + (size_t)row * s.k;
                bytes = static_cast<unsigned>(min(s.tile_rows, s.r1 - row) * s.k * 2);
                row += s.tile_rows;
                return true;
            }
            row = -1;
            if (++seg == SEGMENTS) seg = 0, ++step;
        }
    }
};

// The weight stream (warp 0): the tiles to issue into the ring, in order. When it hands out tile t it also asks
// L2 for tile t + `lookahead` (DecodeParams.prefetch), so DRAM keeps streaming beyond what the ring's
// slots hold while the blocks are held up by barriers and the recurrence; the ring's copies then hit L2.
template <class M, class G>
struct WeightStream {
    SegmentMap<M, G> segments;
    int n_steps;
    int lookahead;
    TileCursor<M, G> at, ahead;
    unsigned handed = 0, passed = 0;  // tiles handed out by `at`, tiles `ahead` is past

    __device__ bool next(const void*& src, unsigned& bytes) {
        if (!at.next(segments, n_steps, src, bytes)) return false;
        if (G::WEIGHT_PREFETCH_TILES == 0 || lookahead == 0) return true;
        ++handed;
        const void* a;
        unsigned n;
        for (; passed < handed + lookahead && ahead.next(segments, n_steps, a, n); ++passed)
            if (passed >= handed) prefetch_l2(a, n);  // tiles already handed out are in the ring
        return true;
    }
};

// SAMPLED: the kernel that draws each step's token (DecodeParams.uniforms); the other takes the argmax. Two kernels,
// so that each one's registers are allocated for its own path (the draw's fp64 reductions would spill the greedy
// kernel's step loop).
template <class M, class G, bool SAMPLED>
struct Decoder {
    static constexpr int THREADS = G::THREADS, WARPS = THREADS / 32;
    static constexpr int PHASES = 5 * M::LAYERS + 1;
    static constexpr int GATED_K = M::LIN_VALUE_DIM, ATT_K = M::ATT_NH * M::ATT_HD;
    using Ring = TileRing<G::SLOTS, G::SLOT_BYTES, WARPS, G::INFLIGHT_TILES>;

    using Stream = WeightStream<M, G>;
    const DecodeParams& p;
    Ring ring;
    Stream stream;    // stream.segments: this block's weight segments (the consumers read them too)
    GridBarrier bar;
    ReadyFlags ready; // the in-projection's rows, per block that writes them
    float* work;      // phase scratch (G::WORK_BYTES): staged GEMV input, or a work item's arrays
    float* scratch;   // reductions: WARPS floats, or WARPS ArgMax pairs
    int* flag;        // [0] a ticket's verdict, [1] this step's input token and (SAMPLED) [3] its count of phases
                      // (shared, not registers held across phases), [2] the last grid barrier the poller has seen
                      // pass (grid.cuh: GridBarrier::wait)
    float* partials;  // K-split GEMVs' partial sums (G::PARTIAL_FLOATS)
    float* own;       // this block's rows of the residual stream (block_rows(HIDDEN)): the rows its out- and
                      // down-projections add to, kept here so those adds read no global memory; x in global
                      // memory is their copy for the phases that read the whole vector
    int step = 0, phase = 0;  // where run() is (the trace's coordinates)

    // One value of the timeline (DecodeParams.trace), from the calling thread; compiled in only where G::TRACE
    // (a build for timing: the registers the stamps take would spill some specs' kernels).
    __device__ void trace(TraceField f, unsigned long long v) const {
        if constexpr (G::TRACE)
            if (p.trace) p.trace[((size_t(step) * PHASES + phase) * gridDim.x + blockIdx.x) * TRACE_FIELDS + f] = v;
    }

    __device__ const unsigned char* layer_base(int l) const { return p.weights + M::layer_offset(l); }
    template <class T>
    __device__ const T* weight(int l, size_t offset) const {
        return reinterpret_cast<const T*>(layer_base(l) + offset);
    }
    __device__ bool skipped(PhaseKind k) const { return stream.segments.skipped(k); }

    // The epilogue of the out- and down-projections: their rows (this block's share of HIDDEN) added to the
    // residual stream.
    __device__ auto residual_add() {
        return [x = p.act + M::ACT_X, mine = own, r0 = block_rows(M::HIDDEN).x](int row, const float* acc, int n) {
            for (int r = 0; r < n; ++r) x[row + r] = mine[row + r - r0] += acc[r];
        };
    }

    // Rows of segment `seg` times the staged vector (K wide), epilogue per row group (see ring_gemv).
    template <int K, class Epilogue>
    __device__ void gemv(int seg, Epilogue&& epilogue) {
        const Segment& s = stream.segments(seg);
        const bool traced = G::TRACE && p.trace && threadIdx.x == 32;
        if (traced) {
            const unsigned tiles = (s.r1 - s.r0 + s.tile_rows - 1) / s.tile_rows;
            trace(T_GEMV, global_ns());
            trace(T_TILES_READY, ring.landed(min(tiles, unsigned(G::SLOTS))));
            trace(T_TILES, tiles);
        }
        ring_gemv<K, G::group_rows(K), G::tile_rows(K), G::k_split(K), WARPS>(ring, stream, staged<K>(), partials,
                                                                             s.r0, s.r1, epilogue);
        if (traced) trace(T_GEMV_END, global_ns());
    }

    template <int K>
    __device__ StagedF32<K> staged() const { return StagedF32<K>{reinterpret_cast<float4*>(work)}; }

    // A K-wide fp32 vector written earlier in this launch, staged as a GEMV input. A thread's loads are issued
    // G::STAGE_BATCH at a time before their stores (a store to shared memory could alias a later load's source,
    // so the compiler would keep them in turn: an L2 round trip each; the batch costs 4 registers a load, which
    // the layout gives only where the kernel has them to spare). Ends with __syncthreads.
    template <int K>
    __device__ void stage(const float* x) {
        constexpr int PER_THREAD = (K / 4 + THREADS - 1) / THREADS;
        constexpr int BATCH = G::STAGE_BATCH < PER_THREAD ? G::STAGE_BATCH : PER_THREAD;
        const StagedF32<K> xs = staged<K>();
        const float4* x4 = reinterpret_cast<const float4*>(x);
        for (int q0 = threadIdx.x; q0 < K / 4; q0 += BATCH * THREADS) {
            float4 v[BATCH];
#pragma unroll
            for (int i = 0; i < BATCH; ++i) {
                const int q = q0 + i * THREADS;
                if (q < K / 4) v[i] = load_coherent(x4 + q);
            }
#pragma unroll
            for (int i = 0; i < BATCH; ++i) {
                const int q = q0 + i * THREADS;
                if (q < K / 4) xs.quad(q) = v[i];
            }
        }
        __syncthreads();
    }

    // ---- phases ------------------------------------------------------------------------------------------------
    __device__ void phase_in(int l, int token) {
        const bool full = M::kind(l);
        float* x = p.act + M::ACT_X;
        const bf16* e = reinterpret_cast<const bf16*>(p.weights + M::EMBED) + (size_t)token * M::HIDDEN;
        if (l == 0) {  // the residual stream starts as the token's embedding row: each block its own rows
            const int2 r = block_rows(M::HIDDEN);
            for (int i = r.x + threadIdx.x; i < r.y; i += THREADS) x[i] = own[i - r.x] = __bfloat162float(e[i]);
        }
        if (skipped(full ? ATT_IN : LIN_IN)) return;
        const float* ln = weight<float>(l, full ? M::FULL_LN1 : M::LIN_LN1);
        float* y = p.act + M::ACT_MIXED;
        if (l == 0) {
            rmsnorm_1p_stage<M::HIDDEN, THREADS>(e, ln, M::EPS, staged<M::HIDDEN>(), scratch);
        } else {
            rmsnorm_1p_stage<M::HIDDEN, THREADS>(x, ln, M::EPS, staged<M::HIDDEN>(), scratch);
        }
        gemv<M::HIDDEN>(4 * l, [&](int row, const float* acc, int n) {
            for (int r = 0; r < n; ++r) y[row + r] = acc[r];
        });
    }

    __device__ DeltaNetLayer deltanet_layer(int l) const {
        const int s = M::layer_slot(l);
        return {p.act + M::ACT_MIXED, weight<float>(l, M::LIN_CONV), weight<float>(l, M::LIN_A_LOG),
                weight<float>(l, M::LIN_DT_BIAS), static_cast<float*>(p.state[s]),
                static_cast<float*>(p.state[M::N_LINEAR + s]), p.act + M::ACT_MIX_OUT};
    }

    __device__ AttentionLayer attention_layer(int l) const {
        const int s = 2 * M::N_LINEAR + M::layer_slot(l);
        return {p.act + M::ACT_MIXED, weight<float>(l, M::FULL_Q_NORM), weight<float>(l, M::FULL_K_NORM),
                static_cast<bf16*>(p.state[s]), static_cast<bf16*>(p.state[M::N_FULL + s]),
                p.act + M::ACT_ATT_ML, p.act + M::ACT_ATT_ACC, p.sync + 2, p.act + M::ACT_MIX_OUT};
    }

    static constexpr int REC_ITEMS = M::LIN_HV * (M::LIN_DV / M::LIN_SLICE);

    // Block-wide: wait until the blocks that write in-projection rows `rows` (of n) have written them; warp 0
    // keeps the ring full meanwhile, a tile between polls.
    template <int N>
    __device__ void wait_rows(int n, const int2 (&rows)[N]) {
        int2 blocks[N];
#pragma unroll
        for (int i = 0; i < N; ++i) blocks[i] = row_blocks(n, rows[i]);
        ready.wait(blocks, [&] { ring.pump(stream, 1); });
    }

    __device__ void phase_mix(int l, int pos) {
        if (M::kind(l)) {
            if (skipped(ATT_CORE)) return;
            const AttentionLayer L = attention_layer(l);
            const int items = M::ATT_NKV * attention_chunks<M>(pos + 1, gridDim.x).y;
            const int chunks = items / M::ATT_NKV;
            for (int i = blockIdx.x; i < items; i += gridDim.x) {
                int2 rows[3];
                attention_reads<M>(i / chunks, rows);
                attention_item<M, THREADS>(L, i, pos, work, flag, SequenceRows{}, true,
                                           [&] { wait_rows(M::ATT_IN_ROWS, rows); });
                __syncthreads();
            }
        } else {
            if (skipped(LIN_REC)) return;
            const DeltaNetLayer L = deltanet_layer(l);
            constexpr int SLICES = M::LIN_DV / M::LIN_SLICE;
            for (int i = blockIdx.x; i < REC_ITEMS; i += gridDim.x) {
                int2 rows[5];
                deltanet_reads<M>(i / SLICES, i % SLICES, rows);
                deltanet_item<M, THREADS>(L, i / SLICES, i % SLICES, pos, work,
                                          [&] { wait_rows(M::LIN_IN_ROWS, rows); });
                __syncthreads();
            }
        }
    }

    __device__ void phase_out(int l) {
        const bool full = M::kind(l);
        if (skipped(full ? ATT_OUT : LIN_OUT)) return;
        const auto residual = residual_add();
        if (full) {
            stage<ATT_K>(p.act + M::ACT_MIX_OUT);
            gemv<ATT_K>(4 * l + 1, residual);
        } else {
            deltanet_gated_norm<M, THREADS>(p.act + M::ACT_MIX_OUT, p.act + M::ACT_MIXED + M::LIN_CONV_DIM,
                                            weight<float>(l, M::LIN_NORM), staged<GATED_K>());
            gemv<GATED_K>(4 * l + 1, residual);
        }
    }

    __device__ void phase_gate_up(int l) {
        if (skipped(MLP_GU)) return;
        const bool full = M::kind(l);
        rmsnorm_1p_stage<M::HIDDEN, THREADS>(p.act + M::ACT_X, weight<float>(l, full ? M::FULL_LN2 : M::LIN_LN2),
                                             M::EPS, staged<M::HIDDEN>(), scratch);
        float* act = p.act + M::ACT_MLP;
        gemv<M::HIDDEN>(4 * l + 2, [&](int row, const float* acc, int n) {  // rows (gate_i, up_i) pairs
            for (int r = 0; r + 1 < n; r += 2) act[(row + r) / 2] = silu(acc[r]) * acc[r + 1];
        });
    }

    __device__ void phase_down(int l) {
        if (skipped(MLP_DOWN)) return;
        stage<M::INTER>(p.act + M::ACT_MLP);
        gemv<M::INTER>(4 * l + 3, residual_add());
    }

    // Final norm, LM head, this block's argmax (into the partials); logits too when asked for. Sampled: the
    // block's rows of the logits, and their softmax part.
    __device__ void phase_lm_head(int step) {
        if (skipped(LM_HEAD)) return;
        const float* norm = reinterpret_cast<const float*>(p.weights + M::FINAL_NORM);
        rmsnorm_1p_stage<M::HIDDEN, THREADS>(p.act + M::ACT_X, norm, M::EPS, staged<M::HIDDEN>(), scratch);
        float* logits = p.logits ? p.logits + (size_t)step * p.logits_stride : nullptr;
        float* row_logits = SAMPLED ? p.act + M::ACT_LOGITS : nullptr;
        ArgMax best = argmax_none();
        gemv<M::HIDDEN>(4 * M::LAYERS, [&](int row, const float* acc, int n) {
            for (int r = 0; r < n; ++r) {
                best = argmax_pick(best, ArgMax{acc[r], row + r});
                if (logits) logits[row + r] = acc[r];
                if (row_logits) row_logits[row + r] = acc[r];
            }
        });
        best = block_argmax<THREADS>(best, reinterpret_cast<ArgMax*>(scratch));
        if (threadIdx.x == 0) reinterpret_cast<ArgMax*>(p.act + M::ACT_ARGMAX)[blockIdx.x] = best;
        if constexpr (SAMPLED) sample_part();  // (after block_argmax's barriers: the block's rows are written)
    }

    // Sampled: the softmax part of the block's rows of the logits.
    __device__ void sample_part() {
        const Segment& rows = stream.segments(4 * M::LAYERS);  // block_rows(M::VOCAB), sample.cuh's slice_of, from
        const SoftmaxPart part = softmax_part<THREADS>(                    // the table (not held through the steps)
            p.act + M::ACT_LOGITS + rows.r0, rows.r1 - rows.r0, p.inv_temperature, sample_scratch());
        if (threadIdx.x == 0) reinterpret_cast<SoftmaxPart*>(p.act + M::ACT_SAMPLE)[blockIdx.x] = part;
    }

    // The staged GEMV input is spent once the LM head's GEMV is: its work area serves the draw's reductions.
    __device__ double* sample_scratch() const { return reinterpret_cast<double*>(work); }

    // After the LM head's barrier, sampled: every block draws the same token from the parts and the logits.
    __device__ int merged_sample(int step) {
        // (G::BLOCKS, the grid: a count of gridDim.x would be worked out once and held through the steps)
        return sample_pick<THREADS>(reinterpret_cast<const SoftmaxPart*>(p.act + M::ACT_SAMPLE), G::BLOCKS,
                                    p.act + M::ACT_LOGITS, M::VOCAB, p.inv_temperature, p.uniforms[step],
                                    sample_scratch());
    }

    // After the LM head's barrier: every block merges the partials, so every block knows the token.
    __device__ int merged_argmax() {
        const ArgMax* parts = reinterpret_cast<const ArgMax*>(p.act + M::ACT_ARGMAX);
        ArgMax best = argmax_none();
        for (int b = threadIdx.x; b < gridDim.x; b += THREADS)
            best = argmax_pick(best, ArgMax{__ldcg(&parts[b].value), __ldcg(&parts[b].index)});
        return block_argmax<THREADS>(best, reinterpret_cast<ArgMax*>(scratch)).index;
    }

    // ---- L2 prefetch of the non-weight data phase k of a step reads first (warp 0) ------------------------------
    __device__ void prefetch(int k, int pos) {
        if (!p.prefetch || k >= PHASES) return;
        if (k == PHASES - 1) {
            prefetch_l2(p.weights + M::FINAL_NORM, M::HIDDEN * sizeof(float));
            return;
        }
        const int l = k / 5, sub = k % 5;
        const bool full = M::kind(l);
        if (sub == 0) {
            prefetch_l2(layer_base(l) + (full ? M::FULL_LN1 : M::LIN_LN1), M::HIDDEN * sizeof(float));
        } else if (sub == 1 && full) {
            prefetch_l2(layer_base(l) + M::FULL_Q_NORM, M::ATT_HD * sizeof(float));
            prefetch_l2(layer_base(l) + M::FULL_K_NORM, M::ATT_HD * sizeof(float));
            attention_prefetch<M>(attention_layer(l), blockIdx.x, pos);
        } else if (sub == 1) {
            const DeltaNetLayer L = deltanet_layer(l);
            constexpr int SLICES = M::LIN_DV / M::LIN_SLICE;
            for (int i = blockIdx.x; i < REC_ITEMS; i += gridDim.x)
                deltanet_prefetch<M>(L, i / SLICES, i % SLICES, pos);
        } else if (sub == 2 && !full) {
            prefetch_l2(layer_base(l) + M::LIN_NORM, M::LIN_DV * sizeof(float));
        } else if (sub == 3) {
            prefetch_l2(layer_base(l) + (full ? M::FULL_LN2 : M::LIN_LN2), M::HIDDEN * sizeof(float));
        }
    }

    // The end of phase k: a grid barrier, during which warp 0 prefetches for a later phase and issues weight
    // tiles into the ring, at most G::BARRIER_TILES of them where the spec caps it (a burst of bulk copies issued
    // here delays the barrier's polls and the next phase's staging loads behind it: H200, 0.8B, tg128 742 us a
    // token with no cap, 717 with 1 tile, 723 with 2; the next GEMV's producer issues the rest); after an
    // in-projection, only this block's ready counter (the next phase waits for the rows it reads).
    __device__ void end_phase(int k, int pos) {
        const bool by_rows = k < PHASES - 1 && k % 5 == 0;
        if (by_rows) ready.publish();
        else bar.arrive();
        if (threadIdx.x == 0) trace(T_DONE, global_ns());
        if (G::PREFETCH > 0 && threadIdx.x < 32) prefetch(k + G::PREFETCH, pos);
        if (!by_rows) {
            const unsigned cap = G::BARRIER_TILES ? ring.issued + G::BARRIER_TILES : ~0u;  // (warp 0's count)
            bar.wait([&] { if (ring.issued < cap) ring.pump(stream, 1); },
                     reinterpret_cast<volatile unsigned*>(flag + 2));
        }
    }

    // The phases step s runs: all of them, but where phase_limit stops the last step.
    __device__ int phases_of(int s) const {
        return s == p.n_steps - 1 && p.phase_limit >= 0 ? p.phase_limit : PHASES;
    }

    __device__ void run() {
        stream.segments.fill();
        ring.init();
        if (threadIdx.x < 32) ring.pump(stream);
        if (blockIdx.x == 0 && threadIdx.x == 0) *p.n_done = 0;
        if (threadIdx.x == 0) {
            flag[1] = p.prompt[0];
            if constexpr (SAMPLED) flag[3] = phases_of(0);
        }
        __syncthreads();
        for (int pos = p.position; pos < p.position + p.n_steps; ++pos) {  // the step, s, is derived: one register
            const int s = pos - p.position;                                  // fewer held across the phases
            // The phases it runs: the greedy kernel holds the count in a register, the sampled one reads it from
            // shared memory (flag[3], set with the step's token: in a register it spills in the draw).
            const int limit = SAMPLED ? 0 : phases_of(s);
            int k = 0;
            step = s;
            for (; k < (SAMPLED ? flag[3] : limit) && k < PHASES - 1; ++k) {
                const int l = k / 5;
                phase = k;
                if (threadIdx.x == 0) trace(T_START, global_ns());
                switch (k % 5) {
                    case 0: phase_in(l, flag[1]); break;
                    case 1: phase_mix(l, pos); break;
                    case 2: phase_out(l); break;
                    case 3: phase_gate_up(l); break;
                    default: phase_down(l); break;
                }
                end_phase(k, pos);
            }
            if (k < (SAMPLED ? flag[3] : limit)) {  // the LM head and the token, unless phase_limit stopped the step before it
                phase = k;
                if (threadIdx.x == 0) trace(T_START, global_ns());
                phase_lm_head(s);
                end_phase(k, pos);
                int token;
                if constexpr (SAMPLED) token = merged_sample(s);
                else token = merged_argmax();
                if (blockIdx.x == 0 && threadIdx.x == 0) {
                    p.tokens[s] = token;
                    *p.n_done = s + 1;
                }
                if (token == p.eos && s >= p.n_prompt - 1) break;
                if (threadIdx.x == 0) {
                    flag[1] = s + 1 < p.n_prompt ? p.prompt[s + 1] : token;
                    if constexpr (SAMPLED) flag[3] = phases_of(s + 1);
                }
                __syncthreads();
            }
        }
        if (threadIdx.x < 32) ring.drain();
        grid_leave(bar, ready);
    }
};

}  // namespace lucegen
