"""Quantized weights on fp16 tensor cores, one kernel for every M (templates/qgemm_tc.cuh): numpy reference, the
load-time repack, units, launcher. Q4_K only (Q6_K was dropped: spec.py's TENSOR_CORE_FORMATS says why).

Y [M, N] fp32 = X [M, K] W^T for rows W [N, K] of a GGUF file, repacked at load (repack: Marlin's layout, 2.8% more
bytes than GGUF's). The kernel dequantises W to fp16 in registers (dequantize_fp16 gives the same fp16 values) and
multiplies it with X's rows in fp16 (each scaled by a power of two into fp16's range first, and the product's row
scaled back: x_fp16), with fp32 sums on tensor cores. The decode GEMV (M = 1) and the GEMM of a tree verify are the
same kernel; a token's outputs are the same bits whatever M and its row in a launch (tests/gpu/test_qgemm_tc_gpu.py
asserts it), so greedy verification needs no second kernel kept bit-equal to the first (qgemv.py's GEMV and GEMM).
The sums' order inside an mma is the tensor core's, so the numpy reference is within a tolerance, not bit for bit.

Status (session 53, H100 with the h200 spec; results/logs/h100-s53-run4-qgemm-tc.txt): on the 27B's Q4_K shapes
1.18-1.34x the int8 GEMV's time at M = 1, 0.64-0.92x the int8 GEMM's at M = 23; with tuning.qgemv.tensor_core_formats
on, the 27B's tg128 is 19% slower and its verify of a 22-node tree 5% faster. Off in every spec (docs/design.md,
"Session 53").
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.quants import _half, _nibbles_k, _scale_min_k4
from ..runtime.memory import DeviceArray
from ..spec import TENSOR_CORE_FORMATS, ChipSpec

BLOCK_VALUES = 256
BLOCK_BYTES = {"q4_k": 144}
ROWS = 16          # output rows of the mma's A tile: a row tile of the repacked layout
SB_BYTES = 2368    # a row tile's super-block, repacked (qgemm_tc.cuh's TC_SB_BYTES): nibbles, scales, d's
X_PITCH = 256 + 8  # an X row's halves in a shared-memory stage (qgemm_tc.cuh's TC_X_PITCH)
WARPS = 8          # warps a block, each a row tile
STAGES = 3         # X's super-blocks in the block's shared-memory ring (cp.async, STAGES - 1 ahead)
# tokens a kernel takes (8 a tile of the mma's B): a launch takes the first that holds its rows (more than 24: more
# launches, 24 each). Every kernel does the same arithmetic per token.
VARIANTS = (8, 16, 24)
MAX_ROWS_A_LAUNCH = VARIANTS[-1]
UNIT = "qgemm_tc"


def kernel_name(fmt: str, rows: int) -> str:
    return f"qgemm_tc_{fmt}_m{rows}"


def variant(rows: int) -> int:
    """The tokens of the kernel a launch of `rows` (<= MAX_ROWS_A_LAUNCH) rows takes."""
    return next(v for v in VARIANTS if rows <= v)


def row_blocks(n: int) -> int:
    """Blocks of WARPS row tiles an n-row matrix takes (grid.x)."""
    return -(-n // (ROWS * WARPS))


def ksplit(n: int, k: int, sm_count: int) -> int:
    """Shares of K's super-blocks a launch for an n x k matrix splits into (grid.y; their sums added in order by
    qgemm_tc_reduce): about two blocks an SM, at most one share a super-block. The shape's alone, never M's, so a
    token's sums are the same whatever M."""
    return max(1, min(k // BLOCK_VALUES, 2 * sm_count // row_blocks(n)))


def min_blocks(rows: int, spec: ChipSpec) -> int:
    """Blocks an SM at least (__launch_bounds__: a register cap) of the kernel for `rows` tokens: three of the M-tile
    of 8 (80 registers, what it takes uncapped for sm_80 / sm_90), so that the decode's 27B gate/up launch (272
    blocks) runs on 132 SMs in one wave, not two (43.2 against 49.8 us on an H100; the K-split shapes, one wave
    either way, lose 13-20% to the tighter schedule: session 53); two elsewhere (128 registers). sm_120's ptxas
    spills the M-tile of 8 at 80 registers: two there."""
    return 3 if rows == 8 and spec.chip.cc < 100 else 2


def _q4_k(b: np.ndarray) -> np.ndarray:
    """fl16(q s + b) with s = fl16(d sc), b = fl16(-(dmin m)) (d sc, dmin m exact in fp32; one rounding, as HFMA2)."""
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, m = _scale_min_k4(b[:, 4:16])
    s = (d * sc).astype(np.float16).astype(np.float64)
    bias = (-(dmin * m)).astype(np.float16).astype(np.float64)
    q = _nibbles_k(b[:, 16:144]).astype(np.float64)
    return (q * s[:, :, None] + bias[:, :, None]).astype(np.float16)


def dequantize_fp16(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Rows [N, K / 256 * block bytes] (uint8) of a format -> the fp16 weights [N, K] the kernel makes."""
    b = np.ascontiguousarray(raw).reshape(-1, BLOCK_BYTES[fmt])
    return _q4_k(b).reshape(raw.shape[0], -1)


def x_exponents(x: np.ndarray) -> np.ndarray:
    """e per row of X: the least e >= 0 that brings the row's largest |x| below 2^15 (qgemm_x_exponent)."""
    _, ex = np.frexp(np.abs(np.asarray(x, np.float32)).max(axis=1))
    return np.clip(ex - 15, 0, 126)


def x_fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """X's rows as the kernel takes them: times 2^-e rounded to fp16, and the scales 2^e its products are multiplied
    by (qgemm_tc_x16)."""
    e = x_exponents(x).astype(np.float32)
    return (np.asarray(x, np.float32) * np.exp2(-e)[:, None]).astype(np.float16), np.exp2(e)


def reference(raw: np.ndarray, fmt: str, x: np.ndarray) -> np.ndarray:
    """Y [M, N] in float64 from the kernel's fp16 operands: X's scaled rows in fp16, the fp16 weights."""
    x16, scale = x_fp16(x)
    return (x16.astype(np.float64) @ dequantize_fp16(raw, fmt).astype(np.float64).T) * scale[:, None]


def shape_problem(fmt: str, n: int, k: int) -> str | None:
    if fmt not in TENSOR_CORE_FORMATS:
        return f"the tensor-core GEMM takes {', '.join(TENSOR_CORE_FORMATS)}, not {fmt}"
    if k % BLOCK_VALUES:
        return f"the tensor-core GEMM takes K a multiple of {BLOCK_VALUES}; got {n} x {k}"
    return None


def _tiles(b: np.ndarray, out: np.ndarray) -> None:
    """Row tiles b uint8 [tiles, 16, sbs, 144] (GGUF blocks) -> out uint32 [tiles, sbs, SB_BYTES / 4] (repack)."""
    tiles, _, sbs, _ = b.shape
    qs = b[..., 16:].reshape(tiles, ROWS, sbs, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=4).reshape(tiles, 2, 8, sbs, 4, 4, 2, 4, 2)  # T b g S c i a t h
    nib = q.transpose(0, 3, 4, 2, 7, 5, 8, 6, 1).reshape(tiles, sbs, 4, 32, 4, 4, 2)  # [..., byte, nibble]
    out[:, :, :512] = np.ascontiguousarray(nib[..., 0] | nib[..., 1] << 4).view("<u4").reshape(tiles, sbs, 512)
    sc, m = _scale_min_k4(b[..., 4:16].reshape(-1, 12))
    sc = sc.astype(np.uint32).reshape(tiles, ROWS, sbs, 8)
    m = m.astype(np.uint32).reshape(tiles, ROWS, sbs, 8)
    scw = sc[:, :8] | m[:, :8] << 8 | sc[:, 8:] << 16 | m[:, 8:] << 24  # [tile, pair g, sb, j]
    out[:, :, 512:576] = scw.transpose(0, 2, 1, 3).reshape(tiles, sbs, 64)
    d = b[..., 0:2].copy().view("<u2")[..., 0].astype(np.uint32)      # [tile, row, sb]
    dmin = b[..., 2:4].copy().view("<u2")[..., 0].astype(np.uint32)
    dw = np.stack([d[:, :8] | d[:, 8:] << 16, dmin[:, :8] | dmin[:, 8:] << 16], -1)  # [tile, g, sb, 2]
    out[:, :, 576:592] = dw.transpose(0, 2, 1, 3).reshape(tiles, sbs, 16)


def repack(raw: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q4_K rows [N, K / 256 * 144] -> the kernel's layout (qgemm_tc.cuh's top comment), flat bytes: per row
    tile of 16 rows (the last one filled up with rows of zeros) and super-block, SB_BYTES. Lane (g, t)'s word i of
    chunk c holds k16 step kk = 4c + i, its nibble b + 2a + 4h the value 16 kk + 8a + 2t + h of row g + 8b. In
    chunks of tiles on every core (numpy lets go of the GIL inside each operation), as kernels/repack.py does."""
    raw = np.ascontiguousarray(raw, np.uint8)
    sbs = k // BLOCK_VALUES
    if raw.ndim != 2 or raw.shape[1] != sbs * 144 or not sbs:
        raise ValueError(f"Q4_K rows of shape {raw.shape} for K = {k}: rows of {k // BLOCK_VALUES} 144-byte blocks "
                         f"expected")
    n = raw.shape[0]
    if n % ROWS:
        raw = np.concatenate([raw, np.zeros((ROWS - n % ROWS, raw.shape[1]), np.uint8)])
    tiles = raw.shape[0] // ROWS
    b = raw.reshape(tiles, ROWS, sbs, 144)
    out = np.empty((tiles, sbs, SB_BYTES // 4), np.uint32)
    step = max(1, (1 << 14) // sbs)  # tiles a chunk: bounds the temporaries
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(lambda t0: _tiles(b[t0:t0 + step], out[t0:t0 + step]), range(0, tiles, step)))
    return out.view(np.uint8).ravel()


def device_weights(raw: np.ndarray, fmt: str) -> DeviceArray:
    """GGUF rows of a tensor-core format on the device as the kernel reads them (repack)."""
    if fmt not in TENSOR_CORE_FORMATS:
        raise ValueError(f"the tensor-core GEMM takes {', '.join(TENSOR_CORE_FORMATS)}, not {fmt}")
    k = raw.shape[1] // BLOCK_BYTES[fmt] * BLOCK_VALUES
    return DeviceArray.from_numpy(repack(raw, k))


def smem_bytes(rows: int) -> int:
    """Dynamic shared memory of a kernel: X's ring of STAGES super-blocks of `rows` tokens."""
    return STAGES * rows * X_PITCH * 2


def units(spec: ChipSpec) -> list[KernelUnit]:
    """One unit per chip (the shapes are launch arguments): every format's kernels, the fp16 conversion and the
    reduction of K's shares."""
    variants = [{"name": kernel_name(f, rows), "rows": rows, "smem": smem_bytes(rows),
                 "min_blocks": min_blocks(rows, spec)} for f in TENSOR_CORE_FORMATS for rows in VARIANTS]
    sigs = tuple(KernelSig(v["name"], WARPS * 32, dynamic_smem=v["smem"]) for v in variants)
    return [KernelUnit(UNIT, "qgemm_tc.cu.j2", {"warps": WARPS, "stages": STAGES, "variants": variants},
                       (*sigs, KernelSig("qgemm_tc_x16", 256), KernelSig("qgemm_tc_reduce", 256)))]


class QGemmTC:
    """y [m, n] fp32 = x [m, k] fp32 . w^T for rows w of a format (device_weights' layout): x's rows to fp16
    (x_fp16) into buffers of its own, then the product, at most MAX_ROWS_A_LAUNCH rows a launch. Called as
    qgemv.QMatmul is (the layered step's projections take either): it makes no XBlocks (xq), and ignores any it is
    given."""

    xq = None

    def __init__(self, module, spec: ChipSpec, fmt: str, max_rows: int, k: int):
        self.spec, self.fmt, self.k, self.max_rows = spec, fmt, k, max_rows
        self.gemm = {rows: module.kernel(kernel_name(fmt, rows)) for rows in VARIANTS}
        for rows, kernel in self.gemm.items():
            kernel.set_max_dynamic_smem(smem_bytes(rows))
        self.to_half = module.kernel("qgemm_tc_x16")
        self.reduce = module.kernel("qgemm_tc_reduce")
        self.x16 = DeviceArray.empty((max_rows, k), np.float16)
        self.scale = DeviceArray.empty(max_rows, np.float32)  # 2^e a row (x_fp16)
        # K's shares' sums [ksplit, rows, n] fp32: ksplit n <= 2 SMs x 16 WARPS rows wherever K splits (ksplit)
        self.parts = DeviceArray.empty(2 * spec.chip.sm_count * ROWS * WARPS * MAX_ROWS_A_LAUNCH, np.float32)

    def __call__(self, w: DeviceArray, x: DeviceArray, y: DeviceArray, n: int, m: int = 1, stream=None,
                 xq=None, ldy: int | None = None) -> None:
        if m > self.max_rows:
            raise ValueError(f"{m} rows exceed the {self.max_rows} this GEMM was made for")
        self.to_half(m, 256, x, self.x16, self.scale, self.k, stream=stream)
        self.product(w, y, n, m, stream, ldy)

    def product(self, w: DeviceArray, y: DeviceArray, n: int, m: int, stream=None, ldy: int | None = None) -> None:
        """The product alone, from the fp16 rows the last call left (benchmarks time this). ldy: floats from one
        row of y to the next (default n)."""
        ldy = n if ldy is None else ldy
        if problem := shape_problem(self.fmt, n, self.k):
            raise ValueError(problem)
        if ldy < n or y.size < (m - 1) * ldy + n:
            raise ValueError(f"y must hold {m} rows of {n} floats {ldy} apart (ldy >= n); got {y} and ldy = {ldy}")
        if w.nbytes < -(-n // ROWS) * self.k // BLOCK_VALUES * SB_BYTES:
            raise ValueError(f"{w} holds less than {n} x {self.k} {self.fmt} weights in the tensor-core layout "
                             f"(qgemm_tc.device_weights)")
        k, ks = self.k, ksplit(n, self.k, self.spec.chip.sm_count)
        grid = (row_blocks(n), ks)
        for m0 in range(0, m, MAX_ROWS_A_LAUNCH):
            rows = min(MAX_ROWS_A_LAUNCH, m - m0)
            x16, scale = self.x16.view((rows, k), offset_bytes=2 * m0 * k), self.scale.view(rows, offset_bytes=4 * m0)
            out = y.view((rows - 1) * ldy + n, offset_bytes=4 * m0 * ldy)
            tokens = variant(rows)
            self.gemm[tokens](grid, WARPS * 32, w, x16, scale, out, self.parts, rows, n, k, ldy,
                              smem=smem_bytes(tokens), stream=stream)
            if ks > 1:
                self.reduce(min(-(-rows * n // 256), 4 * self.spec.chip.sm_count), 256, self.parts, scale, out,
                            rows, n, ks, ldy, stream=stream)

    def free(self) -> None:
        for a in (self.x16, self.scale, self.parts):
            a.free()
