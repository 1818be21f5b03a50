// kv.cuh: KV-cache rows as attention reads them (lucegen/model/kvformats.py holds the formats and their numpy
// reference). bf16, Q8_0 and Q4_0 rows are quant.cuh's FmtBf16, FmtQ8_0 and FmtQ4_0 (the same blocks along
// head_dim); TQ3_0 is FmtTQ3_0 below, with the same piece interface.
//
// TQ3_0 is read in the rotated domain: a 32-value block decodes to level[index] * scale, the values of R x / |x| *
// |x| where R = D2 H D1 (H the 128-point Walsh-Hadamard transform / sqrt(128), D1 and D2 the sign flips
// TQ3_SIGNS1 and TQ3_SIGNS2, bit i set: coordinate i negated). Attention rotates each query group once
// (q.k = (R q).(R k)) and rotates each output group back once (sum p v = R^T sum p (R v)).
#pragma once
#include "quant.cuh"

namespace lucegen {

// The positive Lloyd-Max levels of kvformats.TQ3_LEVELS (exact float32 bits); index i < 4 is -level[3 - i],
// i >= 4 is level[i - 4].
constexpr float TQ3_LEVEL0 = 0x1.61f70cp-6f, TQ3_LEVEL1 = 0x1.10bc12p-4f;
constexpr float TQ3_LEVEL2 = 0x1.e3e688p-4f, TQ3_LEVEL3 = 0x1.81d662p-3f;
// kvformats.SIGNS1 / SIGNS2, as (bits 0-63, bits 64-127).
constexpr unsigned long long TQ3_SIGNS1[2] = {0x231090c29bb2f362ull, 0x95c35f51021a15caull};
constexpr unsigned long long TQ3_SIGNS2[2] = {0xa553b5068c4a43beull, 0x80f33b8793f83731ull};

__device__ __forceinline__ float tq3_level(unsigned i) {
    const unsigned m = (i & 3u) ^ (i & 4u ? 0u : 3u);  // magnitude rank
    const float a = m == 0 ? TQ3_LEVEL0 : m == 1 ? TQ3_LEVEL1 : m == 2 ? TQ3_LEVEL2 : TQ3_LEVEL3;
    return i & 4u ? a : -a;
}

// [0:2] fp16 scale | [2:10] low index bits, value j at bits 2(j%4) of byte j/4 | [10:14] high bits, value j at
// bit j%8 of byte j/8. One piece per block; run r = values 8r .. 8r+7.
struct FmtTQ3_0 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = 14, PIECES = 1, RUNS = 4;
    static constexpr bool ALIGNED16 = false;
    __host__ __device__ static constexpr int voff(int, int r) { return 8 * r; }
    struct Piece {
        unsigned lo[2], hi[1];
        float scale;
    };
    __device__ static Piece load(const unsigned char* block, int) {
        Piece pc;
        pc.scale = half_to_float(*reinterpret_cast<const unsigned short*>(block));
        load_words_a2<2>(block + 2, pc.lo);
        load_words_a2<1>(block + 10, pc.hi);
        return pc;
    }
    __device__ static void run(const Piece& pc, int r, float (&w)[8]) {
        const unsigned lo = (pc.lo[r / 2] >> (16 * (r % 2))) & 0xFFFFu, hi = (pc.hi[0] >> (8 * r)) & 0xFFu;
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = __fmul_rn(tq3_level(((lo >> (2 * i)) & 3u) | (((hi >> i) & 1u) << 2)), pc.scale);
    }
};

}  // namespace lucegen
