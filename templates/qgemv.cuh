// qgemv.cuh: Y = X W^T for a GGUF-quantized W [N, K] (row-major, quant.cuh's formats) and activations X [M, K],
// fp32 Y [M, N]: the GEMV of decode (M = 1) and the small-M GEMM of a tree verify (M up to 64). X is fp32 for bf16
// rows and, for the quantized formats, quantized by qquant_x beforehand to quant.cuh's XBlocks (8 bits per value,
// a scale per 32): the products are then integer dot products (dp4a), as llama.cpp's MMVQ.
//
// Work split. K is cut into slices of 32 pieces (quant.cuh): lane l of a warp decodes piece l of every slice of
// its rows, so each weight byte is decoded by one lane. A warp owns ROWS consecutive rows and a block WARPS x ROWS
// of them, for an M-tile of MT activation rows; the blocks of one row group have consecutive indices (one per
// M-tile) so that they run together and their re-reads of the weights hit L2. The warp takes its rows SPAN slices
// at a time (an item) and multiplies each piece into the MT activation rows (F::dot; activations through L1: every
// warp of the grid reads them). How an item's weights arrive, STAGES:
//   0   straight from global memory into registers (read-only path): every load of an item is issued before its
//       first product, then the warp waits for them; what is in flight is what the registers hold.
//   >1  through a ring of STAGES items in shared memory that belongs to the warp: its lanes copy the rows' bytes
//       with 16-byte cp.async, STAGES - 1 items ahead of the one being multiplied, and decode from there; no block
//       barrier (a __syncwarp orders the ring). What is in flight no longer costs registers, and the loads keep
//       running while the warp multiplies (the quantized formats spend far more instructions per byte than bf16).
//
// Arithmetic. Y[m][n] = warp_sum over lanes of (lane l: the fp32 sum, slice by slice, of its pieces' F::dot; for
// F::QUAD_SUMS, over quads of the quad's sum of quad_sums of its lanes' F::dot from 0, quant.cuh):
// it depends on the format and K only, not on MT, ROWS, SPAN, STAGES or the grid, so the M = 1 GEMV and every M-tile
// of the GEMM give the same bits for the same row (a tree verify computes exactly what decode would). For bf16
// (8-value pieces, 256-value slices) the lanes sum in gemv_bf16's order.
//
// W must be 16-byte aligned; rows of formats whose blocks are not 16-byte multiples (Q8_0, Q4_0) start on
// 2-byte boundaries: F::load reads them with aligned words (quant.cuh) at most to the next 4-byte boundary past the
// row's last byte, and the ring copies a slice widened to the 16-byte words around it (up to 15 bytes of the
// neighbouring rows, from L2), so W must be readable to the next 16-byte boundary after its last byte.
#pragma once
#include "bulk.cuh"
#include "mma.cuh"
#include "quant.cuh"

namespace lucegen {

// The geometry of one kernel: format F, row length K, MT activation rows per block, ROWS rows per warp, SPAN
// slices per item, STAGES items in a warp's shared-memory ring (0: no ring).
template <class F, int K, int MT, int ROWS, int SPAN, int STAGES, int THREADS>
struct QGemm {
    static_assert(K % F::ROW_VALUES == 0, "rows must be whole GGUF blocks of the format");
    static_assert(THREADS % 32 == 0 && SPAN >= 1 && ROWS >= 1, "whole warps");
    static_assert(STAGES == 0 || STAGES >= 2, "a ring holds the item being multiplied and at least one ahead");
    static constexpr int WARPS = THREADS / 32, G = WARPS * ROWS;  // rows per block
    static constexpr int PIECE_VALUES = F::BLOCK_VALUES / F::PIECES;
    static constexpr int SLICE_VALUES = 32 * PIECE_VALUES;  // one piece per lane
    static constexpr int SLICE_BYTES = SLICE_VALUES / F::BLOCK_VALUES * F::BLOCK_BYTES;
    static constexpr int SLICES = (K + SLICE_VALUES - 1) / SLICE_VALUES;
    static constexpr int ITEMS = (SLICES + SPAN - 1) / SPAN;
    static constexpr long long ROW_BYTES = row_bytes<F>(K);
    // W in quant.cuh's layout (tiles of F::TILE rows, block by block): a row's next block BLOCK_STEP bytes further,
    // its next slice SLICE_STEP.
    static constexpr int BLOCK_STEP = F::TILE * F::BLOCK_BYTES;
    static constexpr long long SLICE_STEP = SLICE_BYTES * (long long)F::TILE;
    static constexpr int X_SLICE_BYTES = SLICE_VALUES / F::BLOCK_VALUES * F::XB;  // activations of a slice
    static constexpr long long X_ROW_BYTES = (long long)K * F::XB / F::BLOCK_VALUES;
    // The activations: XBlocks in quant.cuh's layout (groups of 8 rows slice by slice) for the quantized formats,
    // fp32 rows for bf16.
    static constexpr bool XBLOCKS = F::XB % sizeof(XBlock) == 0;
    static_assert(!XBLOCKS || X_SLICE_BYTES == XSLICE * sizeof(XBlock), "a slice's activations are an XBlock slice");
    // Bytes into x of activation row m's slice s: x_slot(m) X_ROW_STEP + s X_STEP (an XBlock row's first slot, in
    // slots; fp32 rows: the row).
    static constexpr int X_STEP = XBLOCKS ? XGROUP * XSLOT * sizeof(XBlock) : X_SLICE_BYTES;
    static constexpr long long X_ROW_STEP = XBLOCKS ? XSLOT * sizeof(XBlock) : X_ROW_BYTES;
    __device__ static int x_slot(int m) { return XBLOCKS ? static_cast<int>(xblock_index(m, 0, SLICES) / XSLOT) : m; }
    __device__ static long long x_at(int m, int s) { return x_slot(m) * X_ROW_STEP + (long long)s * X_STEP; }
    // A row's slice in the ring: as is (16-byte aligned formats), or widened to 16-byte words from a start that is
    // 2-byte aligned (at most 14 bytes before it).
    static constexpr int SLOT = F::ALIGNED16 ? SLICE_BYTES : (SLICE_BYTES + 14 + 15) / 16 * 16;
    static constexpr int ITEM_BYTES = ROWS * SPAN * SLOT;
    static constexpr int SMEM = WARPS * STAGES * ITEM_BYTES;  // the block's dynamic shared memory
};

template <class F, int K, int MT, int ROWS, int SPAN, int STAGES, int THREADS>
__device__ void qgemm(const unsigned char* __restrict__ W, const unsigned char* __restrict__ x, float* __restrict__ y,
                      int N, int M, unsigned char* smem, int ldy) {
    using Q = QGemm<F, K, MT, ROWS, SPAN, STAGES, THREADS>;
    constexpr int SV = Q::SLICE_VALUES, SLICES = Q::SLICES, PV = Q::PIECE_VALUES;
    const int mtiles = (M + MT - 1) / MT;
    const int m0 = (blockIdx.x % mtiles) * MT, mv = min(MT, M - m0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r0 = (blockIdx.x / mtiles) * Q::G + warp * ROWS;  // the warp's first row
    if (r0 >= N) return;
    const int nrows = min(ROWS, N - r0);
    // The activations are read once the kernel before is done (programmatic launch: common.cuh). Asking L2 for the
    // warp's rows before this wait cost 5-15% of the GEMV's rate measured alone (bf16 75% -> 63% of the read
    // rate, Q4_K 49% -> 45-48%), so the weights wait too.
    wait_for_prior_grids();
    const int b = lane / F::PIECES, p = lane % F::PIECES;  // this lane's block in a slice and piece in it
    // Branch-free products, so that the compiler issues every load of an item before the first product: rows past
    // N, activation rows past M and the lanes past the end of a partial last slice read valid bytes (the last row,
    // the last activation row, block 0 of the slice) and their products are dropped.
    const auto live = [&](int s) { return s < SLICES && lane * PV < min(SV, K - s * SV); };
    const auto block = [&](int s) { return live(s) ? b : 0; };
    const auto whole = [&](int s) { return K % SV == 0 || live(s); };  // block(s) == b, for s < SLICES
    const auto row_start = [&](int j) { return wblock_offset<F>(r0 + min(j, nrows - 1), 0, K); };  // bytes into W
    // Activation row m's first slice (rows past M: the last one's). An M-tile's XBlock rows lie in one group, or
    // in whole groups (MT 16): row m0 + i in the slot x_slot(m0) + i, past a first group x_slot(m0) + x_slot(i). (So
    // written, the M = 8 GEMMs' products stay within their register cap.)
    static_assert(XGROUP % MT == 0 || MT % XGROUP == 0, "an M-tile's rows are whole groups or in one group");
    const int x0 = Q::x_slot(m0);
    const auto xrow = [&](int m) {
        const int i = min(m, mv - 1);
        return x + (x0 + (MT > XGROUP ? Q::x_slot(i) : i)) * Q::X_ROW_STEP;
    };
    const auto slice_bytes = [](int s) { return static_cast<int>(row_bytes<F>(min(SV, K - s * SV))); };

    // The ring (STAGES > 1): item t's row j, slice t * SPAN + u at slot(t, j, u), its blocks one after another;
    // copied widened to 16-byte words (plain rows), or block by block (tiles: 16-byte multiples).
    unsigned char* ring = smem + warp * (STAGES * Q::ITEM_BYTES);
    const auto slot = [&](int t, int j, int u) { return ring + (t % max(STAGES, 1)) * Q::ITEM_BYTES + (j * SPAN + u) * Q::SLOT; };
    const auto issue = [&](int t) {  // every lane: its share of item t's copies (if any); always one commit group
        for (int j = 0; j < ROWS && t < Q::ITEMS; ++j)
            for (int u = 0; u < SPAN; ++u) {
                const int s = t * SPAN + u;
                if (j >= nrows || s >= SLICES) continue;
                const long long start = row_start(j) + s * Q::SLICE_STEP;
                if constexpr (F::TILE > 1) {
                    static_assert(F::ALIGNED16, "tiles' blocks are whole 16-byte words");
                    constexpr int BW = F::BLOCK_BYTES / 16;
                    for (int c = lane; c < slice_bytes(s) / 16; c += 32)
                        cp_async16(slot(t, j, u) + 16 * c, W + start + c / BW * Q::BLOCK_STEP + 16 * (c % BW), true);
                } else {
                    const long long from = start & ~15ll;
                    const int words = static_cast<int>((start + slice_bytes(s) + 15 - from) / 16);
                    for (int c = lane; c < words; c += 32) cp_async16(slot(t, j, u) + 16 * c, W + from + 16 * c, true);
                }
            }
        cp_async_commit();
    };
    // Row j's bytes of slice s (item t, position u) where the lanes decode them, its blocks BSTEP bytes apart: the
    // ring or global memory.
    constexpr int BSTEP = STAGES > 1 ? F::BLOCK_BYTES : Q::BLOCK_STEP;
    const auto bytes = [&](int t, int j, int u, int s) -> const unsigned char* {
        if constexpr (STAGES > 1)
            return slot(t, j, u) + (F::ALIGNED16 ? 0 : static_cast<int>((row_start(j) + s * Q::SLICE_STEP) & 15));
        return W + row_start(j) + s * Q::SLICE_STEP;
    };

    // What this lane's loads have in common, made once before the loop (HOIST: where an item is small enough that the
    // registers this keeps cost no spills; else F::load(block, p) makes it again for each piece): per row j, F::lane
    // at its block in slice 0 (ln; in the ring: in stage 0) or at block 0 (ln0: the lanes past the end of a partial
    // last slice), slice s's block being delta bytes further, a multiple of 4 (SLICE_BYTES is one; the ring keeps
    // addresses mod 16; tiles' blocks are 16-byte multiples); its piece's activations (MT = 1), at xl (block 0: xl0)
    // + s Q::X_STEP, in 16-byte words: so typed, the compiler keeps xl whole in registers instead of x apart in a
    // uniform one, added in the loop.
    static_assert(Q::SLICE_BYTES % 4 == 0, "a lane's blocks keep their address mod 4 from slice to slice");
    constexpr bool HOIST = MT <= 4 && ROWS * SPAN <= 2;
    typename F::Lane ln[ROWS], ln0[ROWS];
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
        ln[j] = F::lane(bytes(0, j, 0, 0) + b * BSTEP, p);
        ln0[j] = F::lane(bytes(0, j, 0, 0), p);
    }
    const auto delta = [&](int t, int j, int u, int s) -> long long {
        if constexpr (STAGES > 1) return bytes(t, j, u, s) - bytes(0, j, 0, 0);
        return s * Q::SLICE_STEP;
    };
    constexpr int PIECE_XB = F::XB / F::PIECES;  // a piece's activations (F::dot)
    static_assert(Q::X_ROW_BYTES % 16 == 0 && F::XB % 16 == 0 && PIECE_XB % 16 == 0, "whole 16-byte words");
    const uint4* xl = reinterpret_cast<const uint4*>(x) + (Q::x_at(m0, 0) + b * F::XB + p * PIECE_XB) / 16;
    const uint4* xl0 = xl - b * F::XB / 16;

    if constexpr (STAGES > 1) {
#pragma unroll 1
        for (int t = 0; t < STAGES - 1; ++t) issue(t);
    }
    float acc[ROWS][MT];
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[j][m] = 0.f;
#pragma unroll 1
    for (int t = 0; t < Q::ITEMS; ++t) {
        if constexpr (STAGES > 1) {
            cp_async_wait<STAGES - 2>();  // this lane's copies of item t have landed ...
            __syncwarp();                 // ... and every lane's; every lane is done with item t - 1's stage
            issue(t + STAGES - 1);        // into that stage
        }
        const int s0 = t * SPAN;
        typename F::Piece pc[SPAN][ROWS];
#pragma unroll
        for (int u = 0; u < SPAN; ++u) {  // (block(s) written as whole(s) ? b : 0, so that the M = 8 GEMMs on
            const int s = min(s0 + u, SLICES - 1);  // tiles stay within their register cap without spills)
#pragma unroll
            for (int j = 0; j < ROWS; ++j) {
                if constexpr (HOIST) {  // (a copy, not a pick between the arrays' addresses: that keeps them in local
                    typename F::Lane l = ln0[j];  // memory)
                    if (whole(s)) l = ln[j];
                    pc[u][j] = F::load(l, delta(t, j, u, s));
                } else {
                    pc[u][j] = F::load(bytes(t, j, u, s) + (whole(s) ? b * BSTEP : 0), p);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < SPAN; ++u) {
            const int s = min(s0 + u, SLICES - 1);
            const bool use = live(s0 + u);
            const int xs = s * Q::X_STEP;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                const unsigned char* xm = MT == 1 ? reinterpret_cast<const unsigned char*>(whole(s) ? xl : xl0) + xs
                                                  : xrow(m) + xs + block(s) * F::XB + p * PIECE_XB;
#pragma unroll
                for (int j = 0; j < ROWS; ++j) {
                    if constexpr (F::QUAD_SUMS) {  // the quad's 4 terms, then its sum (quant.cuh); a quad's lanes
                        const float tq = quad_sum(F::dot(pc[u][j], xm, 0.f));  // are live or not alike (K is whole
                        if (use) acc[j][m] = __fadd_rn(acc[j][m], tq);          // quads): a dead one adds nothing
                    } else if (use) {
                        acc[j][m] = F::dot(pc[u][j], xm, acc[j][m]);
                    }
                }
            }
        }
    }
    if constexpr (STAGES > 1) cp_async_wait<0>();
    launch_next_grid();  // once every warp is past its loads: the next kernel's blocks take the freed slots
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const float v = warp_sum<F::QUAD_SUMS ? 4 : 1>(acc[j][m]);
            if (lane == 0 && j < nrows && m < mv) y[(long long)(m0 + m) * ldy + r0 + j] = v;
        }
}

// The GEMM on int8 tensor cores (formats with F::MMA), giving qgemm's bits. Lane l of qgemm sums, slice by slice,
// the terms of its class of pieces (piece l of every slice: block l / PIECES of the slice, piece l % PIECES of it);
// here a block takes TILES x 16 rows and MT activation rows (a multiple of 8), and warp w the classes 4w .. 4w+3 of
// all of them (8 warps: the 32 classes; a warp's are a quad of its block's pieces: with 8 pieces a block, warps
// 2b, 2b + 1 take block b of each slice, with 16 (Q6_K's pairs) warps 4b .. 4b+3). For each of its pieces, row
// tile and 8 activation rows one mma gives the integer u of 16 x 8 (row, activation) pairs at once (two, each over
// half the piece's values, for F::SPLIT), then F::mma_term scales it in fp32 into the class's sum, as qgemm's
// lane does (F::QUAD_SUMS: the warp's 4 classes are one quad of qgemm's lanes, so a thread adds its 4 pieces' terms
// as the quad does and keeps one sum an output, a quarter of the registers). At the end the 32 (8) class sums of
// each output meet in shared memory and are added in warp_sum's butterfly order.
//
// Both operands reach shared memory a slice at a time, through a ring of STAGES slices that the whole block fills
// STAGES - 1 slices ahead of the one multiplied: each row tile's slice and each n-tile's XBlocks of the slice, one
// run of bytes each in quant.cuh's layouts (W in tiles of 16 rows block by block, the XBlocks in groups of 8 rows
// slice by slice). On sm_90 the copy engine moves them, one bulk copy a run (with a copy a row, the 48 copies of a
// stage cost Q4_K's gate/up at M = 16 ~20 of its 75 us: results/logs/h100-s35-run11-13-qgemm-mma-copies.txt,
// h100-s36-run1-3-xblock-layout.txt); elsewhere every thread copies 16-byte words of one row tile's run and one
// activation row with cp.async (THREADS / TILES and THREADS / MT threads each), so where they come from is worked out
// once. (The bulk copies: 4% faster on the 27B's shapes, results/logs/h200-s23-run4-qgemm-mma-bulk-ab.)
// An activation fragment serves the TILES row tiles: XBlocks are 1.5 bytes a value against Q4_K's 0.56, so at 16 rows a
// block the activations were most of what a block copied. Read from global memory instead, each piece's activations
// cost the warp a round trip to L2 between its mma (measured: slower than dp4a). In a stage a tile's rows lie
// BLOCK_BYTES apart (144 and 432 bytes: 4 and 12 banks, so a fragment's 8 rows fall in 8 different 4-bank groups)
// and the activation rows an odd number of 16-byte words (quant.cuh's XSLOT), likewise. An M-tile's n-tiles of 8
// past M are neither copied nor multiplied: a call pays for M rounded up to 8, not to MT.
template <class F, int K, int MT, int TILES, int STAGES, int THREADS>
struct QGemmMma {
    static_assert(F::MMA && F::PIECES % 4 == 0 && THREADS == 256, "8 warps take the 32 classes, in quads of pieces");
    static_assert(MT % 8 == 0, "activation rows in mma tiles of 8");
    static_assert(TILES == 1 || TILES == 2, "one or two row tiles of 16");
    static_assert(STAGES >= 2, "a ring holds the slice being multiplied and at least one ahead");
    static_assert(F::TILE == 16 && F::ALIGNED16, "W in tiles of an mma row tile, whole 16-byte words (quant.cuh)");
    using Q = QGemm<F, K, 1, 1, 1, 0, THREADS>;  // the slice geometry of qgemm
    static constexpr int ROWS = 16 * TILES;      // weight rows per block
    static constexpr int W_TILE = 16 * Q::SLICE_BYTES;  // a row tile's slice: its 16 rows' blocks, block by block
    static constexpr int X_SLOT = XSLOT * sizeof(XBlock);  // an activation row's slot: quant.cuh's, odd words
    static constexpr int W_THREADS = THREADS / TILES, X_THREADS = THREADS / MT;  // copying each run
    static constexpr int W_COPIES = (W_TILE / 16 + W_THREADS - 1) / W_THREADS;  // a thread's words of a slice
    static constexpr int X_COPIES = (Q::X_SLICE_BYTES / 16 + X_THREADS - 1) / X_THREADS;
    static constexpr int X_STAGE = TILES * W_TILE;  // where a stage's activations start
    static constexpr int STAGE_BYTES = X_STAGE + MT * X_SLOT;
    static constexpr int RING = STAGES * STAGE_BYTES;
    static constexpr int CLASSES = F::QUAD_SUMS ? 8 : 32;  // sums an output: qgemm's lanes', or its quads'
    static constexpr int RED = CLASSES * ROWS * MT * 4;  // the class sums of the block's outputs (after the ring's use)
    // the last slice's bytes of a row, and of an activation row (a partial slice where K is not whole slices)
    static constexpr int LAST_BYTES = static_cast<int>(Q::ROW_BYTES - (long long)(Q::SLICES - 1) * Q::SLICE_BYTES);
    static constexpr int X_LAST_BYTES =
        static_cast<int>(Q::X_ROW_BYTES - (long long)(Q::SLICES - 1) * Q::X_SLICE_BYTES);
    static constexpr int BARS = RING > RED ? RING : RED;  // the stages' mbarriers (bulk copies, sm_90)
    static constexpr int SMEM = BARS + 8 * STAGES;
};

template <class F, int K, int MT, int TILES, int STAGES, int THREADS>
__device__ void qgemm_mma(const unsigned char* __restrict__ W, const unsigned char* __restrict__ x,
                          float* __restrict__ y, int N, int M, unsigned char* smem, int ldy) {
    using R = QGemmMma<F, K, MT, TILES, STAGES, THREADS>;
    using Q = typename R::Q;
    constexpr int NT = MT / 8, PV = Q::PIECE_VALUES, PIECE_XB = F::XB / F::PIECES;
    const int mtiles = (M + MT - 1) / MT;
    const int m0 = (blockIdx.x % mtiles) * MT, r0 = (blockIdx.x / mtiles) * R::ROWS;
    const int nts = min(NT, (M - m0 + 7) / 8);  // the n-tiles holding activation rows
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // Where row tile i's slice 0 starts in W (tiles past N's: the last one's; their outputs are dropped).
    const auto tile_start = [&](int i) { return wblock_offset<F>(min(r0 + 16 * i, (N - 1) / 16 * 16), 0, K); };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Slice s into stage s % STAGES by the copy engine: one bulk copy a row tile and one an n-tile of activation rows
    // in use (rows past M are not copied: what their slots hold reaches only their outputs, which are dropped). Copy c
    // is lane c / 8 of warp c % 8's (a bulk copy takes warp-uniform operands, so a warp's are issued one after the
    // other); the lane 0 of each warp with copies (the first TILES + nts) arrives on the stage's mbarrier with its
    // copies' bytes, and the other warps skip the issue (its reduction and proxy fence). Every warp waits on the
    // mbarrier, then on the block (every warp is done with the stage refilled next).
    constexpr int COPIES = (TILES + NT + 7) / 8;  // a warp's copies at most
    auto* bars = reinterpret_cast<unsigned long long*>(smem + R::BARS);
    const int x_rows = min(8 * nts, M - m0);
    const auto issue = [&](int s) {  // the warps with copies (TILES + nts: lane 0 of warps 0 .., then lane 1 ..)
        if (s >= Q::SLICES || warp >= TILES + nts) return;
        unsigned char* stage = smem + (s % STAGES) * R::STAGE_BYTES;
        const bool last = s == Q::SLICES - 1;
        const int c = warp + 8 * lane;
        unsigned bytes = 0;
        const unsigned char* from = W;
        unsigned char* to = stage;
        if (c < TILES) {  // row tile c
            bytes = 16 * (last ? R::LAST_BYTES : Q::SLICE_BYTES);
            from = W + tile_start(c) + s * Q::SLICE_STEP, to = stage + c * R::W_TILE;
        } else if (c < TILES + nts) {  // n-tile c - TILES: its activation rows' slots
            const int nt = c - TILES;
            bytes = min(8, x_rows - 8 * nt) * R::X_SLOT;
            from = x + Q::x_at(m0 + 8 * nt, s), to = stage + R::X_STAGE + 8 * nt * R::X_SLOT;
        }
        const unsigned total = __reduce_add_sync(0xFFFFFFFFu, bytes);
        if (lane == 0) mbar_expect_tx(&bars[s % STAGES], total);  // the warp's arrival, before its copies
        __syncwarp();
        fence_proxy_async();  // the stage's earlier reads (every warp's, ordered by the block barrier) come first
        if (lane < COPIES && bytes) bulk_g2s(to, from, bytes, &bars[s % STAGES]);
    };
    const auto landed = [&](int s) { mbar_wait(&bars[s % STAGES], (s / STAGES) & 1); };
    if (threadIdx.x < STAGES) mbar_init(&bars[threadIdx.x], min(THREADS / 32, TILES + nts));
    if (threadIdx.x == 0) fence_barrier_init();
    __syncthreads();  // the barriers are initialised
#else
    static_assert(THREADS % MT == 0 && THREADS % TILES == 0, "cp.async copies: whole threads a run");
    // This thread's copies: words cw + W_THREADS i of row tile cj's run, words xw + X_THREADS i of activation row
    // xm's slot (rows of n-tiles past nts: none). Rows past M are zeros, read from nowhere (their outputs are
    // dropped): copied from the last row, each copy of the same words at once cost the block ~2 us a duplicate row
    // (results/logs/h200-s12-run3-qgemm-mma-ab: Q4_K at M = 2, 57 -> 40 us; at M = 9, 65 -> 52).
    const int cj = threadIdx.x / R::W_THREADS, cw = threadIdx.x % R::W_THREADS;
    const int xm = threadIdx.x / R::X_THREADS, xw = threadIdx.x % R::X_THREADS;
    const unsigned char* const w_words = W + tile_start(cj) + 16 * cw;
    const unsigned char* const x_words = x + 16 * xw;
    const bool x_copies = xm < 8 * nts, x_real = m0 + xm < M;
    // Where the thread's first words of a stage go (shared-space addresses, worked out once): its copy i lies
    // 16 W_THREADS i (16 X_THREADS i) bytes further, in the shared memory and in the global memory alike.
    const unsigned w_dst = shared_addr(smem) + cj * R::W_TILE + 16 * cw;
    const unsigned x_dst = shared_addr(smem) + R::X_STAGE + xm * R::X_SLOT + 16 * xw;
    // Slice s into stage s % STAGES with cp.async, by every thread: each row tile's run and the XBlocks of the
    // activation rows of the n-tiles in use. Every thread waits for its copies, then on the block (every thread's have
    // landed; every warp is done with the stage refilled next).
    const auto issue = [&](int s) {  // always one commit group
        if (s < Q::SLICES) {
            const unsigned stage = (s % STAGES) * R::STAGE_BYTES;
            const bool last = s == Q::SLICES - 1;
            const unsigned char* from = w_words + s * Q::SLICE_STEP;
            const int end = 16 * (last ? R::LAST_BYTES : Q::SLICE_BYTES);  // past the run's last byte
#pragma unroll
            for (int i = 0; i < R::W_COPIES; ++i)
                if (16 * (cw + R::W_THREADS * i) < end)
                    cp_async16(w_dst + stage + 16 * R::W_THREADS * i, from + 16 * R::W_THREADS * i, true);
            const int xbytes = last ? R::X_LAST_BYTES : Q::X_SLICE_BYTES;
            const unsigned char* xfrom = x_words + Q::x_at(min(m0 + xm, M - 1), s);
#pragma unroll
            for (int i = 0; i < R::X_COPIES; ++i)
                if (x_copies && 16 * (xw + R::X_THREADS * i) < xbytes)
                    cp_async16(x_dst + stage + 16 * R::X_THREADS * i, xfrom + 16 * R::X_THREADS * i, x_real);
        }
        cp_async_commit();
    };
    const auto landed = [&](int) { cp_async_wait<STAGES - 2>(); };
#endif
    // a thread's class sums (F::QUAD_SUMS: one, its quad's, else one a piece c) and its quad's first pair of terms
    constexpr int TC = R::CLASSES / 8, PC = F::QUAD_SUMS ? 2 : 1;
    float acc[TILES][TC][NT][4], pair[TILES][NT][4];
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int c = 0; c < TC; ++c)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][c][nt][e] = 0.f;
    constexpr int QUADS = F::PIECES / 4;  // a block's
    const int q = warp % QUADS;
    const int wb = warp / QUADS;  // the warp's block in every slice
    // The ring's first slices of weights (no kernel writes them) asked of L2 before the wait: a block launched early
    // (behind a row kernel, which lets the next kernel launch at its start) finds them there when its copies start.
    if (warp < TILES)
        prefetch_l2(W + tile_start(warp), min((long long)(STAGES - 1) * Q::SLICE_STEP, 16LL * Q::ROW_BYTES));
    wait_for_prior_grids();   // the activations are the kernel before's
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
#pragma unroll 1
    for (int s = 0; s < Q::SLICES; ++s) {
        landed(s);              // slice s is in its stage ...
        __syncthreads();        // ... for every thread; every warp is done with slice s - 1's stage
        issue(s + STAGES - 1);  // into that stage
        if (s * Q::SLICE_VALUES + (wb * F::PIECES + 4 * q) * PV >= K) continue;  // a partial last slice without
                                                                                 // this warp's pieces: qgemm's lanes
                                                                                 // skip them too
        const unsigned char* stage = smem + (s % STAGES) * R::STAGE_BYTES;
        typename F::MmaRaw raw[TILES][2];
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int i = 0; i < 2; ++i)  // row 16 tile + g + 8i's block wb of the slice
                raw[tile][i] = F::mma_raw(stage + tile * R::W_TILE + (16 * wb + g + 8 * i) * F::BLOCK_BYTES, q, t);
        // the warp's block's XBlocks in a stage's activation rows
        const unsigned char* xb = stage + R::X_STAGE + wb * F::XB;
#pragma unroll
        // The quad's pieces PC at a time (F::QUAD_SUMS: a pair, whose terms meet at once).
        for (int c0 = 0; c0 < 4; c0 += PC) {
            unsigned a[PC][TILES][2][2];
            typename F::Scale sc[PC][TILES][2];
#pragma unroll
            for (int h = 0; h < PC; ++h)
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        F::mma_piece(raw[tile][i], q, c0 + h, lane & ~3, a[h][tile][i][0], a[h][tile][i][1],
                                     sc[h][tile][i]);
            const unsigned char* xp[PC];  // the pieces' XBlocks
#pragma unroll
            for (int h = 0; h < PC; ++h) xp[h] = xb + (4 * q + c0 + h) * PIECE_XB;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                if (nt >= nts) break;
                unsigned b[PC][2];
                int4 meta[PC][2];
#pragma unroll
                for (int h = 0; h < PC; ++h) {
                    const XBlock& xq = *reinterpret_cast<const XBlock*>(xp[h] + (8 * nt + g) * R::X_SLOT);
                    b[h][0] = static_cast<unsigned>(xq.q[t]), b[h][1] = static_cast<unsigned>(xq.q[4 + t]);
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        meta[h][j] = reinterpret_cast<const XBlock*>(xp[h] + (8 * nt + 2 * t + j) * R::X_SLOT)->meta();
                }
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile) {
                    float terms[4] = {0.f, 0.f, 0.f, 0.f};  // F::QUAD_SUMS: the pair's
#pragma unroll
                    for (int h = 0; h < PC; ++h) {
                        const int c = c0 + h;
                        int lo[4], hi[4] = {0, 0, 0, 0};
                        if constexpr (F::SPLIT) {
                            mma_s8(lo, {a[h][tile][0][0], a[h][tile][1][0], 0u, 0u}, b[h]);
                            mma_s8(hi, {0u, 0u, a[h][tile][0][1], a[h][tile][1][1]}, b[h]);
                        } else {
                            mma_s8(lo, {a[h][tile][0][0], a[h][tile][1][0], a[h][tile][0][1], a[h][tile][1][1]}, b[h]);
                        }
                        // C element e: row 16 tile + g + 8 (e / 2), activation 8nt + 2t + e % 2
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const typename F::Scale& se = sc[h][tile][e / 2];
                            if constexpr (F::QUAD_SUMS) {
                                const float tc = F::mma_term(0.f, se, lo[e], hi[e], meta[h][e % 2]);
                                terms[e] = h ? __fadd_rn(terms[e], tc) : tc;
                            } else {
                                acc[tile][c][nt][e] = F::mma_term(acc[tile][c][nt][e], se, lo[e], hi[e], meta[h][e % 2]);
                            }
                        }
                    }
                    if constexpr (F::QUAD_SUMS) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            if (c0 == 0) {
                                pair[tile][nt][e] = terms[e];
                            } else {
                                const float quad = __fadd_rn(pair[tile][nt][e], terms[e]);
                                acc[tile][0][nt][e] = __fadd_rn(acc[tile][0][nt][e], quad);
                            }
                        }
                    }
                }
            }
        }
    }
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 900
    cp_async_wait<0>();
#endif
    launch_next_grid();
    __syncthreads();  // every warp is done with the ring: its memory takes the class sums
    float* red = reinterpret_cast<float*>(smem);  // [class][row][activation]
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
        for (int c = 0; c < TC; ++c)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    red[((TC * warp + c) * R::ROWS + 16 * tile + g + 8 * (e / 2)) * MT + 8 * nt + 2 * t + e % 2] =
                        acc[tile][c][nt][e];
    __syncthreads();
    for (int o = threadIdx.x; o < R::ROWS * MT; o += THREADS) {
        const int row = o / MT, m = o % MT;
        if (r0 + row >= N || m0 + m >= M) continue;
        float v[R::CLASSES];
#pragma unroll
        for (int l = 0; l < R::CLASSES; ++l) v[l] = red[(l * R::ROWS + row) * MT + m];
        y[(long long)(m0 + m) * ldy + r0 + row] = butterfly_sum<R::CLASSES>(v);  // in warp_sum's order
    }
}

// X [M, K] fp32 (K = 32 row_blocks) -> its XBlocks in quant.cuh's layout: one per thread, grid-stride.
__device__ inline void quantize_x(const float* __restrict__ x, XBlock* __restrict__ out, int M, int row_blocks) {
    const int slices = (row_blocks + XSLICE - 1) / XSLICE;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < M * row_blocks; i += gridDim.x * blockDim.x)
        out[xblock_index(i / row_blocks, i % row_blocks, slices)] = quantize_xblock(x + 32ll * i);
}

// out [N, K] fp32 = the values of W's rows (the decode of quant.cuh, alone): one piece per thread, grid-stride.
template <class F>
__device__ void qdequant(const unsigned char* __restrict__ W, float* __restrict__ out, int N, int K) {
    const int pieces = K / (F::BLOCK_VALUES / F::PIECES);
    for (long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x; t < (long long)N * pieces;
         t += (long long)gridDim.x * blockDim.x) {
        const long long n = t / pieces;
        const int b = static_cast<int>(t % pieces) / F::PIECES, p = static_cast<int>(t % pieces) % F::PIECES;
        const auto pc = F::load(W + wblock_offset<F>(static_cast<int>(n), b, K), p);
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
