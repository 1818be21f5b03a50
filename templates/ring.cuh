// ring.cuh: a persistent block's weight stream through a ring of shared-memory slots.
//
// A block of a persistent kernel reads a fixed sequence of weight tiles (its rows of every matrix, phase after
// phase, step after step). The ring holds SLOTS tiles, at most INFLIGHT of them (where capped) still landing:
// warp 0 issues a copy (the bulk copy engine on sm_90+, cp.async below) into a slot as soon as every consumer warp
// has released the tile that slot held, and consumers wait for a tile's bytes on the slot's `full` mbarrier.
// Copies run ahead of the computation by up to SLOTS tiles, across phase boundaries and grid barriers, so DRAM
// keeps streaming while the block waits for other blocks.
//
// Protocol (tile t lives in slot t % SLOTS and is the (t / SLOTS)-th use of that slot):
//   warp 0 is the producer (warp-uniform code): pump(source) issues the next tiles of `source` while their slots
//   are free, without waiting; produce(source, end) issues up to tile `end`, waiting for slots (and, under an
//   INFLIGHT cap, for landings). It consumes no tiles, so its waits depend on the consumers (and DRAM) only,
//   and theirs on it only.
//   warps 1 .. WARPS-1 consume every tile in order: take() waits for full[slot]; the warp reads its rows;
//   release() arrives on empty[slot] (init count WARPS - 1). A warp with no rows in a tile still takes and
//   releases it, so no warp can arrive for a later use of a slot before the earlier use is complete.
#pragma once
#include "bulk.cuh"
#include "gemv.cuh"
#include "grid.cuh"
#include "mbarrier.cuh"

namespace lucegen {

template <int SLOTS, int SLOT_BYTES, int WARPS, unsigned INFLIGHT = 0>
struct TileRing {
    static_assert(SLOT_BYTES % 128 == 0, "slots are whole 128-byte lines");
#if __CUDA_ARCH__ >= 900
    static constexpr unsigned FILL_ARRIVALS = 1;   // the producer's arrive.expect_tx
#else
    static constexpr unsigned FILL_ARRIVALS = 32;  // one cp.async arrival per lane of warp 0
#endif
    unsigned char* slots;         // SLOTS * SLOT_BYTES, 128-byte aligned
    unsigned long long* full;     // SLOTS
    unsigned long long* empty;    // SLOTS
    unsigned taken = 0;           // tiles consumed (in warp 0: by the consumers, once they finish the segment)
    unsigned issued = 0;          // tiles issued (warp 0 only)

    // Block-wide, once.
    __device__ void init() {
        if (threadIdx.x == 0)
            for (int s = 0; s < SLOTS; ++s) {
                mbar_init(&full[s], FILL_ARRIVALS);
                mbar_init(&empty[s], WARPS - 1);
            }
#if __CUDA_ARCH__ >= 900
        if (threadIdx.x == 0) fence_barrier_init();
#endif
        __syncthreads();
    }

    // Warp 0: issue tiles from `source` (source.next(src, bytes) -> false at the end of the stream) while the
    // slot of the next tile is free and fewer than INFLIGHT issued tiles have not landed (0: no such cap), at most
    // `most` of them. The cap keeps the block's copies in step with its use of them: copies queued at the memory
    // system delay the block's (and the grid's) synchronisation loads behind them (H100, the 0.8B's tg128 with the
    // h200 spec, us a token: 817.7 with 6 slots in flight, 812.9 at 3, 780.0 at 2, 888.6 at 1; docs/design.md,
    // session 55). Tile issued - INFLIGHT's slot is not reused before tile issued is issued, so its full
    // mbarrier still tells whether that tile landed.
    template <class Source>
    __device__ void pump(Source& source, unsigned most = ~0u) {
        for (unsigned n = 0; n < most; ++n) {
            const unsigned s = issued % SLOTS, back = issued - INFLIGHT;
            const bool free = issued < SLOTS || mbar_test(&empty[s], ((issued / SLOTS) - 1) & 1);
            const bool room = INFLIGHT == 0 || INFLIGHT >= SLOTS || issued < INFLIGHT ||
                              mbar_test(&full[back % SLOTS], (back / SLOTS) & 1);
            if (!__all_sync(0xffffffffu, free && room)) return;
            const void* src;
            unsigned bytes;
            if (!source.next(src, bytes)) return;
            unsigned char* dst = slots + (size_t)s * SLOT_BYTES;
#if __CUDA_ARCH__ >= 900
            if (threadIdx.x == 0) {
                fence_proxy_async();  // the consumers' reads of this slot's previous tile before the engine writes
                mbar_expect_tx(&full[s], bytes);
                bulk_g2s(dst, src, bytes, &full[s]);
            }
#else
            warp_copy_g2s(dst, src, bytes, &full[s]);
#endif
            ++issued;
        }
    }

    // Warp 0: issue tiles up to `end` (exclusive), waiting for their slots to be released.
    template <class Source>
    __device__ void produce(Source& source, unsigned end) {
        SpinGuard guard;
        for (;;) {
            pump(source);
            if (issued >= end) return;
            guard("a free weight slot", issued, end);
        }
    }

    // A consumer warp: wait for the next tile. Returns the tile's slot.
    __device__ const uint4* take() {
        const unsigned s = taken % SLOTS, parity = (taken / SLOTS) & 1;
        SpinGuard guard;
        while (!__all_sync(0xffffffffu, mbar_test(&full[s], parity))) guard("weight tile", taken, issued);
        return reinterpret_cast<const uint4*>(slots + (size_t)s * SLOT_BYTES);
    }

    // A consumer warp: how many of the next n <= SLOTS tiles have landed, in order (a look, no wait: timing).
    __device__ unsigned landed(unsigned n) const {
        unsigned t = 0;
        while (t < n && mbar_test(&full[(taken + t) % SLOTS], ((taken + t) / SLOTS) & 1)) ++t;
        return t;
    }

    // A consumer warp, after its last read of the tile it took.
    __device__ void release() {
        __syncwarp();
        if (threadIdx.x % 32 == 0) mbar_arrive(&empty[taken % SLOTS]);
        ++taken;
    }

    // Warp 0, before the block exits: copies still landing in shared memory must finish first (the tiles issued
    // beyond the last one consumed).
    __device__ void drain() {
        for (unsigned t = taken; t < issued; ++t) {
            SpinGuard guard;
            while (!__all_sync(0xffffffffu, mbar_test(&full[t % SLOTS], (t / SLOTS) & 1)))
                guard("a weight tile to land before exit", t, issued);
        }
    }
};

// Rows [r0, r1) of a K-wide bf16 matrix, streamed through the ring as tiles of TILE_ROWS rows, times x (staged in
// shared memory). Warp 0 issues the tiles; the consumer warps take units of work in turn across the whole range
// (unit u goes to consumer u % (WARPS - 1)), so every consumer works although a tile may hold fewer units than
// there are warps. A unit is a group of ROWS rows, or with SPLIT > 1 one of SPLIT slices of a group's K (for a
// block with few rows, such as a down-projection's 8 rows of 3584: 2 groups would keep 2 warps busy, 14 units
// keep 14): unit u is slice u % SPLIT of group u / SPLIT; its partial sums go to `partials` (SPLIT x ROWS floats
// per group, shared memory), and once every tile is consumed the consumers add each group's slices in a fixed
// order (deterministic). epilogue(row, acc, n) runs in lane 0 of a consumer with the sums of rows row .. row+n-1
// (n <= ROWS; n < ROWS only at the end of the range).
template <int K, int ROWS, int TILE_ROWS, int SPLIT, int WARPS, class Ring, class Source, class XS, class Epilogue>
__device__ __forceinline__ void ring_gemv(Ring& ring, Source& source, XS xs, float* partials, int r0, int r1,
                                          Epilogue&& epilogue) {
    static_assert(TILE_ROWS % ROWS == 0, "a row group never straddles two tiles");
    static_assert(SPLIT >= 1 && SPLIT <= K / 8, "K slices of at least one 16-byte chunk");
    constexpr int CHUNKS = K / 8, UNITS_PER_TILE = TILE_ROWS / ROWS * SPLIT, CONSUMERS = WARPS - 1;
    const int rows = r1 - r0, tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0) {
        ring.produce(source, ring.taken + tiles);
        ring.taken += tiles;
        return;
    }
    int u = warp - 1;  // this warp's next unit
    for (int j = 0; j < tiles; ++j) {
        const uint4* tile = ring.take();
        const int first = j * TILE_ROWS, in_tile = min(TILE_ROWS, rows - first);
        for (; u < (j + 1) * UNITS_PER_TILE && u / SPLIT * ROWS < rows; u += CONSUMERS) {
            const int g = u / SPLIT, s = u % SPLIT;
            const int local = g * ROWS - first, n = min(ROWS, in_tile - local);
            float acc[ROWS];
            gemv_bf16_smem_rows<K, ROWS>(tile + local * CHUNKS, xs, n, acc, s * CHUNKS / SPLIT,
                                         (s + 1) * CHUNKS / SPLIT);
            if (lane != 0) continue;
            if (SPLIT == 1) {
                epilogue(r0 + g * ROWS, acc, n);
            } else {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) partials[u * ROWS + r] = acc[r];
            }
        }
        ring.release();
    }
    if (SPLIT == 1) return;
    // every consumer's partials are written (warp 0 is not in this barrier: it has returned)
    asm volatile("bar.sync 1, %0;" ::"r"(CONSUMERS * 32) : "memory");
    if (lane != 0) return;
    for (int g = warp - 1; g * ROWS < rows; g += CONSUMERS) {
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            acc[r] = partials[g * SPLIT * ROWS + r];
            for (int s = 1; s < SPLIT; ++s) acc[r] += partials[(g * SPLIT + s) * ROWS + r];
        }
        epilogue(r0 + g * ROWS, acc, min(ROWS, rows - g * ROWS));
    }
}

}  // namespace lucegen
