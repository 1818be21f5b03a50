// argmax.cuh: index of the largest fp32 value (lowest index on ties, as numpy) in one launch, of each of the rows
// of a launch.
//
// Every block of a row (gridDim.x of them) reduces a grid-strided share to one (value, index) pair; the last of
// them to finish (found with the row's atomic ticket) reduces the pairs and resets the ticket, so the next launch
// needs no memset.
#pragma once
#include "common.cuh"

namespace lucegen {

template <int THREADS>
__device__ ArgMax block_argmax(ArgMax a, ArgMax* scratch) {
    constexpr int WARPS = THREADS / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    a = warp_argmax(a);
    __syncthreads();
    if (lane == 0) scratch[warp] = a;
    __syncthreads();
    a = lane < WARPS ? scratch[lane] : argmax_none();
    return warp_argmax(a);
}

// One row: partials holds gridDim.x pairs; ticket is one zero-initialised counter that the kernel leaves at zero.
template <int THREADS>
__device__ void argmax_f32(const float* __restrict__ v, int n, int* __restrict__ out, ArgMax* partials,
                           unsigned int* ticket) {
    __shared__ ArgMax scratch[THREADS / 32];
    __shared__ bool last;
    ArgMax best = argmax_none();
    for (int i = blockIdx.x * THREADS + threadIdx.x; i < n; i += gridDim.x * THREADS)
        best = argmax_pick(best, ArgMax{v[i], i});
    best = block_argmax<THREADS>(best, scratch);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = best;
        __threadfence();
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = argmax_none();
    for (int b = threadIdx.x; b < gridDim.x; b += THREADS) {
        const volatile ArgMax* p = partials + b;
        best = argmax_pick(best, ArgMax{p->value, p->index});
    }
    best = block_argmax<THREADS>(best, scratch);
    if (threadIdx.x == 0) {
        *out = best.index;
        *ticket = 0;
    }
}

}  // namespace lucegen
