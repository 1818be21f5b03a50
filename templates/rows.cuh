// rows.cuh: per-token-row operations of the prefill: the embedding gather into the fp32 residual stream, and the
// zero-centred RMSNorm of that stream into the bf16 rows the projections read. One block per row.
#pragma once
#include "norm.cuh"

namespace lucegen {

// x (fp32 [H]) = the embedding row (bf16 [H]).
template <int H, int THREADS>
__device__ __forceinline__ void embed_row(const bf16* __restrict__ row, float* __restrict__ x) {
    static_assert(H % 8 == 0, "embedding rows are whole 16-byte chunks");
    const uint4* r4 = reinterpret_cast<const uint4*>(row);
    float4* x4 = reinterpret_cast<float4*>(x);
    for (int c = threadIdx.x; c < H / 8; c += THREADS) {
        const uint4 v = __ldg(r4 + c);
        const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
        const float2 p0 = __bfloat1622float2(b[0]), p1 = __bfloat1622float2(b[1]);
        const float2 p2 = __bfloat1622float2(b[2]), p3 = __bfloat1622float2(b[3]);
        x4[2 * c] = make_float4(p0.x, p0.y, p1.x, p1.y);
        x4[2 * c + 1] = make_float4(p2.x, p2.y, p3.x, p3.y);
    }
}

// y (bf16 [H]) = x * rsqrt(mean(x^2) + eps) * (1 + w) for an fp32 row x and fp32 weight w; the row is held in
// registers between the two passes. `scratch` holds THREADS / 32 floats.
template <int H, int THREADS>
__device__ __forceinline__ void rmsnorm_1p_f32_row(const float* __restrict__ x, const float* __restrict__ w,
                                                   bf16* __restrict__ y, float eps, float* scratch) {
    static_assert(H % 4 == 0, "RMSNorm rows are whole float4 quads");
    constexpr int QUADS = H / 4, PER_THREAD = (QUADS + THREADS - 1) / THREADS;
    float4 v[PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int q = threadIdx.x + i * THREADS;
        v[i] = q < QUADS ? load_quad(x, q) : make_float4(0.f, 0.f, 0.f, 0.f);
        ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    }
    const float rstd = rsqrtf(block_sum<THREADS>(ss, scratch) / H + eps);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int q = threadIdx.x + i * THREADS;
        if (q < QUADS) {
            const float4 g = __ldg(reinterpret_cast<const float4*>(w) + q);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(v[i].x * rstd * (1.f + g.x), v[i].y * rstd * (1.f + g.y));
            const __nv_bfloat162 hi = __floats2bfloat162_rn(v[i].z * rstd * (1.f + g.z), v[i].w * rstd * (1.f + g.w));
            reinterpret_cast<uint2*>(y)[q] = make_uint2(*reinterpret_cast<const unsigned*>(&lo),
                                                        *reinterpret_cast<const unsigned*>(&hi));
        }
    }
}

}  // namespace lucegen
