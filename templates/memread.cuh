// memread.cuh: the read-bandwidth ceiling. Every 16-byte word of a buffer is read once (streaming) and folded
// with XOR, so the result is exact and checkable and the compiler cannot drop a load.
#pragma once
#include "common.cuh"

namespace lucegen {

template <int THREADS, int UNROLL>
__device__ void read_xor(const uint4* __restrict__ data, long long n, unsigned int* __restrict__ partials) {
    __shared__ unsigned int scratch[THREADS / 32];
    unsigned int acc = 0;
    const long long stride = (long long)gridDim.x * THREADS;
    long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = load_stream(data + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = load_stream(data + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w) acc ^= scratch[w];
        partials[blockIdx.x] = acc;
    }
}

}  // namespace lucegen
