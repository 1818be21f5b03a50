// sample.cuh: a token drawn from softmax(logits / T) with one uniform u in [0, 1): the first token whose running
// sum of probabilities passes u (the inverse of the distribution function, as numpy's Generator.choice and the
// host's Sampler.draw), for a row cut into slices among the blocks of a grid.
//
// Block b of B holds the slice [n b / B, n (b + 1) / B) (slice_of; the megakernel's LM head rows are the same split).
//   softmax_part   its largest logit m_b and s_b = sum over the slice of exp(z_i - z_b), z = l (1 / T) in fp64;
//   sample_pick    from every part, in block order: Z the largest z_b, w_b = s_b exp(z_b - Z), the first block
//                  whose running sum of w passes u S (S = sum w), and u' = how far into w_b u S lies (a fraction);
//                  then the first token of that slice whose running sum of exp(z_i - z_b) passes u' of their sum.
// Both picks are first_past. Where rounding leaves a target past the last sum, the last token of positive weight is
// taken. fp64 throughout, so a draw is the host's for the same u except where u lies within ~1e-15 of the boundary
// between two tokens. Every block that calls a pick with the same inputs gets the same token (a fixed order of adds
// at every level): the megakernel has every block pick and no block wait.
//
// The loops are not unrolled and the scratch is the caller's: inside the megakernel's step loop, registers are what
// the draw must not take (mk_decode.cuh's sampled kernel compiles without spills).
//
// Reference: lucegen/kernels/sample.py.
#pragma once
#include "common.cuh"

namespace lucegen {

struct SoftmaxPart {
    double sum;  // sum of exp(z_i - z_max) over the slice
    float max;   // the slice's largest logit; -inf where the slice is empty (its sum is 0)
    int pad;
};

// The bytes of shared memory the functions below take as scratch (THREADS threads).
template <int THREADS>
constexpr int sample_scratch_bytes() { return 8 * (THREADS / 32) + 24; }

// Block b's slice [n b / blocks, n (b + 1) / blocks) of n (n * blocks < 2^32: 32-bit division).
__device__ __forceinline__ int2 slice_of(int n, int b, int blocks) {
    return make_int2(static_cast<int>(unsigned(n) * b / blocks), static_cast<int>(unsigned(n) * (b + 1) / blocks));
}

// Max and sum over a block, every thread getting the result (fixed trees: the same bits in every block).
template <int THREADS>
__device__ float block_max(float v, double* scratch) {
    constexpr int WARPS = THREADS / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();  // scratch may still be read by a previous call
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float t = -__int_as_float(0x7f800000);
#pragma unroll 1
    for (int w = 0; w < WARPS; ++w) t = fmaxf(t, static_cast<float>(scratch[w]));
    return t;
}

template <int THREADS>
__device__ double block_sum_f64(double v, double* scratch) {
    constexpr int WARPS = THREADS / 32;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    double t = 0;
#pragma unroll 1
    for (int w = 0; w < WARPS; ++w) t += scratch[w];
    return t;
}

// The part of the n logits at v (a block's slice) at the temperature 1 / inv_t.
template <int THREADS>
__device__ SoftmaxPart softmax_part(const float* v, int n, double inv_t, double* scratch) {
    float m = -__int_as_float(0x7f800000);
#pragma unroll 1
    for (int i = threadIdx.x; i < n; i += THREADS) m = fmaxf(m, __ldcg(v + i));
    m = block_max<THREADS>(m, scratch);
    const double zm = m * inv_t;
    double s = 0;
#pragma unroll 1
    for (int i = threadIdx.x; i < n; i += THREADS) s += exp(__ldcg(v + i) * inv_t - zm);
    return SoftmaxPart{block_sum_f64<THREADS>(s, scratch), m, 0};
}

struct Pick {
    int index;    // the first index whose running sum passes the target
    double frac;  // how far into its weight the target lies, in [0, 1] (1: rounding left the target past them all)
};

// The first i < n whose running sum of weight(i) >= 0 passes u times the sum of them all (u in [0, 1)); the last
// one of positive weight if rounding leaves none that does; 0 if none has weight. Threads take contiguous runs of
// ceil(n / THREADS) indexes, a block scan of the runs' sums finds the thread whose run passes, and it walks its run.
template <int THREADS, class Weight>
__device__ Pick first_past(int n, double u, Weight weight, double* scratch) {
    constexpr int WARPS = THREADS / 32;
    int* owner = reinterpret_cast<int*>(scratch + WARPS);  // [0] the first thread whose run passes, [1] the last
    Pick* out = reinterpret_cast<Pick*>(scratch + WARPS + 1);  // index of positive weight
    // (the thread's index read here, not hoisted: in the megakernel's step loop a run's bounds held from one step
    // to the next would take registers every phase needs)
    unsigned tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    const int run = (n + THREADS - 1) / THREADS, i0 = min(n, int(tid) * run), i1 = min(n, i0 + run);
    double own = 0;
    int last = -1;
#pragma unroll 1
    for (int i = i0; i < i1; ++i) {
        const double w = weight(i);
        own += w;
        if (w > 0) last = i;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    double incl = own;  // the warp's inclusive scan
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
    }
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 31) scratch[warp] = incl;
    if (threadIdx.x == 0) owner[0] = THREADS, owner[1] = -1;
    __syncthreads();
    double before = 0, total = 0;
#pragma unroll 1
    for (int w = 0; w < WARPS; ++w) {
        if (w == warp) before = total;
        total += scratch[w];
    }
    before += incl - own;
    const double target = u * total;
    if (own > 0 && before + own > target) atomicMin(owner, threadIdx.x);
    if (last >= 0) atomicMax(owner + 1, last);
    __syncthreads();
    if (threadIdx.x == owner[0]) {
        Pick p{last, 1.0};
        double sum = before;
    #pragma unroll 1
    for (int i = i0; i < i1; ++i) {
            const double w = weight(i);
            if (w > 0 && sum + w > target) {
                p = Pick{i, fmin(fmax((target - sum) / w, 0.0), 1.0)};
                break;
            }
            sum += w;
        }
        *out = p;
    } else if (threadIdx.x == 0 && owner[0] == THREADS) {
        *out = Pick{max(owner[1], 0), 1.0};
    }
    __syncthreads();
    return *out;
}

// The token of the row v [n] drawn with u at the temperature 1 / inv_t, from its blocks' parts (block order; block b's part
// made of slice_of(n, b, blocks)).
template <int THREADS>
__device__ int sample_pick(const SoftmaxPart* parts, int blocks, const float* v, int n, double inv_t, double u,
                           double* scratch) {
    float m = -__int_as_float(0x7f800000);
#pragma unroll 1
    for (int b = threadIdx.x; b < blocks; b += THREADS) m = fmaxf(m, __ldcg(&parts[b].max));
    const double zmax = block_max<THREADS>(m, scratch) * inv_t;
    const Pick b = first_past<THREADS>(blocks, u, [=](int b) {
        const double s = __ldcg(&parts[b].sum);
        return s > 0 ? s * exp(__ldcg(&parts[b].max) * inv_t - zmax) : 0.0;
    }, scratch);
    const int2 r = slice_of(n, b.index, blocks);
    const double zb = __ldcg(&parts[b.index].max) * inv_t;
    const float* w = v + r.x;
    return r.x + first_past<THREADS>(r.y - r.x, b.frac, [=](int i) { return exp(__ldcg(w + i) * inv_t - zb); },
                                     scratch).index;
}

}  // namespace lucegen
