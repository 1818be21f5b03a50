// bulk.cuh: Hopper (sm_90+) bulk copies global -> shared completing on an mbarrier (the TMA engine's 1-D form).
//
// A producer thread calls mbar_expect_tx(bar, bytes) then bulk_g2s(dst, src, bytes, bar); consumers wait with
// mbar_wait(bar, parity), where parity is the use count of that barrier modulo 2.
#pragma once
#include "mbarrier.cuh"

namespace lucegen {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// Make initialised barriers visible to the async proxy (the copy engine) before first use.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_addr(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n"
        "  .reg .pred done;\n"
        "WAIT_%=:\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "  @!done bra WAIT_%=;\n"
        "}\n" ::"r"(shared_addr(bar)),
        "r"(parity)
        : "memory");
}

// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            shared_addr(dst)),
        "l"(src), "r"(bytes), "r"(shared_addr(bar))
        : "memory");
}

// Order this thread's earlier generic-proxy shared-memory accesses before later async-proxy (copy) ones.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif

}  // namespace lucegen
