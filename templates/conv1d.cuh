// conv1d.cuh: the Gated DeltaNet front of the prefill, over T prompt tokens at absolute positions start .. start+T-1:
// the causal depthwise conv1d + SiLU of the q, k, v channels, and the gates beta = sigmoid(b),
// g = -exp(A_log) * softplus(a + dt_bias) of every value head.
//
// Input: `mixed` [T, MW] fp32, the in-projection rows [q k v (C channels) | z (VD) | b (HV) | a (HV)].
// Conv state: the decode path's ring of K slots [K][C] fp32: slot p % K holds the raw input of position p;
// positions before 0 read as zero. A thread owns four channels over a range of TOKENS tokens: it loads the
// range's inputs (and the K-1 before it) at once and slides the K-tap window along them in registers. Only the thread of a channel's first range reads the ring (the K-1
// inputs before `start`) and only that same thread writes it (the last K-1 inputs, after its reads), so the ring
// is updated in place with no race, for any T >= 1.
#pragma once
#include "activation.cuh"
#include "common.cuh"

namespace lucegen {

template <int C_, int VD_, int HV_, int K_>
struct ConvShape {
    static constexpr int C = C_, VD = VD_, HV = HV_, K = K_;
    static constexpr int MW = C + VD + 2 * HV;  // a row of `mixed`
    static constexpr int QUADS = C / 4, GATE_QUADS = HV / 4;
    static_assert(C % 4 == 0 && VD % 4 == 0 && HV % 4 == 0, "channels and heads come in float4 quads");
};

__device__ __forceinline__ float4 fma4(float4 w, float4 x, float4 acc) {
    return make_float4(fmaf(w.x, x.x, acc.x), fmaf(w.y, x.y, acc.y), fmaf(w.z, x.z, acc.z), fmaf(w.w, x.w, acc.w));
}

// Channels 4q .. 4q+3 over tokens [t0, min(t0 + TOKENS, T)): qkv[t][c] = silu(sum_j w[c][j] x[t - (K-1) + j]),
// in bf16. conv_w is [C][K] fp32 (tap K-1 multiplies the current token). The thread's TOKENS + K - 1 inputs are
// all loaded before the first product (one round trip to L2, not one per token), then the window slides over them
// in registers.
template <class S, int TOKENS>
__device__ void conv1d_silu_quad(const float* __restrict__ mixed, const float* __restrict__ conv_w,
                                 float* __restrict__ ring, bf16* __restrict__ qkv, int q, int t0, int T, int start) {
    constexpr int K = S::K, W = TOKENS + K - 1;
    static_assert(TOKENS >= K - 1, "a later token range's window never reaches before the prompt");
    const int c = 4 * q;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    auto input = [&](int t) { return *reinterpret_cast<const float4*>(mixed + (size_t)t * S::MW + c); };

    // x[i]: the raw input of token t0 - (K-1) + i (from the ring before the prompt, zero before position 0 and
    // past the prompt's end, where nothing is stored)
    float4 x[W];
#pragma unroll
    for (int i = 0; i < W; ++i) {
        const int t = t0 - (K - 1) + i, pos = start + t;
        x[i] = t >= T ? zero
               : t >= 0 ? input(t)
               : pos >= 0 ? *reinterpret_cast<const float4*>(ring + (size_t)(pos % K) * S::C + c)
                          : zero;
    }
    float4 w[K];
#pragma unroll
    for (int j = 0; j < K; ++j)
        w[j] = make_float4(__ldg(conv_w + (c + 0) * K + j), __ldg(conv_w + (c + 1) * K + j),
                           __ldg(conv_w + (c + 2) * K + j), __ldg(conv_w + (c + 3) * K + j));
#pragma unroll
    for (int i = 0; i < TOKENS; ++i) {
        const int t = t0 + i;
        if (t >= T) break;
        float4 acc = zero;
#pragma unroll
        for (int j = 0; j < K; ++j) acc = fma4(w[j], x[i + j], acc);
        const __nv_bfloat162 lo = __floats2bfloat162_rn(silu(acc.x), silu(acc.y));
        const __nv_bfloat162 hi = __floats2bfloat162_rn(silu(acc.z), silu(acc.w));
        *reinterpret_cast<uint2*>(qkv + (size_t)t * S::C + c) =
            make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
    }
    if (t0 == 0) {  // the new state: the raw inputs of positions start+T-(K-1) .. start+T-1. Those from before
                    // the prompt (T < K-1) are in the ring already, in slots no prompt position takes. Only this
                    // thread read the channel's ring, above.
#pragma unroll
        for (int j = 1; j < K; ++j) {
            const int t = T - j;
            if (t >= 0) *reinterpret_cast<float4*>(ring + (size_t)((start + t) % K) * S::C + c) = input(t);
        }
    }
}

// Value heads 4q .. 4q+3 over tokens [t0, min(t0 + TOKENS, T)): beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias),
// into beta and g [T, HV] fp32.
template <class S, int TOKENS>
__device__ void deltanet_gates_quad(const float* __restrict__ mixed, const float* __restrict__ a_log,
                                    const float* __restrict__ dt_bias, float* __restrict__ g,
                                    float* __restrict__ beta, int q, int t0, int T) {
    const int h = 4 * q;
    const float4 al = *reinterpret_cast<const float4*>(a_log + h);
    const float4 dt = *reinterpret_cast<const float4*>(dt_bias + h);
    const float4 rate = make_float4(-__expf(al.x), -__expf(al.y), -__expf(al.z), -__expf(al.w));
#pragma unroll
    for (int i = 0; i < TOKENS; ++i) {
        const int t = t0 + i;
        if (t >= T) break;
        const float* row = mixed + (size_t)t * S::MW + S::C + S::VD;
        const float4 b = *reinterpret_cast<const float4*>(row + h);
        const float4 a = *reinterpret_cast<const float4*>(row + S::HV + h);
        *reinterpret_cast<float4*>(beta + (size_t)t * S::HV + h) =
            make_float4(sigmoid(b.x), sigmoid(b.y), sigmoid(b.z), sigmoid(b.w));
        *reinterpret_cast<float4*>(g + (size_t)t * S::HV + h) =
            make_float4(rate.x * softplus(a.x + dt.x), rate.y * softplus(a.y + dt.y), rate.z * softplus(a.z + dt.z),
                        rate.w * softplus(a.w + dt.w));
    }
}

}  // namespace lucegen
