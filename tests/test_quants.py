"""lucegen.model.quants against gguf's own dequantizers, on freshly drawn blocks."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gguf_quants
from hypothesis import given, settings, strategies as st

from lucegen.model import quants

# Byte offsets of the fp16 fields in a block (the module docstring's layouts): random bytes there are made finite.
HALF_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
# ||dequant(quant(x)) - x|| / ||x|| bounds: about 1.3x the worst seen over 10^4 draws of 1..3 rows x 1..3 blocks
# of each distribution at amplitudes 0.1 .. 10 (much below that the fp16 block scales turn subnormal and lose
# precision, in llama.cpp too); for the plain types, the format's rounding bound.
REL_ERROR = {
    "normal": {T.Q8_0: 0.012, T.Q4_0: 0.19, T.Q4_K: 0.11, T.Q5_K: 0.056, T.Q6_K: 0.027},
    "uniform": {T.Q8_0: 0.007, T.Q4_0: 0.125, T.Q4_K: 0.081, T.Q5_K: 0.041, T.Q6_K: 0.02},
    "student_t": {T.Q8_0: 0.02, T.Q4_0: 0.28, T.Q4_K: 0.18, T.Q5_K: 0.092, T.Q6_K: 0.054},
}
for bounds in REL_ERROR.values():
    bounds.update({T.F32: 0.0, T.F16: 2.0 ** -11, T.BF16: 2.0 ** -8})
# Plain float types: (word dtype, exponent mask, one exponent bit); a word with an all-ones exponent loses that bit.
FLOAT_WORDS = {T.F32: (np.uint32, 0x7F800000, 0x40000000), T.F16: (np.uint16, 0x7C00, 0x4000),
               T.BF16: (np.uint16, 0x7F80, 0x4000)}


def finite(words: np.ndarray, exp_mask: int, bit: int) -> np.ndarray:
    return np.where((words & exp_mask) == exp_mask, words & ~words.dtype.type(bit), words)


def random_raw(t: T, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random bytes for rows x blocks blocks of type t, with every fp16 scale (and F16/BF16/F32 value) finite."""
    rng = np.random.default_rng(seed)
    nbytes = GGML_QUANT_SIZES[t][1] * (32 if t in FLOAT_WORDS else 1)  # 32 plain values per "block"
    raw = rng.integers(0, 256, (rows * blocks, nbytes), dtype=np.uint8)
    if t in FLOAT_WORDS:
        word, exp_mask, bit = FLOAT_WORDS[t]
        raw = finite(raw.view(word), exp_mask, bit).view(np.uint8)
    for at in HALF_FIELDS.get(t, []):
        raw[:, at:at + 2] = finite(raw[:, at:at + 2].copy().view(np.uint16), 0x7C00, 0x4000).view(np.uint8)
    return raw.reshape(rows, blocks * nbytes)


@settings(max_examples=200, deadline=None)
@given(t=st.sampled_from(quants.SUPPORTED), rows=st.integers(1, 3), blocks=st.integers(1, 5),
       seed=st.integers(0, 2**32 - 1))
def test_dequantize_is_bit_equal_to_gguf(t, rows, blocks, seed):
    raw = random_raw(t, rows, blocks, seed)
    ours, theirs = quants.dequantize(raw, t), gguf_quants.dequantize(raw, t)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def documented_dequant(t: T, b: bytes) -> np.ndarray:
    """One block, value by value, exactly as the layouts in lucegen.model.quants' docstring say."""
    f32 = np.float32

    def half(at):
        return f32(np.frombuffer(b[at:at + 2], np.float16)[0])

    if t == T.Q8_0:
        return np.array([half(0) * f32(q) for q in np.frombuffer(b[2:34], np.int8)])
    if t == T.Q4_0:
        return np.array([half(0) * f32((b[2 + j % 16] >> (4 * (j // 16)) & 0xF) - 8) for j in range(32)])
    out = []
    if t == T.Q6_K:
        d, ql, qh, scales = half(208), b[0:128], b[128:192], np.frombuffer(b[192:208], np.int8)
        for i in range(256):
            h, k, l = i // 128, i % 128 // 32, i % 32
            low = (ql[64 * h + l + 32 * (k % 2)] >> (4 * (k // 2))) & 0xF
            q = low | ((qh[32 * h + l] >> (2 * k)) & 3) << 4
            out.append((d * f32(scales[i // 16])) * f32(q - 32))
        return np.array(out)
    d, dmin, s = half(0), half(2), b[4:16]
    qh, qs = (b[16:48], b[48:176]) if t == T.Q5_K else (None, b[16:144])
    for i in range(256):
        sub, l = divmod(i, 32)
        if sub < 4:
            sc, m = s[sub] & 63, s[sub + 4] & 63
        else:
            sc, m = (s[sub + 4] & 0xF) | ((s[sub - 4] >> 6) << 4), (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4)
        q = (qs[32 * (sub // 2) + l] >> (4 * (sub % 2))) & 0xF
        if qh is not None:
            q |= ((qh[l] >> sub) & 1) << 4
        out.append((d * f32(sc)) * f32(q) - (dmin * f32(m)))
    return np.array(out)


@settings(max_examples=20, deadline=None)
@given(t=st.sampled_from([T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K]), seed=st.integers(0, 2**32 - 1))
def test_documented_layouts_match_gguf(t, seed):
    raw = random_raw(t, 1, 1, seed)
    np.testing.assert_array_equal(documented_dequant(t, raw.tobytes()).astype(np.float32).view(np.uint32),
                                  gguf_quants.dequantize(raw, t)[0].view(np.uint32))


def draw_rows(dist: str, shape: tuple[int, int], scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = {"normal": lambda: rng.standard_normal(shape), "uniform": lambda: rng.uniform(-1, 1, shape),
         "student_t": lambda: rng.standard_t(2, shape)}[dist]()
    return (x * scale).astype(np.float32)


@settings(max_examples=200, deadline=None)
@given(t=st.sampled_from(quants.SUPPORTED), rows=st.integers(1, 3), blocks=st.integers(1, 3),
       dist=st.sampled_from(sorted(REL_ERROR)), log_scale=st.floats(-1, 1),
       seed=st.integers(0, 2**32 - 1))
def test_quantize_gives_blocks_gguf_reads_back_close(t, rows, blocks, dist, log_scale, seed):
    n = blocks * max(GGML_QUANT_SIZES[t][0], 32)
    x = draw_rows(dist, (rows, n), 10.0 ** log_scale, seed)
    raw = quants.quantize(x, t)
    assert raw.dtype == np.uint8 and raw.shape == (rows, quants.row_bytes(t, n))
    back = gguf_quants.dequantize(raw, t)
    assert np.isfinite(back).all()
    assert np.linalg.norm(back - x) / np.linalg.norm(x) <= REL_ERROR[dist][t]


@pytest.mark.parametrize("t", quants.SUPPORTED)
def test_zero_rows_stay_zero(t):
    x = np.zeros((2, 512), np.float32)
    x[1, 256:] = np.linspace(-1, 1, 256)  # one zero block next to a live one
    back = gguf_quants.dequantize(quants.quantize(x, t), t)
    np.testing.assert_array_equal(back[0], 0)
    np.testing.assert_array_equal(back[1, :256], 0)


def test_unsupported_type_is_named():
    with pytest.raises(quants.QuantError, match="IQ2_XXS"):
        quants.dequantize(np.zeros((1, 66), np.uint8), T.IQ2_XXS)
    with pytest.raises(quants.QuantError, match="IQ2_XXS"):
        quants.ggml_type("iq2_xxs")
    with pytest.raises(quants.QuantError, match="unknown ggml type"):
        quants.ggml_type("Q9_9")


def test_bad_shapes_and_values():
    with pytest.raises(quants.QuantError, match="256"):
        quants.quantize(np.ones((2, 100), np.float32), T.Q4_K)
    with pytest.raises(quants.QuantError, match="block size 144"):
        quants.dequantize(np.zeros((1, 100), np.uint8), T.Q4_K)
    with pytest.raises(quants.QuantError, match="non-finite"):
        quants.quantize(np.full((1, 32), np.nan, np.float32), T.Q8_0)
    with pytest.raises(quants.QuantError, match="too large"):
        quants.quantize(np.full((1, 32), 1e12, np.float32), T.Q8_0)
