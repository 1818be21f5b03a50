"""GGUF rows as the GPU holds them (quant.cuh's formats read these): every format's rows as stored, except Q6_K's.
(A matrix's rows then lie in tiles, block by block, for the formats of the tensor-core GEMM: Format.device_matrix.)

Q6_K's 210-byte blocks are only 2-byte aligned, and a piece's 32 six-bit values lie spread over 64 bytes of ql and
qh (shared with three other pieces), so a lane read them as 18 funnel-shifted 4-byte words. On the GPU its rows are
repacked at load, losslessly, into *pairs* of blocks that are 16-byte aligned and hold each piece's bits together:

  pair (512 values, 432 bytes): [0:208] block A's body | [208:416] block B's body | [416:418] A's d |
                                [418:420] B's d | [420:432] zero
  body (a block's 8 pieces p of 32 values, q in 0 .. 63 before the offset of 32):
      [16p : 16p + 16]       the low 4 bits: byte j = (q[32p + j] & 15) | (q[32p + 16 + j] & 15) << 4, j < 16
      [128 + 8p : 136 + 8p]  the high 2 bits: in 32-bit word u (u < 2), byte c, bits 2v, 2v + 1 are bits 4, 5 of
                             q[32p + 4w + c], w = 2u + (v & 1) + 4 (v >> 1)
      [192 : 208]            the 16 int8 scales as stored (piece p's: bytes 2p, 2p + 1)

So a piece is one 16-byte load, one 8-byte load, its two scales and its d. Its word w of 4 values (one a byte) is
nibble word w % 4's low (w < 4) or high (w >= 4) nibbles, or-ed with bits 2v, 2v + 1 of high-bit word (w % 4) / 2
(v = w % 2 + 2 (w / 4)) moved to bits 4, 5; an int8 mma lane t (values 4t .. 4t+3 and 16 + 4t .. 16 + 4t+3 of a
piece) reads nibble word t and high-bit word t / 2 alone. A row of an odd number of blocks ends in a pair whose
second block is zeros (the kernels skip its pieces). The pairs' 12 bytes of padding add 2.9% to Q6_K's bytes; the
d's at the row's end instead would add none, at the price of a second address a piece (docs/design.md, Session 30).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..model.quants import QK_K, q6_k_blocks_of


Q6_K_BLOCK = 210                  # GGUF's block
Q6_K_BODY, Q6_K_PAIR = 208, 432   # the GPU's: a block's body, a pair
_CHUNK_BLOCKS = 1 << 14           # blocks a vectorised step (a thread's): bounds the temporaries
_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_BITS = np.uint32(0x03030303)
# Piece p = 4h + k's values are nibble k / 2 of ql's 32-byte run 64h + 32 (k % 2) and bit pair k of qh's 32-byte
# run 32h. In 8-byte words: its nibble words take ql words _RUN + 0, 1 (the run's first 16 bytes: the low nibbles'
# values) and _RUN + 2, 3 (its second 16), for (h, k % 2, word) in order, into body words _NIB[k / 2].
_RUN = np.array([8 * h + 4 * k2 + i for h in range(2) for k2 in range(2) for i in range(2)])
_NIB = [np.array([8 * h + 4 * half + 2 * k2 + i for h in range(2) for k2 in range(2) for i in range(2)])
        for half in range(2)]
# High-bit word u of a piece, bit pair v: the values' word w = 2u + (v & 1) + 4 (v >> 1) of the piece's qh run; as
# indices into the run's 4-byte words for (h, u, v) in order.
_HIGH = np.array([8 * h + 2 * u + (v & 1) + 4 * (v >> 1) for h in range(2) for u in range(2) for v in range(4)])


def _bodies(b: np.ndarray) -> np.ndarray:
    """GGUF Q6_K blocks uint8 [n, 210] -> their bodies [n, 208]."""
    n = len(b)
    ql = np.ascontiguousarray(b[:, :128]).view("<u8")
    lo, hi = ql[:, _RUN], ql[:, _RUN + 2]
    nib = np.empty((n, 16), "<u8")
    nib[:, _NIB[0]] = (lo & _NIBBLES) | ((hi & _NIBBLES) << np.uint64(4))   # k / 2 = 0: the low nibbles
    nib[:, _NIB[1]] = ((lo >> np.uint64(4)) & _NIBBLES) | (hi & ~_NIBBLES)  # k / 2 = 1: the high ones
    qh = np.ascontiguousarray(b[:, 128:192]).view("<u4")[:, _HIGH]          # [block, (h, u, v)]
    pairs = (qh[:, None, :] >> (2 * np.arange(4, dtype=np.uint32))[None, :, None]) & _BITS  # [block, k, (h, u, v)]
    pairs = pairs.reshape(n, 4, 2, 2, 4) << (2 * np.arange(4, dtype=np.uint32))
    high = (pairs[..., 0] | pairs[..., 1] | pairs[..., 2] | pairs[..., 3]).transpose(0, 2, 1, 3)  # [block, h, k, u]
    return np.concatenate([nib.view(np.uint8), np.ascontiguousarray(high).reshape(n, -1).view(np.uint8),
                           b[:, 192:208]], axis=1)


def q6_k_pairs(raw: np.ndarray) -> np.ndarray:
    """GGUF Q6_K rows uint8 [N, blocks * 210] -> the GPU's rows uint8 [N, ceil(blocks / 2) * 432] (see above; an odd
    number of blocks ends in a pair whose second block is zeros)."""
    raw = np.ascontiguousarray(raw, np.uint8)
    blocks = raw.shape[1] // Q6_K_BLOCK if raw.ndim == 2 else 0
    if raw.ndim != 2 or raw.shape[1] != blocks * Q6_K_BLOCK or not blocks:
        raise ValueError(f"Q6_K rows of shape {raw.shape}: rows of whole 210-byte blocks expected")
    n = raw.shape[0]
    if blocks % 2:
        raw = np.concatenate([raw, np.zeros((n, Q6_K_BLOCK), np.uint8)], axis=1)
    b = raw.reshape(-1, Q6_K_BLOCK)
    out = np.empty((len(b) // 2, Q6_K_PAIR), np.uint8)

    def pairs(c0: int) -> None:
        c = b[c0:c0 + _CHUNK_BLOCKS]
        o = out[c0 // 2:(c0 + len(c)) // 2]
        o[:, :2 * Q6_K_BODY] = _bodies(c).reshape(-1, 2 * Q6_K_BODY)
        o[:, 2 * Q6_K_BODY:2 * Q6_K_BODY + 4] = c[:, 208:210].reshape(-1, 4)
        o[:, 2 * Q6_K_BODY + 4:] = 0

    with ThreadPoolExecutor(os.cpu_count()) as pool:  # numpy lets go of the GIL inside each operation
        list(pool.map(pairs, range(0, len(b), _CHUNK_BLOCKS)))
    return out.reshape(n, -1)


def q6_k_pair_pieces(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The GPU's Q6_K rows uint8 [N, pairs * 432] read as quant.cuh's FmtQ6_K::load reads a piece, in 32-bit words:
    (q uint8 [N, pairs * 512] in 0 .. 63, the int8 scales [N, pairs * 32], the d's as fp16 [N, pairs * 2])."""
    rows = np.ascontiguousarray(rows, np.uint8)
    n = rows.shape[0]
    pairs = rows.reshape(n, -1, Q6_K_PAIR)
    bodies = pairs[..., :2 * Q6_K_BODY].reshape(n, -1, Q6_K_BODY)                  # [N, block, 208]
    nib = bodies[..., :128].copy().view("<u4").reshape(n, -1, 8, 4)                # [N, block, piece, word]
    high = bodies[..., 128:192].copy().view("<u4").reshape(n, -1, 8, 2)
    words = np.empty((*nib.shape[:3], 8), np.uint32)
    for w in range(8):
        v = w % 2 + 2 * (w // 4)
        h = high[..., (w % 4) // 2]
        h = h << np.uint32(4 - 2 * v) if v < 2 else h >> np.uint32(2 * v - 4)
        low = nib[..., w % 4] if w < 4 else nib[..., w % 4] >> np.uint32(4)
        words[..., w] = (low & np.uint32(0x0F0F0F0F)) | (h & np.uint32(0x30303030))
    q = words.view(np.uint8).reshape(n, -1)
    scales = bodies[..., 192:].view(np.int8).reshape(n, -1)
    d = pairs[..., 2 * Q6_K_BODY:2 * Q6_K_BODY + 4].copy().view(np.float16).reshape(n, -1)
    return q, scales, d


def q6_k_blocks(rows: np.ndarray, blocks: int) -> np.ndarray:
    """q6_k_pairs undone: the GPU's Q6_K rows -> the GGUF rows uint8 [N, blocks * 210]."""
    q, scales, d = q6_k_pair_pieces(rows)
    n = len(q)
    out = q6_k_blocks_of(q[:, :blocks * QK_K], scales[:, :blocks * 16], d[:, :blocks])
    return out.reshape(n, blocks * Q6_K_BLOCK)
