// layered.cuh: the small per-token-row kernels of the layer-by-layer step (lucegen/engine/layered.py) between its
// quantized projections (qgemv.cuh) and its mixers (the tree kernels, tree.cuh). Rows are fp32; a token row is one
// block's where the kernel normalises the whole row, else spread over blocks (SiLU x up). The DeltaNet gated norm runs
// in the tree DeltaNet kernel (tree.cuh).
#pragma once
#include "activation.cuh"
#include "norm.cuh"
#include "quant.cuh"

namespace lucegen {

// x (fp32 [K]) = row `id` of an embedding table in format F (quant.cuh's layout; its values exactly as
// quants.dequantize gives them).
template <class F, int K, int THREADS>
__device__ void embed_row_q(const unsigned char* __restrict__ table, int id, float* __restrict__ x) {
    static_assert(K % F::ROW_VALUES == 0, "embedding rows are whole GGUF blocks");
    constexpr int PIECES = K / (F::BLOCK_VALUES / F::PIECES);
    for (int t = threadIdx.x; t < PIECES; t += THREADS) {
        const int b = t / F::PIECES, p = t % F::PIECES;
        const auto pc = F::load(table + wblock_offset<F>(id, b, K), p);
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
// DFlash draft's norms, draft.cu.j2) instead, the same arithmetic with 0 + w for 1 + w. Where given (xq.p), h's
// XBlocks into its row xq (the quantized GEMVs' activations: qgemv.cuh's qquant_x fused into the kernel that makes the
// row; q0, q1 multiples of 8) and h in bf16 into h16, both from the registers.
template <int H, int THREADS, bool ZERO_CENTRED = true>
__device__ void add_rmsnorm_part(const float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                                 float eps, float* __restrict__ x_out, float* __restrict__ h, int q0, int q1,
                                 float* scratch, XRow xq, bf16* __restrict__ h16 = nullptr) {
    static_assert(H % 8 == 0, "RMSNorm width must be a multiple of 8");
    static_assert(THREADS % 32 == 0, "whole warps: 8 lanes hold an XBlock");
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
        const bool mine = q >= q0 && q < q1;  // the same for the 8 lanes of an XBlock
        float4 n = make_float4(0.f, 0.f, 0.f, 0.f);
        if (mine) {
            const float4 g = __ldg(reinterpret_cast<const float4*>(w) + q);
            n = make_float4(v[i].x * rstd * (ONE + g.x), v[i].y * rstd * (ONE + g.y), v[i].z * rstd * (ONE + g.z),
                            v[i].w * rstd * (ONE + g.w));
            reinterpret_cast<float4*>(x_out)[q] = v[i];
            reinterpret_cast<float4*>(h)[q] = n;
            if (h16) store_bf16x4(h16 + 4 * q, n);
        }
        if constexpr (H % 32 == 0)
            if (xq.p && __any_sync(0xFFFFFFFFu, mine)) {  // only the warps with quads of the part (a few of PER_THREAD)
                const XBlockLanes b = quantize_xblock_lanes(n, threadIdx.x % 32);
                if (mine) b.store(xq.at(q / 8), threadIdx.x % 32);
            }
    }
}

// act [i0, i1) = silu(gate) * up there (fp32; i0, i1 multiples of 4), a quad a thread; where given, act's XBlocks
// into xq (as add_rmsnorm_part; i0 a multiple of 32).
template <int K, int THREADS>
__device__ void silu_mul_range(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ act,
                               int i0, int i1, XRow xq) {
    static_assert(K % 4 == 0 && THREADS % 32 == 0, "rows of whole quads, whole warps");
    const float4* g4 = reinterpret_cast<const float4*>(gate);
    const float4* u4 = reinterpret_cast<const float4*>(up);
    for (int base = i0 / 4; base < i1 / 4; base += THREADS) {  // the same trip count in every thread
        const int q = base + threadIdx.x;
        const bool mine = q < i1 / 4;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (mine) {
            const float4 g = g4[q], u = u4[q];
            a = make_float4(silu(g.x) * u.x, silu(g.y) * u.y, silu(g.z) * u.z, silu(g.w) * u.w);
            reinterpret_cast<float4*>(act)[q] = a;
        }
        if constexpr (K % 32 == 0)
            if (xq.p) {
                const XBlockLanes b = quantize_xblock_lanes(a, threadIdx.x % 32);
                if (mine) b.store(xq.at(q / 8), threadIdx.x % 32);
            }
    }
}

}  // namespace lucegen
