"""KV-cache formats: numpy reference encoders and decoders, their sizes, and the logits error each gives the
reference forward against bf16 KV.

The cache holds, per attention layer, position and KV head, one row of head_dim values: the key after k_norm and
RoPE, or the value as projected. Each format encodes such rows along head_dim (spec.KV_FORMATS):

bf16   2 bytes per value.
fp8    float8 e4m3 (sm_89+), 1 byte per value, no scale; values beyond +-448 saturate.
q8_0   GGUF Q8_0 blocks of 32 values (34 bytes: fp16 d, int8 q[32]), quants.py's layout and rounding.
q4_0   GGUF Q4_0 blocks of 32 values (18 bytes: fp16 d, 16 bytes of nibbles).
tq3_0  TurboQuant-style, 3.5 bits per value, in groups of 128 values (head_dim must be a multiple of 128):
       the group x is rotated, y = R x / |x| with R = D2 H D1 (D1, D2: fixed random sign flips SIGNS1, SIGNS2;
       H: the 128-point Walsh-Hadamard transform scaled by 1/sqrt(128), so R is orthonormal and R^-1 = D1 H D2);
       each coordinate of y (about N(0, 1/128)) is replaced by the nearest of the 8 Lloyd-Max levels TQ3_LEVELS
       of that distribution (the exact marginal of a uniformly random unit vector in R^128); the group stores
       the 3-bit indices and one fp16 scale s = |x| / |c| (c the vector of chosen levels), so the decoded group
       R^-1 (s c) has x's norm. Bytes, per block of 32 values (4 blocks per group; each block repeats the group's
       scale, so a block decodes alone, as lucebox's TQ3_0 does): [0:2] fp16 s | [2:10] low two index bits, value j
       at bits 2(j%4) of byte j/4 | [10:14] high index bit, value j at bit j%8 of byte j/8. 14 bytes per 32 values.
       Index i < 4 are the negative levels, from the most negative; the high bit is the sign.

Attention reads tq3_0 without leaving the rotated domain: q.k = (R q).(s c), so a kernel rotates the query once per
group, and sum_j p_j v_j = R^-1 sum_j p_j (s_j c_j), so it accumulates the weighted rotated values and rotates the
output once (decode_rotated / rotate / unrotate below).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from .quants import GGMLType, dequantize, quantize

TQ3_GROUP = 128
TQ3_BLOCK, TQ3_BLOCK_BYTES = 32, 14
# Bit i of SIGNS1 / SIGNS2 set: coordinate i is negated (drawn once from default_rng(0x7133), written out here).
SIGNS1 = 0x95C35F51021A15CA231090C29BB2F362
SIGNS2 = 0x80F33B8793F83731A553B5068C4A43BE
# The Lloyd-Max levels of the coordinate distribution of a uniformly random unit vector in R^128 (density
# proportional to (1 - t^2)^62.5): the fixed point of Lloyd's iteration, computed in float64 (tests check it).
TQ3_LEVELS = np.array([-0.18839719, -0.11813977, -0.06658561, -0.02160431,
                       0.02160431, 0.06658561, 0.11813977, 0.18839719], np.float32)

BYTES_PER_VALUE = {"bf16": 2.0, "fp8": 1.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "tq3_0": TQ3_BLOCK_BYTES / TQ3_BLOCK}


class KVFormatError(ValueError):
    """A KV format lucegen does not know, or rows it cannot encode."""


def row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one cached row (one head's head_dim values)."""
    check(fmt, head_dim)
    return round(BYTES_PER_VALUE[fmt] * head_dim)


def check(fmt: str, head_dim: int) -> None:
    if fmt not in BYTES_PER_VALUE:
        raise KVFormatError(f"unknown KV format {fmt!r} (formats: {', '.join(BYTES_PER_VALUE)})")
    block = {"q8_0": 32, "q4_0": 32, "tq3_0": TQ3_GROUP}.get(fmt, 1)
    if head_dim % block:
        raise KVFormatError(f"{fmt} KV rows are whole groups of {block} values; head_dim {head_dim} is not")


# ---- TQ3_0 -------------------------------------------------------------------------------------------------------
def _signs(mask: int) -> np.ndarray:
    return np.where([(mask >> i) & 1 for i in range(TQ3_GROUP)], -1.0, 1.0)


def _hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


# R = D2 H D1 as a matrix (float64); rows of a group are rotated as y = x @ R.T
_R = _signs(SIGNS2)[:, None] * _hadamard(TQ3_GROUP) * _signs(SIGNS1)[None, :]


def rotate(x: np.ndarray) -> np.ndarray:
    """y = R x on every group of 128 along the last axis (float64 in, float64 out)."""
    g = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, TQ3_GROUP)
    return (g @ _R.T).reshape(x.shape)


def unrotate(y: np.ndarray) -> np.ndarray:
    """x = R^-1 y = R^T y on every group of 128."""
    g = np.asarray(y, np.float64).reshape(*y.shape[:-1], -1, TQ3_GROUP)
    return (g @ _R).reshape(y.shape)


def _tq3_encode(x: np.ndarray) -> np.ndarray:
    """rows [n, d] -> bytes [n, d / 32 * 14]."""
    n, d = x.shape
    g = rotate(x.astype(np.float64)).reshape(n, d // TQ3_GROUP, TQ3_GROUP)
    norm = np.linalg.norm(x.astype(np.float64).reshape(n, -1, TQ3_GROUP), axis=-1, keepdims=True)
    u = np.divide(g, norm, out=np.zeros_like(g), where=norm > 0)
    bounds = (TQ3_LEVELS[1:].astype(np.float64) + TQ3_LEVELS[:-1]) / 2
    idx = np.searchsorted(bounds, u).astype(np.uint8)  # nearest level (on a boundary, the lower one)
    c = np.linalg.norm(TQ3_LEVELS[idx].astype(np.float64), axis=-1, keepdims=True)
    scale = (norm / c).astype(np.float16)  # c > 0: every level is nonzero
    if not np.isfinite(scale).all():
        raise KVFormatError("tq3_0: a group's norm overflows the fp16 scale")
    idx = idx.reshape(n, -1, TQ3_BLOCK)                                 # [n, blocks, 32]
    lo = (idx & 3).reshape(n, -1, 8, 4) << np.arange(0, 8, 2, dtype=np.uint8)
    hi = (idx >> 2).reshape(n, -1, 4, 8) << np.arange(8, dtype=np.uint8)
    s = np.repeat(scale, TQ3_GROUP // TQ3_BLOCK, axis=1).reshape(n, -1, 1).view(np.uint8)  # [n, blocks, 2]
    blocks = np.concatenate([s, np.bitwise_or.reduce(lo, axis=-1), np.bitwise_or.reduce(hi, axis=-1)], axis=-1)
    return blocks.reshape(n, -1)


def decode_rotated(raw: np.ndarray) -> np.ndarray:
    """tq3_0 bytes [n, d / 32 * 14] -> the rotated-domain values s * c [n, d], float32 (what attention reads)."""
    b = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, TQ3_BLOCK_BYTES)
    scale = b[..., 0:2].copy().view(np.float16).astype(np.float32)            # [n, blocks, 1]
    lo = (b[..., 2:10, None] >> np.arange(0, 8, 2, dtype=np.uint8)) & 3        # [n, blocks, 8, 4]
    hi = (b[..., 10:14, None] >> np.arange(8, dtype=np.uint8)) & 1             # [n, blocks, 4, 8]
    idx = lo.reshape(*lo.shape[:2], 32) | (hi.reshape(*hi.shape[:2], 32) << 2)
    return (TQ3_LEVELS[idx] * scale).reshape(raw.shape[0], -1)


def _tq3_decode(raw: np.ndarray) -> np.ndarray:
    return unrotate(decode_rotated(raw)).astype(np.float32)


# ---- every format ------------------------------------------------------------------------------------------------
def _fp8(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)


_ENCODE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "bf16": lambda x: x.astype(ml_dtypes.bfloat16).view(np.uint8),
    "fp8": lambda x: _fp8(x).view(np.uint8),
    "q8_0": lambda x: quantize(x, GGMLType.Q8_0),
    "q4_0": lambda x: quantize(x, GGMLType.Q4_0),
    "tq3_0": _tq3_encode,
}
_DECODE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "bf16": lambda b: b.view(ml_dtypes.bfloat16).astype(np.float32),
    "fp8": lambda b: b.view(ml_dtypes.float8_e4m3fn).astype(np.float32),
    "q8_0": lambda b: dequantize(b, GGMLType.Q8_0),
    "q4_0": lambda b: dequantize(b, GGMLType.Q4_0),
    "tq3_0": _tq3_decode,
}


def encode(x: np.ndarray, fmt: str) -> np.ndarray:
    """float rows [..., head_dim] -> uint8 [..., row_bytes(fmt, head_dim)]."""
    x = np.ascontiguousarray(x, np.float32)
    check(fmt, x.shape[-1])
    if not np.isfinite(x).all():
        raise KVFormatError(f"{fmt}: cannot encode non-finite KV values")
    out = _ENCODE[fmt](x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def decode(raw: np.ndarray, fmt: str) -> np.ndarray:
    """uint8 rows [..., row_bytes] -> float32 [..., head_dim]."""
    raw = np.ascontiguousarray(raw, np.uint8)
    out = _DECODE[fmt](raw.reshape(-1, raw.shape[-1]))
    return out.reshape(*raw.shape[:-1], out.shape[-1])


def codec(fmt: str) -> Callable[[np.ndarray], np.ndarray]:
    """x -> decode(encode(x)): what attention sees of rows stored in `fmt` (the reference's kv_codec)."""
    return lambda x: decode(encode(x, fmt), fmt)


# ---- the error each format gives the reference forward --------------------------------------------------------
@dataclass(frozen=True)
class KVError:
    fmt: str
    rel_error: float   # |logits - logits with bf16 KV| / |logits with bf16 KV|, over every step
    top1_agree: float  # fraction of steps whose argmax equals the bf16-KV argmax
    max_abs: float     # largest logit difference


def logits_error(weights: Mapping[str, np.ndarray], cfg, tokens: Sequence[int], prompt: int,
                 formats: Sequence[str] = ("fp8", "q8_0", "q4_0", "tq3_0")) -> list[KVError]:
    """Teacher-forced run of the reference forward: prefill tokens[:prompt], then decode the rest one by one,
    with every format's KV and with bf16 KV; the logits after the prompt and after each decoded token compared."""
    from lucegen.reference.model import State, decode_step, prefill

    def run(fmt: str) -> np.ndarray:
        state = State(kv_codec=codec(fmt))
        out = [prefill(weights, cfg, tokens[:prompt], state)[-1]]
        out += [decode_step(weights, cfg, t, state) for t in tokens[prompt:]]
        return np.stack(out).astype(np.float64)

    base = run("bf16")
    errors = []
    for fmt in formats:
        got = run(fmt)
        errors.append(KVError(fmt, float(np.linalg.norm(got - base) / np.linalg.norm(base)),
                              float(np.mean(got.argmax(-1) == base.argmax(-1))), float(np.abs(got - base).max())))
    return errors
