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
    """The kernel's fp16 weights: within fp16's rounding of the scale (and Q4_K's bias) and of the result (3 x 2^-11
    of the scale group's largest magnitude) of gguf's fp32 dequantisation. A nibble, bit, scale or bias taken from the
    wrong place is a whole quantisation step or more."""
    raw = rows(fmt, 16, 512, seed)
    want = exact(raw, fmt)
    got = qgemm_tc.dequantize_fp16(raw, fmt).astype(np.float32)
    group = 32 if fmt == "q4_k" else 16
    top = np.abs(want).reshape(16, -1, group).max(axis=2, keepdims=True)
    assert (np.abs(got - want).reshape(16, -1, group) <= 3 * 2.0**-11 * top + 1e-30).all()


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
def test_reference_is_close_to_the_exact_product(fmt):
    raw = rows(fmt, 32, 1024, 7)
    x = np.random.default_rng(8).standard_normal((5, 1024), dtype=np.float32)
    want = x.astype(np.float64) @ exact(raw, fmt).astype(np.float64).T
    got = qgemm_tc.reference(raw, fmt, x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("m, rows", [(1, 8), (8, 8), (9, 16), (17, 32), (33, 48), (48, 48), (49, 56), (100, 104)])
def test_padded_rows_cover_every_launch(m, rows):
    """Launches of 48 rows, then the last one's kernel (8, 16, 32 or 48 tokens): X holds that many rows."""
    assert qgemm_tc.padded_rows(m) == rows


def test_shape_problem_names_the_shape_and_the_format():
    assert "104 x 512" in qgemm_tc.shape_problem("q4_k", 104, 512)
    assert "not q8_0" in qgemm_tc.shape_problem("q8_0", 5120, 5120)
    assert qgemm_tc.shape_problem("q6_k", 5120, 17408) is None


@pytest.mark.parametrize("spec_name", list_specs())
def test_kernels_compile_without_spills(tmp_path, spec_name):
    result = build(load_spec(spec_name), tiny_config(), qgemm_tc.units(load_spec(spec_name)), root=tmp_path)
    names = {qgemm_tc.kernel_name(f, rows) for f in TENSOR_CORE_FORMATS for rows in qgemm_tc.VARIANTS}
    assert {k.name for k in result.kernels} == names | {"qgemm_tc_x16"}
    for k in result.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"
