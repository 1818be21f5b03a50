"""Quantized weights on fp16 tensor cores, one kernel for every M (templates/qgemm_tc.cuh): numpy reference, units,
launcher. Q4_K only (Q6_K was dropped: spec.py's TENSOR_CORE_FORMATS says why).

Y [M, N] fp32 = X [M, K] W^T for rows W [N, K] as the GGUF file stores them. The kernel dequantises W to fp16 in
registers (dequantize_fp16 gives the same fp16 values) and multiplies it with X's rows in fp16 (each scaled by a
power of two into fp16's range first, and the product's row scaled back: x_fp16), with fp32 sums on tensor cores.
The decode GEMV (M = 1) and the GEMM of a tree verify are the same kernel; a token's outputs are the same bits
whatever M and its row in a tile (tests/gpu/test_qgemm_tc_gpu.py asserts it), so greedy verification needs no second
kernel kept bit-equal to the first (qgemv.py's GEMV and GEMM). The sums' order inside an mma is the tensor core's,
so the numpy reference is within a tolerance, not bit for bit.

Status (session 10, H200): correct against numpy and batch-invariant (tests/gpu/test_qgemm_tc_gpu.py), and with
tuning.qgemv.tensor_core_formats on, the 27B's greedy speculation equals plain greedy decoding. Off in every spec:
~38% of the read rate at M = 1 (the CUDA-core GEMV: ~70%), so autoregressive decode halves while DDTree gains ~20%
(docs/design.md, "Session 10").
"""
from __future__ import annotations

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.quants import _half, _nibbles_k, _scale_min_k4
from ..runtime.memory import DeviceArray
from ..spec import TENSOR_CORE_FORMATS, ChipSpec

BLOCK_VALUES = 256
BLOCK_BYTES = {"q4_k": 144}
CLASSES = {"q4_k": "TcQ4K"}
WARPS = 4     # warps a block, each a share of K's super-blocks
STAGES = 3    # shared-memory buffers a warp streams its super-blocks through (cp.async, STAGES - 1 ahead)
# tokens a kernel takes (8 a tile of the mma's B): a launch takes the first that holds its rows (more than 48: more
# launches, 48 each); X is padded with zero rows to the kernel's count. Every kernel does the same arithmetic per token.
VARIANTS = (8, 16, 32, 48)
MAX_ROWS_A_LAUNCH = VARIANTS[-1]
ROWS = 16     # output rows of the mma's A tile
# row tiles a block (each activation fragment a warp loads serves them all): two read X half as often, but make
# half the blocks; a block takes two from TWO_TILES_FROM tokens (session 10's sweep: results/logs/h200-s10-*)
TILES = (1, 2)
TWO_TILES_FROM = {"q4_k": 16}
UNIT = "qgemm_tc"


def kernel_name(fmt: str, rows: int, tiles: int) -> str:
    return f"qgemm_tc_{fmt}_m{rows}_t{tiles}"


def tiles_for(fmt: str, rows: int) -> int:
    """Row tiles a block in the kernel for `rows` tokens."""
    return 2 if rows >= TWO_TILES_FROM[fmt] else 1


def variant(rows: int) -> int:
    """The tokens of the kernel a launch of `rows` (<= MAX_ROWS_A_LAUNCH) rows takes."""
    return next(v for v in VARIANTS if rows <= v)


def padded_rows(m: int) -> int:
    """Rows of X the launches for m rows read: whole launches of MAX_ROWS_A_LAUNCH, then the last one's kernel."""
    last = (m - 1) // MAX_ROWS_A_LAUNCH * MAX_ROWS_A_LAUNCH
    return last + variant(m - last)


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
    by (qgemm_tc_x16, in slot order there)."""
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


def smem_bytes(fmt: str, rows: int, tiles: int) -> int:
    """Dynamic shared memory of a kernel: each warp's stages, then the warps' partial sums (fp32 mma fragments)."""
    return WARPS * STAGES * 16 * tiles * BLOCK_BYTES[fmt] + WARPS * tiles * rows // 8 * 32 * 4 * 4


def units(spec: ChipSpec) -> list[KernelUnit]:
    """One unit per chip (the shapes are launch arguments): every format's kernels and the fp16 conversion."""
    variants = [{"name": kernel_name(f, rows, tiles), "fmt": f.upper(), "cls": CLASSES[f], "rows": rows,
                 "tiles": tiles, "smem": smem_bytes(f, rows, tiles)}
                for f in TENSOR_CORE_FORMATS for rows in VARIANTS for tiles in TILES]
    sigs = tuple(KernelSig(v["name"], WARPS * 32, dynamic_smem=v["smem"]) for v in variants)
    return [KernelUnit(UNIT, "qgemm_tc.cu.j2", {"warps": WARPS, "stages": STAGES, "variants": variants},
                       (*sigs, KernelSig("qgemm_tc_x16", 256)))]


class QGemmTC:
    """y [m, n] fp32 = x [m, k] fp32 . w^T for rows w of a format: x's rows to fp16 (x_fp16) into buffers of its own,
    then the product, at most MAX_ROWS_A_LAUNCH rows a launch. Called as qgemv.QMatmul is (the layered step's
    projections take either): it makes no XBlocks (xq), and ignores any it is given."""

    xq = None

    def __init__(self, module, spec: ChipSpec, fmt: str, max_rows: int, k: int):
        self.spec, self.fmt, self.k, self.max_rows = spec, fmt, k, max_rows
        self.gemm = {(rows, tiles): module.kernel(kernel_name(fmt, rows, tiles))
                     for rows in VARIANTS for tiles in TILES}
        for (rows, tiles), kernel in self.gemm.items():
            kernel.set_max_dynamic_smem(smem_bytes(fmt, rows, tiles))
        self.to_half = module.kernel("qgemm_tc_x16")
        self.x16 = DeviceArray.empty((padded_rows(max_rows), k), np.float16)
        self.scale = DeviceArray.empty(padded_rows(max_rows), np.float32)  # 2^e a row (x_fp16)

    def __call__(self, w: DeviceArray, x: DeviceArray, y: DeviceArray, n: int, m: int = 1, stream=None,
                 xq=None, tiles: int | None = None, ldy: int | None = None) -> None:
        if m > self.max_rows:
            raise ValueError(f"{m} rows exceed the {self.max_rows} this GEMM was made for")
        # X to fp16, zeros to the end of the last launch's tokens
        self.to_half(padded_rows(m), 256, x, self.x16, self.scale, m, self.k, stream=stream)
        self.product(w, y, n, m, stream, tiles, ldy)

    def product(self, w: DeviceArray, y: DeviceArray, n: int, m: int, stream=None, tiles: int | None = None,
                ldy: int | None = None) -> None:
        """The product alone, from the fp16 rows the last call left (benchmarks time this). tiles: row tiles a block
        (by default tiles_for's); ldy: floats from one row of y to the next (default n)."""
        ldy = n if ldy is None else ldy
        if problem := shape_problem(self.fmt, n, self.k):
            raise ValueError(problem)
        if ldy < n or y.size < (m - 1) * ldy + n:
            raise ValueError(f"y must hold {m} rows of {n} floats {ldy} apart (ldy >= n); got {y} and ldy = {ldy}")
        if w.ptr % 16:  # the kernel reads its blocks as 16-byte words
            raise ValueError(f"Q4_K weights for the tensor-core GEMM must start 16-byte aligned (at {w.ptr:#x})")
        k = self.k
        for m0 in range(0, m, MAX_ROWS_A_LAUNCH):
            rows = min(MAX_ROWS_A_LAUNCH, m - m0)
            tokens = variant(rows)  # the kernel reads this many rows of X: zeros past m (__call__)
            t = tiles or tiles_for(self.fmt, tokens)
            self.gemm[tokens, t](-(-n // (ROWS * t)), WARPS * 32, w,
                                     self.x16.view((tokens, k), offset_bytes=2 * m0 * k),
                                     self.scale.view(tokens, offset_bytes=4 * m0),
                                     y.view((rows - 1) * ldy + n, offset_bytes=4 * m0 * ldy), rows, n, k, ldy,
                                     smem=smem_bytes(self.fmt, tokens, t), stream=stream)

    def free(self) -> None:
        self.x16.free()
        self.scale.free()
