"""The tensor-core GEMM's numpy side (lucegen/kernels/qgemm_tc.py): its fp16 weights against the exact
dequantisation, and its kernels compiled for every spec."""
from __future__ import annotations

import numpy as np
import pytest

from lucegen.codegen.build import build
from lucegen.kernels import qgemm_tc
from lucegen.model.config import tiny_config
from lucegen.model.quants import dequantize, ggml_type, quantize
from lucegen.spec import TENSOR_CORE_FORMATS, list_specs, load_spec


def rows(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    return quantize(w, ggml_type(fmt)).reshape(n, -1)


def exact(raw: np.ndarray, fmt: str) -> np.ndarray:
    return dequantize(raw.reshape(-1), ggml_type(fmt)).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_fp16_weights_are_the_dequantised_weights_rounded_to_fp16(fmt, seed):
    """The kernel's fp16 weights: within fp16's rounding of the scale and bias and of the result (3 x 2^-11 of the
    scale group's largest magnitude) of gguf's fp32 dequantisation. A nibble, bit, scale or bias taken from the
    wrong place is a whole quantisation step or more."""
    raw = rows(fmt, 16, 512, seed)
    want = exact(raw, fmt)
    got = qgemm_tc.dequantize_fp16(raw, fmt).astype(np.float32)
    group = 32  # Q4_K's scale groups
    top = np.abs(want).reshape(16, -1, group).max(axis=2, keepdims=True)
    assert (np.abs(got - want).reshape(16, -1, group) <= 3 * 2.0**-11 * top + 1e-30).all()


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
def test_reference_is_close_to_the_exact_product(fmt):
    raw = rows(fmt, 32, 1024, 7)
    x = np.random.default_rng(8).standard_normal((5, 1024), dtype=np.float32)
    want = x.astype(np.float64) @ exact(raw, fmt).astype(np.float64).T
    got = qgemm_tc.reference(raw, fmt, x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("rows, tokens", [(1, 8), (8, 8), (9, 16), (16, 16), (17, 24), (24, 24)])
def test_a_launch_takes_the_first_kernel_that_holds_its_rows(rows, tokens):
    assert qgemm_tc.variant(rows) == tokens


@pytest.mark.parametrize("n, k, shares", [(34816, 5120, 1), (10240, 5120, 3), (5120, 6144, 6), (5120, 17408, 6),
                                          (16, 256, 1), (64, 512, 2)])
def test_k_splits_into_about_two_blocks_an_sm_and_at_most_a_share_a_super_block(n, k, shares):
    """The 27B's Q4_K shapes on 132 SMs as session 52's prototype ran them; a small K caps the shares."""
    assert qgemm_tc.ksplit(n, k, 132) == shares


def test_rows_past_the_fp16_range_are_scaled_by_a_power_of_two_into_it():
    """A row's largest |x| below 2^15 after the scaling, the least scaling that does it, and 1 for a row that fits."""
    most = np.array([1, 2.0**15, 3e5, 2.0**15 - 1, 1e-30, 6.5e4], np.float32)
    x = np.random.default_rng(0).uniform(-0.5, 0.5, (6, 256)).astype(np.float32) * most[:, None]
    x[:, 7] = -most
    x16, scale = qgemm_tc.x_fp16(x)
    assert np.isfinite(x16).all()
    most = np.abs(x).max(axis=1) / scale
    assert (most < 2.0**15).all() and ((scale == 1) | (most >= 2.0**14)).all()
    assert list(scale) == [1, 2, 16, 1, 1, 2]


def test_shape_problem_names_the_shape_and_the_format():
    assert "104 x 500" in qgemm_tc.shape_problem("q4_k", 104, 500)
    assert "not q8_0" in qgemm_tc.shape_problem("q8_0", 5120, 5120)
    assert qgemm_tc.shape_problem("q4_k", 5120, 17408) is None
    assert "takes q4_k, not q6_k" in qgemm_tc.shape_problem("q6_k", 5120, 17408)  # dropped (spec.py)


@pytest.mark.parametrize("spec_name", list_specs())
def test_kernels_compile_without_spills(tmp_path, spec_name):
    result = build(load_spec(spec_name), tiny_config(), qgemm_tc.units(load_spec(spec_name)), root=tmp_path)
    names = {qgemm_tc.kernel_name(f, rows) for f in TENSOR_CORE_FORMATS for rows in qgemm_tc.VARIANTS}
    assert {k.name for k in result.kernels} == names | {"qgemm_tc_x16", "qgemm_tc_reduce"}
    for k in result.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"


# ---- the repacked layout read back as the kernel reads it ------------------------------------------------------
# Each lane's A registers of every k16 step, made from its words as TcSuperBlock does (the fp16 operations in float64,
# rounded once as HFMA2 rounds), placed at (row, k) by the mma's A fragment layout (a0: row g, k 2t, 2t + 1; a1: row
# g + 8; a2, a3: k + 8): every weight must land once, as dequantize_fp16's bits.

def _halves(u: np.ndarray) -> np.ndarray:
    """uint32 words -> [..., 2] their fp16 halves (low first) as float64."""
    return np.stack([u & 0xFFFF, u >> 16], -1).astype(np.uint16).view(np.float16).astype(np.float64)


def read_back(packed: np.ndarray, n: int, k: int) -> np.ndarray:
    tiles, sbs = -(-n // qgemm_tc.ROWS), k // 256
    rec = packed.view(np.uint32).reshape(tiles, sbs, qgemm_tc.SB_BYTES // 4)
    w = np.full((tiles * 16, k), np.nan)
    placed = np.zeros((tiles * 16, k), int)
    f16 = lambda v: np.asarray(v, np.float64).astype(np.float16).astype(np.float64)
    magic = lambda word, mask: _halves((word & np.uint32(mask)) | np.uint32(0x64006400))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        d, dmin = _halves(rec[:, :, 576 + 2 * g]), _halves(rec[:, :, 577 + 2 * g])  # [tile, sb, (g, g + 8)]
        for kk in range(16):
            c, i, j = kk // 4, kk % 4, kk // 2
            word = rec[:, :, (32 * c + lane) * 4 + i]
            sw = rec[:, :, 512 + 8 * g + j]
            sc = np.stack([(sw & 0xFF) + 1024, (sw >> 16 & 0xFF) + 1024], -1).astype(np.float64)  # 1024 + sc
            mn = np.stack([(sw >> 8 & 0xFF) + 1024, (sw >> 24) + 1024], -1).astype(np.float64)
            s, b = f16(sc * d - 1024 * d), f16(mn * -dmin + 1024 * dmin)                # fl16(d sc), fl16(-dmin m)
            for shift, dk in ((0, 0), (8, 8)):
                ww = word >> np.uint32(shift)
                lo = f16(magic(ww, 0x000F000F) - 1024)                                 # q of row g
                hi = f16(f16(magic(ww, 0x00F000F0) * 0.0625) - 64)                      # q of row g + 8
                for r, q in ((0, lo), (1, hi)):
                    vals = f16(q * s[..., r, None] + b[..., r, None])                    # [tile, sb, 2]
                    for h in range(2):
                        rows = np.arange(tiles)[:, None] * 16 + g + 8 * r
                        cols = np.arange(sbs)[None, :] * 256 + 16 * kk + 2 * t + dk + h
                        w[rows, cols] = vals[..., h]
                        placed[rows, cols] += 1
    assert (placed == 1).all(), "a weight placed twice or never"
    return w[:n]


@pytest.mark.parametrize("n, seed", [(16, 0), (48, 1), (37, 2)])
def test_the_repacked_layout_reads_back_as_the_fp16_weights(n, seed):
    """Every nibble, scale, min and d where the kernel looks for it, bit for bit; rows past N (a last partial tile)
    come back as zeros."""
    k = 512
    raw = rows("q4_k", n, k, seed)
    packed = qgemm_tc.repack(raw, k)
    assert packed.nbytes == -(-n // 16) * (k // 256) * qgemm_tc.SB_BYTES
    got = read_back(packed, -(-n // 16) * 16, k)
    want = qgemm_tc.dequantize_fp16(raw, "q4_k").astype(np.float64)
    assert np.array_equal(got[:n], want)
    assert (got[n:] == 0).all()


def test_rows_that_are_not_whole_blocks_of_k_are_refused():
    with pytest.raises(ValueError, match="rows of 2 144-byte blocks"):
        qgemm_tc.repack(np.zeros((16, 200), np.uint8), 512)
