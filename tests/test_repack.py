"""The GPU's layout of Q6_K rows (lucegen/kernels/repack.py): lossless, and read back by the word arithmetic of
quant.cuh's FmtQ6_K (load, and an int8 mma lane's mma_raw / mma_piece) as the GGUF block's values, scales and d."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lucegen.kernels import qgemv
from lucegen.kernels.repack import Q6_K_BODY, Q6_K_PAIR, q6_k_blocks, q6_k_pair_pieces, q6_k_pairs
from lucegen.model.quants import GGMLType, dequantize, q6_k_values, quantize

Q6_K = qgemv.fmt_of("q6_k")


def random_blocks(n: int, blocks: int, seed: int) -> np.ndarray:
    """Rows of random bytes: every bit of ql, qh and the scales is used, so every pattern must survive."""
    return np.random.default_rng(seed).integers(0, 256, (n, blocks * 210), np.uint8)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), blocks=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_pairs_hold_the_gguf_rows_exactly(n, blocks, seed):
    raw = random_blocks(n, blocks, seed)
    rows = Q6_K.device_rows(raw)
    assert rows.shape == (n, Q6_K.row_bytes(256 * blocks)) == (n, -(-blocks // 2) * Q6_K_PAIR)
    np.testing.assert_array_equal(Q6_K.gguf_rows(rows, 256 * blocks), raw)
    pairs = rows.reshape(n, -1, Q6_K_PAIR)
    assert (pairs[..., 2 * Q6_K_BODY + 4:] == 0).all()  # the padding
    if blocks % 2:  # the last pair's second block: zeros, d = 0
        assert (pairs[:, -1, Q6_K_BODY:2 * Q6_K_BODY] == 0).all() and (pairs[:, -1, 418:420] == 0).all()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 4), blocks=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_a_lane_reads_each_piece_as_its_values_scales_and_d(n, blocks, seed):
    """FmtQ6_K::load's words (q6_k_pair_pieces follows them) give piece P of a pair the values 32P .. 32P + 31 of
    GGUF block P / 8 of the pair, its scales 2 (P % 8), + 1 and its d."""
    raw = random_blocks(n, blocks, seed)
    q, scales, d = q6_k_pair_pieces(q6_k_pairs(raw))
    b = raw.reshape(-1, 210)
    np.testing.assert_array_equal(q[:, :256 * blocks].reshape(-1, 256), q6_k_values(b))
    np.testing.assert_array_equal(scales[:, :16 * blocks].reshape(-1, 16), b[:, 192:208].view(np.int8))
    np.testing.assert_array_equal(d[:, :blocks].reshape(-1).view(np.uint16), b[:, 208:210].copy().view("<u2").ravel())


def test_an_mma_lane_reads_its_two_words_of_each_piece():
    """mma_raw / mma_piece: lane t takes nibble word t and high-bit word t / 2 (shifted down by 2 (t % 2)) of a piece,
    and makes of them the piece's values 4t .. 4t + 3 (lo) and 16 + 4t .. 16 + 4t + 3 (hi), a byte each."""
    raw = random_blocks(3, 2, 7)
    pairs = q6_k_pairs(raw).reshape(-1, Q6_K_PAIR)
    values = q6_k_values(raw.reshape(-1, 210)).reshape(-1, 2, 8, 32)  # [pair, block, piece, value]
    for pair, want in zip(pairs, values):
        for blk in range(2):
            body = pair[Q6_K_BODY * blk:Q6_K_BODY * (blk + 1)]
            for p in range(8):
                nib = body[16 * p:16 * p + 16].copy().view("<u4")
                high = body[128 + 8 * p:136 + 8 * p].copy().view("<u4")
                for t in range(4):
                    h = int(high[t // 2]) >> 2 * (t % 2)
                    lo = (int(nib[t]) & 0x0F0F0F0F) | ((h << 4) & 0x30303030)
                    hi = ((int(nib[t]) >> 4) & 0x0F0F0F0F) | (h & 0x30303030)
                    assert list(lo.to_bytes(4, "little")) == list(want[blk, p, 4 * t:4 * t + 4])
                    assert list(hi.to_bytes(4, "little")) == list(want[blk, p, 16 + 4 * t:16 + 4 * t + 4])


def test_quantized_rows_dequantize_the_same_after_the_round_trip():
    w = np.random.default_rng(3).standard_normal((5, 768), np.float32)
    raw = quantize(w, GGMLType.Q6_K)
    np.testing.assert_array_equal(dequantize(Q6_K.gguf_rows(Q6_K.device_rows(raw), 768), GGMLType.Q6_K),
                                  dequantize(raw, GGMLType.Q6_K))


def test_the_other_formats_go_to_the_gpu_as_stored():
    for f in qgemv.FORMATS.values():
        if f.name != "q6_k":
            raw = np.arange(3 * f.gguf_row_bytes(256), dtype=np.uint64).astype(np.uint8).reshape(3, -1)
            assert f.row_bytes(256) == raw.shape[1]
            np.testing.assert_array_equal(f.device_rows(raw), raw)
            np.testing.assert_array_equal(f.gguf_rows(raw, 256), raw)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(sorted(qgemv.FORMATS)), n=st.integers(1, 40), blocks=st.integers(1, 7),
       seed=st.integers(0, 2**32 - 1))
def test_matrices_are_tiles_of_rows_block_by_block(fmt, n, blocks, seed):
    """Format.device_matrix (what the kernels read: quant.cuh's wblock_offset, whose C++ the host decoders of
    test_qgemv read through) puts row r's block kb of device_rows at wblock_offset(r, kb), zeros elsewhere, in whole
    tiles of 16 rows for the mma formats and plain rows for the others; matrix_rows undoes it."""
    f = qgemv.fmt_of(fmt)
    k = blocks * f.row_step
    raw = np.random.default_rng(seed).integers(0, 256, (n, f.gguf_row_bytes(k)), np.uint8)
    rows, w = f.device_rows(raw), f.device_matrix(raw)
    assert f.tile_rows == (16 if fmt in ("q4_k", "q6_k") else 1)
    assert w.shape == (f.matrix_bytes(n, k),) == (-(-n // f.tile_rows) * f.tile_rows * f.row_bytes(k),)
    bb = f.block_bytes
    placed = np.zeros(w.size, bool)
    for r in range(n):
        for kb in range(rows.shape[1] // bb):
            at = f.wblock_offset(r, kb, k)
            np.testing.assert_array_equal(w[at:at + bb], rows[r, kb * bb:(kb + 1) * bb])
            placed[at:at + bb] = True
    assert placed.sum() == rows.size and not w[~placed].any()  # each block once; the rows past n are zeros
    np.testing.assert_array_equal(f.matrix_rows(w, n, k), raw)


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="whole 210-byte blocks"):
        q6_k_pairs(np.zeros((2, 300), np.uint8))
    with pytest.raises(ValueError, match="q6_k rows of K = 384 values.*256"):
        Q6_K.row_bytes(384)
