// layered.cuh: the small per-token-row kernels of the layer-by-layer step (lucegen/engine/layered.py) between its
// quantized projections (qgemv.cuh) and its mixers (the tree kernels, tree.cuh). Rows are fp32; one block per
// token row.
#pragma once
#include "mk_attention.cuh"
#include "norm.cuh"
#include "quant.cuh"

namespace lucegen {

// x (fp32 [K]) = row `id` of an embedding table in format F (its values exactly as quants.dequantize gives them).
template <class F, int K, int THREADS>
__device__ void embed_row_q(const unsigned char* __restrict__ table, int id, float* __restrict__ x) {
    static_assert(K % F::BLOCK_VALUES == 0, "embedding rows are whole blocks");
    constexpr int PIECES = K / F::BLOCK_VALUES * F::PIECES;
    const unsigned char* row = table + (size_t)id * (K / F::BLOCK_VALUES * F::BLOCK_BYTES);
    for (int t = threadIdx.x; t < PIECES; t += THREADS) {
        const int b = t / F::PIECES, p = t % F::PIECES;
        const auto pc = F::load(row + (size_t)b * F::BLOCK_BYTES, p);
#pragma unroll
        for (int r = 0; r < F::RUNS; ++r) {
            float w[8];
            F::run(pc, r, w);
            float* o = x + b * F::BLOCK_VALUES + F::voff(p, r);
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = w[i];
        }
    }
}

// x (fp32 [H]) += y (when given); then h = RMSNorm (1 + w) of x, fp32. `scratch` holds THREADS/32 floats.
template <int H, int THREADS>
__device__ void add_rmsnorm_row(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                                float eps, float* __restrict__ h, float* scratch) {
    float4* x4 = reinterpret_cast<float4*>(x);
    if (y != nullptr) {
        const float4* y4 = reinterpret_cast<const float4*>(y);
        for (int q = threadIdx.x; q < H / 4; q += THREADS) {
            const float4 a = x4[q], b = y4[q];
            x4[q] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
        __syncthreads();
    }
    rmsnorm_1p_stage<H, THREADS>(static_cast<const float*>(x), w, eps, GlobalQuads{reinterpret_cast<float4*>(h)},
                                 scratch);
}

// xq = the XBlocks (quant.cuh) of this block's fp32 row of K values, once every thread's writes of the row are
// done: the quantized GEMVs' activation quantization (qgemv.cuh's qquant_x, the same function) fused into the
// kernel that makes the row, instead of a launch of its own before each projection. Rows whose K is not whole
// 32-value blocks have no XBlocks (no quantized matrix takes them).
template <int K, int THREADS>
__device__ void quantize_row(const float* row, XBlock* __restrict__ xq) {
    if constexpr (K % 32 == 0) {
        __syncthreads();
        for (int i = threadIdx.x; i < K / 32; i += THREADS) xq[i] = quantize_xblock(row + 32 * i);
    }
}

// act (fp32 [I]) = silu(gate) * up.
template <int I, int THREADS>
__device__ void silu_mul_row(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ act) {
    for (int i = threadIdx.x; i < I; i += THREADS) act[i] = silu(gate[i]) * up[i];
}

}  // namespace lucegen
