// conv1d.cuh: the Gated DeltaNet front of the prefill, over T prompt tokens at absolute positions start .. start+T-1:
// the causal depthwise conv1d + SiLU of the q, k, v channels, and the gates beta = sigmoid(b),
// g = -exp(A_log) * softplus(a + dt_bias) of every value head. gdn_chunk_prep runs them for its chunk and head.
//
// Input: `mixed` [T, MW] fp32, the in-projection rows [q k v (C channels) | z (VD) | b (HV) | a (HV)].
// Conv state: the decode path's ring of K slots [K][C] fp32: slot p % K holds the raw input of position p;
// positions before 0 read as zero. A thread convolves four channels over a range of tokens: it loads the range's
// inputs (and the K-1 before it) at once and slides the K-tap window along them in registers. Only the range that
// starts the prompt reads the ring (the K-1 inputs before `start`); conv_ring_update writes it, and must run after
// those reads (the same thread, or past a barrier), so the ring is updated in place with no race, for any T >= 1.
#pragma once
#include "activation.cuh"
#include "common.cuh"

namespace lucegen {

template <int C_, int VD_, int HV_, int K_>
struct ConvShape {
    static constexpr int C = C_, VD = VD_, HV = HV_, K = K_;
    static constexpr int MW = C + VD + 2 * HV;  // a row of `mixed`
    static_assert(C % 4 == 0 && VD % 4 == 0 && HV % 4 == 0, "rows of `mixed` are whole float4 quads");
};

__device__ __forceinline__ float4 fma4(float4 w, float4 x, float4 acc) {
    return make_float4(fmaf(w.x, x.x, acc.x), fmaf(w.y, x.y, acc.y), fmaf(w.z, x.z, acc.z), fmaf(w.w, x.w, acc.w));
}

// Channels c .. c+3 over tokens [t0, min(t0 + TOKENS, T)): out(t, silu(sum_j w[c][j] x[t - (K-1) + j])) as a float4.
// conv_w is [C][K] fp32 (tap K-1 multiplies the current token). The TOKENS + K - 1 inputs are all loaded before the
// first product (one round trip to L2, not one per token), then the window slides over them in registers.
template <class S, int TOKENS, class Out>
__device__ __forceinline__ void conv1d_silu_quad(const float* __restrict__ mixed, const float* __restrict__ conv_w,
                                                 const float* __restrict__ ring, int c, int t0, int T, int start,
                                                 Out&& out) {
    constexpr int K = S::K, W = TOKENS + K - 1;
    static_assert(TOKENS >= K - 1, "a later token range's window never reaches before the prompt");
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);

    // x[i]: the raw input of token t0 - (K-1) + i (from the ring before the prompt, zero before position 0 and
    // past the prompt's end, where nothing is stored)
    float4 x[W];
    const float* in = mixed + (size_t)(t0 - (K - 1)) * S::MW + c;
    if (t0 >= K - 1 && t0 + TOKENS <= T) {  // the window inside the prompt: the loads issue back to back
#pragma unroll
        for (int i = 0; i < W; ++i) x[i] = *reinterpret_cast<const float4*>(in + (size_t)i * S::MW);
    } else {
#pragma unroll
        for (int i = 0; i < W; ++i) {
            const int t = t0 - (K - 1) + i, pos = start + t;
            x[i] = t >= T ? zero
                   : t >= 0 ? *reinterpret_cast<const float4*>(in + (size_t)i * S::MW)
                   : pos >= 0 ? *reinterpret_cast<const float4*>(ring + (size_t)(pos % K) * S::C + c)
                              : zero;
        }
    }
    float wc[4 * K];  // the four channels' taps, 4K consecutive floats: K 16-byte loads, not 4K scalar ones
#pragma unroll
    for (int j = 0; j < K; ++j)
        *reinterpret_cast<float4*>(wc + 4 * j) = __ldg(reinterpret_cast<const float4*>(conv_w + (size_t)c * K) + j);
    float4 w[K];
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = make_float4(wc[j], wc[K + j], wc[2 * K + j], wc[3 * K + j]);
#pragma unroll
    for (int i = 0; i < TOKENS; ++i) {
        if (t0 + i >= T) break;
        float4 acc = zero;
#pragma unroll
        for (int j = 0; j < K; ++j) acc = fma4(w[j], x[i + j], acc);
        out(t0 + i, make_float4(silu(acc.x), silu(acc.y), silu(acc.z), silu(acc.w)));
    }
}

// The new conv state of channels c .. c+3: the raw inputs of positions start+T-(K-1) .. start+T-1 into the ring.
// Those from before the prompt (T < K-1) are in the ring already, in slots no prompt position takes.
template <class S>
__device__ __forceinline__ void conv_ring_update(const float* __restrict__ mixed, float* __restrict__ ring, int c,
                                                 int T, int start) {
#pragma unroll
    for (int j = 1; j < S::K; ++j) {
        const int t = T - j;
        if (t >= 0)
            *reinterpret_cast<float4*>(ring + (size_t)((start + t) % S::K) * S::C + c) =
                *reinterpret_cast<const float4*>(mixed + (size_t)t * S::MW + c);
    }
}

// Four channels' SiLU outputs as bf16, 8 bytes.
__device__ __forceinline__ uint2 bf16x4(float4 v) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    return make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
}

// The gates of value head h at token t: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias).
template <class S>
__device__ __forceinline__ float2 deltanet_gates(const float* __restrict__ mixed, const float* __restrict__ a_log,
                                                 const float* __restrict__ dt_bias, int t, int h) {
    const float* row = mixed + (size_t)t * S::MW + S::C + S::VD;
    return make_float2(-__expf(a_log[h]) * softplus(row[S::HV + h] + dt_bias[h]), sigmoid(row[h]));
}

}  // namespace lucegen
