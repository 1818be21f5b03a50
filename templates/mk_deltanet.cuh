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
#include "common.cuh"

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

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
// torch.nn.functional.softplus with beta 1 and threshold 20.
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

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
    constexpr int RATIO = M::LIN_HV / M::LIN_HK, SLICES = M::LIN_DV / M::LIN_SLICE;
    return c >= 2 * M::LIN_DK || (vh % RATIO == 0 && c % SLICES == slice);
}

// The in-projection rows [x, y) item (vh, slice) reads: q and k of its key head, its value channels, b and a.
template <class M>
__device__ __forceinline__ void deltanet_reads(int vh, int slice, int2 (&rows)[5]) {
    constexpr int DK = M::LIN_DK, C = M::LIN_CONV_DIM;
    const int kh = vh / (M::LIN_HV / M::LIN_HK), v0 = 2 * M::LIN_KEY_DIM + vh * M::LIN_DV + slice * M::LIN_SLICE;
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
    const int kh = vh / (M::LIN_HV / M::LIN_HK), j0 = slice * M::LIN_SLICE;
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

// One work item, by one block. `work` holds 2 dk + SLICE + 2 floats of shared memory.
template <class M, int THREADS>
__device__ void deltanet_item(const DeltaNetLayer& L, int vh, int slice, int pos, float* work) {
    constexpr int DK = M::LIN_DK, DV = M::LIN_DV, K = M::LIN_CONV_K, C = M::LIN_CONV_DIM, SLICE = M::LIN_SLICE;
    constexpr int WARPS = THREADS / 32, LANE_ROWS = (DK + 31) / 32, WARP_COLS = (SLICE + WARPS - 1) / WARPS;
    static_assert(WARPS >= 2 && DV % SLICE == 0 && M::LIN_HV % M::LIN_HK == 0, "DeltaNet split");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kh = vh / (M::LIN_HV / M::LIN_HK), j0 = slice * SLICE;
    float* qk = work;             // [2 dk]: q then k after conv + SiLU
    float* v = work + 2 * DK;     // [SLICE]
    float* sums = v + SLICE;      // [2]: sum of squares of q and of k
    float* state = L.state + ((size_t)vh * DV + j0) * DK;

    // The head's gates (their loads overlap the state's and the convolution's).
    const float beta = sigmoid(load_coherent(L.mixed + C + M::LIN_VALUE_DIM + vh));
    const float g = -__expf(L.a_log[vh]) * softplus(load_coherent(L.mixed + C + M::LIN_VALUE_DIM + M::LIN_HV + vh) +
                                                    L.dt_bias[vh]);
    const float decay = __expf(g);

    // This warp's state columns first: their latency overlaps the convolution.
    float S[WARP_COLS][LANE_ROWS];
#pragma unroll
    for (int w = 0; w < WARP_COLS; ++w)
#pragma unroll
        for (int r = 0; r < LANE_ROWS; ++r) {
            const int j = warp + w * WARPS, i = lane + 32 * r;
            S[w][r] = pos > 0 && j < SLICE && i < DK ? load_coherent(state + (size_t)j * DK + i) : 0.f;
        }

    // Causal depthwise conv + SiLU of the channels this item reads; this token's inputs into the ring.
    for (int c = threadIdx.x; c < 2 * DK + SLICE; c += THREADS) {
        const int ch = deltanet_channel<M>(c, kh, vh, j0);
        const float x = load_coherent(L.mixed + ch);
        float acc = L.conv_w[ch * K + K - 1] * x;
#pragma unroll
        for (int t = 0; t < K - 1; ++t) {
            const int p = pos - (K - 1) + t;
            if (p >= 0) acc += L.conv_w[ch * K + t] * load_coherent(L.conv_ring + (size_t)(p % K) * C + ch);
        }
        (c < 2 * DK ? qk[c] : v[c - 2 * DK]) = silu(acc);
        if (deltanet_writes_channel<M>(c, vh, slice)) L.conv_ring[(size_t)(pos % K) * C + ch] = x;
    }
    __syncthreads();
    if (warp < 2) {  // l2norm of q (warp 0) and k (warp 1)
        float ss = 0.f;
        for (int i = lane; i < DK; i += 32) ss += qk[warp * DK + i] * qk[warp * DK + i];
        ss = warp_sum(ss);
        if (lane == 0) sums[warp] = ss;
    }
    __syncthreads();
    const float q_scale = rsqrtf(sums[0] + 1e-6f) * rsqrtf(static_cast<float>(DK));
    const float k_scale = rsqrtf(sums[1] + 1e-6f);

    // Per column j: S = decay S; delta = beta (v_j - S^T k); S += k delta; o_j = S^T q (the updated state).
#pragma unroll
    for (int w = 0; w < WARP_COLS; ++w) {
        const int j = warp + w * WARPS;
        if (j >= SLICE) break;
        float kv = 0.f;
#pragma unroll
        for (int r = 0; r < LANE_ROWS; ++r) {
            const int i = lane + 32 * r;
            S[w][r] *= decay;
            if (i < DK) kv += S[w][r] * (qk[DK + i] * k_scale);
        }
        const float delta = (v[j] - warp_sum(kv)) * beta;
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < LANE_ROWS; ++r) {
            const int i = lane + 32 * r;
            if (i < DK) {
                S[w][r] += (qk[DK + i] * k_scale) * delta;
                o += S[w][r] * (qk[i] * q_scale);
                state[(size_t)j * DK + i] = S[w][r];
            }
        }
        o = warp_sum(o);
        if (lane == 0) L.out[vh * DV + j0 + j] = o;
    }
}

// The gated RMSNorm of the head outputs (weight w [dv], gate z = silu(z)) into shared memory as the staged input of
// the out-projection. Warp h normalises heads h, h + WARPS, ...: one pass over the head's outputs and gates (their
// loads in flight together) stages w o silu(z) and sums o^2, a second in shared memory scales it by 1 / rms(o).
// Ends with __syncthreads.
template <class M, int THREADS, class XS>
__device__ void deltanet_gated_norm(const float* out, const float* z, const float* w, XS xs) {
    constexpr int DV = M::LIN_DV, WARPS = THREADS / 32;
    static_assert(DV % 4 == 0, "heads are whole float4 quads");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int h = warp; h < M::LIN_HV; h += WARPS) {
        const float4* o4 = reinterpret_cast<const float4*>(out + h * DV);
        const float4* g4 = reinterpret_cast<const float4*>(z + h * DV);
        float ss = 0.f;
        for (int q = lane; q < DV / 4; q += 32) {
            const float4 o = load_coherent(o4 + q), g = load_coherent(g4 + q);
            const float4 s = reinterpret_cast<const float4*>(w)[q];
            ss += o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w;
            xs.quad(h * DV / 4 + q) = make_float4(s.x * o.x * silu(g.x), s.y * o.y * silu(g.y),
                                                  s.z * o.z * silu(g.z), s.w * o.w * silu(g.w));
        }
        const float rstd = rsqrtf(warp_sum(ss) / DV + M::EPS);
        for (int q = lane; q < DV / 4; q += 32) {
            float4& v = xs.quad(h * DV / 4 + q);
            v = make_float4(v.x * rstd, v.y * rstd, v.z * rstd, v.w * rstd);
        }
    }
    __syncthreads();
}

}  // namespace lucegen
