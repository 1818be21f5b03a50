// mk_deltanet.cuh: the Gated DeltaNet decode step, split over blocks by (value head, slice of value columns).
//
// A work item owns value columns [j0, j0 + SLICE) of value head vh. Its recurrent state slice (SLICE columns of
// dk fp32, stored column-major as [Hv][dv][dk] so a slice is one contiguous run) is read once and written once.
// q and k of the head's key head are recomputed by every item that needs them (2 x dk channels of conv + SiLU +
// l2norm: cheaper than a dependency between blocks). The gated RMSNorm needs all dv outputs of a head, so it runs
// where they are consumed (the out-projection phase); this phase writes the raw head outputs.
//
// The conv state is a ring of K slots indexed by absolute position: token p's raw input goes to slot p % K, and
// the window of token p reads slots (p-K+1 .. p-1) % K, which nobody writes during step p, so the items of a head
// read the old inputs while one of them writes the new ones, without a barrier. Positions before 0 read as zero,
// and the recurrent state at position 0 reads as zero: a new sequence needs no reset.
#pragma once
#include "activation.cuh"
#include "common.cuh"
#include "quant.cuh"

namespace lucegen {

struct DeltaNetLayer {
    const float* mixed;     // this token's in-projection: [q | k | v (conv channels) | z | b | a]
    const float* conv_w;    // [conv_dim][K]
    const float* a_log;     // [Hv]
    const float* dt_bias;   // [Hv]
    float* conv_ring;       // [K][conv_dim]
    float* state;           // [Hv][dv][dk]
    float* out;             // [Hv * dv] raw (un-normalised) head outputs
};

// The key head value head vh reads.
template <class M>
__device__ __forceinline__ int deltanet_key_head(int vh) {
    return M::LIN_TILED ? vh % M::LIN_HK : vh / (M::LIN_HV / M::LIN_HK);
}

// The conv channels one item reads: q and k of key head kh, then its SLICE value channels.
template <class M>
__device__ __forceinline__ int deltanet_channel(int c, int kh, int vh, int j0) {
    constexpr int DK = M::LIN_DK;
    return c < DK ? kh * DK + c
         : c < 2 * DK ? M::LIN_KEY_DIM + kh * DK + (c - DK)
                      : 2 * M::LIN_KEY_DIM + vh * M::LIN_DV + j0 + (c - 2 * DK);
}

// Does item (vh, slice) write channel c's conv input? Value channels belong to their item; the 2 dk q/k channels
// of a key head are written by the items of the first value head reading it, spread over its slices.
template <class M>
__device__ __forceinline__ bool deltanet_writes_channel(int c, int vh, int slice) {
    constexpr int SLICES = M::LIN_DV / M::LIN_SLICE;
    const bool first_of_key_head = M::LIN_TILED ? vh < M::LIN_HK : vh % (M::LIN_HV / M::LIN_HK) == 0;
    return c >= 2 * M::LIN_DK || (first_of_key_head && c % SLICES == slice);
}

// The in-projection rows [x, y) item (vh, slice) reads: q and k of its key head, its value channels, b and a.
template <class M>
__device__ __forceinline__ void deltanet_reads(int vh, int slice, int2 (&rows)[5]) {
    constexpr int DK = M::LIN_DK, C = M::LIN_CONV_DIM;
    const int kh = deltanet_key_head<M>(vh), v0 = 2 * M::LIN_KEY_DIM + vh * M::LIN_DV + slice * M::LIN_SLICE;
    rows[0] = make_int2(kh * DK, (kh + 1) * DK);
    rows[1] = make_int2(M::LIN_KEY_DIM + kh * DK, M::LIN_KEY_DIM + (kh + 1) * DK);
    rows[2] = make_int2(v0, v0 + M::LIN_SLICE);
    rows[3] = make_int2(C + M::LIN_VALUE_DIM + vh, C + M::LIN_VALUE_DIM + vh + 1);
    rows[4] = make_int2(C + M::LIN_VALUE_DIM + M::LIN_HV + vh, C + M::LIN_VALUE_DIM + M::LIN_HV + vh + 1);
}

// The L2 lines item (vh, slice) reads first: its state slice, conv weights and conv-ring inputs, gates' weights.
template <class M>
__device__ __forceinline__ void deltanet_prefetch(const DeltaNetLayer& L, int vh, int slice, int pos) {
    constexpr int DK = M::LIN_DK, K = M::LIN_CONV_K, C = M::LIN_CONV_DIM;
    const int kh = deltanet_key_head<M>(vh), j0 = slice * M::LIN_SLICE;
    if (pos > 0) prefetch_l2(L.state + ((size_t)vh * M::LIN_DV + j0) * DK, sizeof(float) * M::LIN_SLICE * DK);
    for (int r = 0; r < 3; ++r) {  // the q, k and value channel runs
        const int first = deltanet_channel<M>(r * DK, kh, vh, j0), count = r < 2 ? DK : M::LIN_SLICE;
        prefetch_l2(L.conv_w + (size_t)first * K, sizeof(float) * count * K);
        for (int t = 1; t < K && pos - t >= 0; ++t)
            prefetch_l2(L.conv_ring + (size_t)((pos - t) % K) * C + first, sizeof(float) * count);
    }
    prefetch_l2(L.a_log + vh, sizeof(float));
    prefetch_l2(L.dt_bias + vh, sizeof(float));
}

// How an item's threads hold its state slice: warp w owns columns w, w + WARPS, ..; lane l rows l, l + 32, ..
template <class M, int THREADS>
struct DeltaNetSplit {
    static constexpr int DK = M::LIN_DK, SLICE = M::LIN_SLICE, WARPS = THREADS / 32;
    static constexpr int LANE_ROWS = (DK + 31) / 32, WARP_COLS = (SLICE + WARPS - 1) / WARPS;
    static_assert(WARPS >= 2 && M::LIN_DV % SLICE == 0 && M::LIN_HV % M::LIN_HK == 0, "DeltaNet split");
};

// The gates and l2norm scales of one token of one item, and k.q of the normalised k and q (two 16-byte words).
struct alignas(16) DeltaNetGates {
    float q_scale, k_scale, beta, decay, kq;
};

// This thread's part of a state slice (SLICE columns of dk, column-major) into registers; zeros when `has` is false.
template <class M, int THREADS>
__device__ __forceinline__ void deltanet_load_state(
        float (&S)[DeltaNetSplit<M, THREADS>::WARP_COLS][DeltaNetSplit<M, THREADS>::LANE_ROWS], const float* state,
        bool has) {
    using P = DeltaNetSplit<M, THREADS>;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int w = 0; w < P::WARP_COLS; ++w)
#pragma unroll
        for (int r = 0; r < P::LANE_ROWS; ++r) {
            const int j = warp + w * P::WARPS, i = lane + 32 * r;
            S[w][r] = has && j < P::SLICE && i < P::DK ? load_coherent(state + (size_t)j * P::DK + i) : 0.f;
        }
}

// Causal depthwise conv + SiLU of conv channel ch for one token, its raw input x. past(t, y) sets y to the raw
// input of channel ch at the t-th oldest position of the window (t < K-1) and returns true, or returns false before
// the sequence.
template <class M, class Past>
__device__ __forceinline__ float deltanet_conv(const float (&w)[M::LIN_CONV_K], float x, Past past) {
    constexpr int K = M::LIN_CONV_K;
    float acc = w[K - 1] * x;
#pragma unroll
    for (int t = 0; t < K - 1; ++t) {
        float y;
        if (past(t, y)) acc += w[t] * y;
    }
    return silu(acc);
}

// The same with channel ch's taps read from the conv weights [conv_dim][K].
template <class M, class Past>
__device__ __forceinline__ float deltanet_conv(const float* conv_w, int ch, float x, Past past) {
    float w[M::LIN_CONV_K];
#pragma unroll
    for (int t = 0; t < M::LIN_CONV_K; ++t) w[t] = conv_w[ch * M::LIN_CONV_K + t];
    return deltanet_conv<M>(w, x, past);
}

// One of a token's three sums over dk, by one warp (every lane gets it), of its q and k after conv + SiLU (qk: q
// then k): which 0 q.q, 1 k.k, 2 k.q.
template <class M>
__device__ __forceinline__ float deltanet_qk_sum(const float* qk, int which) {
    constexpr int DK = M::LIN_DK;
    const int lane = threadIdx.x % 32;
    const float* x = qk + (which == 1 ? DK : 0);
    const float* y = qk + (which == 0 ? 0 : DK);
    float s = 0.f;
    for (int i = lane; i < DK; i += 32) s += x[i] * y[i];
    return warp_sum(s);
}

// The l2norm scales (from the sums of squares of q and k) and the gates of value head vh for one token, from the
// token's raw beta and decay inputs (its in-projection's b and a rows) and the head's A_log and dt_bias.
template <class M>
__device__ __forceinline__ DeltaNetGates deltanet_gates_of(float b, float a, float a_log, float dt_bias,
                                                           const float (&sums)[3]) {
    DeltaNetGates gt;
    gt.q_scale = rsqrtf(sums[0] + 1e-6f) * rsqrtf(static_cast<float>(M::LIN_DK));
    gt.k_scale = rsqrtf(sums[1] + 1e-6f);
    gt.kq = sums[2] * gt.k_scale * gt.q_scale;
    gt.beta = sigmoid(b);
    gt.decay = __expf(-__expf(a_log) * softplus(a + dt_bias));
    return gt;
}

// One token's front for an item: conv + SiLU of the channels it reads (q and k of key head kh, the SLICE value
// channels from j0) into `work` (2 dk + SLICE + 3 floats), their l2norm scales and the gates. window(ch, t) points at
// the raw input of channel ch at the t-th oldest position of the window (t < K-1), or is null before the sequence;
// seen(c, ch, x) is told every raw input of this token. What does not depend on this token's in-projection (the
// windows, the conv weights, the gates' parameters) is loaded first; then wait() (block-wide) waits for the
// in-projection's rows, so those loads' latency runs under the wait, and the token's inputs and its b and a are
// read in one round trip.
template <class M, int THREADS, class Window, class Seen, class Wait>
__device__ __forceinline__ DeltaNetGates deltanet_front(const float* mixed, const float* conv_w, const float* a_log,
                                                        const float* dt_bias, int vh, int j0, float* work,
                                                        Window window, Seen seen, Wait wait) {
    constexpr int DK = M::LIN_DK, SLICE = M::LIN_SLICE, K = M::LIN_CONV_K, C = M::LIN_CONV_DIM;
    constexpr int CHANNELS = 2 * DK + SLICE, PER_THREAD = (CHANNELS + THREADS - 1) / THREADS;
    const int warp = threadIdx.x / 32, kh = deltanet_key_head<M>(vh);
    float* qk = work;             // [2 dk]: q then k after conv + SiLU
    float* v = work + 2 * DK;     // [SLICE]
    float* sums = v + SLICE;      // [3]: q.q, k.k and k.q (deltanet_qk_sum)
    if (warp < 3) {  // the conv weights of the q, k and value channel runs, asked of L2
        const int first = deltanet_channel<M>(warp * DK, kh, vh, j0), count = warp < 2 ? DK : SLICE;
        prefetch_l2(conv_w + (size_t)first * K, sizeof(float) * count * K);
    }
    float past[PER_THREAD][K - 1];  // this thread's channels' window inputs
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
        const int ch = deltanet_channel<M>(min(static_cast<int>(threadIdx.x) + u * THREADS, CHANNELS - 1), kh, vh, j0);
#pragma unroll
        for (int t = 0; t < K - 1; ++t) {
            const float* y = window(ch, t);
            past[u][t] = y ? load_coherent(y) : 0.f;
        }
    }
    const float head_a_log = a_log[vh], head_dt_bias = dt_bias[vh];
    wait();
    const float b = load_coherent(mixed + C + M::LIN_VALUE_DIM + vh);
    const float a = load_coherent(mixed + C + M::LIN_VALUE_DIM + M::LIN_HV + vh);
#pragma unroll
    for (int u = 0; u < PER_THREAD; ++u) {
        const int c = threadIdx.x + u * THREADS;
        if (c >= CHANNELS) break;
        const int ch = deltanet_channel<M>(c, kh, vh, j0);
        const float x = load_coherent(mixed + ch);
        (c < 2 * DK ? qk[c] : v[c - 2 * DK]) = deltanet_conv<M>(conv_w, ch, x, [&](int t, float& y) {
            y = past[u][t];
            return window(ch, t) != nullptr;
        });
        seen(c, ch, x);
    }
    __syncthreads();
    for (int which = warp; which < 3; which += THREADS / 32) {
        const float sum = deltanet_qk_sum<M>(qk, which);
        if (threadIdx.x % 32 == 0) sums[which] = sum;
    }
    __syncthreads();
    return deltanet_gates_of<M>(b, a, head_a_log, head_dt_bias, {sums[0], sums[1], sums[2]});
}

// The recurrence for one token over the slice in registers, per column j: S' = decay S + k delta with delta = beta
// (v_j - decay S^T k), and o_j = S'^T q = decay S^T q + delta (k.q) into out[j]: both of the column's dots are of the
// state before the token, so they take one warp sum together (the chain from one token's state to the next has one
// round of shuffles, not two). With STORE the new columns go to `state` as well.
template <class M, int THREADS, bool STORE>
__device__ __forceinline__ void deltanet_update(
        float (&S)[DeltaNetSplit<M, THREADS>::WARP_COLS][DeltaNetSplit<M, THREADS>::LANE_ROWS], const float* work,
        DeltaNetGates gt, float* state, float* out) {
    using P = DeltaNetSplit<M, THREADS>;
    constexpr int DK = P::DK, WC = P::WARP_COLS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float* qk = work;
    const float* v = work + 2 * DK;
    float dots[2 * WC];  // per column S^T k, then S^T q
#pragma unroll
    for (int w = 0; w < WC; ++w) {
        dots[w] = dots[WC + w] = 0.f;
#pragma unroll
        for (int r = 0; r < P::LANE_ROWS; ++r) {
            const int i = lane + 32 * r;
            if (i < DK) {
                dots[w] += S[w][r] * (qk[DK + i] * gt.k_scale);
                dots[WC + w] += S[w][r] * (qk[i] * gt.q_scale);
            }
        }
    }
    warp_sum_each(dots);
#pragma unroll
    for (int w = 0; w < WC; ++w) {
        const int j = warp + w * P::WARPS;
        const float delta = j < P::SLICE ? (v[j] - gt.decay * dots[w]) * gt.beta : 0.f;  // columns past the slice: 0
#pragma unroll
        for (int r = 0; r < P::LANE_ROWS; ++r) {
            const int i = lane + 32 * r;
            if (i < DK) {
                S[w][r] = gt.decay * S[w][r] + (qk[DK + i] * gt.k_scale) * delta;
                if (STORE && j < P::SLICE) state[(size_t)j * DK + i] = S[w][r];
            }
        }
        if (lane == 0 && j < P::SLICE) out[j] = gt.decay * dots[WC + w] + delta * gt.kq;
    }
}

// One decode work item, by one block: the token at `pos` reads its window from the conv ring and writes its raw
// inputs there; the state slice is read and written in place. `work` holds 2 dk + SLICE + 3 floats of shared memory.
// wait() (block-wide) returns once the item's in-projection rows are written: the conv window is loaded before it,
// and so is the state slice where a thread's part of it is a few registers (H200, 0.8B: 746 us a token against 767
// when the state and the window were asked of L2 before the wait and loaded after it); a larger part is loaded right after the wait, with the
// token's inputs (held across the wait, whose idle loop issues weight copies, it spills the 27B's kernel).
template <class M, int THREADS, class Wait>
__device__ void deltanet_item(const DeltaNetLayer& L, int vh, int slice, int pos, float* work, Wait wait) {
    constexpr int DK = M::LIN_DK, DV = M::LIN_DV, K = M::LIN_CONV_K, C = M::LIN_CONV_DIM;
    using P = DeltaNetSplit<M, THREADS>;
    constexpr bool STATE_FIRST = P::WARP_COLS * P::LANE_ROWS <= 4;
    const int j0 = slice * M::LIN_SLICE;
    float* state = L.state + ((size_t)vh * DV + j0) * DK;
    float S[P::WARP_COLS][P::LANE_ROWS];
    if constexpr (STATE_FIRST) deltanet_load_state<M, THREADS>(S, state, pos > 0);
    const auto window = [&](int ch, int t) -> const float* {
        const int p = pos - (K - 1) + t;
        return p < 0 ? nullptr : L.conv_ring + (size_t)(p % K) * C + ch;
    };
    const auto seen = [&](int c, int ch, float x) {
        if (deltanet_writes_channel<M>(c, vh, slice)) L.conv_ring[(size_t)(pos % K) * C + ch] = x;
    };
    const DeltaNetGates gt = deltanet_front<M, THREADS>(L.mixed, L.conv_w, L.a_log, L.dt_bias, vh, j0, work, window,
                                                        seen, [&] {
        wait();
        if constexpr (!STATE_FIRST) deltanet_load_state<M, THREADS>(S, state, pos > 0);
    });
    deltanet_update<M, THREADS, true>(S, work, gt, state, L.out + vh * DV + j0);
}

// Head h's gated RMSNorm (weight w [dv], gate silu(z)) by the calling warp, in two parts, so that a warp can have
// several heads' loads in flight: load() reads the head's outputs and gates (their loads in flight together) and makes
// w o silu(z) in registers and the sum of o^2; store() scales each by 1 / rms(o) and stores it into xs, and with xq
// (heads of whole XBlocks: dv a multiple of 32) the head's XBlocks into the row xq too (quant.cuh's XRow), quantized
// from the registers (quantize_xblock_lanes: quantize_xblock's bytes).
template <class M>
struct GatedNormHead {
    static constexpr int DV = M::LIN_DV, QUADS = DV / 4, ROUNDS = (QUADS + 31) / 32;
    static_assert(DV % 4 == 0, "heads are whole float4 quads");
    float4 v[ROUNDS];
    float ss;
    __device__ void load(const float* out, const float* z, const float* w, int h) {
        const int lane = threadIdx.x % 32;
        const float4* o4 = reinterpret_cast<const float4*>(out + h * DV);
        const float4* g4 = reinterpret_cast<const float4*>(z + h * DV);
        ss = 0.f;
#pragma unroll
        for (int i = 0; i < ROUNDS; ++i) {
            const int q = 32 * i + lane;
            v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (q < QUADS) {
                const float4 o = load_coherent(o4 + q), g = load_coherent(g4 + q);
                const float4 s = reinterpret_cast<const float4*>(w)[q];
                ss += o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w;
                v[i] = make_float4(s.x * o.x * silu(g.x), s.y * o.y * silu(g.y), s.z * o.z * silu(g.z),
                                   s.w * o.w * silu(g.w));
            }
        }
    }
    template <class XS>
    __device__ void store(XS xs, int h, XRow xq = {}) {
        const int lane = threadIdx.x % 32;
        const float rstd = rsqrtf(warp_sum(ss) / DV + M::EPS);
#pragma unroll
        for (int i = 0; i < ROUNDS; ++i) {
            const int q = 32 * i + lane;
            v[i] = make_float4(v[i].x * rstd, v[i].y * rstd, v[i].z * rstd, v[i].w * rstd);
            if (q < QUADS) xs.quad(h * QUADS + q) = v[i];
            if constexpr (DV % 32 == 0)
                if (xq.p != nullptr) {  // (every lane: the shuffles; an XBlock's 8 lanes all hold quads or none)
                    const XBlockLanes part = quantize_xblock_lanes(v[i], lane);
                    if (q < QUADS) part.store(xq.at((h * DV + 4 * q) / 32), lane);
                }
        }
    }
};

// One head's GatedNormHead, loaded and stored.
template <class M, class XS>
__device__ __forceinline__ void deltanet_gated_norm_head(const float* out, const float* z, const float* w, XS xs,
                                                         int h, XRow xq = {}) {
    GatedNormHead<M> g;
    g.load(out, z, w, h);
    g.store(xs, h, xq);
}

// The gated RMSNorm of the head outputs into xs (shared memory as the staged input of the out-projection, or a
// global row), heads [h0, h1): warp h takes heads h0 + h, h0 + h + WARPS, ... Ends with __syncthreads.
template <class M, int THREADS, class XS>
__device__ void deltanet_gated_norm(const float* out, const float* z, const float* w, XS xs, int h0 = 0,
                                    int h1 = M::LIN_HV) {
    for (int h = h0 + threadIdx.x / 32; h < h1; h += THREADS / 32) deltanet_gated_norm_head<M>(out, z, w, xs, h);
    __syncthreads();
}

}  // namespace lucegen
