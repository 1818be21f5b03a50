// mbarrier.cuh: shared-memory mbarriers and warp-wide cp.async copies that complete on them, for every lucegen
// arch (sm_80+). bulk.cuh adds the sm_90 bulk copy engine, which completes on the same barriers.
//
// Phases: an mbarrier completes a phase when its pending arrivals (and, on sm_90, its expected transaction bytes)
// reach zero; a waiter passes the phase of parity p with mbar_test(bar, p). A barrier used for the n-th time
// (n = 0, 1, ...) is waited on with parity n & 1.
#pragma once
#include "common.cuh"

namespace lucegen {

__device__ __forceinline__ unsigned shared_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// `count` arrivals complete a phase.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(shared_addr(bar)), "r"(count) : "memory");
}

// One arrival (release: this thread's earlier shared-memory reads are done before the phase can complete).
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    unsigned long long state;
    asm volatile("mbarrier.arrive.shared.b64 %0, [%1];" : "=l"(state) : "r"(shared_addr(bar)) : "memory");
    (void)state;
}

// True once the phase of parity `parity` has completed (acquire: what completed it is visible after).
__device__ __forceinline__ bool mbar_test(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n"
        "  selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(shared_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory by the 32 lanes of a
// warp with 16-byte cp.async; the barrier's phase completes when every lane's copies have landed (init count 32:
// each lane's arrival fires when its own copies are done).
__device__ __forceinline__ void warp_copy_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    const int lane = threadIdx.x % 32;
    const unsigned d = shared_addr(dst);
    const char* s = static_cast<const char*>(src);
    for (unsigned off = lane * 16u; off < bytes; off += 32u * 16u)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + off), "l"(s + off) : "memory");
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"(shared_addr(bar)) : "memory");
}

}  // namespace lucegen
