// gemm.cuh: Y = X W^T on tensor cores, for every projection of the prefill.
//
// X [M, K] bf16 (the M = T token rows, row-major), W [N, K] bf16 (the weight, row-major as stored), fp32
// accumulation, K a multiple of 64. A block computes a BM x BN tile of Y with WM x WN warps (mma.sync m16n8k16);
// the K loop streams BK = 64 columns of X and W per step through STAGES cp.async stages in swizzled shared memory.
// Blocks are numbered in groups of GROUP_M row tiles that walk all column tiles together, so the blocks resident at
// once read the same few W tiles from L2 instead of each streaming W from DRAM. Where too few tiles would leave SMs
// idle (a narrow output at a short prompt), the launcher may split K into slices (the `add` epilogue only: see
// "deterministic split-K" below: the slices' partial tiles are summed in slice order, so the result does not depend
// on timing).
//
// The epilogue is a functor called once per warp with its accumulators (see the Store / Add / SiluMul below), so a
// residual add or the MLP's SiLU(gate) * up costs no extra pass over memory.
#pragma once
#include "activation.cuh"
#include "mma.cuh"

namespace lucegen {

template <int BM_, int BN_, int WM_, int WN_, int STAGES_>
struct GemmShape {
    static constexpr int BM = BM_, BN = BN_, BK = 64, WM = WM_, WN = WN_, STAGES = STAGES_;
    static constexpr int THREADS = WM * WN * 32;
    static constexpr int TM = BM / WM, TN = BN / WN;  // one warp's tile
    static constexpr int MI = TM / 16, NI = TN / 8;    // its mma tiles
    static constexpr int GROUP_M = 8;
    static constexpr int SMEM = STAGES * (BM + BN) * BK * 2;
    static_assert(TM % 16 == 0 && TN % 16 == 0 && STAGES >= 2, "GEMM tile shape");
};

// Visit a warp tile's accumulators as pairs of adjacent columns: f(row, col, Y[row][col], Y[row][col + 1]).
template <int MI, int NI, class F>
__device__ __forceinline__ void for_each_pair(const float (&acc)[MI][NI][4], int row0, int col0, F&& f) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int r = row0 + mi * 16 + g, c = col0 + ni * 8 + 2 * t;
            f(r, c, acc[mi][ni][0], acc[mi][ni][1]);
            f(r + 8, c, acc[mi][ni][2], acc[mi][ni][3]);
        }
}

// Where a token-N wgmma tile's accumulators go (gemm_wgmma.cuh's WgmmaTokensNShape: its rows are outputs, its
// columns tokens): d[j][e] is Y[tok0 + 8j + 2t + e % 2][out0 + g + 8 (e / 2)] for lane g * 4 + t. The bounds are
// taken once, as the tokens and outputs left from the thread's first element, so that an element's test and its
// offset from that element are constants but for the row stride.
struct TransposedTile {
    int token, output, tokens, outputs;  // the thread's first element, and how many tokens / outputs from it are in Y
    __device__ __forceinline__ TransposedTile(int out0, int tok0, int M, int N)
        : token(tok0 + threadIdx.x % 4 * 2), output(out0 + threadIdx.x % 32 / 4), tokens(M - token),
          outputs(N - output) {}
    __device__ __forceinline__ bool in(int j, int e) const { return 8 * j + e % 2 < tokens && 8 * (e / 2) < outputs; }
    __device__ __forceinline__ static int offset(int j, int e, int ld) { return (8 * j + e % 2) * ld + 8 * (e / 2); }
};

// *p = v where `pred`: a predicated store, not a branch around one.
__device__ __forceinline__ void store_if(bf16* p, float v, bool pred) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %2, 0;\n"
        "@p st.global.b16 [%0], %1;\n"
        "}\n" ::"l"(p), "h"(__bfloat16_as_ushort(__float2bfloat16(v))), "r"(int(pred))
        : "memory");
}
__device__ __forceinline__ void store_if(float* p, float v, bool pred) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %2, 0;\n"
        "@p st.global.f32 [%0], %1;\n"
        "}\n" ::"l"(p), "f"(v), "r"(int(pred))
        : "memory");
}

// A token-N tile's accumulators stored as they are: Y [M, N] of bf16 or fp32.
template <int J, class T>
__device__ __forceinline__ void store_transposed(T* y, const float (&d)[J][4], int out0, int tok0, int M, int N) {
    const TransposedTile tile(out0, tok0, M, N);
    T* first = y + (size_t)tile.token * N + tile.output;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) store_if(first + tile.offset(j, e, N), d[j][e], tile.in(j, e));
}

// Two adjacent columns of a row in one store.
__device__ __forceinline__ void store_pair(bf16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store_pair(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}

// ---- epilogues: (accumulators, the warp tile's first row and column, M, N). N is even. -----------------------
// Each also has `transposed(d, out0, tok0, M, N)` for a token-N tile's accumulators (TransposedTile). A PAIRWISE one
// writes Y without reading it, a pair of adjacent columns at a time (`pair(r, c, Y[r][c], Y[r][c + 1], M, N)`), so
// that a tile staged in shared memory can be stored in whole rows (gemm_wgmma.cuh's store_staged).

template <class T>
struct StoreRows {  // Y [M, N] of T (bf16 or fp32)
    T* y;
    static constexpr bool PAIRWISE = true;
    __device__ __forceinline__ void pair(int r, int c, float a, float b, int M, int N) const {
        if (r < M && c < N) store_pair(y + (size_t)r * N + c, a, b);
    }
    template <int MI, int NI>
    __device__ __forceinline__ void operator()(const float (&acc)[MI][NI][4], int row0, int col0, int M, int N) const {
        for_each_pair(acc, row0, col0, [&](int r, int c, float a, float b) { pair(r, c, a, b, M, N); });
    }
    template <int J>
    __device__ __forceinline__ void transposed(const float (&d)[J][4], int out0, int tok0, int M, int N) const {
        store_transposed(y, d, out0, tok0, M, N);
    }
};
using StoreBf16 = StoreRows<bf16>;
using StoreF32 = StoreRows<float>;

// Y [M, N] fp32 += X W^T: the residual stream after an output projection. Y is read CHUNK column tiles (8 columns
// each) of a row group at a time, all of a chunk's loads before its stores: a store may alias a later load for all
// the compiler knows (rows r and r + 8 are N apart), so pair by pair each read-modify-write waited a round trip.
struct AddF32 {
    float* y;
    static constexpr bool PAIRWISE = false;  // each pair reads Y before it writes it: see transposed's batches
    template <int MI, int NI>
    __device__ __forceinline__ void operator()(const float (&acc)[MI][NI][4], int row0, int col0, int M, int N) const {
        constexpr int CHUNK = NI < 8 ? NI : 8;
        static_assert(NI % CHUNK == 0, "AddF32 chunks");
        const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int n0 = 0; n0 < NI; n0 += CHUNK) {
                float2 old[CHUNK][2];
#pragma unroll
                for (int i = 0; i < CHUNK; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = row0 + mi * 16 + g + 8 * h, c = col0 + (n0 + i) * 8 + 2 * t;
                        old[i][h] = r < M && c < N ? *reinterpret_cast<const float2*>(y + (size_t)r * N + c)
                                                   : make_float2(0.f, 0.f);
                    }
#pragma unroll
                for (int i = 0; i < CHUNK; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = row0 + mi * 16 + g + 8 * h, c = col0 + (n0 + i) * 8 + 2 * t;
                        const float* a = acc[mi][n0 + i] + 2 * h;
                        if (r < M && c < N)
                            *reinterpret_cast<float2*>(y + (size_t)r * N + c) =
                                make_float2(old[i][h].x + a[0], old[i][h].y + a[1]);
                    }
            }
    }
    // CHUNK token columns of 8 at a time, their loads before their stores (as above)
    template <int J>
    __device__ __forceinline__ void transposed(const float (&d)[J][4], int out0, int tok0, int M, int N) const {
        constexpr int CHUNK = J % 4 == 0 ? 4 : (J % 2 == 0 ? 2 : 1);
        const TransposedTile tile(out0, tok0, M, N);
        float* first = y + (size_t)tile.token * N + tile.output;
#pragma unroll
        for (int j0 = 0; j0 < J; j0 += CHUNK) {
            float old[CHUNK][4];
#pragma unroll
            for (int i = 0; i < CHUNK; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    old[i][e] = tile.in(j0 + i, e) ? first[tile.offset(j0 + i, e, N)] : 0.f;
#pragma unroll
            for (int i = 0; i < CHUNK; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (tile.in(j0 + i, e)) first[tile.offset(j0 + i, e, N)] = old[i][e] + d[j0 + i][e];
        }
    }
};

// The MLP's act = silu(gate) * up, Y [M, N/2] bf16, from a W whose rows pair gate_proj and up_proj (row 2i =
// gate row i, row 2i + 1 = up row i: the decode megakernel's packing): a thread's two adjacent columns are the gate
// and the up value of one output.
struct SiluMulBf16 {
    bf16* y;
    static constexpr bool PAIRWISE = true;
    __device__ __forceinline__ void pair(int r, int c, float gate, float up, int M, int N) const {
        if (r < M && c < N) y[(size_t)r * (N / 2) + c / 2] = __float2bfloat16(silu(gate) * up);
    }
    template <int MI, int NI>
    __device__ __forceinline__ void operator()(const float (&acc)[MI][NI][4], int row0, int col0, int M, int N) const {
        for_each_pair(acc, row0, col0, [&](int r, int c, float a, float b) { pair(r, c, a, b, M, N); });
    }
    // A token-N tile holds gate row 2i and up row 2i + 1 in lanes 4 apart (g even and g + 1): the up value comes
    // from lane + 4, and the even-g lanes store.
    template <int J>
    __device__ __forceinline__ void transposed(const float (&d)[J][4], int out0, int tok0, int M, int N) const {
        const TransposedTile tile(out0, tok0, M, N);
        const bool gate = threadIdx.x % 32 / 4 % 2 == 0;
        bf16* first = y + (size_t)tile.token * (N / 2) + tile.output / 2;
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float up = __shfl_xor_sync(0xffffffffu, d[j][e], 4);
                store_if(first + (8 * j + e % 2) * (N / 2) + 4 * (e / 2), silu(d[j][e]) * up, gate && tile.in(j, e));
            }
    }
};

// The `add` of a split-K launch: the kernel stores the block's partial tile to its slot of `partials` and calls
// split_k_add (below), not this functor.
struct AddF32Split {
    float* y;
    float* partials;     // one BM x BN fp32 slot per block of the launch (Gemm's workspace)
    unsigned* counters;  // one per tile, zero before and after every launch
};

template <class E>
struct IsSplitK {
    static constexpr bool value = false;
};
template <>
struct IsSplitK<AddF32Split> {
    static constexpr bool value = true;
};

// ---- a block's work -------------------------------------------------------------------------------------------

// A block's work: its (row tile, column tile) and its slice of K, k tiles kt0 .. kt0 + k_tiles - 1; the tile's
// index in grouped order (of `tiles`) and the slice's index (of `splits`).
struct GemmWork {
    int tm, tn, kt0, k_tiles, tile, tiles, split, splits;
};

template <class S>
__device__ __forceinline__ int gemm_tiles(int M, int N) {
    return ((M + S::BM - 1) / S::BM) * ((N + S::BN - 1) / S::BN);
}

// The work items are `splits` copies of the tiles (1 but for split-K); in each, tiles are numbered in grouped order,
// and copy s takes k tiles [s KT / splits, (s + 1) KT / splits) of the KT = K / BK. Item i = split * tiles + tile.
template <class S>
__device__ __forceinline__ GemmWork gemm_work(int M, int N, int K, int item, int splits) {
    const int tiles_m = (M + S::BM - 1) / S::BM, tiles_n = (N + S::BN - 1) / S::BN, tiles = tiles_m * tiles_n;
    const int block = item % tiles, split = item / tiles;
    const int per_group = S::GROUP_M * tiles_n, id = block % per_group;
    const int first = block / per_group * S::GROUP_M, rows = min(tiles_m - first, S::GROUP_M);
    const int kt_all = K / S::BK, kt0 = split * kt_all / splits;
    return {first + id % rows, id / rows, kt0, (split + 1) * kt_all / splits - kt0, block, tiles, split, splits};
}

// A grid of one block per item: item blockIdx.x of gridDim.x.
template <class S>
__device__ __forceinline__ GemmWork gemm_block_work(int M, int N, int K) {
    return gemm_work<S>(M, N, K, blockIdx.x, gridDim.x / gemm_tiles<S>(M, N));
}

// ---- deterministic split-K ----------------------------------------------------------------------------------
//
// Block b = split * tiles + tile of a split launch holds, in registers, the partial tile p_split (the sum over its
// slice of K). Every block writes it to its slot b of `partials` (BM x BN fp32, row-major, rows and columns past M
// and N included), then counts itself in on the tile's counter; the block that arrives last (it sees splits - 1
// arrivals before its own) resets the counter to 0 for the next launch and adds the tile's slices into Y in slice
// order, element by element:
//     Y = Y0 + ((((p_0 + p_1) + p_2) + ... ) + p_{splits-1})
// as a launch without split adds its whole-K sum once. So the bits of Y depend on the inputs and the count of
// slices, never on which block finished first. No block waits for another (any block may arrive last), so the grid
// needs no co-residency.

// *p read past L1 where `pred`, else `other`: a predicated load, so that a run of them issues back to back.
__device__ __forceinline__ float2 load_cg_if(const float2* p, bool pred, float2 other) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %3, 0;\n"
        "@p ld.global.cg.v2.f32 {%0, %1}, [%2];\n"
        "}\n"
        : "+f"(other.x), "+f"(other.y)
        : "l"(p), "r"(int(pred))
        : "memory");
    return other;
}

// The split-K sum (above), after the block has stored its partial to its slot, for the THREADS threads
// tid = 0 .. THREADS - 1 that stored it (all of them must call it; named barrier `bar` is theirs): the last block
// of the tile adds the tile's slices into Y [M, N] (its tile at row m0, column n0). MAX_SPLITS: the most slices a
// launch has (the spec's split_k). The last block reads a batch of UNROLL column pairs of every slice and of Y0 at
// once (slices past `splits` predicated off to -0, which added leaves any sum as it is), then sums and stores them.
template <int BM, int BN, int THREADS, int MAX_SPLITS>
__device__ __forceinline__ void split_k_add(const GemmWork& work, int tid, int bar, float* partials,
                                            unsigned* counters, float* Y, int m0, int n0, int M, int N) {
    __threadfence();  // this thread's partial is visible to the whole GPU before the block counts itself in
    named_barrier(bar, THREADS);
    bool last = false;
    if (tid == 0) {
        last = atomicAdd(counters + work.tile, 1u) == unsigned(work.splits - 1);
        if (last) counters[work.tile] = 0;  // every slice of the tile has arrived: zero for the next launch
    }
    if (!named_barrier_any(bar, THREADS, last)) return;
    __threadfence();
    constexpr int PAIRS = BM * BN / 2, PER = PAIRS / THREADS, UNROLL = PER < 8 ? PER : 8;
    static_assert(PAIRS % THREADS == 0 && PER % UNROLL == 0, "split-K pairs");
    const float2* tile = reinterpret_cast<const float2*>(partials) + (size_t)work.tile * PAIRS;
    const size_t slice = (size_t)work.tiles * PAIRS;  // pairs from one slice's slot of the tile to the next one's
    const int rows = min(BM, M - m0), cols = min(BN, N - n0);
#pragma unroll 1
    for (int e0 = 0; e0 < PER; e0 += UNROLL) {
        float2 p[MAX_SPLITS][UNROLL], y0[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int e = (e0 + u) * THREADS + tid, r = e / (BN / 2), c = e % (BN / 2) * 2;
            const bool in = r < rows && c < cols;
            y0[u] = load_cg_if(reinterpret_cast<const float2*>(Y + (size_t)(m0 + r) * N + n0 + c), in,
                               make_float2(0.f, 0.f));
#pragma unroll
            for (int s = 0; s < MAX_SPLITS; ++s)
                p[s][u] = load_cg_if(tile + s * slice + e, in && s < work.splits, make_float2(-0.f, -0.f));
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int e = (e0 + u) * THREADS + tid, r = e / (BN / 2), c = e % (BN / 2) * 2;
            float2 t = p[0][u];
#pragma unroll
            for (int s = 1; s < MAX_SPLITS; ++s) t = make_float2(t.x + p[s][u].x, t.y + p[s][u].y);
            if (r < rows && c < cols)
                *reinterpret_cast<float2*>(Y + (size_t)(m0 + r) * N + n0 + c) =
                    make_float2(y0[u].x + t.x, y0[u].y + t.y);
        }
    }
}

// ---- the mma.sync block -----------------------------------------------------------------------------------------

// One block's BM x BN tile of Y = X W^T (or its share of K); launched with splits * ceil(M/BM) * ceil(N/BN) blocks
// of S::THREADS threads and S::SMEM bytes of dynamic shared memory. MAX_SPLITS: see split_k_add.
template <class S, class Epilogue, int MAX_SPLITS = 1>
__device__ void gemm_bf16_tn(const bf16* __restrict__ X, const bf16* __restrict__ W, int M, int N, int K,
                             const Epilogue& epilogue, unsigned char* smem) {
    using ATile = SwizzledTile<S::BM, S::BK>;
    using BTile = SwizzledTile<S::BN, S::BK>;
    constexpr int STAGE = ATile::BYTES + BTile::BYTES;
    run_after_prior_grids();
    const GemmWork work = gemm_block_work<S>(M, N, K);
    const int m0 = work.tm * S::BM, n0 = work.tn * S::BN, k_tiles = work.k_tiles;
    const int warp = threadIdx.x / 32, wm = warp / S::WN * S::TM, wn = warp % S::WN * S::TN;
    const bf16* x = X + (size_t)m0 * K + work.kt0 * S::BK;
    const bf16* w = W + (size_t)n0 * K + work.kt0 * S::BK;

    auto load = [&](int kt) {  // k tile kt into stage kt % STAGES; always one commit, so group counts stay aligned
        if (kt < k_tiles) {
            unsigned char* stage = smem + (kt % S::STAGES) * STAGE;
            load_tile_async<S::BM, S::BK, S::THREADS>(ATile{stage}, x + kt * S::BK, K, M - m0);
            load_tile_async<S::BN, S::BK, S::THREADS>(BTile{stage + ATile::BYTES}, w + kt * S::BK, K, N - n0);
        }
        cp_async_commit();
    };

    float acc[S::MI][S::NI][4];
#pragma unroll
    for (int mi = 0; mi < S::MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < S::NI; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;

#pragma unroll
    for (int s = 0; s < S::STAGES - 1; ++s) load(s);
#pragma unroll 1
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<S::STAGES - 2>();  // k tile kt has landed (for this thread) ...
        __syncthreads();                 // ... for every thread, and every warp is done with k tile kt - 1
        load(kt + S::STAGES - 1);        // into the stage k tile kt - 1 used
        const ATile a{smem + (kt % S::STAGES) * STAGE};
        const BTile b{smem + (kt % S::STAGES) * STAGE + ATile::BYTES};
#pragma unroll
        for (int kk = 0; kk < S::BK; kk += 16) {
            unsigned af[S::MI][4], bfrag[S::NI][2];
#pragma unroll
            for (int mi = 0; mi < S::MI; ++mi) load_a_frag(af[mi], a, wm + mi * 16, kk);
#pragma unroll
            for (int ni = 0; ni < S::NI; ni += 2) {
                unsigned r[4];
                load_b_frags_nk(r, b, wn + ni * 8, kk);
                bfrag[ni][0] = r[0], bfrag[ni][1] = r[1], bfrag[ni + 1][0] = r[2], bfrag[ni + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < S::MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < S::NI; ++ni) mma_bf16(acc[mi][ni], af[mi], bfrag[ni]);
        }
    }
    cp_async_wait<0>();
    if constexpr (IsSplitK<Epilogue>::value) {  // the partial to the block's slot, then the tile's last block adds
        StoreF32{epilogue.partials + (size_t)blockIdx.x * S::BM * S::BN}(acc, wm, wn, S::BM, S::BN);
        split_k_add<S::BM, S::BN, S::THREADS, MAX_SPLITS>(work, threadIdx.x, 1, epilogue.partials, epilogue.counters,
                                                          epilogue.y, m0, n0, M, N);
    } else {
        epilogue(acc, m0 + wm, n0 + wn, M, N);
    }
}

}  // namespace lucegen
