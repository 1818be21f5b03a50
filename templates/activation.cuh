// activation.cuh: the scalar activations of Qwen3.5 in fp32, written as PyTorch computes them.
#pragma once

namespace lucegen {

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }
// x * sigmoid(x) as PyTorch's kernel writes it: x / (1 + exp(-x)).
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
// torch.nn.functional.softplus with beta 1 and threshold 20.
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }

}  // namespace lucegen
