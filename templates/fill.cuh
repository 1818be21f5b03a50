// fill.cuh: deterministic pseudo-random fills on the device, for benchmark weights of the real shapes with no host
// copy: element i of a fill is lo + (hi - lo) * u, u in [0, 1) from the splitmix64 mix of (seed, i).
#pragma once
#include "common.cuh"

namespace lucegen {

__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long i) {
    unsigned long long z = seed * 0x9E3779B97F4A7C15ull + i;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * (1.f / 16777216.f);
}

template <class T>
__device__ __forceinline__ void fill_uniform(T* p, long long n, unsigned long long seed, float lo, float hi) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        p[i] = static_cast<T>(lo + (hi - lo) * uniform01(seed, i));
}

}  // namespace lucegen
