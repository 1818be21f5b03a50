// wgmma.cuh: Hopper (sm_90a) warpgroup tensor-core building blocks: 2-D TMA tile loads with 128-byte swizzle,
// shared-memory matrix descriptors, wgmma.mma_async m64n128k16 in bf16 with fp32 accumulators.
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

// Descriptor of a K-major bf16 tile in the 128-byte swizzle starting at `tile` (1024-byte aligned, or advanced from
// such a start by a multiple of 32 bytes along K): start address / 16 in bits 0-13, leading byte offset 16 (unused
// by swizzled K-major layouts) in 16-29, stride byte offset 1024 (from one group of 8 rows to the next) in 32-45,
// swizzle mode 1 (128 bytes) in 62-63.
__device__ __forceinline__ unsigned long long smem_desc_sw128(const void* tile) {
    const unsigned long long addr = shared_addr(tile);
    return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
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

// d (64 x 128) = (accumulate ? d : 0) + A (64 x 16, K-major, descriptor a) B (16 x 128, stored [n][k] K-major,
// descriptor b): both operands from shared memory, issued asynchronously by the whole warpgroup.
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[16][4], unsigned long long a, unsigned long long b,
                                                 int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        :
          "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(a), "l"(b), "r"(accumulate));
}

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
