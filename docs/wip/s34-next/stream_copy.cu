// Lab (session 34, for the next session's first run): the verify GEMM's bytes moved the way the decode GEMV moves
// them, with no multiply, to time against main's qgemm_mma with its multiply taken out (tools/verify_gemm_time.py
// on a tree whose slice loop `continue`s always: 64 us for Q4_K gate/up at M = 16 on the H100, the weights alone
// 33 us at the read rate).
//
// Block: 8 warps, ROWS rows (16 TILES), all K. Warp w takes main's classes 4w .. 4w+3: in every slice (4 Q4_K
// super-blocks of 144 bytes a row) its block b = w / 2's 16-byte head (d, dmin, scales) and 64 bytes of qs (the
// half 32 (w % 2) .. of it: pieces 4 (w % 2) .. +3), for each of the block's rows, and the XBlocks of those 4 pieces
// (4 x 48 bytes) for each of the MT activation rows. Each warp keeps its own ring of STAGES slices in shared memory,
// filled with cp.async 16-byte words by its own lanes and waited for with cp.async.wait_group + __syncwarp: no
// block barrier. The words are folded into one value a lane, stored only if it equals a constant (so that the
// loads stay), the outputs otherwise untouched.
#define DEV __device__ __forceinline__

DEV unsigned smem_u32(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
DEV void cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
DEV void commit() { asm volatile("cp.async.commit_group;"); }
template <int N> DEV void wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

constexpr int SB = 144, XB = 48;  // Q4_K super-block bytes; XBlock bytes (32 values)

template <int MT, int TILES, int STAGES>
struct StreamGeo {
    static constexpr int ROWS = 16 * TILES;
    static constexpr int W_WORDS = ROWS * 5, X_WORDS = MT * 4 * XB / 16;  // a warp's words of a slice
    static constexpr int STAGE = 16 * (W_WORDS + X_WORDS);
    static constexpr int SMEM = 8 * STAGES * STAGE;
};

template <int MT, int TILES, int STAGES>
__device__ void stream_copy(const unsigned char* __restrict__ W, const unsigned char* __restrict__ X,
                            float* __restrict__ Y, int N, int K, int M) {
    using G = StreamGeo<MT, TILES, STAGES>;
    extern __shared__ __align__(16) unsigned char smem[];
    const int mtiles = (M + MT - 1) / MT;
    const int m0 = (blockIdx.x % mtiles) * MT, r0 = (blockIdx.x / mtiles) * G::ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b = warp / 2, h = warp % 2;
    const long long row_bytes = (long long)K / 256 * SB, x_row_bytes = (long long)K / 32 * XB;
    const int slices = K / 1024;
    unsigned char* ring = smem + warp * STAGES * G::STAGE;
    const auto issue = [&](int s) {
        if (s < slices) {
            const unsigned st = smem_u32(ring + (s % STAGES) * G::STAGE);
            for (int i = lane; i < G::W_WORDS; i += 32) {  // row i / 5: its head (word 0), then 4 words of qs
                const int r = i / 5, w = i % 5;
                const long long at = (long long)min(r0 + r, N - 1) * row_bytes + (long long)(4 * s + b) * SB +
                                     (w == 0 ? 0 : 16 + 64 * h + 16 * (w - 1));
                cp16(st + 16 * i, W + at);
            }
            for (int i = lane; i < G::X_WORDS; i += 32) {  // activation row i / 12: 4 XBlocks, 12 words
                const int m = i / 12, w = i % 12;
                const long long at = (long long)min(m0 + m, M - 1) * x_row_bytes +
                                     (long long)(32 * s + 8 * b + 4 * h) * XB + 16 * w;
                cp16(st + 16 * (G::W_WORDS + i), X + at);
            }
        }
        commit();
    };
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
    unsigned fold = 0;
#pragma unroll 1
    for (int s = 0; s < slices; ++s) {
        wait_group<STAGES - 2>();
        __syncwarp();
        issue(s + STAGES - 1);  // the stage of slice s - 1: every lane is past it (the __syncwarp above)
        const uint4* st = reinterpret_cast<const uint4*>(ring + (s % STAGES) * G::STAGE);
        for (int i = lane; i < G::W_WORDS + G::X_WORDS; i += 32) {
            const uint4 v = st[i];
            fold ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    if (fold == 0x9E3779B9u) Y[blockIdx.x] = static_cast<float>(fold);
}

#define KERNEL(MT, TILES, ST, MB)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, MB) stream_copy_m##MT##_r##TILES##_s##ST##_b##MB(          \
        const unsigned char* W, const unsigned char* X, float* Y, int N, int K, int M) {                        \
        stream_copy<MT, TILES, ST>(W, X, Y, N, K, M);                                                           \
    }
KERNEL(16, 2, 2, 2)
KERNEL(16, 2, 3, 1)
KERNEL(16, 2, 4, 1)
KERNEL(16, 1, 3, 2)
KERNEL(16, 1, 6, 1)
