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
    static constexpr int TILE = 1;  // rows as they are (quant.cuh's wblock_offset)
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
        for (int i = 0; i < 8; ++i)
            w[i] = __fmul_rn(tq3_level(((lo >> (2 * i)) & 3u) | (((hi >> i) & 1u) << 2)), pc.scale);
    }
};

// ---- KV rows as the tree attention writes and reads them ----------------------------------------------------------
// A row of HD values is HD / 32 blocks of BLOCK_BYTES (bf16: 64 bytes; Q8_0 and Q4_0: gguf's blocks, written as
// gguf's quantizer writes them, bit for bit). A lane reads 8 consecutive values (chunk c: values 8c .. 8c + 7) at a
// time: load(row, c) gives the bytes (from L2: a row may have been written by this kernel), values() the floats.
// A format stores GROUP values at a time: store_block(x, dst), 32 floats into one block by one thread (GROUP 32), or
// store_group(x, dst), 128 floats into 4 blocks by a warp (TQ3_0). Formats with a scale a block (SCALED) give the
// chunk's values before it, exactly (unscaled: integers, or TQ3_0's levels), and the scale apart (scale), so that
// attention multiplies by the scale once a head rather than once a value: values() = unscaled() * scale(), in fp32.
// ROTATED rows hold R x (TQ3_0): attention rotates its queries into their domain and its outputs back
// (rotate_group).

// Two bytes from global memory through L2 (rows of Q8_0 and Q4_0 blocks are 2-byte aligned).
__device__ __forceinline__ unsigned kv_half(const unsigned char* p) {
    return __ldcg(reinterpret_cast<const unsigned short*>(p));
}

// 8 bytes at a 2-byte-aligned address from global memory through L2, as two 32-bit words.
__device__ __forceinline__ void kv_words(const unsigned char* p, unsigned (&w)[2]) { load_words_a2<2, true>(p, w); }

// A block's fp16 scale d into its first two bytes, as one 16-bit store (blocks are 2-byte aligned). (Two byte
// stores of the bits, (bits & 0xFF) and bits >> 8, were compiled by NVRTC 13 into an F2I.U8.F16 of the half's value
// for the low byte: the scale lost its low 8 bits on the H200.)
__device__ __forceinline__ void kv_store_half(unsigned char* dst, float d) {
    *reinterpret_cast<unsigned short*>(dst) = __half_as_ushort(__float2half_rn(d));
}

// A scaled format's chunk as values: its integers times its scale.
template <class KV>
__device__ __forceinline__ void kv_scaled(const typename KV::Raw& r, float (&f)[8]) {
    KV::unscaled(r, f);
    const float d = KV::scale(r);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = __fmul_rn(f[i], d);
}

struct KVBf16 {
    static constexpr bool BF16 = true, SCALED = false, ROTATED = false;
    static constexpr int BLOCK_BYTES = 64, GROUP = 32;
    struct Raw {
        uint4 w;
    };
    __device__ static Raw load(const unsigned char* row, int c) {
        return {__ldcg(reinterpret_cast<const uint4*>(row) + c)};
    }
    __device__ static void values(const Raw& r, float (&f)[8]) {
        const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&r.w);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float2 t = __bfloat1622float2(w2[e]);
            f[2 * e] = t.x;
            f[2 * e + 1] = t.y;
        }
    }
    __device__ static void store_block(const float* x, unsigned char* dst) {
        bf16* b = reinterpret_cast<bf16*>(dst);
        for (int j = 0; j < 32; ++j) b[j] = __float2bfloat16(x[j]);
    }
};

// Q8_0: [0:2] fp16 d | int8 q[32]; x = d q. Quantized as gguf does: d = max |x| / 127, q = roundf(x / d) by the
// fp32 reciprocal, d rounded to fp16 after.
struct KVQ8_0 {
    static constexpr bool BF16 = false, SCALED = true, ROTATED = false;
    static constexpr int BLOCK_BYTES = 34, GROUP = 32;
    struct Raw {
        unsigned q[2];
        float d;
    };
    __device__ static Raw load(const unsigned char* row, int c) {
        const unsigned char* block = row + c / 4 * BLOCK_BYTES;
        Raw r;
        r.d = half_to_float(kv_half(block));
        kv_words(block + 2 + 8 * (c % 4), r.q);
        return r;
    }
    __device__ static float scale(const Raw& r) { return r.d; }
    // q: each byte, xor 0x80 (q + 128), under the exponent of 2^23, less 2^23 + 128 (byte_minus)
    __device__ static void unscaled(const Raw& r, float (&f)[8]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = byte_minus(r.q[i / 4] ^ 0x80808080u, i % 4, MAGIC_U_VALUE + 128.f);
    }
    __device__ static void values(const Raw& r, float (&f)[8]) { kv_scaled<KVQ8_0>(r, f); }
    __device__ static void store_block(const float* x, unsigned char* dst) {
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
        const float d = __fdiv_rn(amax, 127.f), id = d == 0.f ? 0.f : __frcp_rn(d);
        kv_store_half(dst, d);
        for (int j = 0; j < 32; ++j)
            dst[2 + j] = static_cast<unsigned char>(static_cast<signed char>(roundf(__fmul_rn(x[j], id))));
    }
};

// Q4_0: [0:2] fp16 d | 16 bytes, value j in the low nibble of byte j and value j + 16 in its high nibble; x = d (q -
// 8). Quantized as gguf does: d = (the value of largest magnitude, the first of equals) / -8, q = trunc(x / d + 8.5)
// by the fp32 reciprocal, at most 15, d rounded to fp16 after.
struct KVQ4_0 {
    static constexpr bool BF16 = false, SCALED = true, ROTATED = false;
    static constexpr int BLOCK_BYTES = 18, GROUP = 32;
    struct Raw {
        unsigned q[2];
        float d;
        int shift;  // 0: the low nibbles (values 0-15 of the block), 4: the high ones
    };
    __device__ static Raw load(const unsigned char* row, int c) {
        const unsigned char* block = row + c / 4 * BLOCK_BYTES;
        Raw r;
        r.d = half_to_float(kv_half(block));
        kv_words(block + 2 + 8 * (c % 2), r.q);
        r.shift = c % 4 / 2 * 4;
        return r;
    }
    __device__ static float scale(const Raw& r) { return r.d; }
    // q - 8: each nibble (moved to the low one) under the exponent of 2^23, less 2^23 + 8
    __device__ static void unscaled(const Raw& r, float (&f)[8]) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            f[i] = byte_minus((r.q[i / 4] >> r.shift) & 0x0F0F0F0Fu, i % 4, MAGIC_U_VALUE + 8.f);
    }
    __device__ static void values(const Raw& r, float (&f)[8]) { kv_scaled<KVQ4_0>(r, f); }
    __device__ static void store_block(const float* x, unsigned char* dst) {
        float m = x[0];
        for (int j = 1; j < 32; ++j)
            if (fabsf(x[j]) > fabsf(m)) m = x[j];
        const float d = __fdiv_rn(m, -8.f), id = d == 0.f ? 0.f : __frcp_rn(d);
        kv_store_half(dst, d);
        const auto q = [&](int j) {
            return min(15u, static_cast<unsigned>(truncf(__fadd_rn(__fmul_rn(x[j], id), 8.5f))));
        };
        for (int j = 0; j < 16; ++j) dst[2 + j] = static_cast<unsigned char>(q(j) | q(j + 16) << 4);
    }
};

// TQ3_0 rows (kvformats.py; the block layout of FmtTQ3_0 above). A warp holds a 128-value group, lane l its values
// 4l .. 4l + 3.

// The lane's coordinates of v negated where their bits of the 128-bit mask (lo: bits 0-63) are set.
__device__ __forceinline__ void tq3_signs(unsigned long long lo, unsigned long long hi, float (&v)[4]) {
    const int lane = threadIdx.x % 32;
    const unsigned bits = static_cast<unsigned>((lane < 16 ? lo : hi) >> (4 * (lane % 16)));
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(__float_as_uint(v[i]) ^ ((bits >> i & 1u) << 31));
}

// v = H v / sqrt(128), H the Walsh-Hadamard matrix in Sylvester's order (H[i][j] = (-1)^popcount(i & j), as
// kvformats' _hadamard): the butterflies of index bits 0-1 in the lane, of bits 2-6 across lanes.
__device__ __forceinline__ void tq3_hadamard(float (&v)[4]) {
    const int lane = threadIdx.x % 32;
    const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    v[0] = a0 + a2, v[1] = a1 + a3, v[2] = a0 - a2, v[3] = a1 - a3;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float o = __shfl_xor_sync(0xFFFFFFFFu, v[i], m);
            v[i] = lane & m ? o - v[i] : v[i] + o;
        }
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= 0.0883883476483184405f;  // 1 / sqrt(128)
}

// v = R v = D2 H D1 v, or with INVERSE R^T v = D1 H D2 v (warp-wide).
template <bool INVERSE>
__device__ __forceinline__ void tq3_rotate(float (&v)[4]) {
    if constexpr (INVERSE) tq3_signs(TQ3_SIGNS2[0], TQ3_SIGNS2[1], v);
    else tq3_signs(TQ3_SIGNS1[0], TQ3_SIGNS1[1], v);
    tq3_hadamard(v);
    if constexpr (INVERSE) tq3_signs(TQ3_SIGNS1[0], TQ3_SIGNS1[1], v);
    else tq3_signs(TQ3_SIGNS2[0], TQ3_SIGNS2[1], v);
}

// The edges between the positive levels' cells: (level i-1 + level i) / 2.
constexpr float TQ3_EDGE1 = (TQ3_LEVEL0 + TQ3_LEVEL1) * 0.5f, TQ3_EDGE2 = (TQ3_LEVEL1 + TQ3_LEVEL2) * 0.5f;
constexpr float TQ3_EDGE3 = (TQ3_LEVEL2 + TQ3_LEVEL3) * 0.5f;

struct KVTQ3_0 {
    static constexpr bool BF16 = false, SCALED = true, ROTATED = true;
    static constexpr int BLOCK_BYTES = 14, GROUP = 128;
    struct Raw {
        unsigned lo, hi;  // the low index bits of the chunk's values (2 each), their high bits (1 each)
        float d;
    };
    __device__ static Raw load(const unsigned char* row, int c) {  // chunk c = run c % 4 of block c / 4
        const unsigned char* block = row + c / 4 * BLOCK_BYTES;
        const int r = c % 4;
        return {kv_half(block + 2 + 2 * r), kv_half(block + 10 + (r & ~1)) >> (8 * (r & 1)) & 0xFFu,
                half_to_float(kv_half(block))};
    }
    __device__ static float scale(const Raw& r) { return r.d; }
    __device__ static void unscaled(const Raw& r, float (&f)[8]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = tq3_level((r.lo >> (2 * i) & 3u) | (r.hi >> i & 1u) << 2);
    }
    __device__ static void values(const Raw& r, float (&f)[8]) { kv_scaled<KVTQ3_0>(r, f); }

    // A group of 128 floats in shared memory rotated in place (INVERSE: back), warp-wide.
    template <bool INVERSE>
    __device__ static void rotate_group(float* x) {
        const int lane = threadIdx.x % 32;
        const float4 t = reinterpret_cast<const float4*>(x)[lane];
        float v[4] = {t.x, t.y, t.z, t.w};
        tq3_rotate<INVERSE>(v);
        reinterpret_cast<float4*>(x)[lane] = make_float4(v[0], v[1], v[2], v[3]);
    }

    // The group x (128 floats) into its 4 blocks at dst, warp-wide, as kvformats' encoder: the nearest levels of the
    // rotated unit vector R x / |x| (an edge goes to the lower cell), and the scale |x| / |c| (c the chosen levels)
    // in every block. In fp32 where the reference works in float64: a value within rounding of an edge may take the
    // other cell, and the fp16 scale may differ in its last bit.
    __device__ static void store_group(const float* x, unsigned char* dst) {
        const int lane = threadIdx.x % 32;
        float v[4], ss = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = x[4 * lane + i];
            ss = fmaf(v[i], v[i], ss);
        }
        const float norm = sqrtf(warp_sum(ss)), inv = norm > 0.f ? 1.f / norm : 0.f;
        tq3_rotate<false>(v);
        unsigned lo = 0, hi = 0;
        float cc = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float u = v[i] * inv, a = fabsf(u);
            const unsigned idx = u > 0.f ? 4u + (a > TQ3_EDGE1) + (a > TQ3_EDGE2) + (a > TQ3_EDGE3)
                                         : 3u - (a >= TQ3_EDGE1) - (a >= TQ3_EDGE2) - (a >= TQ3_EDGE3);
            const float c = tq3_level(idx);
            cc = fmaf(c, c, cc);
            lo |= (idx & 3u) << (2 * i);
            hi |= (idx >> 2) << i;
        }
        const float scale = norm / sqrtf(warp_sum(cc));
        const unsigned pair = __shfl_xor_sync(0xFFFFFFFFu, hi, 1);
        unsigned char* block = dst + lane / 8 * BLOCK_BYTES;  // values 4l .. 4l + 3: block l / 8, j = 4 (l % 8) + i
        block[2 + lane % 8] = static_cast<unsigned char>(lo);
        if (lane % 2 == 0) block[10 + lane % 8 / 2] = static_cast<unsigned char>(hi | pair << 4);
        if (lane % 8 == 0) kv_store_half(block, scale);
    }
};

// Row (kv head g, position p) of a layer's cache in format KV: HD values a row, NKV rows a position.
template <class KV, int NKV, int HD>
__device__ __forceinline__ size_t kv_row(int g, int p) {
    return ((size_t)p * NKV + g) * (HD / 32 * KV::BLOCK_BYTES);
}

}  // namespace lucegen
