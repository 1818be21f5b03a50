// layered.cuh: the small per-token-row kernels of the layer-by-layer step (lucegen/engine/layered.py) between its
// quantized projections (qgemv.cuh) and its mixers (the tree kernels, tree.cuh). Rows are fp32; a token row is one
// block's where the kernel normalises the whole row, else spread over blocks (SiLU x up). The DeltaNet gated norm runs
// in the tree DeltaNet kernel (tree.cuh).
#pragma once
#include "activation.cuh"
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

// x_out = x + y (y when given, else x itself) and h = RMSNorm (1 + w) of it, fp32, on quads [q0, q1) of the
// H-wide row: the blocks of a row each take a part of it, every one summing the squares of the whole row in the same
// order (so the same rstd, bit for bit; the row's ~20-40 KB come from L2). x_out must not be x (the other blocks
// still read x). `scratch` holds THREADS/32 floats. ZERO_CENTRED = false: the plain w * x_hat of Qwen3RMSNorm (the
// DFlash draft's norms, draft.cu.j2) instead, the same arithmetic with 0 + w for 1 + w.
template <int H, int THREADS, bool ZERO_CENTRED = true>
__device__ void add_rmsnorm_part(const float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                                 float eps, float* __restrict__ x_out, float* __restrict__ h, int q0, int q1,
                                 float* scratch) {
    static_assert(H % 8 == 0, "RMSNorm width must be a multiple of 8");
    constexpr int QUADS = H / 4, PER_THREAD = (QUADS + THREADS - 1) / THREADS;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* y4 = reinterpret_cast<const float4*>(y);
    float4 v[PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int q = threadIdx.x + i * THREADS;
        v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (q < QUADS) {
            v[i] = x4[q];
            if (y != nullptr) {
                const float4 b = y4[q];
                v[i] = make_float4(v[i].x + b.x, v[i].y + b.y, v[i].z + b.z, v[i].w + b.w);
            }
        }
        ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    }
    const float rstd = rsqrtf(block_sum<THREADS>(ss, scratch) / H + eps);
    constexpr float ONE = ZERO_CENTRED ? 1.f : 0.f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int q = threadIdx.x + i * THREADS;
        if (q >= q0 && q < q1) {
            const float4 g = __ldg(reinterpret_cast<const float4*>(w) + q);
            reinterpret_cast<float4*>(x_out)[q] = v[i];
            reinterpret_cast<float4*>(h)[q] = make_float4(v[i].x * rstd * (ONE + g.x), v[i].y * rstd * (ONE + g.y),
                                                          v[i].z * rstd * (ONE + g.z), v[i].w * rstd * (ONE + g.w));
        }
    }
}

// xq = the XBlocks (quant.cuh) of values [v0, v1) of an fp32 row of K values (v0, v1 multiples of 32), once every
// thread's writes of them are done: the quantized GEMVs' activation quantization (qgemv.cuh's qquant_x, the same
// function) fused into the kernel that makes the row, instead of a launch of its own before each projection. Rows
// whose K is not whole 32-value blocks have no XBlocks (no quantized matrix takes them).
template <int K, int THREADS>
__device__ void quantize_row(const float* row, XBlock* __restrict__ xq, int v0 = 0, int v1 = K) {
    if constexpr (K % 32 == 0) {
        __syncthreads();
        for (int i = v0 / 32 + threadIdx.x; i < v1 / 32; i += THREADS) xq[i] = quantize_xblock(row + 32 * i);
    }
}

// act [i0, i1) = silu(gate) * up there (fp32).
template <int THREADS>
__device__ void silu_mul_range(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ act,
                               int i0, int i1) {
    for (int i = i0 + threadIdx.x; i < i1; i += THREADS) act[i] = silu(gate[i]) * up[i];
}

}  // namespace lucegen
