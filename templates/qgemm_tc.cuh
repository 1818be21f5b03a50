// qgemm_tc.cuh: Y = X W^T for Q4_K weights W [N, K] as the GGUF file stores them and fp16 activations
// X [M, K], on fp16 tensor cores (mma.sync m16n8k16, fp32 accumulators): one kernel for every M, the decode GEMV
// (M = 1) and the GEMM of a tree verify alike, batch-invariant (a token's outputs do not depend on M or on its place
// in a tile), so that a verify row equals the decode row by construction. docs/design.md, "Session 9", has the design,
// "Session 10" what it measured.
//
// The weights are the mma's A operand (16 rows a tile) and the tokens its B (8 a tile), so an mma does useful work
// for up to 8 tokens and the decode GEMV wastes only B's columns. A block of WARPS warps computes TILES x 16 output
// rows for NT x 8 tokens; warp w takes a contiguous share of the K / 256 super-blocks, and the warps' partial sums
// are added in warp order. Lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of the A tile: 4 values of one
// scale group each an mma, dequantised in registers (TcQ4K below says which). An mma's 16 k slots hold the group's
// values out of order: lane t's slots 2t, 2t+1 hold its values 0 and 2 (bytes 0 and 2 of a word), slots
// 2t+8, 2t+9 its values 1 and 3. B takes the activations in the same order: qgemm_tc_x16 stores each 4 fp16 of X as
// e0 e2 e1 e3, so that a uint2 of token g's row is lane (g, t)'s B fragment as it is.
//
// Dequantisation (as Marlin does it): (q | 0x6400) is the fp16 1024 + q; the 1024 comes off exactly, then one HFMA2
// rounds the weight once. (Folding the 1024 into the bias would round away half a quantisation step.)
// lucegen/kernels/qgemm_tc.py's dequantize_fp16 gives the same fp16 weights in numpy.
#pragma once
#include <cuda_fp16.h>

#include "mma.cuh"
#include "quant.cuh"

namespace lucegen {

// Where qgemm_tc_x16 puts element i of X: within each 4, positions 1 and 2 swap places.
__host__ __device__ constexpr int qgemm_x_slot(int i) {
    const int j = i & 3;
    return (i & ~3) | (j == 1 ? 2 : j == 2 ? 1 : j);
}

// X's rows go to fp16 scaled by 2^-e, e = this of the row's largest |x|: the least e >= 0 that brings it below 2^15,
// so that no activation overflows fp16 (65504); the product's row is multiplied by 2^e, exactly. A power of two
// changes no rounding in fp16's normal range, and e depends on the token's own row alone (batch invariance).
__device__ __forceinline__ int qgemm_x_exponent(float most) {
    int ex;
    frexpf(most, &ex);  // most = f 2^ex, f in [0.5, 1)
    return min(max(ex - 15, 0), 126);
}

// Where lane (g, t)'s B columns start: token g of each 8-token tile of X. X holds whole tiles (the launcher pads it
// with zero rows), so no row is out of range and none needs a select.
template <int NT>
struct XCols {
    const __half* row[NT];
    __device__ __forceinline__ XCols(const __half* X, int K) {
        const int g = threadIdx.x % 32 / 4;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) row[nt] = X + (size_t)(8 * nt + g) * K;
    }
    // the lane's B fragment of each token tile at k0: its token's 4 activations (a uint2 of the permuted fp16 X)
    __device__ __forceinline__ void load(size_t k0, unsigned (&b)[NT][2]) const {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(row[nt] + k0));
            b[nt][0] = v.x, b[nt][1] = v.y;
        }
    }
};

// Tile i's A (rows g, g + 8 of its 16) times each token tile's B: every B fragment serves all TILES row tiles.
template <int TILES, int NT>
__device__ __forceinline__ void qgemm_tc_mma(float (&acc)[TILES][NT][4], const unsigned (&a)[TILES][4],
                                             const unsigned (&b)[NT][2]) {
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_f16(acc[i][nt], a[i], b[nt]);
}

// ---- Q4_K: [0:2] d | [2:4] dmin | [4:16] scales[12] | [16:144] qs[128] -------------------------------------------
// Lane (g, t) loads, for each of its rows, bytes 8t .. 8t+7 of each 32-byte run c of qs: sub-block 2c (low nibbles)
// and 2c + 1 (high) values 8t .. 8t+7 of each, two mmas a sub-block (values 8t .. 8t+3, then 8t+4 .. 8t+7). The 4
// lanes of a row decode two sub-blocks' scales each and pass them round. Weights fl16(q s + b), s = fl16(d sc),
// b = fl16(-(dmin m)).
struct TcQ4K {
    static constexpr int BLOCK_VALUES = 256, BLOCK_BYTES = 144, TILE = FmtQ4_K::TILE;  // W as quant.cuh lays it out

    // sub-block j's fp16 scale and bias as one word (scale in the low half)
    __device__ static unsigned scale_bias(int j, const uint4& h) {
        const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x & 0xFFFFu)));
        const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(h.x >> 16)));
        const unsigned scm = scale_min_k4(j, h);
        const __half2 sb = __floats2half2_rn(__fmul_rn(d, float(scm & 0xFFu)), -__fmul_rn(dmin, float(scm >> 8)));
        return *reinterpret_cast<const unsigned*>(&sb);
    }

    // the nibbles at bits SHIFT and SHIFT + 16 of w as fp16 weights, scaled by the word sb (scale | bias << 16)
    template <int SHIFT>
    __device__ static unsigned pair(unsigned w, unsigned sb) {
        unsigned h;  // (w >> SHIFT) & 0x000F000F | 0x64006400 in one LOP3 (the compiler makes two of it)
        asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(w >> SHIFT), "r"(0x000F000Fu), "r"(0x64006400u));
        const unsigned scale_w = __byte_perm(sb, 0u, 0x1010), bias_w = __byte_perm(sb, 0u, 0x3232);
        const __half2 q = __hsub2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x6400)));
        const __half2 r = __hfma2(q, *reinterpret_cast<const __half2*>(&scale_w),
                                  *reinterpret_cast<const __half2*>(&bias_w));
        return *reinterpret_cast<const unsigned*>(&r);
    }

    // a super-block of the lane's rows in each row tile: blk[i][0] (row g of tile i) and blk[i][1] (row g + 8)
    template <int TILES, int NT>
    __device__ static void superblock(const unsigned char* const (&blk)[TILES][2], size_t k_base, const XCols<NT>& x,
                                      float (&acc)[TILES][NT][4]) {
        const int lane = threadIdx.x % 32, t = lane % 4;
        uint2 qs[TILES][2][4];
        unsigned own[TILES][2][2];  // [tile][row][sub-block 2t, 2t + 1]
#pragma unroll
        for (int i = 0; i < TILES; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint4 h = *reinterpret_cast<const uint4*>(blk[i][r]);
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    qs[i][r][c] = *reinterpret_cast<const uint2*>(blk[i][r] + 16 + 32 * c + 8 * t);
                own[i][r][0] = scale_bias(2 * t, h), own[i][r][1] = scale_bias(2 * t + 1, h);
            }
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {  // sub-block 2c + hf: the low (hf 0) or high nibbles
                const size_t k0 = k_base + 32 * (2 * c + hf) + 8 * t;
                unsigned b0[NT][2], b1[NT][2];
                x.load(k0, b0);
                x.load(k0 + 4, b1);
                unsigned a0[TILES][4], a1[TILES][4];  // values 8t .. 8t+3, then 8t+4 .. 8t+7: rows g, g+8 of slots
#pragma unroll                                        // 2t.., 2t+8..
                for (int i = 0; i < TILES; ++i) {
                    unsigned sb[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r) sb[r] = __shfl_sync(0xFFFFFFFFu, own[i][r][hf], (lane & ~3) | c);
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const uint2 q = qs[i][r][c];
                        a0[i][r] = hf ? pair<4>(q.x, sb[r]) : pair<0>(q.x, sb[r]);
                        a0[i][2 + r] = hf ? pair<12>(q.x, sb[r]) : pair<8>(q.x, sb[r]);
                        a1[i][r] = hf ? pair<4>(q.y, sb[r]) : pair<0>(q.y, sb[r]);
                        a1[i][2 + r] = hf ? pair<12>(q.y, sb[r]) : pair<8>(q.y, sb[r]);
                    }
                }
                qgemm_tc_mma(acc, a0, b0);
                qgemm_tc_mma(acc, a1, b1);
            }
    }
};

// A launch: ceil(N / (16 TILES)) blocks of WARPS * 32 threads, each TILES row tiles of 16 (a last block's tiles past
// N read row N - 1 and store nothing); rows 0 .. 8 NT - 1 of X (zeros past M), their scales S (qgemm_tc_x16), and
// rows 0 .. M - 1 of Y, ldy floats apart. Warp w takes a contiguous share of K's super-blocks; the warps' sums are
// added in warp order, whatever TILES and NT, so a token's outputs are the same bits in every variant.
//
// Each warp streams its rows' super-blocks through STAGES buffers of shared memory (cp.async, 16 bytes a copy; the
// blocks are 16-byte aligned), STAGES - 1 super-blocks ahead of the one it
// multiplies. Dynamic shared memory: kernels/qgemm_tc.py's smem_bytes.
template <class F, int NT, int TILES, int WARPS, int STAGES>
__device__ void qgemm_tc(const unsigned char* __restrict__ W, const __half* __restrict__ X,
                         const float* __restrict__ S, float* __restrict__ Y, int M, int N, int K, int ldy) {
    static_assert(F::BLOCK_BYTES % 16 == 0, "blocks copied as 16-byte words");
    constexpr int ROWS_W = 16 * TILES, CHUNKS = F::BLOCK_BYTES / 16, STAGE = ROWS_W * F::BLOCK_BYTES;
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
    unsigned char* const stages = smem + warp * STAGES * STAGE;
    float(*partial)[TILES][NT][32][4] = reinterpret_cast<float(*)[TILES][NT][32][4]>(smem + WARPS * STAGES * STAGE);
    const int n0 = blockIdx.x * ROWS_W, blocks = K / 256;
    const int s0 = warp * blocks / WARPS, s1 = (warp + 1) * blocks / WARPS;
    const auto row = [&](int j) { return W + wblock_offset<F>(min(n0 + j, N - 1), 0, K); };  // the warp's row j
    // The lane's copies, the same for every super-block: copy i is 16-byte word ch of row j's block (c = lane + 32 i
    // = j CHUNKS + ch), from src[i] + s TILE BLOCK_BYTES (quant.cuh's layout) into dst[i] (< 0: no copy).
    constexpr int COPIES = (ROWS_W * CHUNKS + 31) / 32;
    const unsigned char* src[COPIES];
    int dst[COPIES];
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
        const int c = lane + 32 * i, j = c / CHUNKS, ch = c % CHUNKS;
        const bool copy = c < ROWS_W * CHUNKS;
        src[i] = row(copy ? j : 0) + 16 * ch;
        dst[i] = copy ? j * F::BLOCK_BYTES + 16 * ch : -1;
    }
    const auto issue = [&](int s) {  // super-block s of the warp's rows into its stage, if s is in the warp's share
        if (s < s1) {
            unsigned char* const stage = stages + (s - s0) % STAGES * STAGE;
            const size_t step = (size_t)s * F::TILE * F::BLOCK_BYTES;
#pragma unroll
            for (int i = 0; i < COPIES; ++i)
                if (dst[i] >= 0) cp_async16(stage + dst[i], src[i] + step, true);
        }
        cp_async_commit();  // empty past the share: every iteration waits on the same group count
    };
    const XCols<NT> x(X, K);
    float acc[TILES][NT][4] = {};
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) issue(s0 + p);
#pragma unroll 1
    for (int s = s0; s < s1; ++s) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();  // every lane's copies of s have landed; every lane is done with s - 1's stage
        issue(s + STAGES - 1);
        const unsigned char* const stage = stages + (s - s0) % STAGES * STAGE;
        const unsigned char* blk[TILES][2];  // the lane's rows g, g + 8 of each tile
#pragma unroll
        for (int i = 0; i < TILES; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r) blk[i][r] = stage + (16 * i + 8 * r + g) * F::BLOCK_BYTES;
        F::template superblock<TILES, NT>(blk, (size_t)s * 256, x, acc);
    }
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) partial[warp][i][nt][lane][e] = acc[i][nt][e];
    __syncthreads();
    for (int j = threadIdx.x; j < TILES * NT * 32 * 4; j += WARPS * 32) {  // the warps' partials added in warp order
        const int i = j / (NT * 128), nt = j / 128 % NT, ln = j / 4 % 32, e = j % 4;
        float sum = partial[0][i][nt][ln][e];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) sum += partial[w][i][nt][ln][e];
        // c0, c1: row g, tokens 2t, 2t+1; c2, c3: row g + 8
        const int token = 8 * nt + 2 * (ln % 4) + e % 2, n = n0 + 16 * i + ln / 4 + 8 * (e / 2);
        if (token < M && n < N) Y[(size_t)token * ldy + n] = sum * S[token];
    }
}

}  // namespace lucegen
