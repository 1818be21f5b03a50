// quant.cuh: GGUF weight blocks decoded to fp32, bit-equal to lucegen/model/quants.py (and the gguf package).
//
// The block layouts are the ones in quants.py's docstring, but Q6_K's: the GPU holds its blocks repacked in pairs
// (lucegen/kernels/repack.py, FmtQ6_K below). Every format is read in *pieces*: a piece is what one
// lane decodes at once, RUNS runs of 8 consecutive values of one block (the piece's bytes, its scales). A format F
// gives
//   F::BLOCK_VALUES, F::BLOCK_BYTES, F::PIECES (pieces per block), F::RUNS (runs per piece),
//   F::ROW_VALUES       rows are a multiple of this many values (BLOCK_VALUES, or a half pair: row_bytes below),
//   F::ALIGNED16        every block starts on a 16-byte boundary (so do rows and slices of whole blocks),
//   F::TILE             rows a tile of the matrix as the GPU holds it (WTILE for the F::MMA formats, else 1:
//                       wblock_offset below),
//   F::voff(p, r)       the offset in the block of the first of the 8 values of run r of piece p,
//   F::load(block, p)   the piece's bytes and scales (block: any generic pointer, 2-byte aligned at least),
//   F::Lane, F::lane(block, p), F::load(lane, delta)
//                       the same in two steps, for a lane that reads piece p of many blocks: what its loads have
//                       in common, made once at one of them, then each block delta bytes further (a multiple of 4),
//   F::run(piece, r, w) the run's 8 values,
//   F::XB               bytes of activations per block, as the products read them (below),
//   F::dot(piece, x, acc) acc with the piece's contribution to a dot product with activations x added (the
//                       piece's XB / PIECES bytes, at p XB / PIECES in the block's XB).
// Per value the decode gives the bits numpy gives in quants.py, signed zeros included: fl(d * q) (Q8_0, Q4_0),
// fl(fl(d * sc) * q) (Q6_K), fl(fl(fl(d * sc) * q) - fl(dmin * m)) (Q4_K, Q5_K; one FFMA, see FmtK4::run). The
// _rn intrinsics pin each rounding, so --use_fast_math cannot fuse or reorder them.
//
// Products. bf16 rows multiply fp32 activations (XB = 32: the block's 8 floats) in fp32, in dot8_bf16's order.
// The quantized formats multiply activations quantized to 8 bits per 32 values (XBlock, as llama.cpp's q8_1),
// a piece (32 values: one activation block) at a time: an integer dot product u (dp4a), then in fp32 the sum acc
// it goes into takes it (group_acc):
//   acc = fl(acc + fl(dx * fl(a * u)))          (Q8_0: u = sum of q qx, a = d;
//                                               Q6_K: u = sum of sc (q - 32) qx, its int8 scales inside, a = d:
//                                               the GEMV's bytes hold q, the XBlock's half sums take 32 qx back
//                                               off; the tensor cores' bytes hold q - 32)
//   acc = fma(-b, dxv, fma(a, fl(dx * u), acc)) (the formats with mins, Q4_K, Q5_K: u = sum of q qx, a = fl(d sc),
//                                               b = fl(dmin m); Q4_0: u = sum of q qx, a = d, b = 8 d, its offset;
//                                               dxv = fl(dx * v), v the sum of the qx: the XBlock holds it)
// QuadSums<F> (F::QUAD_SUMS) sums by quads of lanes instead (the lanes 4q .. 4q+3 of a warp, qgemv.cuh): each lane
// makes its piece's term as above from acc = 0, the quad adds the four pairwise, (t0 + t1) + (t2 + t3), and that
// into its running sum, slice by slice; the warp's sum then adds the 8 quads'. A tensor-core thread holds a quad's 4
// pieces, so it keeps one sum an output instead of four: Q4_K's, where the verify GEMM is the mma one
// (lucegen/kernels/qgemv.py's sums_by_quads).
// Every integer is exact and below 2^24, so its conversion to float is too. With the fused multiply-adds the
// formats with mins take four instructions a piece and activation row (a conversion, a multiply, two FMAs) where a
// term fl(dx * fl(fl(a * u) - fl(b * v))) added to acc took seven. The others would save one of four: not worth
// it, since it costs the h200 spec's dp4a Q6_K GEMM 12 bytes of spills. lucegen/kernels/qgemv.py emulates this in
// numpy bit for bit (PieceFactors.accumulate, emulate).
//
// Tensor cores (Q4_K, Q6_K: F::MMA). The GEMM of a tree verify takes u from int8 mma instead of dp4a: the same
// integer. A format then gives
//   F::MmaRaw, F::mma_raw(block, q, t) what thread t (mma.cuh's fragments) loads of the block for its pieces
//                                      4q .. 4q+3 (a quad),
//   F::mma_piece(raw, q, c, quad, lo, hi, sc) piece 4q + c from that: its values 4t .. 4t+3 (lo) and 16+4t ..
//                                      16+4t+3 (hi) as bytes (an A fragment's words for one row) and its F::Scale
//                                      (quad: the first of the 4 lanes that hold the row, lane & ~3: they may
//                                      pass scales round),
//   F::SPLIT                           whether u needs the dots of the two halves (values 0-15, 16-31) apart,
//   F::mma_term(acc, scale, dlo, dhi, meta) acc with the piece's term added, from the dots of mma_piece's
//                                      halves with the XBlock (meta: XBlock::meta): F::term, where mma_piece's
//                                      bytes are the GEMV's (F::dot adds its term through F::term); Q6_K's are
//                                      q - 32 as signed bytes, so its u needs no half sums: two multiply-adds,
//                                      not four, the same integer.
#pragma once
#include <cuda_fp16.h>

#include "common.cuh"

namespace lucegen {

// ---- small integers to float without an int-to-float conversion ------------------------------------------------
// The float with the bits 0x4B0000bb is 2^23 + bb (byte bb): one PRMT puts byte i of a word under that exponent,
// and subtracting 2^23 + bias (exact: both lie in [2^23, 2^24)) leaves bb - bias as a float, exactly: two
// instructions instead of an I2F and the shifts and masks that would isolate the byte for it (an I2F issues at half
// the FFMA's rate on the H100, as an IMAD does: tools/pipe_rates.py, session 52). Words are masked (and shifted)
// first so that each byte holds one value.
constexpr unsigned MAGIC_U = 0x4B000000u;
constexpr float MAGIC_U_VALUE = 8388608.f;  // 2^23

__device__ __forceinline__ float byte_minus(unsigned word, int i, float magic_plus_bias) {
    return __fsub_rn(__uint_as_float(__byte_perm(word, MAGIC_U, 0x7440u | static_cast<unsigned>(i))), magic_plus_bias);
}

// An unsigned integer u < 2^23 as a float (scales and mins: once per piece).
__device__ __forceinline__ float uint_to_float(unsigned u) {
    return __fsub_rn(__uint_as_float(MAGIC_U | u), MAGIC_U_VALUE);
}

__device__ __forceinline__ float half_to_float(unsigned bits16) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
}

// N little-endian 32-bit words starting at a 2-byte aligned address: N + 1 aligned loads funnel-shifted into place
// when the address is 2 mod 4 (and no load past the last byte when it is 0 mod 4).
// THROUGH_L2: global memory by ld.global.cg (bytes this kernel may have written).
template <int N, bool THROUGH_L2 = false>
__device__ __forceinline__ void load_words_a2(const unsigned char* p, unsigned (&w)[N]) {
    const unsigned mis = reinterpret_cast<size_t>(p) & 2u;  // pointer arithmetic keeps p's address space (LDS)
    const unsigned* a = reinterpret_cast<const unsigned*>(p - mis);
    const unsigned shift = mis * 8u;
    const auto word = [&](int i) {
        if constexpr (THROUGH_L2) return __ldcg(a + i);
        else return a[i];
    };
    unsigned lo = word(0);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const unsigned hi = (i + 1 < N || shift) ? word(i + 1) : 0u;
        w[i] = __funnelshift_r(lo, hi, shift);
        lo = hi;
    }
}

// 8 decoded weights dot 8 activations in fp32, in dot8_bf16's order.
__device__ __forceinline__ float dot8(const float (&w)[8], f32x8 x) {
    float acc = w[0] * x.lo.x;
    acc = fmaf(w[1], x.lo.y, acc);
    acc = fmaf(w[2], x.lo.z, acc);
    acc = fmaf(w[3], x.lo.w, acc);
    acc = fmaf(w[4], x.hi.x, acc);
    acc = fmaf(w[5], x.hi.y, acc);
    acc = fmaf(w[6], x.hi.z, acc);
    return fmaf(w[7], x.hi.w, acc);
}

// ---- activations quantized per 32 values ----------------------------------------------------------------------
// qx = rint(x * fl(1 / dx)) with dx = fl(max|x| / 127) (qx = 0 where dx = 0), fl(dx * v) for v the sum of the 32
// qx (the K-quants' mins multiply it) and the sums of each half of 16 (Q6_K's offset of 32 multiplies them: its two
// scales split a piece in halves; together they are v, which Q4_0's offset multiplies). 48 bytes, so that a row of
// them is whole 16-byte words. (A block whose max|x| is below 2^-119 has a subnormal dx, flushed to 0 under
// --use_fast_math: its qx are 0, not numpy's.)
struct alignas(16) XBlock {
    int q[8];  // 32 int8, little-endian in 8 words
    float d;
    float dv;  // fl(d * (qx[0] + ... + qx[31]))
    int h[2];  // qx[0] + ... + qx[15], qx[16] + ... + qx[31]
    // Vector loads: qx words 4i .. 4i+3, words 2i, 2i+1, and {d's bits, dv's bits, h[0], h[1]}.
    __device__ int4 quad(int i) const { return reinterpret_cast<const int4*>(q)[i]; }
    __device__ int2 pair(int i) const { return reinterpret_cast<const int2*>(q)[i]; }
    __device__ int4 meta() const { return *reinterpret_cast<const int4*>(&d); }
};
static_assert(sizeof(XBlock) == 48, "XBlock is three 16-byte words");

// The rounding an XBlock is made of, shared by its two quantizers so that they give the same bytes: the scale d of a
// block whose max |x| is amax, and 1 / d (0 for a block of zeros); four values at that inverse scale as a word of
// signed bytes (value i in byte i), their sum added to `sum`; dv from d and the block's sum.
struct XBlockScale {
    float d, inv;
    __device__ explicit XBlockScale(float amax) : d(__fdiv_rn(amax, 127.f)), inv(d == 0.f ? 0.f : __fdiv_rn(1.f, d)) {}
    __device__ unsigned word(float4 v, int& sum) const {
        const float f[4] = {v.x, v.y, v.z, v.w};
        unsigned w = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = __float2int_rn(__fmul_rn(f[i], inv));
            sum += q;
            w |= (static_cast<unsigned>(q) & 0xFFu) << (8 * i);
        }
        return w;
    }
    __device__ float dv(int sum) const { return __fmul_rn(d, static_cast<float>(sum)); }
};

__device__ __forceinline__ float abs_max4(float4 v) {
    return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
}

// 32 fp32 values (16-byte aligned) -> their XBlock.
__device__ __forceinline__ XBlock quantize_xblock(const float* x) {
    float4 v[8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = reinterpret_cast<const float4*>(x)[i];
        amax = fmaxf(amax, abs_max4(v[i]));
    }
    const XBlockScale sc(amax);
    XBlock b;
    b.d = sc.d;
    b.h[0] = b.h[1] = 0;
#pragma unroll
    for (int w = 0; w < 8; ++w) b.q[w] = static_cast<int>(sc.word(v[w], b.h[w / 4]));
    b.dv = sc.dv(b.h[0] + b.h[1]);
    return b;
}

// The XBlock of 32 values that 8 consecutive lanes of a warp hold as float4s (lane l: values 4 (l % 8) .. +3), by
// quantize_xblock's arithmetic (so the same bytes), the max and the half sums passed round by shuffles: a row kernel
// quantizes its output from its registers, without writing it, waiting at a block barrier and reading it back.
// Every lane of the warp calls it. Lane l gets word l % 8 of the block's q, and its {d, dv, h[0], h[1]}.
struct XBlockLanes {
    unsigned word;
    int4 meta;
    __device__ void store(XBlock* xb, int lane) const {  // 8 lanes write the block's 32 bytes of q, one its meta
        reinterpret_cast<unsigned*>(xb->q)[lane % 8] = word;
        if (lane % 8 == 0) *reinterpret_cast<int4*>(&xb->d) = meta;
    }
};

__device__ __forceinline__ XBlockLanes quantize_xblock_lanes(float4 v, int lane) {
    float amax = abs_max4(v);
#pragma unroll
    for (int o = 1; o < 8; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const XBlockScale sc(amax);
    XBlockLanes out;
    int half = 0;  // this lane's 4, then its half's 16
    out.word = sc.word(v, half);
    half += __shfl_xor_sync(0xFFFFFFFFu, half, 1);
    half += __shfl_xor_sync(0xFFFFFFFFu, half, 2);
    const int other = __shfl_xor_sync(0xFFFFFFFFu, half, 4);
    const int h0 = lane % 8 < 4 ? half : other, h1 = lane % 8 < 4 ? other : half;
    out.meta = make_int4(__float_as_int(sc.d), __float_as_int(sc.dv(h0 + h1)), h0, h1);
    return out;
}

// The XBlocks of activation rows as the quantized products read them: in groups of XGROUP rows (an mma n-tile), in
// a group slice by slice (XSLICE XBlocks, 1,024 values: a slice of every quantized format's GEMV, qgemv.cuh), in a
// slice row by row, each row's XBlocks in a slot of XSLOT (the last one unused). So the verify GEMM copies an
// n-tile's activations of a slice as one run of bytes, rows lie an odd number of 16-byte words apart in it (an mma
// fragment's 8 rows in 8 different bank groups), and where a row lies depends on its width alone, not on how many
// rows there are. lucegen/kernels/qgemv.py's xblock_index is the same.
constexpr int XGROUP = 8, XSLICE = 32, XSLOT = 33;
static_assert(XSLOT * sizeof(XBlock) / 16 % 2 == 1, "a slot is an odd number of 16-byte words");
// Row m's XBlock kb, in rows of `slices` slices.
__host__ __device__ constexpr long long xblock_index(int m, int kb, int slices) {
    return (((long long)(m / XGROUP) * slices + kb / XSLICE) * XGROUP + m % XGROUP) * XSLOT + kb % XSLICE;
}

// One row's XBlocks in that layout (p, its first: null for none), for the kernels that quantize a row at a time.
struct XRow {
    XBlock* p;
    __device__ XBlock* at(int kb) const { return p + kb / XSLICE * (XGROUP * XSLOT) + kb % XSLICE; }
};
__device__ __forceinline__ XRow xrow(XBlock* xq, int m, int row_blocks) {  // row m of rows of row_blocks XBlocks
    return {xq ? xq + xblock_index(m, 0, (row_blocks + XSLICE - 1) / XSLICE) : nullptr};
}

// The sum of the products of the signed bytes of words w[i] and x[i].
template <int N>
__device__ __forceinline__ int dot_words(const unsigned (&w)[N], const int (&x)[N]) {
    int u = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) u = __dp4a(static_cast<int>(w[i]), x[i], u);
    return u;
}
__device__ __forceinline__ int dot_words(const unsigned (&w)[4], int4 x) { return dot_words(w, {x.x, x.y, x.z, x.w}); }

// acc = fl(acc + fl(dx * fl(a * u))) and acc = fma(-b, dxv, fma(a, fl(dx * u), acc)): a group added to a sum (see
// the top).
__device__ __forceinline__ float group_acc(float acc, float dx, float a, int u) {
    return __fadd_rn(acc, __fmul_rn(dx, __fmul_rn(a, static_cast<float>(u))));
}
__device__ __forceinline__ float group_acc(float acc, float dx, float a, int u, float b, float dxv) {
    return __fmaf_rn(-b, dxv, __fmaf_rn(a, __fmul_rn(dx, static_cast<float>(u)), acc));
}

// F::Lane of the formats that need nothing more than the block and the piece.
struct BlockLane {
    const unsigned char* block;
    int p;
};

// The bytes of a row of K values (K a multiple of F::ROW_VALUES): whole blocks, the last one half filled where a row
// of Q6_K holds an odd number of GGUF blocks (its pieces past K read zeros, and the products skip them).
template <class F>
__host__ __device__ constexpr long long row_bytes(long long K) {
    return (K + F::BLOCK_VALUES - 1) / F::BLOCK_VALUES * F::BLOCK_BYTES;
}

// A weight matrix as the GPU holds it: its rows in tiles of F::TILE (the last one filled up with rows of zeros),
// a tile block by block: block kb of every row of the tile, then block kb + 1. F::TILE is 1 (plain rows) but for the
// formats the verify GEMM takes on tensor cores (F::MMA), WTILE, an mma row tile: so one bulk copy moves a tile's
// slice into shared memory, where its rows lie BLOCK_BYTES apart (144, 432: a fragment's 8 rows in 8 bank groups,
// unpadded), and the decode GEMV reads each block where it read it before, only a tile's blocks further on
// (results/logs/h100-s36-run4-tiled-gemv-timing.txt: no slower). kernels/qgemv.py's tile_rows is the same.
// Bytes from the matrix's start to row n's block kb, in rows of K values:
constexpr int WTILE = 16;
template <class F>
__host__ __device__ constexpr long long wblock_offset(int n, int kb, long long K) {
    const unsigned r = static_cast<unsigned>(n);  // (n >= 0: a shift and a mask)
    return r / F::TILE * F::TILE * row_bytes<F>(K) +
           static_cast<long long>(kb * F::TILE + r % F::TILE) * F::BLOCK_BYTES;
}

// ---- bf16: 8 values per 16-byte "block", one piece, one run ---------------------------------------------------
struct FmtBf16 {
    static constexpr int BLOCK_VALUES = 8, BLOCK_BYTES = 16, PIECES = 1, RUNS = 1, ROW_VALUES = BLOCK_VALUES;
    static constexpr bool ALIGNED16 = true, QUAD_SUMS = false;
    static constexpr int TILE = 1;
    __host__ __device__ static constexpr int voff(int, int) { return 0; }
    using Lane = BlockLane;
    __device__ static Lane lane(const unsigned char* block, int p) { return {block, p}; }
    struct Piece {
        uint4 v;
    };
    __device__ static Piece load(const unsigned char* block, int) { return {*reinterpret_cast<const uint4*>(block)}; }
    __device__ static Piece load(const Lane& ln, long long delta) { return load(ln.block + delta, ln.p); }
    __device__ static void run(const Piece& pc, int, float (&w)[8]) {
        const unsigned u[4] = {pc.v.x, pc.v.y, pc.v.z, pc.v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = __uint_as_float(u[i] << 16);
            w[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
        }
    }
    static constexpr int XB = 32;
    __device__ static float dot(const Piece& pc, const unsigned char* xb, float acc) {
        float w[8];
        run(pc, 0, w);
        const float4* x = reinterpret_cast<const float4*>(xb);
        return __fadd_rn(acc, dot8(w, f32x8{x[0], x[1]}));
    }
};

// ---- Q8_0 and Q4_0: one 32-value piece a block, [0:2] the fp16 d, then WORDS words of quants (2-byte aligned) --
template <int BYTES, int WORDS>
struct FmtD32 {
    static constexpr int BLOCK_VALUES = 32, BLOCK_BYTES = BYTES, PIECES = 1, RUNS = 4, ROW_VALUES = BLOCK_VALUES;
    static constexpr bool ALIGNED16 = false, QUAD_SUMS = false;
    static constexpr int TILE = 1;
    static constexpr int XB = sizeof(XBlock);
    __host__ __device__ static constexpr int voff(int, int r) { return 8 * r; }
    using Lane = BlockLane;
    __device__ static Lane lane(const unsigned char* block, int p) { return {block, p}; }
    struct Piece {
        unsigned q[WORDS];
        float d;
    };
    __device__ static Piece load(const unsigned char* block, int) {
        Piece pc;
        pc.d = half_to_float(*reinterpret_cast<const unsigned short*>(block));
        load_words_a2<WORDS>(block + 2, pc.q);
        return pc;
    }
    __device__ static Piece load(const Lane& ln, long long delta) { return load(ln.block + delta, ln.p); }
};

// Q8_0: [0:2] d | [2:34] int8 qs[32]; x[j] = d * qs[j]. Run r = values 8r .. 8r+7.
struct FmtQ8_0 : FmtD32<34, 8> {
    __device__ static void run(const Piece& pc, int r, float (&w)[8]) {
        const unsigned w0 = pc.q[2 * r] ^ 0x80808080u, w1 = pc.q[2 * r + 1] ^ 0x80808080u;  // bytes q + 128
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = __fmul_rn(byte_minus(i < 4 ? w0 : w1, i % 4, MAGIC_U_VALUE + 128.f), pc.d);
    }
    __device__ static float dot(const Piece& pc, const unsigned char* xb, float acc) {  // one group: the block
        const XBlock& x = *reinterpret_cast<const XBlock*>(xb);
        const unsigned lo[4] = {pc.q[0], pc.q[1], pc.q[2], pc.q[3]}, hi[4] = {pc.q[4], pc.q[5], pc.q[6], pc.q[7]};
        return group_acc(acc, x.d, pc.d, dot_words(lo, x.quad(0)) + dot_words(hi, x.quad(1)));
    }
};

// Q4_0: [0:2] d | [2:18] qs[16]; x[j] = d * ((qs[j] & 0xF) - 8), x[j+16] = d * ((qs[j] >> 4) - 8). Run r: the low
// (r < 2) or high nibbles of bytes 8(r%2) .. 8(r%2)+7 = values 8r .. 8r+7.
struct FmtQ4_0 : FmtD32<18, 4> {
    __device__ static void run(const Piece& pc, int r, float (&w)[8]) {
        const unsigned w0 = (pc.q[2 * (r % 2)] >> (4 * (r / 2))) & 0x0F0F0F0Fu;
        const unsigned w1 = (pc.q[2 * (r % 2) + 1] >> (4 * (r / 2))) & 0x0F0F0F0Fu;
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = __fmul_rn(pc.d, byte_minus(i < 4 ? w0 : w1, i % 4, MAGIC_U_VALUE + 8.f));
    }
    // One group: the block. The offset of 8 as a min: d (q - 8) = d q - 8 d, and 8 d is exact.
    __device__ static float dot(const Piece& pc, const unsigned char* xb, float acc) {
        const XBlock& x = *reinterpret_cast<const XBlock*>(xb);
        unsigned lo[4], hi[4];  // values 0-15, 16-31
#pragma unroll
        for (int i = 0; i < 4; ++i) lo[i] = pc.q[i] & 0x0F0F0F0Fu, hi[i] = (pc.q[i] >> 4) & 0x0F0F0F0Fu;
        const int u = dot_words(lo, x.quad(0)) + dot_words(hi, x.quad(1));
        return group_acc(acc, x.d, pc.d, u, __fmul_rn(8.f, pc.d), x.dv);
    }
};

// ---- Q4_K / Q5_K: [0:2] d | [2:4] dmin | [4:16] scales[12] | (Q5_K: [16:48] qh[32]) | qs[128] ---------------
// Sub-block j (32 values) has a 6-bit scale sc and min m (get_scale_min_k4); x = fl(fl(d*sc) * q - fl(dmin*m)).
// Piece p (8 per block) = sub-block p: the low (p even) or high nibbles of qs bytes 32c .. 32c+31 (c = p/2); run r =
// values 32p + 8r .. +7 = the nibbles of bytes 32c + 8r .. +7. Q5_K's fifth bit of value 32j + i is bit j of qh[i].
// Sub-block j's sc and m, as a word: sc in byte 0, m in byte 1. Branch-free: bytes j % 4 of h.y, h.z, h.w (scales
// 0-3, 4-7, 8-11; h.x holds d and dmin) are A, B, C, and sc, m = A & 63, B & 63 for j < 4, else
// (C & 15) | (A >> 6) << 4, (C >> 4) | (B >> 6) << 4.
__device__ __forceinline__ unsigned scale_min_k4(int j, const uint4& h) {
    const unsigned i = static_cast<unsigned>(j) & 3u;
    const unsigned ab = __byte_perm(h.y, h.z, i | ((i + 4u) << 4));  // byte 0: A, byte 1: B
    const unsigned cc = __byte_perm(h.w, 0u, i | (i << 4));           // bytes 0, 1: C
    const unsigned high = (cc & 0x000Fu) | ((cc >> 4) & 0x0F00u) | ((ab >> 2) & 0x3030u);
    return j < 4 ? ab & 0x3F3Fu : high;
}

template <bool Q5>
struct FmtK4 {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = Q5 ? 176 : 144, PIECES = 8, RUNS = 4, ROW_VALUES = 256;
    static constexpr bool ALIGNED16 = true, QUAD_SUMS = false;
    static constexpr int TILE = Q5 ? 1 : WTILE;  // F::MMA's
    static constexpr int QS = Q5 ? 48 : 16;  // byte offset of qs in the block
    __host__ __device__ static constexpr int voff(int p, int r) { return 32 * p + 8 * r; }
    using Lane = BlockLane;
    __device__ static Lane lane(const unsigned char* block, int p) { return {block, p}; }
    struct Piece {
        // the 32 values q, one per byte, except Q4_K's odd pieces: there the bytes keep their high nibble in
        // place, xor 0x80, so that a byte is 16 q - 128 as a signed byte (see dot; value() undoes it)
        unsigned q[8];
        float ds, dm;  // fl(d * sc), fl(dmin * m)
        int j;         // the sub-block
    };
    static constexpr bool SHIFTED = !Q5;  // Q4_K's odd pieces as above
    __device__ static bool high(const Piece& pc) { return SHIFTED && (pc.j & 1); }
    __device__ static Piece load(const unsigned char* block, int p) {
        Piece pc;
        const uint4 h = *reinterpret_cast<const uint4*>(block);
        const uint4 a = *reinterpret_cast<const uint4*>(block + QS + 32 * (p / 2));
        const uint4 b = *reinterpret_cast<const uint4*>(block + QS + 32 * (p / 2) + 16);
        const unsigned q[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        if constexpr (SHIFTED) {  // one LOP3 a word: the nibble in place (xor 0x80 for the high ones), no shift
            const unsigned mask = p % 2 ? 0xF0F0F0F0u : 0x0F0F0F0Fu, flip = p % 2 ? 0x80808080u : 0u;
#pragma unroll
            for (int i = 0; i < 8; ++i) pc.q[i] = (q[i] & mask) ^ flip;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) pc.q[i] = (q[i] >> (4 * (p % 2))) & 0x0F0F0F0Fu;
            // bit p of each qh byte -> bit 4 of the value's byte
            const uint4 c = *reinterpret_cast<const uint4*>(block + 16), e = *reinterpret_cast<const uint4*>(block + 32);
            const unsigned qh[8] = {c.x, c.y, c.z, c.w, e.x, e.y, e.z, e.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) pc.q[i] |= ((qh[i] >> p) << 4) & 0x10101010u;
        }
        const Scale sc = scale(h, p);
        pc.ds = sc.ds;
        pc.dm = sc.dm;
        pc.j = p;
        return pc;
    }
    // The 4 values q of word w as bytes 0 .. 15 (or 31).
    __device__ static unsigned values(const Piece& pc, int w) {
        return high(pc) ? (pc.q[w] ^ 0x80808080u) >> 4 : pc.q[w];
    }
    __device__ static Piece load(const Lane& ln, long long delta) { return load(ln.block + delta, ln.p); }
    __device__ static void run(const Piece& pc, int r, float (&w)[8]) {
        // fl(fl(ds * q) - dm) in one FFMA: ds * q is exact (an fp16 times 6 bits, times 5 bits: <= 22 bits), and an
        // FMA rounds the exact ds * q - dm once, with the signed-zero rule of that sum.
#pragma unroll
        for (int i = 0; i < 8; ++i)
            w[i] = __fmaf_rn(pc.ds, byte_minus(values(pc, 2 * r + i / 4), i % 4, MAGIC_U_VALUE), -pc.dm);
    }
    static constexpr int XB = 8 * sizeof(XBlock);
    struct Scale {
        float ds, dm;
    };
    static constexpr bool SPLIT = false;
    __device__ static float term(float acc, const Scale& sc, int dlo, int dhi, const int4& meta) {
        return group_acc(acc, __int_as_float(meta.x), sc.ds, dlo + dhi, sc.dm, __int_as_float(meta.y));
    }
    __device__ static float mma_term(float acc, const Scale& sc, int dlo, int dhi, const int4& meta) {
        return term(acc, sc, dlo, dhi, meta);
    }
    // One group: the sub-block, with its activation block. u = the sum of q qx; for Q4_K's odd pieces the bytes are
    // 16 q - 128, so their dot is 16 u - 128 v, and u = (that + 128 v) / 16, exactly (v: the XBlock's half sums).
    __device__ static float dot(const Piece& pc, const unsigned char* xb, float acc) {
        const XBlock& x = *reinterpret_cast<const XBlock*>(xb);
        const unsigned lo[4] = {pc.q[0], pc.q[1], pc.q[2], pc.q[3]}, hi[4] = {pc.q[4], pc.q[5], pc.q[6], pc.q[7]};
        const int4 meta = x.meta();
        int u = dot_words(lo, x.quad(0)) + dot_words(hi, x.quad(1));
        if (high(pc)) u = (u + 128 * (meta.z + meta.w)) >> 4;
        return term(acc, {pc.ds, pc.dm}, u, 0, meta);
    }
    // Tensor cores (Q4_K): value 4t + i of piece p is nibble p % 2 of qs byte 32 (p / 2) + 4t + i. Quad q (pieces
    // 4q .. 4q+3) of a block: the words at 4t and 16 + 4t of qs bytes 64q .. 64q+63, and the scales of piece 4q + t,
    // which the 4 lanes of the row pass round (each decodes one piece's instead of all four).
    static constexpr bool MMA = !Q5;
    struct MmaRaw {
        Scale own;      // piece 4q + t's
        unsigned w[4];  // pair j (pieces 4q + 2j, 4q + 2j + 1): w[2j] values 4t.., w[2j + 1] values 16 + 4t..
    };
    __device__ static MmaRaw mma_raw(const unsigned char* block, int q, int t) {
        MmaRaw r;
        r.own = scale(*reinterpret_cast<const uint4*>(block), 4 * q + t);
        const unsigned* w = reinterpret_cast<const unsigned*>(block + QS + 64 * q + 4 * t);
#pragma unroll
        for (int i = 0; i < 4; ++i) r.w[i] = w[4 * i];  // bytes 64q + 16 i + 4t
        return r;
    }
    __device__ static void mma_piece(const MmaRaw& r, int, int c, int quad, unsigned& lo, unsigned& hi, Scale& sc) {
        lo = (r.w[2 * (c / 2)] >> (4 * (c % 2))) & 0x0F0F0F0Fu;
        hi = (r.w[2 * (c / 2) + 1] >> (4 * (c % 2))) & 0x0F0F0F0Fu;
        // from the row's lane t = c
        sc = {__shfl_sync(0xFFFFFFFFu, r.own.ds, quad | c), __shfl_sync(0xFFFFFFFFu, r.own.dm, quad | c)};
    }
    __device__ static Scale scale(const uint4& h, int p) {  // h: the block's first 16 bytes
        const unsigned scm = scale_min_k4(p, h);
        return {__fmul_rn(half_to_float(h.x & 0xFFFFu), byte_minus(scm, 0, MAGIC_U_VALUE)),
                __fmul_rn(half_to_float(h.x >> 16), byte_minus(scm, 1, MAGIC_U_VALUE))};
    }
};
using FmtQ4_K = FmtK4<false>;
using FmtQ5_K = FmtK4<true>;

// ---- Q6_K, as the GPU holds it: pairs of blocks, repacked at load (lucegen/kernels/repack.py) ---------------------
// A pair (512 values, 432 bytes, 16-byte aligned): [0:208] block A's body | [208:416] B's | [416:418] A's d |
// [418:420] B's d | zero. A body holds its block's 8 pieces p of 32 values (q in 0 .. 63): [16p, +16) their low 4 bits,
// [128 + 8p, +8) their high 2 bits, [192, 208) the 16 int8 scales as stored. Piece P of the pair (16) is piece P % 8
// of block P / 8: values 32P .. 32P+31, x = fl(d*sc) * (q - 32), scales 2 (P % 8) and + 1 (the piece's halves).
// Its word w of 4 values (a byte each): nibble word w % 4's low (w < 4) or high (w >= 4) nibbles, and bits 2v, 2v + 1
// (v = w % 2 + 2 (w / 4)) of high-bit word (w % 4) / 2 moved to bits 4, 5. Run r = values 32P + 8r .. +7 (words 2r,
// 2r + 1; scale r / 2 of the piece).
struct FmtQ6_K {
    static constexpr int BLOCK_VALUES = 512, BLOCK_BYTES = 432, PIECES = 16, RUNS = 4, ROW_VALUES = 256;
    static constexpr bool ALIGNED16 = true, QUAD_SUMS = false;
    static constexpr int TILE = WTILE;
    static constexpr int BODY = 208, D = 416;  // a block's body, the d's
    __host__ __device__ static constexpr int voff(int p, int r) { return 32 * p + 8 * r; }
    struct Piece {
        unsigned q[8];  // q in 0 .. 63, one per byte (the offset of 32 is subtracted in the products and the decode)
        int sc[2];      // the two scales
        float d;
    };
    using Lane = BlockLane;
    __device__ static Lane lane(const unsigned char* pair, int p) { return {pair, p}; }
    // bits 2v, 2v + 1 of each byte of a high-bit word, at bits 4, 5
    __device__ static unsigned high_bits(unsigned h, int v) {
        return (v < 2 ? h << (4 - 2 * v) : h >> (2 * v - 4)) & 0x30303030u;
    }
    __device__ static Piece load(const unsigned char* pair, int p) {
        Piece pc;
        const unsigned char* body = pair + BODY * (p / 8);
        const uint4 n = *reinterpret_cast<const uint4*>(body + 16 * (p % 8));
        const uint2 h = *reinterpret_cast<const uint2*>(body + 128 + 8 * (p % 8));
        const unsigned nw[4] = {n.x, n.y, n.z, n.w}, hw[2] = {h.x, h.y};
#pragma unroll
        for (int w = 0; w < 8; ++w)
            pc.q[w] = ((w < 4 ? nw[w] : nw[w - 4] >> 4) & 0x0F0F0F0Fu) | high_bits(hw[w % 4 / 2], w % 2 + 2 * (w / 4));
        const unsigned sc = *reinterpret_cast<const unsigned short*>(body + 192 + 2 * (p % 8));
        pc.sc[0] = static_cast<signed char>(sc & 0xFFu);
        pc.sc[1] = static_cast<signed char>(sc >> 8);
        pc.d = half_to_float(*reinterpret_cast<const unsigned short*>(pair + D + 2 * (p / 8)));
        return pc;
    }
    __device__ static Piece load(const Lane& ln, long long delta) { return load(ln.block + delta, ln.p); }
    __device__ static void run(const Piece& pc, int r, float (&w)[8]) {
        const float ds = __fmul_rn(pc.d, static_cast<float>(pc.sc[r / 2]));  // exact conversion: |sc| <= 128
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = __fmul_rn(ds, byte_minus(pc.q[2 * r + i / 4], i % 4, MAGIC_U_VALUE + 32.f));
    }
    static constexpr int XB = 16 * sizeof(XBlock);
    struct Scale {
        int sc[2];
        float d;
    };
    static constexpr bool SPLIT = true;
    // One group: the piece's 32 values, with its activation block; the two scales multiply their halves' integer dots
    // (|sc u| <= 128 * 16 * 32 * 127 each, so u stays below 2^24): u = sc0 u0 + sc1 u1, weight scale d. The bytes
    // are q, not q - 32 (0 .. 63: the same as signed bytes), so a half's dot is u0 + 32 (qx[0] + ... + qx[15]): the
    // XBlock's half sums take the 32 back off, and u0, u1, u are the same integers.
    __device__ static float term(float acc, const Scale& sc, int dlo, int dhi, const int4& meta) {
        return group_acc(acc, __int_as_float(meta.x), sc.d,
                         sc.sc[0] * (dlo - 32 * meta.z) + sc.sc[1] * (dhi - 32 * meta.w));
    }
    // mma_piece's bytes are q - 32: the same u with no half sums
    __device__ static float mma_term(float acc, const Scale& sc, int dlo, int dhi, const int4& meta) {
        return group_acc(acc, __int_as_float(meta.x), sc.d, sc.sc[0] * dlo + sc.sc[1] * dhi);
    }
    // each byte q (0 .. 63) as the signed byte q - 32: bits 0-4 kept, bits 5-7 set where bit 5 is clear
    __device__ static unsigned minus32(unsigned q) { return (q & 0x1F1F1F1Fu) | ((~q & 0x20202020u) * 7u); }
    __device__ static float dot(const Piece& pc, const unsigned char* xb, float acc) {
        const XBlock& x = *reinterpret_cast<const XBlock*>(xb);
        const unsigned lo[4] = {pc.q[0], pc.q[1], pc.q[2], pc.q[3]}, hi[4] = {pc.q[4], pc.q[5], pc.q[6], pc.q[7]};
        return term(acc, {{pc.sc[0], pc.sc[1]}, pc.d}, dot_words(lo, x.quad(0)), dot_words(hi, x.quad(1)),
                    x.meta());
    }
    // Tensor cores: lane t takes values 4t .. 4t+3 (word t) and 16 + 4t .. 16 + 4t+3 (word 4 + t) of a piece: nibble
    // word t and high-bit word t / 2 (bit pairs t % 2 and 2 + t % 2). Quad q (pieces 4q .. 4q+3 of the pair: block
    // q / 2, its pieces 4 (q % 2) ..): those two words of each, its 8 scales (two words) and the block's d.
    static constexpr bool MMA = true;
    struct MmaRaw {
        unsigned n[4], h[4], sc[2];  // piece 4q + c's nibble word, its high-bit word shifted down by 2 (t % 2)
        unsigned short d;
    };
    __device__ static MmaRaw mma_raw(const unsigned char* pair, int q, int t) {
        MmaRaw r;
        const unsigned char* body = pair + BODY * (q / 2);
        const int p0 = 4 * (q % 2);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            r.n[c] = *reinterpret_cast<const unsigned*>(body + 16 * (p0 + c) + 4 * t);
            r.h[c] = *reinterpret_cast<const unsigned*>(body + 128 + 8 * (p0 + c) + 4 * (t / 2)) >> (2 * (t % 2));
        }
        const uint2 sc = *reinterpret_cast<const uint2*>(body + 192 + 2 * p0);
        r.sc[0] = sc.x;
        r.sc[1] = sc.y;
        r.d = *reinterpret_cast<const unsigned short*>(pair + D + 2 * (q / 2));
        return r;
    }
    __device__ static void mma_piece(const MmaRaw& r, int, int c, int, unsigned& lo, unsigned& hi, Scale& sc) {
        lo = minus32((r.n[c] & 0x0F0F0F0Fu) | ((r.h[c] << 4) & 0x30303030u));
        hi = minus32(((r.n[c] >> 4) & 0x0F0F0F0Fu) | (r.h[c] & 0x30303030u));
        const unsigned pair = r.sc[c / 2] >> (16 * (c % 2));  // scales 2c, 2c + 1 of the quad's 8
        sc = {{static_cast<signed char>(pair & 0xFFu), static_cast<signed char>((pair >> 8) & 0xFFu)}, half_to_float(r.d)};
    }
};

// F with its products summed by quads of lanes (see the top), for the formats whose quad's pieces a tensor-core
// thread holds (F::MMA)
template <class F>
struct QuadSums : F {
    static_assert(F::MMA, "quads of lanes serve the int8 mma GEMM's threads");
    static constexpr bool QUAD_SUMS = true;
};

}  // namespace lucegen
