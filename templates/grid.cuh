// grid.cuh: synchronisation for persistent kernels launched cooperatively (every block co-resident).
//
// GridBarrier counts arrivals on one counter that only grows: barrier number e (e = 1, 2, ...) is passed when
// the counter reaches e * gridDim.x, so no barrier resets anything. The last block to leave the kernel returns
// the counters to zero (grid_leave), so the next launch starts from zero without a memset. Comparisons are
// wrap-safe, so a launch may pass any number of barriers.
//
// Ordering is release/acquire at GPU scope, the pattern of CUTLASS's GenericBarrier: a block's threads meet at
// __syncthreads, then thread 0 publishes with a release reduction (red.release.gpu: no return value to wait for,
// no separate fence); a waiting block's thread 0 polls with ld.acquire.gpu, then __syncthreads hands what it
// acquired to the block's other threads (causality order is transitive through the CTA barrier).
//
// Every spin is guarded: a wait that lasts longer than WAIT_LIMIT_NS prints what it waited for and traps, so a
// broken dependency fails the launch with an error instead of hanging the GPU.
#pragma once
#include "common.cuh"

namespace lucegen {

constexpr unsigned long long WAIT_LIMIT_NS = 5'000'000'000ull;

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Out of line (a cold path): the printf's call would otherwise make every spin loop save its registers.
__device__ __noinline__ void wait_timed_out(const char* what, unsigned a, unsigned b) {
    printf("lucegen: block %d thread %d waited %.0f s for %s (%u, %u): trapping\n", blockIdx.x, threadIdx.x,
           WAIT_LIMIT_NS * 1e-9, what, a, b);
    __trap();
}

// Counts the rounds of a spin loop; every 1024 rounds compares the time spent with WAIT_LIMIT_NS.
struct SpinGuard {
    unsigned rounds = 0;
    unsigned long long start = 0;
    __device__ __forceinline__ void operator()(const char* what, unsigned a, unsigned b) {
        if (++rounds % 1024) return;
        const unsigned long long now = global_ns();
        if (!start) start = now;
        if (now - start > WAIT_LIMIT_NS) wait_timed_out(what, a, b);
    }
};

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Adds v at gpu scope as a release: this thread's earlier writes, and those it has synchronised with (the block's,
// after a __syncthreads), are visible to whoever acquires the new value. No return value: nothing to wait for.
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Adds v at gpu scope, acquiring what earlier releasers published and releasing this thread's writes; returns the
// old value.
__device__ __forceinline__ unsigned atom_acq_rel(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// counters: [0] barrier arrivals, [1] blocks that have left. `passed` is this block's count of barriers passed
// times gridDim.x (the same in every block: all blocks pass the same barriers).
struct GridBarrier {
    unsigned* counters;
    unsigned passed = 0;

    // Block-wide: thread 0 announces the arrival, releasing the block's global writes.
    __device__ __forceinline__ void arrive() {
        __syncthreads();
        passed += gridDim.x;
        if (threadIdx.x == 0) red_release(counters, 1u);
    }

    // Has every block arrived? (thread 0 asks; wrap-safe)
    __device__ __forceinline__ bool done() const { return static_cast<int>(load_acquire(counters) - passed) >= 0; }

    // Block-wide (at least 2 warps): wait until every block has arrived. Warp 1 polls: thread 32's last poll
    // acquires every block's writes and the __syncthreads passes them on. Warp 0 meanwhile runs `idle()`
    // (warp-uniform) until the poller has posted the barrier to `seen` (shared memory), so what idle() does
    // (issuing weight copies) never delays noticing the barrier.
    template <typename Idle>
    __device__ __forceinline__ void wait(Idle&& idle, volatile unsigned* seen) {
        if (threadIdx.x / 32 == 1) {
            SpinGuard guard;
            while (!__shfl_sync(0xffffffffu, threadIdx.x == 32 ? done() : false, 0))
                guard("the grid barrier", passed / gridDim.x, 0);
            if (threadIdx.x == 32) *seen = passed;
        } else if (threadIdx.x < 32) {  // a stale `seen` (shared memory outlives a launch) only ends this early
            while (__shfl_sync(0xffffffffu, *seen, 0) != passed) idle();
        }
        __syncthreads();
    }
};

// Per-block ready counters, for a vector that blocks write in row shares and that later work reads by row ranges
// (so it need not wait for every block): block b bumps counters[b] (a release) once it has written its share of
// the vector; a block about to read rows written by blocks b0..b1 waits until their counters reach the number of
// vectors published so far in this launch (acquire), which is the same in every block. Like the barrier's, the
// counters only grow within a launch and grid_leave returns them to zero.
struct ReadyFlags {
    unsigned* counters;      // [gridDim.x]
    unsigned published = 0;  // vectors every block has published (or is publishing) in this launch

    // Block-wide: this block's share of the next vector is written.
    __device__ __forceinline__ void publish() {
        __syncthreads();
        ++published;
        if (threadIdx.x == 0) red_release(counters + blockIdx.x, 1u);
    }

    // Block-wide: wait until every block of each range blocks[i] = (first, last) has published the latest vector,
    // running `idle()` in warp 0 between polls (warp-uniform; keep it short: it delays noticing the rows). Each
    // lane's last poll acquires what its blocks wrote; the __syncthreads passes it on.
    template <int N, typename Idle>
    __device__ __forceinline__ void wait(const int2 (&blocks)[N], Idle&& idle) {
        if (threadIdx.x < 32) {
            SpinGuard guard;
            for (;;) {
                bool ready = true;
#pragma unroll
                for (int i = 0; i < N; ++i)
                    for (int b = blocks[i].x + static_cast<int>(threadIdx.x); b <= blocks[i].y; b += 32)
                        ready &= static_cast<int>(load_acquire(counters + b) - published) >= 0;
                if (__all_sync(0xffffffffu, ready)) break;
                idle();
                guard("rows other blocks write", published, blocks[0].x);
            }
        }
        __syncthreads();
    }
};

// The last block out resets the barrier and the ready counters so the next launch starts at zero. Call once, after
// the last barrier.
__device__ __forceinline__ void grid_leave(GridBarrier& bar, ReadyFlags& ready) {
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(bar.counters + 1, 1u) == gridDim.x - 1) {
        // every block has passed every barrier and every wait: nobody reads them any more
        for (unsigned b = 0; b < gridDim.x; ++b) ready.counters[b] = 0;
        bar.counters[0] = 0;
        bar.counters[1] = 0;
        __threadfence();
    }
}

// A ticket among the `n` blocks that share a piece of work: returns true in exactly one of them, the last to
// arrive, after which everything the others wrote before arriving is visible to it. The last one resets the
// ticket, so a grid barrier between two uses is all the reuse needs. Block-wide; `flag` is shared memory.
__device__ __forceinline__ bool last_to_arrive(unsigned* ticket, unsigned n, int* flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool last = atom_acq_rel(ticket, 1u) == n - 1;
        if (last) *ticket = 0;  // the next use is after a grid barrier, which publishes this
        *flag = last;
    }
    __syncthreads();
    return *flag != 0;
}

}  // namespace lucegen
