// qgemv.cuh: Y = X W^T for a GGUF-quantized W [N, K] (row-major, quant.cuh's formats) and activations X [M, K],
// fp32 Y [M, N]: the GEMV of decode (M = 1) and the small-M GEMM of a tree verify (M up to 64). X is fp32 for bf16
// rows and, for the quantized formats, quantized by qquant_x beforehand to quant.cuh's XBlocks (8 bits per value,
// a scale per 32): the products are then integer dot products (dp4a), as llama.cpp's MMVQ.
//
// Work split. K is cut into slices of 32 pieces (quant.cuh): lane l of a warp decodes piece l of every slice of
// its rows, so each weight byte is decoded by one lane. A block owns a contiguous range of rows and an M-tile of
// MT activation rows; it walks its rows in passes of G = WARPS x ROWS rows (row i of a pass goes to warp i % WARPS)
// and, within a pass, slice by slice. Each (pass, slice) is one pipeline item: the rows' bytes of that slice (and
// the MT activation rows' bytes of that slice, unless they all fit in shared memory and are loaded once up front:
// XFULL) are copied into a shared-memory stage (STAGES items in flight), then every warp loads its rows' pieces
// once into registers and multiplies each into all MT activation rows (F::dot). The copies: on sm_90+ the bulk copy
// engine (one copy per row and per activation row, issued by thread 0, completing on the stage's mbarrier), so
// that no thread spends instructions on them; below, 16-byte cp.async by every thread.
// Weights move DRAM -> shared memory once; a block's M-tiles beyond the first re-read them, and the launcher gives
// the blocks of one row range consecutive indices so that they run together and the re-reads hit L2.
//
// Arithmetic. Y[m][n] = warp_sum over lanes of (lane l: the fp32 sum, slice by slice, of F::dot(piece, activations)):
// it depends on the format and K only, not on MT, ROWS, the stages or the grid, so the M = 1 GEMV and every M-tile
// of the GEMM give the same bits for the same row (a tree verify computes exactly what decode would). For bf16
// (8-value pieces, 256-value slices) the lanes sum in gemv_bf16's order.
//
// Rows of formats whose blocks are not 16-byte multiples (Q8_0, Q4_0, Q6_K) may start anywhere on a 2-byte
// boundary: a row's slice is copied widened to the 16-byte boundaries around it and decoded at its offset, so up
// to 15 bytes at each end also come in with the neighbouring row (from L2; DRAM sectors are read once). W must be
// 16-byte aligned and readable up to the next 16-byte boundary after its last byte.
#pragma once
#include "bulk.cuh"
#include "mma.cuh"
#include "quant.cuh"

namespace lucegen {

// The geometry of one kernel: format F, row length K, MT activation rows per block, ROWS rows per warp and pass;
// XFULL: the M-tile's activations of every slice are loaded once, before the first item, instead of with each item.
template <class F, int K, int MT, int ROWS, int THREADS, int STAGES, bool XFULL>
struct QGemm {
    static_assert(K % F::BLOCK_VALUES == 0, "rows must be whole blocks of the format");
    static_assert(THREADS % 32 == 0 && STAGES >= 2, "whole warps, at least double buffering");
    static constexpr int WARPS = THREADS / 32, G = WARPS * ROWS;
    static constexpr int PIECE_VALUES = F::BLOCK_VALUES / F::PIECES;
    static constexpr int SLICE_VALUES = 32 * PIECE_VALUES;  // one piece per lane
    static constexpr int SLICE_BYTES = SLICE_VALUES / F::BLOCK_VALUES * F::BLOCK_BYTES;
    static constexpr int SLICES = (K + SLICE_VALUES - 1) / SLICE_VALUES;
    static constexpr long long ROW_BYTES = (long long)K / F::BLOCK_VALUES * F::BLOCK_BYTES;
    // A row's slice in shared memory: as is (16-byte aligned formats), or widened to 16-byte boundaries from a
    // start that is 2-byte aligned (at most 14 bytes before it).
    static constexpr int SLOT = F::ALIGNED16 ? SLICE_BYTES : (SLICE_BYTES + 14 + 15) / 16 * 16;
    // Activations of a slice, per row: F::XB bytes per block, as in global memory (fp32 or XBlocks).
    static constexpr int X_SLICE_BYTES = SLICE_VALUES / F::BLOCK_VALUES * F::XB;
    static constexpr long long X_ROW_BYTES = (long long)K / F::BLOCK_VALUES * F::XB;  // in global memory
    static constexpr int X_ROW_SLICES = XFULL ? SLICES : 1;  // slices of an activation row in shared memory
    static constexpr int X_BYTES = MT * X_ROW_SLICES * X_SLICE_BYTES;
    static constexpr int STAGE_BYTES = G * SLOT + (XFULL ? 0 : X_BYTES);
    static constexpr int SMEM = (XFULL ? X_BYTES : 0) + STAGES * STAGE_BYTES;
    static_assert(SLOT % 16 == 0 && X_SLICE_BYTES % 16 == 0 && STAGE_BYTES % 16 == 0, "16-byte copies");
};

template <class F, int K, int MT, int ROWS, int THREADS, int STAGES, bool XFULL>
__device__ void qgemm(const unsigned char* __restrict__ W, const unsigned char* __restrict__ x, float* __restrict__ y,
                      int N, int M, unsigned char* smem) {
    using Q = QGemm<F, K, MT, ROWS, THREADS, STAGES, XFULL>;
    constexpr int WARPS = Q::WARPS, G = Q::G, SLOT = Q::SLOT, SLICES = Q::SLICES, PV = Q::PIECE_VALUES;
    constexpr int SV = Q::SLICE_VALUES, XS = Q::X_SLICE_BYTES, XROW = Q::X_ROW_SLICES * XS;  // bytes per activation row
    unsigned char* stages = smem + (XFULL ? Q::X_BYTES : 0);
    const int mtiles = (M + MT - 1) / MT;
    const int rblocks = gridDim.x / mtiles, rb = blockIdx.x / mtiles;
    if (rb >= rblocks) return;  // a grid that is not a multiple of the M-tiles: the spare blocks have no rows
    const int m0 = (blockIdx.x % mtiles) * MT, mv = min(MT, M - m0);
    const int r0 = static_cast<int>((long long)N * rb / rblocks), r1 = static_cast<int>((long long)N * (rb + 1) / rblocks);
    const int items = (r1 - r0 + G - 1) / G * SLICES;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Start of row `row`'s slice s in W (bytes).
    const auto slice_start = [](int row, int s) { return (long long)row * Q::ROW_BYTES + (long long)s * Q::SLICE_BYTES; };
    // Activation row m0 + m's bytes of slice s in global memory, and their 16-byte words.
    const auto x_slice = [&](int m, int s) { return x + (m0 + m) * Q::X_ROW_BYTES + (long long)s * XS; };
    const auto x_words = [](int s) { return min(SV, K - s * SV) / F::BLOCK_VALUES * F::XB / 16; };
    // The M-tile's activations of slice s into xs (row m at xs + m * XROW).
    const auto copy_x = [&](unsigned char* xs, int s) {
        for (int c = threadIdx.x; c < MT * (XS / 16); c += THREADS) {
            const int m = c / (XS / 16), j = c % (XS / 16);
            if (m < mv && j < x_words(s)) cp_async16(xs + m * XROW + 16 * j, x_slice(m, s) + 16 * j, true);
        }
    };
    // Item t: its first row, slice, number of rows, and the bytes of a row's slice.
    struct Item {
        int p0, s, nrows;
        long long bytes;
    };
    const auto item = [&](int t) {
        const int p0 = r0 + t / SLICES * G, s = t % SLICES;
        return Item{p0, s, min(G, r1 - p0), (long long)min(SV, K - s * SV) / F::BLOCK_VALUES * F::BLOCK_BYTES};
    };
#if __CUDA_ARCH__ >= 900
    __shared__ unsigned long long full[STAGES];
    // Thread 0: the copies of item t into stage t % STAGES, by the copy engine.
    const auto issue = [&](int t) {
        const Item it = item(t);
        unsigned char* tile = stages + (t % STAGES) * Q::STAGE_BYTES;
        const int xwords = XFULL ? 0 : x_words(it.s);
        // row i's slice widened to 16-byte words: from its word, `size` bytes
        const auto from = [&](int i) { return slice_start(it.p0 + i, it.s) & ~15ll; };
        const auto size = [&](int i) {
            return static_cast<unsigned>(((slice_start(it.p0 + i, it.s) + it.bytes + 15) & ~15ll) - from(i));
        };
        unsigned total = static_cast<unsigned>(mv * xwords * 16);
        for (int i = 0; i < it.nrows; ++i) total += size(i);
        fence_proxy_async();  // every warp's reads of the stage's previous item before the engine writes
        mbar_expect_tx(&full[t % STAGES], total);
        for (int i = 0; i < it.nrows; ++i) bulk_g2s(tile + i * SLOT, W + from(i), size(i), &full[t % STAGES]);
        for (int m = 0; m < mv && xwords; ++m)
            bulk_g2s(tile + G * SLOT + m * XROW, x_slice(m, it.s), xwords * 16, &full[t % STAGES]);
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; ++i) mbar_init(&full[i], 1);
        fence_barrier_init();
        for (int t = 0; t < min(STAGES, items); ++t) issue(t);
    }
    if constexpr (XFULL) {
#pragma unroll 1
        for (int s = 0; s < SLICES; ++s) copy_x(smem + s * XS, s);
        cp_async_commit();
        cp_async_wait<0>();
    }
    __syncthreads();  // the barriers are initialised and the activations in, for every thread
#else
    // Every thread: its share of the copies of item t (if any) into stage t % STAGES; always one commit group.
    const auto issue = [&](int t) {
        if (t < items) {
            const Item it = item(t);
            unsigned char* tile = stages + (t % STAGES) * Q::STAGE_BYTES;
            for (int c = threadIdx.x; c < G * (SLOT / 16); c += THREADS) {
                const int i = c / (SLOT / 16), j = c % (SLOT / 16);
                if (i < it.nrows) {
                    const long long start = slice_start(it.p0 + i, it.s), from = (start & ~15ll) + 16 * j;
                    if (from < start + it.bytes) cp_async16(tile + i * SLOT + 16 * j, W + from, true);
                }
            }
            if constexpr (!XFULL) copy_x(tile + G * SLOT, it.s);
        }
        cp_async_commit();
    };
    if constexpr (XFULL) {  // completes with item 0's group
#pragma unroll 1
        for (int s = 0; s < SLICES; ++s) copy_x(smem + s * XS, s);
    }
#pragma unroll 1
    for (int t = 0; t < STAGES - 1; ++t) issue(t);
#endif

    float acc[ROWS][MT];
#pragma unroll 1
    for (int t = 0; t < items; ++t) {
#if __CUDA_ARCH__ >= 900
        mbar_wait(&full[t % STAGES], (t / STAGES) & 1);
#else
        cp_async_wait<STAGES - 2>();  // item t has landed (for this thread's copies) ...
        __syncthreads();              // ... and for everyone's; every warp is done with item t - 1's stage
        issue(t + STAGES - 1);        // into that stage
#endif
        const Item it = item(t);
        const int p0 = it.p0, s = it.s, nrows = it.nrows;
        const unsigned char* tile = stages + (t % STAGES) * Q::STAGE_BYTES;
        const int b = lane / F::PIECES, p = lane % F::PIECES;  // this lane's block in the slice and piece in it
        const unsigned char* xs = (XFULL ? smem + s * XS : tile + G * SLOT) + b * F::XB;
        if (s == 0) {
#pragma unroll
            for (int j = 0; j < ROWS; ++j)
#pragma unroll
                for (int m = 0; m < MT; ++m) acc[j][m] = 0.f;
        }
        if (lane * PV < min(SV, K - s * SV)) {
            typename F::Piece pc[ROWS];
#pragma unroll
            for (int j = 0; j < ROWS; ++j) {
                const int i = warp + WARPS * j;
                if (i < nrows) {
                    const int at = F::ALIGNED16 ? 0 : static_cast<int>(slice_start(p0 + i, s) & 15);
                    pc[j] = F::load(tile + i * SLOT + at + b * F::BLOCK_BYTES, p);
                }
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (m < mv) {
#pragma unroll
                    for (int j = 0; j < ROWS; ++j)
                        if (warp + WARPS * j < nrows) acc[j][m] = __fadd_rn(acc[j][m], F::dot(pc[j], xs + m * XROW));
                }
            }
        }
        if (s == SLICES - 1) {
#pragma unroll
            for (int j = 0; j < ROWS; ++j)
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const float v = warp_sum(acc[j][m]);
                    if (lane == 0 && warp + WARPS * j < nrows && m < mv) y[(long long)(m0 + m) * N + p0 + warp + WARPS * j] = v;
                }
        }
#if __CUDA_ARCH__ >= 900
        __syncthreads();  // every warp is done with stage t % STAGES: refill it
        if (threadIdx.x == 0 && t + STAGES < items) issue(t + STAGES);
#endif
    }
    cp_async_wait<0>();
}

// X [M, K] fp32 (K a multiple of 32) -> its `blocks` = M * K / 32 XBlocks, in order: one per thread, grid-stride.
__device__ inline void quantize_x(const float* __restrict__ x, XBlock* __restrict__ out, int blocks) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < blocks; i += gridDim.x * blockDim.x)
        out[i] = quantize_xblock(x + 32ll * i);
}

// out [N, K] fp32 = the values of W's rows (the decode of quant.cuh, alone): one piece per thread, grid-stride.
template <class F>
__device__ void qdequant(const unsigned char* __restrict__ W, float* __restrict__ out, int N, int K) {
    const int pieces = K / F::BLOCK_VALUES * F::PIECES;
    const long long row_bytes = (long long)K / F::BLOCK_VALUES * F::BLOCK_BYTES;
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < (long long)N * pieces;
         t += (long long)gridDim.x * blockDim.x) {
        const long long n = t / pieces;
        const int b = static_cast<int>(t % pieces) / F::PIECES, p = static_cast<int>(t % pieces) % F::PIECES;
        const auto pc = F::load(W + n * row_bytes + (long long)b * F::BLOCK_BYTES, p);
#pragma unroll
        for (int r = 0; r < F::RUNS; ++r) {
            float w[8];
            F::run(pc, r, w);
            float* o = out + n * K + (long long)b * F::BLOCK_VALUES + F::voff(p, r);
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = w[i];
        }
    }
}

}  // namespace lucegen
