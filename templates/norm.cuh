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

// Four values of a row as fp32: from fp32 written earlier in the same launch (read through L2), or from bf16 weights.
__device__ __forceinline__ float4 load_quad(const float* x, int q) {
    return load_coherent(reinterpret_cast<const float4*>(x) + q);
}
__device__ __forceinline__ float4 load_quad(const bf16* x, int q) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(x) + q);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}

// The same zero-centred RMSNorm of one H-wide row (fp32 or bf16) with an fp32 weight, kept in fp32 and written
// through out.quad(q) (StagedF32: shared memory as a staged GEMV input; GlobalQuads: an fp32 row in global memory).
// One block; ends with __syncthreads. `scratch` holds THREADS/32 floats. The weight is loaded with the row (one
// memory round trip, not one before the reduction and one after).
template <int H, int THREADS, typename T, class XS>
__device__ void rmsnorm_1p_stage(const T* __restrict__ x, const float* __restrict__ w, float eps, XS out,
                                 float* scratch) {
    static_assert(H % 8 == 0, "RMSNorm width must be a multiple of 8");
    constexpr int QUADS = H / 4, PER_THREAD = (QUADS + THREADS - 1) / THREADS;
    float4 v[PER_THREAD], g[PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int q = threadIdx.x + i * THREADS;
        v[i] = q < QUADS ? load_quad(x, q) : make_float4(0.f, 0.f, 0.f, 0.f);
        g[i] = q < QUADS ? __ldg(reinterpret_cast<const float4*>(w) + q) : make_float4(0.f, 0.f, 0.f, 0.f);
        ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    }
    const float rstd = rsqrtf(block_sum<THREADS>(ss, scratch) / H + eps);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int q = threadIdx.x + i * THREADS;
        if (q < QUADS)
            out.quad(q) = make_float4(v[i].x * rstd * (1.f + g[i].x), v[i].y * rstd * (1.f + g[i].y),
                                      v[i].z * rstd * (1.f + g[i].z), v[i].w * rstd * (1.f + g[i].w));
    }
    __syncthreads();
}

}  // namespace lucegen
