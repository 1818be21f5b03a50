"""Quantized GEMV and small-M GEMM, Y = X W^T for W [N, K] in a GGUF format: numpy reference, units, launchers.

W is stored exactly as in the GGUF file (lucegen.model.quants' layouts; bf16 as plain bf16 rows), X is fp32
[M, K], Y fp32 [M, N]. The kernels (templates/qgemv.cuh) load each weight piece once, from global memory straight
into registers, and multiply it into an M-tile of activation rows (read through L1): MT = 1 for the decode GEMV,
spec.tuning.qgemv.gemm_m_tile for the GEMM of a tree verify. bf16 rows multiply fp32 activations
in fp32. The quantized formats multiply activations quantized to 8 bits per 32 values (quantize_x, as llama.cpp's
q8_1; a small kernel runs first) with integer dot products (dp4a), then scale each piece of 32 values into its
lane's fp32 sum, in a fixed order (quant.cuh's top comment): emulate gives the kernels' Y in numpy bit for bit, and
quantization_bound bounds its distance from the exact product. Why: decoding every weight to fp32 and multiplying
it with an FMA per activation row is bound by arithmetic, not bytes, from M = 1 on an H200 (21% of the read rate
for Q4_K); dp4a does four products in one instruction, on bytes that need no conversion.

M is any number of rows, in M-tiles; the weights are re-read once per M-tile, by blocks that run side by side so
that the re-reads come from L2. Every (format, K) gets a GEMV and a GEMM with the same arithmetic per output (it
depends on neither the M-tile nor the grid), so a GEMM row is the GEMV of that row bit for bit.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model import quants
from ..model.config import ModelConfig
from ..model.quants import QK_K, GGMLType, _half, _nibbles_k, _scale_min_k4, dequantize, q6_k_values, quantize
from ..runtime.memory import DeviceArray
from ..spec import WEIGHT_FORMATS, ChipSpec
from .repack import q6_k_blocks, q6_k_pairs

DEFAULT_MIX = "q4_k_m"  # the quantization lucegen builds for by default (the 27B's deployment)
XBLOCK_BYTES = 48  # quant.cuh's XBlock: 32 int8, the fp32 scale, the sum of the 32, the sums of each 16
XGROUP, XSLICE, XSLOT = 8, 32, 33  # quant.cuh's XBlock layout (xblock_index): groups of 8 rows, slices of 32
                                   # XBlocks, a row's in a slot of 33
VERIFY_ROWS = 65   # activation rows QMatmul makes room for up front (a tree verify: the largest budget, 64, + root)
MMA_ROWS, MMA_THREADS = 16, 256  # qgemm_mma: weight rows a tile (the mma's M), threads (a warp per 4 lane classes)
WTILE = MMA_ROWS  # quant.cuh's: rows a tile of W as the GPU holds it, for the formats with the mma GEMM
# qgemm_mma's kernels per format, (M-tile, row tiles of 16 a block, blocks an SM at least), and their ring depth; a call
# takes the one with the fewest M-tiles for its M, then the smallest M-tile (for_rows). Measured on the H200, the 27B's
# three shapes summed (results/logs/h200-s24-run1-qgemm-mma-m-tiles): Q4_K's two row tiles at mt16 (each activation
# fragment serves both) beat one at mt24 at M = 17-32 (M=23 162 against 181 us; M=32 181 against 235); Q6_K's mt24 (one
# row tile) beats mt16 at M = 17-24 (M=17 193 against 261; M=23 223 against 267), not at 16 (184 against 179) or 32 (300
# against 287); mt32 (118 KB a block: one an SM) lost everywhere. Summed by quads (sums_by_quads), Q4_K's two row tiles
# take mt24 too (QUAD_TILINGS; H100, session 38: M=23 gate/up 69.9 us against 94.3 at two M-tiles of 16). An M-tile of 8
# takes the mma GEMM's calls of up to 8 rows (a tree verify of budget 7 and less), three blocks an SM (an 85-register
# cap, no spills): H100, h200 spec, at M = 5 / 8 (results/logs/h100-s50-run1-m8.txt) Q4_K gate/up 41.4 / 43.3 us against
# 47.1 / 47.8 at mt16, Q6_K down 33.4 / 33.4 against 40.0 / 40.5, qkv 21.3 / 21.4 against 24.5 / 24.7 (Q4_K's qkv 16.7
# against 15.7 the one loss); a ring of 3 or 4 lost to 2 (gate/up at M = 8 46.3 and 55.8).
MMA_TILINGS = {"q4_k": ((8, 2, 3), (16, 2, 2)), "q6_k": ((8, 1, 3), (16, 1, 2), (24, 1, 2))}
QUAD_TILINGS = {"q4_k": ((8, 1, 3), (8, 2, 3), (16, 1, 2), (16, 2, 2), (24, 2, 2))}
MMA_STAGES = 2
# A block of two row tiles shares each activation fragment between them, but halves the grid: Q4_K's gate/up (34,816
# rows, 1,088 blocks at mt16) takes two (54.4 us at M = 16 against 67.4-74.5 in one), qkv (10,240: 320), out and down
# (5,120: 160) take one (18.8 / 13.8 / 34.3 us against 19.6 / 15.0 / 37.1; H100, session 38 run 4). for_rows takes
# the most row tiles whose grid holds FILL_BLOCKS blocks an SM: two waves of two (the blocks an SM at M-tiles of 16).
FILL_BLOCKS = 4


@dataclass(frozen=True)
class Format:
    """A weight format as the kernels read it (quant.cuh's trait `cls`): a block of `block_values` values in
    `block_bytes` bytes, decoded in `pieces` pieces; `aligned16` when every block starts on a 16-byte boundary.
    The GPU holds the GGUF rows as stored (a block: quants.block_shape), except Q6_K's, repacked into pairs of
    blocks (device_rows, kernels/repack.py); a matrix's rows in tiles of `tile_rows`, block by block
    (device_matrix: quant.cuh's wblock_offset)."""
    name: str
    ggml: GGMLType
    cls: str
    block_values: int
    block_bytes: int
    pieces: int
    aligned16: bool
    mma: bool = False  # the GEMM can run on int8 tensor cores (quant.cuh's F::MMA)
    row_values: int = 0  # rows are a multiple of this many values (0: block_values; Q6_K: a GGUF block, half a pair)
    quad_sums: bool = False  # summed by quads of lanes where the spec asks (sums_by_quads)

    @property
    def quantizes_x(self) -> bool:
        """Activations quantized to XBlocks (integer products, a piece of 32 values at a time), not fp32 (bf16)."""
        return self.ggml != GGMLType.BF16

    @property
    def x_block_bytes(self) -> int:
        """Activation bytes per weight block as the kernels read them (quant.cuh's F::XB)."""
        return self.block_values // 32 * XBLOCK_BYTES if self.quantizes_x else 4 * self.block_values

    @property
    def x_slice_bytes(self) -> int:
        return self.slice_values // self.block_values * self.x_block_bytes

    @property
    def slice_values(self) -> int:
        """K is processed in slices of one piece per lane of a warp."""
        return 32 * self.block_values // self.pieces

    @property
    def slice_bytes(self) -> int:
        return self.slice_values // self.block_values * self.block_bytes

    @property
    def slot_bytes(self) -> int:
        """Shared memory for one row's slice: widened to 16-byte boundaries unless blocks are 16-byte aligned."""
        return self.slice_bytes if self.aligned16 else (self.slice_bytes + 14 + 15) // 16 * 16

    @property
    def row_step(self) -> int:
        return self.row_values or self.block_values

    def row_bytes(self, k: int) -> int:
        """Bytes of a row of k values on the GPU (quant.cuh's row_bytes: a last block half filled where k is an odd
        number of Q6_K's GGUF blocks)."""
        check_k(self, k)
        return -(-k // self.block_values) * self.block_bytes

    def gguf_row_bytes(self, k: int) -> int:
        """Bytes of a row of k values as GGUF stores it (bf16: plain bf16)."""
        return quants.row_bytes(self.ggml, k)

    def device_rows(self, raw: np.ndarray) -> np.ndarray:
        """GGUF rows uint8 [N, gguf_row_bytes] -> the rows the kernels read [N, row_bytes]."""
        raw = np.ascontiguousarray(raw).view(np.uint8)
        return q6_k_pairs(raw) if self.ggml == GGMLType.Q6_K else raw

    def gguf_rows(self, rows: np.ndarray, k: int) -> np.ndarray:
        """device_rows undone: the kernels' rows [N, row_bytes(k)] -> the GGUF rows."""
        rows = np.ascontiguousarray(rows).view(np.uint8)
        return q6_k_blocks(rows, k // QK_K) if self.ggml == GGMLType.Q6_K else rows

    @property
    def tile_rows(self) -> int:
        """Rows a tile of a matrix as the GPU holds it (quant.cuh's F::TILE): an mma row tile for the formats the
        verify GEMM takes on tensor cores, else 1 (plain rows)."""
        return WTILE if self.mma else 1

    def matrix_bytes(self, n: int, k: int) -> int:
        """Bytes of a matrix of n rows of k values on the GPU: whole tiles."""
        return -(-n // self.tile_rows) * self.tile_rows * self.row_bytes(k)

    def wblock_offset(self, n, kb, k: int):
        """quant.cuh's wblock_offset: bytes from a matrix's start to row n's block kb (rows of k values)."""
        t = self.tile_rows
        return n // t * t * self.row_bytes(k) + (kb * t + n % t) * self.block_bytes

    def device_matrix(self, raw: np.ndarray) -> np.ndarray:
        """GGUF rows [N, gguf_row_bytes] -> the matrix as the kernels read it, flat bytes [matrix_bytes]: the rows
        repacked (device_rows), in tiles of tile_rows rows (the last one filled up with rows of zeros), a tile
        block by block."""
        rows = self.device_rows(raw)
        t, (n, row) = self.tile_rows, rows.shape
        if n % t:
            rows = np.concatenate([rows, np.zeros((t - n % t, row), np.uint8)])
        return np.ascontiguousarray(rows.reshape(-1, t, row // self.block_bytes, self.block_bytes)
                                    .transpose(0, 2, 1, 3)).reshape(-1)

    def matrix_rows(self, w: np.ndarray, n: int, k: int) -> np.ndarray:
        """device_matrix undone: the matrix's bytes (at least matrix_bytes(n, k)) -> the GGUF rows [n, ...]."""
        t, row = self.tile_rows, self.row_bytes(k)
        w = np.ascontiguousarray(w).view(np.uint8).reshape(-1)[:self.matrix_bytes(n, k)]
        rows = w.reshape(-1, row // self.block_bytes, t, self.block_bytes).transpose(0, 2, 1, 3).reshape(-1, row)
        return self.gguf_rows(rows[:n], k)


FORMATS = {f.name: f for f in (
    Format("bf16", GGMLType.BF16, "FmtBf16", 8, 16, 1, True),
    Format("q8_0", GGMLType.Q8_0, "FmtQ8_0", 32, 34, 1, False),
    Format("q4_0", GGMLType.Q4_0, "FmtQ4_0", 32, 18, 1, False),
    Format("q4_k", GGMLType.Q4_K, "FmtQ4_K", 256, 144, 8, True, mma=True, quad_sums=True),
    Format("q5_k", GGMLType.Q5_K, "FmtQ5_K", 256, 176, 8, True),
    Format("q6_k", GGMLType.Q6_K, "FmtQ6_K", 512, 432, 16, True, mma=True, row_values=256),  # pairs (repack.py)
)}
assert tuple(FORMATS) == WEIGHT_FORMATS


def fmt_of(name: str | GGMLType) -> Format:
    """The Format of a spec weight-format name ('q4_k') or a ggml type."""
    for f in FORMATS.values():
        if name in (f.name, f.ggml):
            return f
    raise ValueError(f"no quantized GEMV for weight format {name!r} (formats: {', '.join(FORMATS)})")


def check_k(fmt: Format, k: int) -> None:
    if k <= 0 or k % fmt.row_step:
        raise ValueError(f"{fmt.name} rows of K = {k} values: K must be a positive multiple of the "
                         f"{fmt.name} block of {fmt.row_step} values")


# ---- numpy reference -----------------------------------------------------------------------------------------
def encode(w: np.ndarray, fmt: str) -> np.ndarray:
    """float rows [N, K] -> the format's bytes [N, row_bytes] (quants.quantize; bf16 rounds to nearest even)."""
    return quantize(w, fmt_of(fmt).ggml)


def reference(raw: np.ndarray, fmt: str, x: np.ndarray) -> np.ndarray:
    """Y [M, N] = X [M, K] times the dequantized rows of raw [N, row_bytes]^T, in float64: the exact product."""
    w = dequantize(raw, fmt_of(fmt).ggml).astype(np.float64)
    return np.atleast_2d(x).astype(np.float64) @ w.T


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activations [M, K] (K a multiple of 32) as quant.cuh's quantize_xblock makes them: per 32 values
    dx = fl(max|x| / 127) and qx = rint(fl(x * fl(1 / dx))) (0 where dx = 0), and the sum v of the 32 qx.
    Returns qx int32 [M, K], dx float32 [M, K/32], v int32 [M, K/32]."""
    x = np.atleast_2d(np.asarray(x, np.float32))
    m, k = x.shape
    if k % 32:
        raise ValueError(f"activations of K = {k} values: quantized products need K a multiple of 32")
    b = x.reshape(m, k // 32, 32)
    dx = np.abs(b).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(dx > 0, np.float32(1) / dx, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int32)
    return q.reshape(m, k), dx, q.sum(axis=-1, dtype=np.int32)


def xblocks(x: np.ndarray) -> np.ndarray:
    """The XBlocks [M, K/32 * 48] of activations x, row by row (quant.cuh's XBlock: the 32 qx as int8, dx,
    fl(dx * v) for v the sum of the 32 qx, and the sums of qx[0:16] and qx[16:32], all little-endian). The GPU holds
    them in the layout of xblock_index (place_xblocks, xblocks_of)."""
    q, dx, sums = quantize_x(x)
    m, k = q.shape
    out = np.zeros((m, k // 32, XBLOCK_BYTES), np.uint8)
    out[..., :32] = q.astype(np.int8).view(np.uint8).reshape(m, k // 32, 32)
    out[..., 32:36] = dx.astype("<f4")[..., None].view(np.uint8)
    out[..., 36:40] = (dx * sums.astype(np.float32)).astype("<f4")[..., None].view(np.uint8)
    halves = q.reshape(m, k // 32, 2, 16).sum(axis=-1, dtype=np.int32)  # Q6_K's two scales split a block in halves
    out[..., 40:48] = halves.astype("<i4").view(np.uint8).reshape(m, k // 32, 8)
    return out.reshape(m, -1)


def xblock_index(m, kb, k: int):
    """Where row m's XBlock kb lies in a buffer of XBlocks of rows of k values, in XBlocks (quant.cuh's xblock_index):
    in groups of XGROUP rows, in a group slice by slice (XSLICE XBlocks), in a slice row by row, each row's XBlocks in
    a slot of XSLOT."""
    m, kb, slices = np.asarray(m), np.asarray(kb), -(-k // (32 * XSLICE))
    return ((m // XGROUP * slices + kb // XSLICE) * XGROUP + m % XGROUP) * XSLOT + kb % XSLICE


def xblock_bytes(rows: int, k: int) -> int:
    """Bytes of the XBlocks of `rows` rows of k values on the GPU (whole groups and slots)."""
    return int(xblock_index(-(-rows // XGROUP) * XGROUP, 0, k)) * XBLOCK_BYTES


def xblock_row(xq: DeviceArray | None, m: int, k: int) -> DeviceArray | None:
    """A buffer of XBlocks of rows of k values from row m's first on: where a kernel that writes one row, as its row
    0 (a mixer of one token), puts row m (None: None)."""
    if xq is None:
        return None
    at = int(xblock_index(m, 0, k)) * XBLOCK_BYTES
    return xq.view(xq.nbytes - at, offset_bytes=at)


def place_xblocks(buf: np.ndarray, b: np.ndarray, at=None) -> None:
    """XBlocks b [n, K/32 * 48] (xblocks' rows) into the bytes buf as its rows `at` (default 0 .. n - 1) in the GPU's
    layout: a host stand-in for the kernels that write them."""
    b = np.asarray(b, np.uint8).reshape(len(b), -1, XBLOCK_BYTES)
    m, kb = np.meshgrid(np.arange(len(b)) if at is None else np.asarray(at), np.arange(b.shape[1]), indexing="ij")
    _xblock_array(buf)[xblock_index(m, kb, 32 * b.shape[1])] = b


def xblocks_of(buf: np.ndarray, m: int, k: int) -> np.ndarray:
    """The XBlocks [m, k/32 * 48] of m rows of k values in the GPU's layout, from its bytes buf (xblocks' form)."""
    r, kb = np.meshgrid(np.arange(m), np.arange(k // 32), indexing="ij")
    return _xblock_array(buf)[xblock_index(r, kb, k)].reshape(m, -1)


def _xblock_array(buf: np.ndarray) -> np.ndarray:
    flat = buf.reshape(-1).view(np.uint8)
    return flat[:flat.size // XBLOCK_BYTES * XBLOCK_BYTES].reshape(-1, XBLOCK_BYTES)


def _int_weights(raw: np.ndarray, fmt: Format) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The weights as the integer products read them, in pieces of 32 values: q int32 [N, K] (Q6_K: sc * (q - 32),
    its int8 scale of 16 values folded in; the others: q as stored), the scale of each piece float32 [N, K/32]
    (Q4_K, Q5_K: fl(d * sc); the others: d) and its min (Q4_K, Q5_K: fl(dmin * m); Q4_0: 8 d, its offset; None for
    Q8_0 and Q6_K)."""
    n = len(raw)
    blk = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, quants.block_shape(fmt.ggml)[1])
    mins = None
    if fmt.ggml == GGMLType.Q8_0:
        q, scale = blk[:, 2:].view(np.int8).astype(np.int32), _half(blk[:, 0:2])
    elif fmt.ggml == GGMLType.Q4_0:
        q, scale = np.concatenate([blk[:, 2:] & 0xF, blk[:, 2:] >> 4], axis=1).astype(np.int32), _half(blk[:, 0:2])
        mins = (np.float32(8) * scale).reshape(n, -1)
    elif fmt.ggml == GGMLType.Q6_K:
        sc = np.repeat(blk[:, 192:208].view(np.int8).astype(np.int32), 16, axis=1)
        q = (q6_k_values(blk).astype(np.int32) - 32) * sc
        scale = np.repeat(_half(blk[:, 208:210]), 8, axis=1)
    else:  # Q4_K, Q5_K
        q5 = fmt.ggml == GGMLType.Q5_K
        sc, m = _scale_min_k4(blk[:, 4:16])
        q = _nibbles_k(blk[:, 48:176] if q5 else blk[:, 16:144])
        if q5:
            q = q | (((blk[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        q = q.astype(np.int32)
        scale = _half(blk[:, 0:2]) * sc
        mins = (_half(blk[:, 2:4]) * m).reshape(n, -1)
    return q.reshape(n, -1), scale.reshape(n, -1), mins


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fl(a b + c) for float32 a, b, c, rounded once, as an fp32 FMA: a b is exact in float64, the sum with c is
    rounded to odd there (two-sum's error tells which neighbour is odd), and rounding that to float32 then rounds
    the exact a b + c (53 bits hold 24 + 2)."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    z = s - p
    err = (p - (s - z)) + (c - z)  # p + c = s + err exactly
    even = (s.view(np.int64) & 1) == 0
    return np.where((err != 0) & even, np.nextafter(s, np.copysign(np.inf, err)), s).astype(np.float32)


@dataclass(frozen=True)
class PieceFactors:
    """What a quantized kernel adds into a sum per piece (32 values) of a row and an activation row (quant.cuh's
    group_acc): acc = fma(-b, dxv, fma(a, fl(dx u), acc)) for the formats with mins, acc = fl(acc + fl(dx fl(a u)))
    for the others. a, b float32 [N, pieces] (b None: no mins), u float32 [M, N, pieces] (exact integers),
    dx and dxv = fl(dx v) float32 [M, pieces]."""
    a: np.ndarray
    b: np.ndarray | None
    u: np.ndarray
    dx: np.ndarray
    dxv: np.ndarray

    def accumulate(self, acc: np.ndarray, t) -> np.ndarray:
        """acc [M, N] (t an index into the pieces) or [M, N, len(t)] (t indices) with those pieces added, as a
        lane adds them."""
        a, u, dx = self.a[:, t], self.u[:, :, t], self.dx[:, None, t]
        if self.b is None:
            return acc + dx * (a * u)
        return fma32(-self.b[:, t], self.dxv[:, None, t], fma32(a, dx * u, acc))


def piece_factors(raw: np.ndarray, fmt: str, x: np.ndarray) -> PieceFactors:
    """The per-piece factors of Y = X W^T in the quantized formats' kernels (see PieceFactors)."""
    f = fmt_of(fmt)
    if not f.quantizes_x:
        raise ValueError(f"{f.name} multiplies fp32 activations: use reference()")
    qx, dx, v = quantize_x(x)
    qw, scale, mins = _int_weights(raw, f)
    n, m = len(raw), len(qx)
    u = np.einsum("npk,mpk->mnp", qw.reshape(n, -1, 32), qx.reshape(m, -1, 32), dtype=np.int64)
    return PieceFactors(scale, mins, u.astype(np.float32), dx, dx * v.astype(np.float32))  # |u| < 2^24: exact


def sums_by_quads(spec: ChipSpec, fmt: Format) -> bool:
    """Whether `fmt`'s products are summed by quads of lanes in `spec`'s builds (quant.cuh's QuadSums), not by lanes:
    for the formats that take them (Format.quad_sums) where the spec asks (tuning.qgemv.quad_sums, with the int8 mma
    GEMM, whose thread then keeps one class sum an output instead of four: M-tiles of 24 in the registers)."""
    return fmt.quad_sums and spec.tuning.qgemv.quad_sums


def classes(quads: bool) -> int:
    """Sums a warp keeps apart for an output (qgemm_mma's class sums): its quads', or its lanes'."""
    return 8 if quads else 32


def emulate(raw: np.ndarray, fmt: str, x: np.ndarray, quads: bool = False) -> np.ndarray:
    """Y [M, N] float32 as the quantized formats' kernels compute it, bit for bit: lane l of a warp adds piece l of
    every slice of 32 pieces (K order) into its sum (PieceFactors.accumulate; lanes past the end of a partial last
    slice add nothing), then the 32 lane sums meet in warp_sum's butterfly. With quads (sums_by_quads) each quad of
    lanes adds its 4 terms (each from a sum of 0) pairwise, (t0 + t1) + (t2 + t3), into its sum, and the 8 quads' sums
    meet in the butterfly's last three steps."""
    pf = piece_factors(raw, fmt, x)
    m, n, pieces = pf.u.shape
    acc = np.zeros((m, n, classes(quads)), np.float32)
    for s0 in range(0, pieces, 32):
        lanes = min(32, pieces - s0)
        if quads:  # K is whole quads (rows of whole 256-value blocks)
            t = pf.accumulate(np.zeros((m, n, lanes), np.float32), np.arange(s0, s0 + lanes))
            quad = (t[..., 0::4] + t[..., 1::4]) + (t[..., 2::4] + t[..., 3::4])
            acc[..., :lanes // 4] = acc[..., :lanes // 4] + quad
        else:
            acc[..., :lanes] = pf.accumulate(acc[..., :lanes], np.arange(s0, s0 + lanes))
    w = classes(quads) // 2
    while w:  # lane (quad) l < w adds l + w's sum
        acc[..., :w] = acc[..., :w] + acc[..., w:2 * w]
        w //= 2
    return acc[..., 0]


def quantization_bound(raw: np.ndarray, fmt: str, x: np.ndarray, quads: bool = False) -> np.ndarray:
    """[M, N]: a bound on |emulate - reference| (float64). Per value, |x - dx qx| <= dx (1/2 + 2^-16) (rint of
    fl(x fl(1 / dx)), two roundings of a value of at most 127.5), times |w|; and the fp32 roundings, each within
    2^-24 of the magnitudes summed so far ((|scale q| + |min|) |dx qx| per value): per piece fl(dx u), dxv's and
    up to two in the exact product's own dequantized weight, two FMAs per slice in a lane's sum (with quads: and the
    quad's three adds), 5 in the butterfly."""
    f = fmt_of(fmt)
    qx, dx, _ = quantize_x(x)
    qw, scale, mins = _int_weights(raw, f)
    w = np.abs(dequantize(raw, f.ggml)).astype(np.float64)
    mag = np.abs(np.repeat(scale, 32, axis=1) * qw).astype(np.float64)
    if mins is not None:
        mag += np.abs(np.repeat(mins, 32, axis=1))
    xd = np.repeat(dx, 32, axis=1).astype(np.float64)
    roundings = 4 + (5 if quads else 2) * -(-qx.shape[1] // f.slice_values) + 5
    return (xd * (0.5 + 2.0**-16)) @ w.T + roundings * 2.0**-24 * (np.abs(qx) * xd) @ mag.T


# ---- kernel shapes -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tuning:
    threads: int
    rows: int        # rows per warp (their pieces share each activation load)
    mt: int          # activation rows per block (1: the GEMV)
    span: int        # K-slices per item (a warp's unit of loads)
    stages: int = 0  # items in each warp's shared-memory ring; 0: loads straight into registers
    mma: bool = False  # the GEMM on int8 tensor cores (qgemm_mma: `rows` tiles of 16 rows a block, 8 warps, a
                       # block-wide ring of `stages` slices; span unused)
    min_blocks: int = 2  # blocks an SM at least (__launch_bounds__: a register cap)

    def name(self, fmt: Format, k: int) -> str:
        floor = f"_mb{self.min_blocks}" if self.min_blocks != 2 else ""
        if self.mma:
            return f"qgemm_mma_m{self.mt}_r{self.rows}_{fmt.name}_k{k}_t{self.threads}_st{self.stages}{floor}"
        kind = "qgemv" if self.mt == 1 else f"qgemm_m{self.mt}"
        ring = f"_st{self.stages}" if self.stages else ""
        return f"{kind}_{fmt.name}_k{k}_r{self.rows}_s{self.span}_t{self.threads}{ring}{floor}"

    def rows_per_block(self) -> int:
        return MMA_ROWS * self.rows if self.mma else self.threads // 32 * self.rows

    def smem(self, fmt: Format, k: int, quads: bool = False) -> int:
        """Dynamic shared memory of a block: each warp's ring of `stages` items of rows x span slots; for mma the
        larger of the block's ring (`stages` slices of its rows, unpadded, and of mt activation rows, each in a slot
        of an odd number of 16-byte words) and the class sums (classes(quads)) of its rows x mt outputs, which reuse the
        ring's memory, then an mbarrier a stage (sm_90's bulk copies)."""
        if self.mma:
            rows = self.rows_per_block()
            stage = rows * fmt.slice_bytes + self.mt * XSLOT * XBLOCK_BYTES
            return max(self.stages * stage, classes(quads) * rows * self.mt * 4) + 8 * self.stages  # + the mbarriers
        return self.threads // 32 * self.stages * self.rows * self.span * fmt.slot_bytes

    def grid(self, n: int, m: int) -> int:
        """Blocks for N rows and M activation rows: one per row group and M-tile, the M-tiles of a row group
        consecutive (they run together and share the weights through L2)."""
        return -(-n // self.rows_per_block()) * -(-m // self.mt)


def tunings(spec: ChipSpec, fmt: Format, k: int, model: str | None = None) -> list[Tuning]:
    """The spec's kernels for rows of K values: the GEMV (M = 1), then the GEMM's M-tiles 2, 4, ... up to the
    spec's gemm_m_tile (a call takes the smallest that holds its M: every activation row of a tile costs its
    products whether it exists or not); spans no longer than K's slices. With tuning.qgemv.gemm = mma, the formats
    that have it also get the GEMMs on int8 tensor cores (mma_tilings, MMA_STAGES), which calls of at least
    the format's gemm_mma_from rows take (for_rows), and only the M-tiles that some smaller M takes."""
    q = spec.tuning.qgemv
    slices = -(-k // fmt.slice_values)
    mma = q.gemm == "mma" and fmt.mma
    gemms = [Tuning(q.threads, q.gemm_rows_per_warp, mt, min(q.gemm_span, slices), q.stages)
             for mt in (2, 4, 8, 16) if mt <= q.gemm_m_tile and not (mma and tile_from(mt) >= q.mma_from_for(fmt.name))]
    if mma:
        gemms += [Tuning(MMA_THREADS, tiles, mt, 1, MMA_STAGES, mma=True, min_blocks=floor)
                  for mt, tiles, floor in mma_tilings(spec, fmt)]
    gemv = Tuning(q.threads, q.rows_per_warp, 1, min(q.span, slices), q.stages, min_blocks=q.min_blocks_for(model))
    return [gemv, *gemms]


def mma_tilings(spec: ChipSpec, fmt: Format) -> tuple[tuple[int, int, int], ...]:
    """(M-tile, row tiles a block, blocks an SM at least) of `fmt`'s mma GEMMs in `spec`'s builds: QUAD_TILINGS'
    where its sums go by quads, else MMA_TILINGS'."""
    return QUAD_TILINGS[fmt.name] if sums_by_quads(spec, fmt) else MMA_TILINGS[fmt.name]


def tile_from(mt: int) -> int:
    """The smallest M that takes the GEMM's M-tile mt (of 2, 4, 8, 16: the one past half of it; 2 for 2)."""
    return max(2, mt // 2 + 1)


def for_rows(kernels: Sequence[Tuning], m: int, mma_from: int = 2, n: int | None = None, sm_count: int = 0) -> Tuning:
    """The kernel for M rows (of N of W, on sm_count SMs): an int8 mma GEMM where there is one and M >= mma_from (or
    they are the only kernels), the one with the fewest M-tiles for M, then the smallest M-tile, then the most row
    tiles a block whose grid still gives every SM FILL_BLOCKS blocks (else the fewest: N unknown, the most); else the
    GEMV for one row, the smallest M-tile holding them, or the largest."""
    mma = [t for t in kernels if t.mma]
    rest = [t for t in kernels if not t.mma]
    if mma and (not rest or m >= max(2, mma_from)):
        best = min(mma, key=lambda t: (-(-m // t.mt), t.mt))
        tilings = sorted((t for t in mma if t.mt == best.mt), key=lambda t: t.rows)
        if n is None:
            return tilings[-1]
        return next((t for t in reversed(tilings) if t.grid(n, m) >= FILL_BLOCKS * sm_count), tilings[0])
    fits = [t for t in rest if t.mt >= m and (m == 1 or t.mt > 1)]
    return min(fits, key=lambda t: t.mt) if fits else max(rest, key=lambda t: t.mt)


# ---- which (format, K) pairs a model needs -------------------------------------------------------------------
def _matrix_pairs(items: Iterable[tuple[str, GGMLType, tuple[int, ...]]], tied: bool) -> list[tuple[str, int]]:
    """(format, K) of the matrices a forward multiplies: 2-D tensors except the conv1d taps and the embeddings
    (a row gather), unless the embeddings are tied and serve as the LM head."""
    out = set()
    for name, t, shape in items:
        if len(shape) != 2 or "conv1d" in name or ("token_embd" in name and not tied):
            continue
        if t not in (GGMLType.F32, GGMLType.F16):
            out.add((fmt_of(t).name, shape[-1]))
    return sorted(out)


def mix_pairs(model: ModelConfig, mix: str = "q4_k_m") -> list[tuple[str, int]]:
    """The (format, K) pairs of `model` quantized with lucegen's rendition of a llama.cpp mix."""
    from ..model.checkpoint import gguf_types
    from ..model.gguf_file import gguf_name, gguf_shape
    from ..model.weights import weight_shapes
    types, _ = gguf_types(model, mix)
    return _matrix_pairs(((gguf_name(n), types[n], gguf_shape(n, s)) for n, s in weight_shapes(model).items()),
                         model.tie_word_embeddings)


def gguf_pairs(checkpoint) -> list[tuple[str, int]]:
    """The (format, K) pairs of a GGUF file's matrices (lucegen.model.gguf_file.GGUFCheckpoint)."""
    raws = (checkpoint.raw(name) for name in checkpoint.tensors)
    return _matrix_pairs(((r.name, r.type, r.shape) for r in raws), checkpoint.config.tie_word_embeddings)


def units(spec: ChipSpec, model: ModelConfig, pairs: Iterable[tuple[str, int]] | None = None,
          extra: Iterable[Tuning] = ()) -> list[KernelUnit]:
    """One unit per format: the GEMV and the GEMM of each of its K (and a kernel for each of the `extra` tunings:
    bench qgemv --tune; mma ones only for the formats that have it), and the format's dequantizer, all of them
    summing as sums_by_quads says. By default the pairs of the model in DEFAULT_MIX that the spec runs; an engine
    loading a GGUF file passes gguf_pairs(file)."""
    if pairs is None:
        pairs = [(f, k) for f, k in mix_pairs(model, DEFAULT_MIX) if f in spec.tuning.weight_formats]
    pairs = sorted(set(pairs))
    threads = spec.tuning.qgemv.threads
    out = []
    for name in dict.fromkeys(f for f, _ in pairs):
        fmt = fmt_of(name)
        quads = sums_by_quads(spec, fmt)
        kernels = {}
        for k in sorted(k for f, k in pairs if f == name):
            check_k(fmt, k)
            for t in (*tunings(spec, fmt, k, model.name), *(e for e in extra if fmt.mma or not e.mma)):
                t = dataclasses.replace(t, span=min(t.span, -(-k // fmt.slice_values)))
                smem = t.smem(fmt, k, quads)
                if smem > spec.chip.smem_per_block:
                    raise ValueError(f"{spec.name}: {t.name(fmt, k)} needs {smem} bytes of shared memory; "
                                     f"a block may use {spec.chip.smem_per_block}")
                kernels[t.name(fmt, k)] = {"name": t.name(fmt, k), "k": k, "mt": t.mt, "rows": t.rows,
                                           "span": t.span, "stages": t.stages, "threads": t.threads, "mma": t.mma,
                                           "smem": smem, "min_blocks": t.min_blocks}
        sigs = tuple(KernelSig(k["name"], k["threads"], dynamic_smem=k["smem"]) for k in kernels.values())
        quant = (KernelSig("qquant_x", threads),) if fmt.quantizes_x else ()
        out.append(KernelUnit(f"qgemv_{fmt.name}", "qgemv.cu.j2",
                              {"fmt": fmt.name, "threads": threads,
                               "cls": f"QuadSums<{fmt.cls}>" if quads else fmt.cls, "kernels": list(kernels.values())},
                              (*sigs, *quant, KernelSig(f"qdequant_{fmt.name}", threads))))
    return out


# ---- launchers -----------------------------------------------------------------------------------------------
def device_weights(raw: np.ndarray, fmt: str) -> DeviceArray:
    """GGUF rows [N, gguf_row_bytes] of format `fmt` on the device as the kernels read them (Format.device_matrix)."""
    return device_bytes(fmt_of(fmt).device_matrix(raw))


def device_bytes(raw: np.ndarray) -> DeviceArray:
    """Bytes on the device, the allocation padded to a 16-byte multiple (the kernels read whole 16-byte words)."""
    raw = np.ascontiguousarray(raw).view(np.uint8).ravel()
    out = DeviceArray.empty(-(-raw.size // 16) * 16, np.uint8)
    out.view(raw.size).copy_from(raw)
    return out


class QMatmul:
    """Y [M, N] = X [M, K] W^T for W [N, K] in format `fmt`: the GEMV kernel for M = 1, the GEMM for M > 1. For the
    quantized formats X is first quantized (qquant_x) into a scratch buffer this object owns: calls that may run
    at the same time on different streams need one QMatmul each."""

    def __init__(self, module, spec: ChipSpec, fmt: str, k: int, kernels: Sequence[Tuning] | None = None,
                 model: str | None = None):
        self.fmt, self.k = fmt_of(fmt), k
        self.tunings = list(kernels or tunings(spec, self.fmt, k, model))
        self.mma_from = spec.tuning.qgemv.mma_from_for(self.fmt.name)
        self.sm_count = spec.chip.sm_count
        self.kernels = {t: module.kernel(t.name(self.fmt, k)) for t in self.tunings}
        self.quads = sums_by_quads(spec, self.fmt)  # how the kernels sum (emulate's quads)
        self.smem = {t: t.smem(self.fmt, k, self.quads) for t in self.tunings}
        for t, kernel in self.kernels.items():
            if self.smem[t] > 48 * 1024:  # past the default dynamic shared memory: opt in
                kernel.set_max_dynamic_smem(self.smem[t])
        self.quant = module.kernel("qquant_x") if self.fmt.quantizes_x else None
        self.quant_blocks = 4 * spec.chip.sm_count
        self.quant_threads = spec.tuning.qgemv.threads
        # quantized activations: room for a tree verify's rows up front (no allocation in the calls a graph may
        # capture), grown if a call brings more
        self.xq = DeviceArray.empty(xblock_bytes(VERIFY_ROWS, k), np.uint8) if self.quant else None

    def __call__(self, w: DeviceArray, x: DeviceArray, y: DeviceArray, n: int, m: int = 1, stream=None,
                 xq: DeviceArray | None = None, ldy: int | None = None) -> None:
        """Y = X W^T. xq: X's XBlocks made already (by the kernel that wrote X: quant.cuh's quantize_xblock_lanes), for
        the quantized formats; else this call quantizes X first (qquant_x). ldy: floats from one row of Y to the next
        (default n; more writes W's n columns into wider rows, e.g. a part of a fused projection: the GEMMs, or one
        row)."""
        ldy = n if ldy is None else ldy
        if n < 1 or m < 1 or ldy < n:
            raise ValueError(f"need at least one row of W and of X, and rows of Y at least n apart; got n = {n}, "
                             f"m = {m}, ldy = {ldy}")
        if w.nbytes < -(-self.fmt.matrix_bytes(n, self.k) // 16) * 16:
            raise ValueError(f"{self.fmt.name} weights of {n} rows x {self.k} need {self.fmt.matrix_bytes(n, self.k)} "
                             f"bytes padded to 16 (device_weights); got {w.nbytes}")
        if x.size < m * self.k or y.size < (m - 1) * ldy + n or x.dtype != np.float32 or y.dtype != np.float32:
            raise ValueError(f"x must be fp32 [{m}, {self.k}] and y fp32 [{m}, {n}] (rows {ldy} apart); got {x} and {y}")
        t = self.tuning_for(m, n)
        if t.mt == 1 and m > 1 and ldy != n:
            raise ValueError(f"{t.name(self.fmt, self.k)} writes Y's rows n = {n} apart, not {ldy}")
        if self.quant is not None:
            nbytes = xblock_bytes(m, self.k)
            if xq is not None:
                if xq.nbytes < nbytes:
                    raise ValueError(f"xq must hold the XBlocks of x [{m}, {self.k}] ({nbytes} bytes); got {xq}")
                x = xq
            else:
                if self.xq.nbytes < nbytes:
                    self.xq.free()
                    self.xq = DeviceArray.empty(nbytes, np.uint8)
                blocks = m * self.k // 32
                self.quant(min(self.quant_blocks, -(-blocks // self.quant_threads)), self.quant_threads, x, self.xq,
                           m, self.k // 32, stream=stream)
                x = self.xq
        self.kernels[t](t.grid(n, m), t.threads, w, x, y, n, m,
                        *((ldy,) if t.mt > 1 else ()), smem=self.smem[t], stream=stream)

    def tuning_for(self, m: int, n: int | None = None) -> Tuning:
        """The kernel a call of M rows (of N of W: the grid it fills, for_rows) takes."""
        return for_rows(self.tunings, m, self.mma_from, n, self.sm_count)

    def free(self) -> None:
        if self.xq is not None:
            self.xq.free()


class Dequant:
    """out [N, K] fp32 = the values of N rows of K (a kernel around qdequant<F>: a format's decode alone), e.g.
    module.kernel("qdequant_q4_k")."""

    def __init__(self, kernel, spec: ChipSpec, threads: int):
        self.kernel, self.threads, self.blocks = kernel, threads, 4 * spec.chip.sm_count

    def __call__(self, w: DeviceArray, out: DeviceArray, n: int, k: int, stream=None) -> None:
        if out.size < n * k or out.dtype != np.float32:
            raise ValueError(f"out must be fp32 [{n}, {k}]; got {out}")
        self.kernel(self.blocks, self.threads, w, out, n, k, stream=stream)
