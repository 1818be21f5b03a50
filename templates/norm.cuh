// norm.cuh: zero-centred RMSNorm, y = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32 inside, bf16 out (HF Qwen3.5).
#pragma once
#include "common.cuh"

namespace lucegen {

// One row of H values normalised by one block of THREADS threads. H must be a multiple of 8.
template <int H, int THREADS>
__device__ void rmsnorm_1p_row(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y,
                               float eps, float* scratch) {
    static_assert(H % 8 == 0, "RMSNorm width must be a multiple of 8");
    constexpr int CHUNKS = H / 8;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    float ss = 0.f;
    for (int c = threadIdx.x; c < CHUNKS; c += THREADS) {
        const uint4 v = x4[c];
        ss += dot8_bf16(v, v);
    }
    const float rstd = rsqrtf(block_sum<THREADS>(ss, scratch) / H + eps);
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    uint4* y4 = reinterpret_cast<uint4*>(y);
    for (int c = threadIdx.x; c < CHUNKS; c += THREADS) {
        uint4 xv = x4[c], wv = w4[c], out;
        const bf16* xe = reinterpret_cast<const bf16*>(&xv);
        const bf16* we = reinterpret_cast<const bf16*>(&wv);
        bf16* oe = reinterpret_cast<bf16*>(&out);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            oe[i] = __float2bfloat16(__bfloat162float(xe[i]) * rstd * (1.f + __bfloat162float(we[i])));
        y4[c] = out;
    }
}

}  // namespace lucegen
