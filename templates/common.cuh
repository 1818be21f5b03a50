// common.cuh: types, vector loads and reductions shared by every lucegen kernel.
#pragma once
#include <cuda_bf16.h>


namespace lucegen {

using bf16 = __nv_bfloat16;

// 16-byte load of data read once (weights): bypass L1, ask L2 for the whole 256-byte sector group.
__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Ask L2 to fetch [p, p + bytes) from DRAM without waiting for it. One lane issues the bulk prefetch (sm_90+);
// below sm_90 the lanes of the calling warp prefetch one 128-byte line each in turn. The range is widened to
// whole 16-byte words, so its ends must lie inside an allocation padded to 16 bytes.
__device__ __forceinline__ void prefetch_l2(const void* p, size_t bytes) {
    const size_t a = reinterpret_cast<size_t>(p) & ~size_t(15);
    const size_t e = (reinterpret_cast<size_t>(p) + bytes + 15) & ~size_t(15);
    if (e <= a) return;
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x % 32 == 0)
        for (size_t s = a; s < e; s += 65536) {
            const unsigned n = static_cast<unsigned>(e - s < 65536 ? e - s : 65536);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(s), "r"(n) : "memory");
        }
#else
    for (size_t s = (a & ~size_t(127)) + (threadIdx.x % 32) * 128; s < e; s += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(s));
#endif
}

// Programmatic dependent launch (sm_90+). On a stream that launches with it (lucegen.runtime.Stream(programmatic=
// True)), a kernel's blocks may start while the kernel before it still runs: each must pass wait_for_prior_grids()
// before it touches memory that earlier kernels write or read (the wait returns once the kernel before has
// finished and its writes are visible; that one waited for its own predecessor, so all earlier kernels are done).
// Work on memory no kernel writes (weights) may come first. launch_next_grid() lets the next kernel's blocks be
// scheduled (at the latest they are when this kernel ends). Both do nothing without the launch attribute or
// before sm_90.
__device__ __forceinline__ void wait_for_prior_grids() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_next_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The start of a short kernel that has nothing to do before its inputs are ready: the next kernel may launch, and
// this one waits for the one before (the layer-by-layer decode step's kernels, each a few microseconds).
__device__ __forceinline__ void follow_prior_grids() {
    launch_next_grid();
    wait_for_prior_grids();
}

// The same, the other way round: wait for the kernel before, then let the next one launch, so that at most one kernel
// is launched ahead of the one running (the prefill's: a chain of early launches parks blocks on the SMs that a
// register- or shared-memory-hungry GEMM block then waits for). A long kernel rather lets the next one launch near
// its end: blocks launched early sit on the SMs until it ends, taking shared memory and warp slots from it.
__device__ __forceinline__ void run_after_prior_grids() {
    wait_for_prior_grids();
    launch_next_grid();
}

// Eight bf16 packed in a uint4 -> dot product with eight other bf16, accumulated in fp32.
__device__ __forceinline__ float dot8_bf16(uint4 a, uint4 b) {
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 fa = __bfloat1622float2(a2[i]);
        const float2 fb = __bfloat1622float2(b2[i]);
        acc = fmaf(fa.x, fb.x, acc);
        acc = fmaf(fa.y, fb.y, acc);
    }
    return acc;
}

// Eight fp32 values: an activation chunk staged in shared memory, the fp32 counterpart of a uint4 of eight bf16.
struct f32x8 {
    float4 lo, hi;
};

// Eight bf16 weights dot eight fp32 activations, in fp32.
__device__ __forceinline__ float dot8_bf16(uint4 w, f32x8 x) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w);
    const float2 a = __bfloat1622float2(w2[0]), b = __bfloat1622float2(w2[1]);
    const float2 c = __bfloat1622float2(w2[2]), d = __bfloat1622float2(w2[3]);
    float acc = a.x * x.lo.x;
    acc = fmaf(a.y, x.lo.y, acc);
    acc = fmaf(b.x, x.lo.z, acc);
    acc = fmaf(b.y, x.lo.w, acc);
    acc = fmaf(c.x, x.hi.x, acc);
    acc = fmaf(c.y, x.hi.y, acc);
    acc = fmaf(d.x, x.hi.z, acc);
    return fmaf(d.y, x.hi.w, acc);
}

// K fp32 values in shared memory, split into 16-byte halves so that a warp reading consecutive chunks touches
// consecutive 16-byte words (no bank conflicts): values 8c..8c+3 at quad c, values 8c+4..8c+7 at quad K/8 + c.
template <int K>
struct StagedF32 {
    static_assert(K % 8 == 0, "staged vectors are whole 8-value chunks");
    float4* quads;  // 2 * (K / 8) float4
    // The slot of values 4q..4q+3 (q < K/4).
    __device__ __forceinline__ float4& quad(int q) const { return quads[(q & 1) * (K / 8) + (q >> 1)]; }
    __device__ __forceinline__ f32x8 operator[](int c) const { return f32x8{quads[c], quads[K / 8 + c]}; }
};

// A plain fp32 row in global memory with StagedF32's quad(q) interface (the per-layer kernels' outputs).
struct GlobalQuads {
    float4* quads;
    __device__ __forceinline__ float4& quad(int q) const { return quads[q]; }
};

// Loads of data other blocks of the same launch wrote: served by L2 (the point of coherence), never by a stale L1.
__device__ __forceinline__ float4 load_coherent(const float4* p) { return __ldcg(p); }
__device__ __forceinline__ float load_coherent(const float* p) { return __ldcg(p); }

// Four fp32 values rounded to bf16 (to nearest) at y, 8-byte aligned.
__device__ __forceinline__ void store_bf16x4(bf16* y, float4 v) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(y) = make_uint2(*reinterpret_cast<const unsigned*>(&lo),
                                              *reinterpret_cast<const unsigned*>(&hi));
}

// The sum of a warp's values in a butterfly: lane l adds lane l ^ o's partial, o = 16, 8, ... down to LAST (LAST 4:
// the sums of the 8 quads, where the 4 lanes of each hold the same value, quad_sum's).
template <int LAST = 1>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o >= LAST; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of N values in one thread's registers, in warp_sum's order (lane l adds lane l + w's partial, w = N / 2,
// ..., 1): the same bits as a warp_sum of them, lane by lane (N = 32), or quad by quad (N = 8, warp_sum<4>).
// (One step a template instance: nested loops over w and l leave the inner one rolled, and v in local memory.)
template <int N, int W = N / 2>
__device__ __forceinline__ float butterfly_sum(float (&v)[N]) {
    if constexpr (W == 0) {
        return v[0];
    } else {
#pragma unroll
        for (int l = 0; l < W; ++l) v[l] += v[l + W];
        return butterfly_sum<N, W / 2>(v);
    }
}

// The sum of a quad's (4 lanes') values, (v0 + v1) + (v2 + v3), in each of its lanes (the same bits in all four).
__device__ __forceinline__ float quad_sum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// One step of warp_sums_spread: each lane keeps one half of its 2 HALF values (the upper one where its lane bit o
// is set), adds the partner's same half, and hands on the rest; then the next step.
template <int HALF, int N>
__device__ __forceinline__ void warp_sums_spread_step(float (&v)[N], int lane) {
    if constexpr (HALF >= 1) {
        constexpr int o = 32 * HALF / N;
        const int upper = lane & o ? -1 : 0;  // a mask: the selects stay in registers
#pragma unroll
        for (int i = 0; i < HALF; ++i) {
            const int lo = __float_as_int(v[i]), hi = __float_as_int(v[i + HALF]);
            const float send = __int_as_float((lo & upper) | (hi & ~upper));
            const float keep = __int_as_float((hi & upper) | (lo & ~upper));
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
        warp_sums_spread_step<HALF / 2>(v, lane);
    }
}

// N sums across the warp at once (N a power of two up to 32), each lane's v[i] added into sum i: lane l gets sum
// l / (32 / N). Each step hands half of a lane's values to the partner lane and keeps the other half, so the N
// sums take N - 1 + 5 - log2(N) shuffles where N warp_sums take 5 N. v is overwritten.
template <int N>
__device__ __forceinline__ float warp_sums_spread(float (&v)[N]) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "a power of two up to 32");
    warp_sums_spread_step<N / 2>(v, threadIdx.x % 32);
    float s = v[0];
#pragma unroll
    for (int o = 16 / N; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// N warp_sums at once, their butterflies in lockstep (each the same adds in the same order as warp_sum's, so the
// same bits): N independent shuffles a round instead of one chain after another.
template <int N>
__device__ __forceinline__ void warp_sum_each(float (&v)[N]) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
}

// warp_sum_each's sums (the same bits) in fewer shuffles where N is a power of two above 1: warp_sums_spread, then
// one shuffle a sum from a lane that holds it (N = 4: 10 shuffles against 20; a register or two more).
template <int N>
__device__ __forceinline__ void warp_sum_each_spread(float (&v)[N]) {
    if constexpr (N > 1 && N <= 32 && (N & (N - 1)) == 0) {
        const float own = warp_sums_spread(v);
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = __shfl_sync(0xffffffffu, own, i * (32 / N));
    } else {
        warp_sum_each(v);
    }
}

// N warp_sums (warp_sum_each's bits), each into one lane: put(i, sum i) runs in the lane that has sum i (SPREAD and N
// a power of two: lane 32 / N i, from warp_sums_spread alone; else lane 0, after warp_sum_each).
template <bool SPREAD, int N, class Put>
__device__ __forceinline__ void warp_sums_put(float (&v)[N], Put put) {
    const int lane = threadIdx.x % 32;
    if constexpr (SPREAD && N > 1 && N <= 32 && (N & (N - 1)) == 0) {
        const float own = warp_sums_spread(v);
        if (lane % (32 / N) == 0) put(lane / (32 / N), own);
    } else {
        warp_sum_each(v);
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < N; ++i) put(i, v[i]);
    }
}

// Sum over a block of THREADS threads; every thread gets the result. `scratch` holds THREADS/32 floats.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    constexpr int WARPS = THREADS / 32;
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < WARPS ? scratch[lane] : 0.f;
    return warp_sum(t);
}

// (value, index) pair ordered as numpy's argmax: larger value wins, the lower index breaks ties.
struct ArgMax {
    float value;
    int index;
};

// The identity of argmax_pick: loses to every value, -inf included (its index is past any real one).
__device__ __forceinline__ ArgMax argmax_none() { return ArgMax{-__int_as_float(0x7f800000), 0x7fffffff}; }

__device__ __forceinline__ ArgMax argmax_pick(ArgMax a, ArgMax b) {
    const bool take_b = b.value > a.value || (b.value == a.value && b.index < a.index);
    return take_b ? b : a;
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgMax b{__shfl_xor_sync(0xffffffffu, a.value, o), __shfl_xor_sync(0xffffffffu, a.index, o)};
        a = argmax_pick(a, b);
    }
    return a;
}

// A barrier among `threads` threads (whole warps) on named barrier `id`, and one that also returns whether any of
// them passed `p`.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ bool named_barrier_any(int id, int threads, bool p) {
    int any;
    asm volatile(
        "{\n"
        ".reg .pred p, q;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "bar.red.or.pred q, %2, %3, p;\n"
        "selp.b32 %0, 1, 0, q;\n"
        "}\n"
        : "=r"(any)
        : "r"(int(p)), "r"(id), "r"(threads)
        : "memory");
    return any != 0;
}

}  // namespace lucegen
