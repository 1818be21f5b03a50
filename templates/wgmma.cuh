// wgmma.cuh: Hopper (sm_90a) warpgroup tensor-core building blocks: 2-D TMA tile loads with 128-byte swizzle,
// shared-memory matrix descriptors, wgmma.mma_async m64nNk16 in bf16 with fp32 accumulators.
//
// Tiles are K-major (rows of 64 bf16 = 128 bytes, the K columns of one row contiguous) in the 128-byte swizzle: the
// 16-byte chunk c of row r sits at chunk c ^ (r % 8), the layout of mma.cuh's SwizzledTile<ROWS, 64>; a tile starts
// on a 1024-byte boundary (8 rows), which the swizzle is relative to. The TMA engine writes that layout
// (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma reads it through a descriptor with the same swizzle mode.
//
// Accumulators of one m64nN wgmma, per thread of the warpgroup (warp w = its warp within the warpgroup, g = lane / 4,
// t = lane % 4): for each 8-column block j, d[j][0..1] = D(16w + g, 8j + 2t .. +1), d[j][2..3] = D(16w + g + 8, ...):
// per warp, the fp32 C layout of mma.sync m16n8 (mma.cuh) over 16 rows, so gemm.cuh's epilogues take them as is.
#pragma once
#include "bulk.cuh"

namespace lucegen {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

// The driver's CUtensorMap (cuTensorMapEncodeTiled): 128 opaque bytes, passed by value as a __grid_constant__
// kernel parameter.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// Load the box at (inner coordinate `col`, outer coordinate `row`) of a 2-D tensor map into shared memory; the
// barrier's transaction count drops by the box's bytes (out-of-range elements are zero-filled and counted too).
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap& map, int col, int row,
                                            unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
            "r"(shared_addr(dst)),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col), "r"(row), "r"(shared_addr(bar))
        : "memory");
}

// The same for a 3-D tensor map: the box at (`col`, `mid`, `row`), e.g. (head dim, head, position) of a
// [positions][heads][head_dim] tensor with a box of 64 x 1 x rows.
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap& map, int col, int mid, int row,
                                            unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::
            "r"(shared_addr(dst)),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col), "r"(mid), "r"(row), "r"(shared_addr(bar))
        : "memory");
}

// Descriptor of a K-major bf16 tile in the 128-byte swizzle starting at `tile` (1024-byte aligned, or advanced from
// such a start by a multiple of 32 bytes along K): start address / 16 in bits 0-13, leading byte offset 16 (unused
// by swizzled K-major layouts) in 16-29, stride byte offset 1024 (from one group of 8 rows to the next) in 32-45,
// swizzle mode 1 (128 bytes) in 62-63.
__device__ __forceinline__ unsigned long long smem_desc_sw128(const void* tile) {
    const unsigned long long addr = shared_addr(tile);
    return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

// Descriptor of an MN-major bf16 operand in the 128-byte swizzle (wgmma's B with imm-trans-b = 1): rows of the
// tile are K (a row of 64 bf16 of N contiguous, swizzled as above), starting at `tile` (1024-byte aligned, or
// advanced by whole groups of 8 rows); the next 64 columns of N start `n_stride` bytes further (leading byte offset),
// the next 8 rows of K 1024 bytes further (stride byte offset).
__device__ __forceinline__ unsigned long long smem_desc_sw128_mn(const void* tile, unsigned n_stride) {
    const unsigned long long addr = shared_addr(tile);
    return ((addr & 0x3FFFF) >> 4) | ((unsigned long long)(n_stride >> 4) << 16) | ((1024ull >> 4) << 32) |
           (1ull << 62);
}

// Make the accumulators' register values visible to the following wgmma (and order this warpgroup's wgmma issue).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Wait until at most N of this warpgroup's committed wgmma groups are still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keep the compiler from moving accesses to the accumulators across a wgmma fence, commit or wait.
template <int J>
__device__ __forceinline__ void fence_accumulators(float (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// d (64 x N) = (accumulate ? d : 0) + A (64 x 16, K-major, descriptor a) B (16 x N, stored [n][k] K-major,
// descriptor b): both operands from shared memory, issued asynchronously by the whole warpgroup. N is a multiple of
// 8 up to 256; the PTX takes one register operand per accumulator, so each N a kernel uses is specialised where it is
// rendered (prefill_gemm.cu.j2's wgmma_bf16 macro): WgmmaBf16<N>::mma(d, a, b, accumulate), d[N / 8][4].
template <int N>
struct WgmmaBf16;

// d (64 x N) += A (64 x 16, bf16 pairs in registers, mma.sync's m16n8k16 A fragment per warp: a[0] rows g, columns
// 2t..; a[1] rows g + 8; a[2], a[3] the same 8 columns on) B (16 x N, MN-major, descriptor b): the P V product of
// attention, P straight from the score registers. Rendered per N like WgmmaBf16: WgmmaBf16RegA<N>::mma(d, a, b).
template <int N>
struct WgmmaBf16RegA;

// Registers per thread for the rest of the kernel, raised or lowered warpgroup-wide (a producer warpgroup gives
// registers to the consumers).
template <int N>
__device__ __forceinline__ void regs_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

#endif

}  // namespace lucegen
