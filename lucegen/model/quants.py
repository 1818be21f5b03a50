"""GGUF tensor formats: numpy dequantizers and quantizers for the types lucegen runs.

Dequantizers are bit-equal to `gguf.quants.dequantize` (tested on random blocks). Quantizers write blocks that
ggml reads: Q8_0 and Q4_0 are gguf's own (bit-exact ports of llama.cpp's reference); Q4_K, Q5_K and Q6_K follow
llama.cpp's `quantize_row_q{4,5,6}_K_ref` (ggml-quants.c): the same scale searches (`make_qkx2_quants`,
`make_qx_quants`), vectorised over blocks in float32, so they are close to, not bit-identical with, llama.cpp's
output (sums are accumulated in a different order).

Every type is a sequence of blocks along a row (ggml's ne0, numpy's last axis); a row of n values takes
n / block_elems * block_bytes bytes. All multi-byte fields are little-endian; `half` is IEEE fp16.
Byte offsets inside one block (these are what the CUDA kernels read):

F32   1 value,   4 B: float32.
F16   1 value,   2 B: fp16.
BF16  1 value,   2 B: the upper 16 bits of a float32.
Q8_0  32 values, 34 B:  [0:2] half d | [2:34] int8 qs[32].                       x[j] = d * qs[j]
Q4_0  32 values, 18 B:  [0:2] half d | [2:18] u8 qs[16].
      x[j] = d * ((qs[j] & 0xF) - 8),  x[j+16] = d * ((qs[j] >> 4) - 8)   for j < 16
Q4_K  256 values, 144 B: [0:2] half d | [2:4] half dmin | [4:16] u8 scales[12] | [16:144] u8 qs[128].
      8 sub-blocks s of 32 values, each with a 6-bit scale sc[s] and a 6-bit min m[s] packed in scales[12]:
        s < 4:  sc = scales[s] & 63,                                m = scales[s+4] & 63
        s >= 4: sc = (scales[s+4] & 0xF) | ((scales[s-4] >> 6) << 4), m = (scales[s+4] >> 4) | ((scales[s] >> 6) << 4)
      qs is four 32-byte chunks c: value 32*s + l with s = 2c takes the low nibble of qs[32c + l], s = 2c+1 the
      high nibble.                                          x = (d * sc[s]) * q - (dmin * m[s])
Q5_K  256 values, 176 B: [0:2] half d | [2:4] half dmin | [4:16] u8 scales[12] | [16:48] u8 qh[32] |
      [48:176] u8 qs[128].
      As Q4_K (same scales, same nibble order in qs) plus a fifth bit: bit s of qh[l] is bit 4 of value 32*s + l.
Q6_K  256 values, 210 B: [0:128] u8 ql[128] | [128:192] u8 qh[64] | [192:208] int8 scales[16] | [208:210] half d.
      Two halves h of 128 values; in half h, for l < 32 (ql_h = ql[64h:], qh_h = qh[32h:]):
        value 128h + l      = (ql_h[l]    & 0xF) | ((qh_h[l] >> 0) & 3) << 4
        value 128h + l + 32 = (ql_h[l+32] & 0xF) | ((qh_h[l] >> 2) & 3) << 4
        value 128h + l + 64 = (ql_h[l]    >> 4)  | ((qh_h[l] >> 4) & 3) << 4
        value 128h + l + 96 = (ql_h[l+32] >> 4)  | ((qh_h[l] >> 6) & 3) << 4
      value i belongs to sub-block i // 16.                 x = (d * scales[i // 16]) * (q - 32)
Alignment inside a row: Q4_K (144 B) and Q5_K (176 B) blocks are multiples of 16 bytes; Q8_0 (34 B), Q4_0 (18 B)
and Q6_K (210 B) blocks are only 2-byte aligned. (The GPU holds Q6_K rows repacked: lucegen/kernels/repack.py.)
"""
from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GGMLType
from gguf import quants as gguf_quants

SUPPORTED = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
             GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)
QK_K = 256
_CHUNK_VALUES = 1 << 20  # values per vectorised step: bounds the temporaries


class QuantError(ValueError):
    """A tensor type lucegen cannot handle, or data that does not fit a type."""


def ggml_type(t: GGMLType | int | str) -> GGMLType:
    """The GGMLType for an enum value, its number or its name ('Q4_K'); QuantError when not supported."""
    try:
        t = GGMLType[t.upper()] if isinstance(t, str) else GGMLType(t)
    except (KeyError, ValueError):
        raise QuantError(f"unknown ggml type {t!r}") from None
    if t not in SUPPORTED:
        raise QuantError(f"ggml type {t.name} is not supported (supported: {', '.join(s.name for s in SUPPORTED)})")
    return t


def block_shape(t: GGMLType) -> tuple[int, int]:
    """(values per block, bytes per block)."""
    return GGML_QUANT_SIZES[t]


def row_bytes(t: GGMLType, n: int) -> int:
    elems, nbytes = block_shape(t)
    if n % elems:
        raise QuantError(f"row length {n} is not a multiple of the {t.name} block size {elems}")
    return n // elems * nbytes


# ---- dequantization: uint8 blocks [n, block_bytes] -> float32 [n, block_elems] ---------------------------------
def _half(b: np.ndarray) -> np.ndarray:
    """Two bytes per row -> float32 column [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K block from its 12 packed bytes, as float32 [n, 8]."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def _nibbles_k(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K qs[128] -> low 4 bits of the 256 values as [n, 8, 32] (sub-block, position)."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0xF).reshape(-1, 8, 32)


def _dq_q8_0(b):
    return b[:, 2:].view(np.int8).astype(np.float32) * _half(b[:, 0:2])


def _dq_q4_0(b):
    q = np.concatenate([b[:, 2:] & 0xF, b[:, 2:] >> 4], axis=1).astype(np.int8) - np.int8(8)
    return _half(b[:, 0:2]) * q.astype(np.float32)


def _dq_k(b, q5: bool):
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, m = _scale_min_k4(b[:, 4:16])
    q = _nibbles_k(b[:, 48:176] if q5 else b[:, 16:144])
    if q5:
        q = q | (((b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    return ((d * sc)[:, :, None] * q.astype(np.float32) - (dmin * m)[:, :, None]).reshape(-1, QK_K)


def q6_k_values(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [n, 210] -> their 6-bit values q (0 .. 63, before the offset of 32) uint8 [n, 256]."""
    ql = b[:, 0:128].reshape(-1, 2, 1, 2, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)
    ql = (ql & 0xF).reshape(-1, 2, 4, 32)  # [half, k, l]: k = 0..3 -> offsets 0, 32, 64, 96
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return (ql | (qh << 4)).reshape(-1, QK_K)


def _dq_q6_k(b):
    q = (q6_k_values(b).astype(np.int8) - np.int8(32)).reshape(-1, 16, 16).astype(np.float32)
    scale = _half(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return (scale[:, :, None] * q).reshape(-1, QK_K)


_DEQUANT: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.F32: lambda b: b.view(np.float32),
    GGMLType.F16: lambda b: b.view(np.float16).astype(np.float32),
    GGMLType.BF16: lambda b: b.view(ml_dtypes.bfloat16).astype(np.float32),
    GGMLType.Q8_0: _dq_q8_0,
    GGMLType.Q4_0: _dq_q4_0,
    GGMLType.Q4_K: lambda b: _dq_k(b, q5=False),
    GGMLType.Q5_K: lambda b: _dq_k(b, q5=True),
    GGMLType.Q6_K: _dq_q6_k,
}


# ---- quantization: float32 blocks [n, block_elems] -> uint8 [n, block_bytes] ---------------------------------
def _qkx2(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp make_qkx2_quants on each row of x (one sub-block): (scale, min) with x ~ scale * L - min,
    L in [0, nmax], chosen among nstep + 1 grid offsets by weighted least squares (weights av_x + |x|)."""
    w = np.sqrt(np.mean(x * x, axis=1, keepdims=True)) + np.abs(x)
    lo, hi = np.minimum(x.min(1, keepdims=True), 0), x.max(1, keepdims=True)
    span = np.where(hi > lo, hi - lo, 1)
    sw, sx = w.sum(1), (w * x).sum(1)
    scale, mn = (span / nmax)[:, 0], lo[:, 0]
    L = np.clip(np.rint(nmax / span * (x - lo)), 0, nmax)
    best = (w * (scale[:, None] * L + lo - x) ** 2).sum(1)
    for step in range(nstep + 1):
        L = np.clip(np.rint((rmin + rdelta * step + nmax) / span * (x - lo)), 0, nmax)
        sl, sl2, sxl = (w * L).sum(1), (w * L * L).sum(1), (w * L * x).sum(1)
        det = sw * sl2 - sl * sl
        with np.errstate(divide="ignore", invalid="ignore"):
            s, m = (sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det
            s, m = np.where(m > 0, sxl / sl2, s), np.minimum(m, 0)
        err = (w * (s[:, None] * L + m[:, None] - x) ** 2).sum(1)
        better = (det > 0) & (err < best)
        best, scale, mn = np.where(better, err, best), np.where(better, s, scale), np.where(better, m, mn)
    return np.where(hi[:, 0] > lo[:, 0], scale, 0), -mn


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Inverse of _scale_min_k4: [n, 8] six-bit scales and mins -> [n, 12] bytes."""
    hi_s, hi_m = (ls[:, 4:] >> 4) << 6, (lm[:, 4:] >> 4) << 6
    return np.concatenate([ls[:, :4] | hi_s, lm[:, :4] | hi_m, (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=1)


def _quant_k(x: np.ndarray, q5: bool) -> np.ndarray:
    """quantize_row_q4_K_ref / quantize_row_q5_K_ref on blocks x [n, 256]."""
    nmax = 31 if q5 else 15
    sub = x.reshape(-1, 8, 32)
    scale, mn = _qkx2(sub.reshape(-1, 32), nmax, *((-0.5, 0.1, 15) if q5 else (-1.0, 0.1, 20)))
    scale, mn = scale.reshape(-1, 8), mn.reshape(-1, 8)
    max_scale, max_min = np.maximum(scale.max(1, keepdims=True), 0), np.maximum(mn.max(1, keepdims=True), 0)
    with np.errstate(divide="ignore"):
        ls = np.clip(np.rint(np.where(max_scale > 0, 63 / max_scale, 0) * scale), 0, 63).astype(np.uint8)
        lm = np.clip(np.rint(np.where(max_min > 0, 63 / max_min, 0) * mn), 0, 63).astype(np.uint8)
    d, dmin = (max_scale / 63).astype(np.float16), (max_min / 63).astype(np.float16)
    d_sub, m_sub = d.astype(np.float32) * ls, dmin.astype(np.float32) * lm
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.rint((sub + m_sub[:, :, None]) / d_sub[:, :, None])
    L = np.where(d_sub[:, :, None] > 0, np.clip(L, 0, nmax), 0).astype(np.uint8)  # [n, 8, 32]
    pairs = L.reshape(-1, 4, 2, 32)
    qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    parts = [d.view(np.uint8), dmin.view(np.uint8), _pack_scale_min_k4(ls, lm)]
    if q5:
        parts.append(np.bitwise_or.reduce((L >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate(parts + [qs], axis=1)


def _qx_scale(x: np.ndarray, nmax: int) -> np.ndarray:
    """llama.cpp make_qx_quants(rmse_type=1) on each row of x: the scale of x ~ scale * L, L in [-nmax, nmax-1],
    best of 19 grid offsets by x^2-weighted least squares."""
    amax = x[np.arange(len(x)), np.abs(x).argmax(1)][:, None]
    zero = np.abs(amax[:, 0]) < 1e-15
    amax = np.where(zero[:, None], 1, amax)
    w = x * x

    def fit(iscale):
        L = np.clip(np.rint(iscale * x), -nmax, nmax - 1)
        return (w * x * L).sum(1), (w * L * L).sum(1)

    with np.errstate(divide="ignore", invalid="ignore"):
        sumlx, suml2 = fit(-nmax / amax)
        scale = np.where(suml2 > 0, sumlx / suml2, 0)
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            sumlx, suml2 = fit(-(nmax + 0.1 * step) / amax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, 0, scale)


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref on blocks x [n, 256]."""
    sub = x.reshape(-1, 16, 16)
    scales = _qx_scale(sub.reshape(-1, 16), 32).reshape(-1, 16)
    max_scale = scales[np.arange(len(scales)), np.abs(scales).argmax(1)][:, None]
    live = np.abs(max_scale) >= 1e-15
    with np.errstate(divide="ignore"):
        iscale = np.where(live, -128 / max_scale, 0)
        d = np.where(live, 1 / iscale, 0).astype(np.float16)
    sc = np.clip(np.rint(iscale * scales), -128, 127).astype(np.int8)
    d_sub = d.astype(np.float32) * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.rint(sub / d_sub[:, :, None])
    L = (np.where(d_sub[:, :, None] != 0, np.clip(L, -32, 31), 0) + 32).astype(np.uint8)
    return q6_k_blocks_of(L.reshape(-1, QK_K), sc, d)


def q6_k_blocks_of(q: np.ndarray, scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q6_K blocks [n, 210] of their values q uint8 [n, 256] (0 .. 63), int8 scales [n, 16] and fp16 d [n]
    (q6_k_values undone)."""
    q = q.reshape(-1, 2, 4, 32)  # [half, k, l]
    ql = np.concatenate([(q[:, :, 0] & 0xF) | (q[:, :, 2] << 4), (q[:, :, 1] & 0xF) | (q[:, :, 3] << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales.reshape(-1, 16).view(np.uint8),
                           d.reshape(-1, 1).view(np.uint8)], axis=1)


_QUANT: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.F32: lambda x: x.view(np.uint8),
    GGMLType.F16: lambda x: x.astype(np.float16).view(np.uint8),
    GGMLType.BF16: lambda x: x.astype(ml_dtypes.bfloat16).view(np.uint8),
    GGMLType.Q8_0: lambda x: gguf_quants.quantize(x, GGMLType.Q8_0),
    GGMLType.Q4_0: lambda x: gguf_quants.quantize(x, GGMLType.Q4_0),
    GGMLType.Q4_K: lambda x: _quant_k(x, q5=False),
    GGMLType.Q5_K: lambda x: _quant_k(x, q5=True),
    GGMLType.Q6_K: _quant_q6_k,
}


# ---- public -------------------------------------------------------------------------------------------------
def _blockwise(fn, blocks: np.ndarray, t: GGMLType, out_width: int, out_dtype) -> np.ndarray:
    out = np.empty((len(blocks), out_width), out_dtype)
    step = max(1, _CHUNK_VALUES // block_shape(t)[0])
    for i in range(0, len(blocks), step):
        out[i:i + step] = fn(blocks[i:i + step])
    return out


def dequantize(raw: np.ndarray, t: GGMLType | int | str) -> np.ndarray:
    """uint8 rows [..., row_bytes] of type t -> float32 [..., row_values]."""
    t = ggml_type(t)
    elems, nbytes = block_shape(t)
    raw = np.atleast_1d(np.ascontiguousarray(raw)).view(np.uint8)
    if raw.shape[-1] % nbytes:
        raise QuantError(f"{t.name}: {raw.shape[-1]} bytes per row is not a multiple of the block size {nbytes}")
    out = _blockwise(_DEQUANT[t], raw.reshape(-1, nbytes), t, elems, np.float32)
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes * elems)


def quantize(x: np.ndarray, t: GGMLType | int | str) -> np.ndarray:
    """float rows [..., n] -> uint8 [..., row_bytes(t, n)] of type t."""
    t = ggml_type(t)
    elems, nbytes = block_shape(t)
    x = np.ascontiguousarray(x, dtype=np.float32)
    row_bytes(t, x.shape[-1])
    if not np.isfinite(x).all():
        raise QuantError(f"{t.name}: cannot quantize non-finite values")
    with np.errstate(over="ignore"):  # an overflowing scale is reported below
        out = _blockwise(_QUANT[t], x.reshape(-1, elems), t, nbytes, np.uint8)
    if t != GGMLType.F32 and not np.isfinite(_blockwise(_DEQUANT[t], out, t, elems, np.float32)).all():
        raise QuantError(f"{t.name}: values too large for the format (an fp16 value or scale overflows)")
    return out.reshape(*x.shape[:-1], x.shape[-1] // elems * nbytes)
