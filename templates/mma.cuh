// mma.cuh: tensor-core building blocks for every lucegen arch (sm_80+): cp.async copies into shared memory,
// ldmatrix fragment loads, mma.sync in bf16 (m16n8k16) and tf32 (m16n8k8), fp32 accumulators, and int8
// (m16n8k32) with int32 ones.
//
// Fragment layouts (PTX ISA, "matrix fragments for mma.m16n8k16 / m16n8k8"), with g = lane / 4, t = lane % 4:
//   bf16 A (16x16, row-major)  a[0]: (g, 2t..2t+1)  a[1]: (g+8, 2t..)  a[2]: (g, 2t+8..)  a[3]: (g+8, 2t+8..)
//   bf16 B (16x8, "col")       b[0]: (k 2t..2t+1, n g)  b[1]: (k 2t+8..2t+9, n g)
//   tf32 A (16x8)              a[0]: (g, t)  a[1]: (g+8, t)  a[2]: (g, t+4)  a[3]: (g+8, t+4)
//   tf32 B (8x8)               b[0]: (k t, n g)  b[1]: (k t+4, n g)
//   fp32 C/D (16x8)            c[0..1]: (g, 2t..2t+1)  c[2..3]: (g+8, 2t..2t+1)
// A bf16 B fragment is two k-consecutive values of one column n: a row of an [n][k] (k-contiguous) array, which is
// how every weight matrix W [N, K] is stored, so B = W^T needs no transposition.
#pragma once
#include "mbarrier.cuh"

namespace lucegen {

// ---- cp.async: global -> shared, 16 bytes per thread, completing by groups ------------------------------------

// Copy 16 bytes to the shared-space address dst (shared_addr); when `valid` is false the 16 shared bytes are
// zero-filled and `src` is not read.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

// The same to a generic pointer into shared memory.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    cp_async16(shared_addr(dst), src, valid);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- ldmatrix: four 8x8 b16 matrices, one row address per lane (lanes 8i..8i+7 address matrix i) --------------

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_addr(row)));
}

// The same, each matrix transposed: lane l gets rows 2(l%4), 2(l%4)+1 of column l/4 (B fragments of a [k][n] array).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_addr(row)));
}

// ---- mma.sync -------------------------------------------------------------------------------------------------

// d += a b for a 16x16 bf16 A, a 16x8 bf16 B, fp32 d.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b for a 16x16 fp16 A, a 16x8 fp16 B, fp32 d.
__device__ __forceinline__ void mma_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b for a 16x8 tf32 A, an 8x8 tf32 B, fp32 d.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d = a b for a 16x32 int8 A, a 32x8 int8 B, int32 d: a[0] (g, 4t..4t+3), a[1] (g+8, 4t..), a[2] (g, 16+4t..),
// a[3] (g+8, 16+4t..); b[0] (k 4t..4t+3, n g), b[1] (k 16+4t.., n g); d laid out as fp32 C. Exact integers.
__device__ __forceinline__ void mma_s8(int (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0));
}

// fp32 -> tf32 (10 mantissa bits), rounded to nearest, ties away from zero.
__device__ __forceinline__ unsigned tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// bf16 -> tf32 is exact: the bf16 bits are the top half of the fp32 bits.
__device__ __forceinline__ unsigned tf32(bf16 x) { return static_cast<unsigned>(__bfloat16_as_ushort(x)) << 16; }

// Two fp32 -> one register of two bf16 (the low half holds `lo`), rounded to nearest even.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
}

// ---- swizzled shared-memory tiles -----------------------------------------------------------------------------

// A tile of ROWS rows of COLS bf16 (COLS a multiple of 64), row-major, with the 16-byte chunks of each row permuted
// by chunk ^ (row % 8) inside every group of 8. The eight rows an ldmatrix or a cp.async phase touches at the same
// logical chunk then land in eight different bank groups: no conflicts, no padding.
template <int ROWS, int COLS>
struct SwizzledTile {
    static_assert(COLS % 64 == 0, "swizzled rows are whole groups of eight 16-byte chunks");
    static constexpr int CHUNKS = COLS / 8;
    static constexpr int BYTES = ROWS * COLS * 2;
    unsigned char* base;
    __device__ __forceinline__ unsigned char* chunk(int row, int c) const {
        return base + row * (COLS * 2) + ((c ^ (row & 7)) * 16);
    }
    __device__ __forceinline__ bf16 at(int row, int col) const {
        return *reinterpret_cast<const bf16*>(chunk(row, col / 8) + (col % 8) * 2);
    }
};

// Copy rows [0, ROWS) of a row-major bf16 matrix (row stride `ld` elements, first row `src`) into a swizzled tile
// with THREADS threads; rows at or past `rows_valid` are zero-filled. One cp.async group is NOT committed here.
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile_async(SwizzledTile<ROWS, COLS> tile, const bf16* src, size_t ld,
                                                int rows_valid) {
    constexpr int CHUNKS = SwizzledTile<ROWS, COLS>::CHUNKS, TOTAL = ROWS * CHUNKS;
#pragma unroll
    for (int j = 0; j < (TOTAL + THREADS - 1) / THREADS; ++j) {
        const int i = j * THREADS + threadIdx.x;
        if (TOTAL % THREADS == 0 || i < TOTAL) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool valid = r < rows_valid;
            cp_async16(tile.chunk(r, c), valid ? src + r * ld + c * 8 : src, valid);
        }
    }
}

// A fragment (16 rows from `row0`, 16 columns from `col0`) of a swizzled row-major tile.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_a_frag(unsigned (&a)[4], SwizzledTile<ROWS, COLS> tile, int row0, int col0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4(a, tile.chunk(row0 + lane % 16, col0 / 8 + lane / 16));
}

// B fragments of two adjacent 8-column tiles (n0..n0+15) over 16 k (k0..k0+15) from a tile stored [n][k]:
// b[0..1] for columns n0..n0+7, b[2..3] for n0+8..n0+15.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_b_frags_nk(unsigned (&b)[4], SwizzledTile<ROWS, COLS> tile, int n0, int k0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4(b, tile.chunk(n0 + (lane & 7) + ((lane >> 4) << 3), k0 / 8 + ((lane >> 3) & 1)));
}

// The same two B fragments from a tile stored [k][n] (n contiguous), through the transposing ldmatrix.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_b_frags_kn(unsigned (&b)[4], SwizzledTile<ROWS, COLS> tile, int k0, int n0) {
    const int lane = threadIdx.x % 32;
    ldmatrix_x4_trans(b, tile.chunk(k0 + (lane & 15), n0 / 8 + (lane >> 4)));
}

}  // namespace lucegen
