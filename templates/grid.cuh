// grid.cuh: synchronisation for persistent kernels launched cooperatively (every block co-resident).
//
// GridBarrier counts arrivals on one counter that only grows: barrier number e (e = 1, 2, ...) is passed when
// the counter reaches e * gridDim.x, so no barrier resets anything. The last block to leave the kernel returns
// the counters to zero (grid_leave), so the next launch starts from zero without a memset. Comparisons are
// wrap-safe, so a launch may pass any number of barriers.
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

// counters: [0] barrier arrivals, [1] blocks that have left. `passed` is this block's count of barriers passed
// times gridDim.x (the same in every block: all blocks pass the same barriers).
struct GridBarrier {
    unsigned* counters;
    unsigned passed = 0;

    // Block-wide: the block's global writes are published, then thread 0 announces the arrival.
    __device__ __forceinline__ void arrive() {
        __syncthreads();
        passed += gridDim.x;
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counters, 1u);
        }
    }

    // Has every block arrived? (thread 0 asks; wrap-safe)
    __device__ __forceinline__ bool done() const { return static_cast<int>(load_acquire(counters) - passed) >= 0; }

    // Block-wide: wait until every block has arrived, running `idle()` in warp 0 between polls (warp-uniform).
    template <typename Idle>
    __device__ __forceinline__ void wait(Idle&& idle) {
        if (threadIdx.x < 32) {
            SpinGuard guard;
            for (;;) {
                const bool all = __shfl_sync(0xffffffffu, threadIdx.x == 0 ? done() : false, 0);
                if (all) break;
                idle();
                guard("the grid barrier", passed / gridDim.x, 0);
            }
            if (threadIdx.x == 0) __threadfence();  // other blocks' writes, published before they arrived
        }
        __syncthreads();
    }
};

// The last block out resets the barrier so the next launch starts at zero. Call once, after the last barrier.
__device__ __forceinline__ void grid_leave(GridBarrier& bar) {
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(bar.counters + 1, 1u) == gridDim.x - 1) {
        bar.counters[0] = 0;  // every block has passed every barrier: nobody reads it any more
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
        __threadfence();
        const bool last = atomicAdd(ticket, 1u) == n - 1;
        if (last) {
            *ticket = 0;
            __threadfence();
        }
        *flag = last;
    }
    __syncthreads();
    return *flag != 0;
}

}  // namespace lucegen
