"""The tensor-core Q4_K GEMM's numpy side (lucegen/kernels/qgemm_tc.py): its fp16 weights against the exact
dequantisation, and its kernels compiled for every spec."""
from __future__ import annotations

import numpy as np
import pytest

from lucegen.codegen.build import build
from lucegen.kernels import qgemm_tc
from lucegen.model.config import tiny_config
from lucegen.model.quants import GGMLType, dequantize, quantize
from lucegen.spec import list_specs, load_spec


def q4k_rows(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    return w, quantize(w, GGMLType.Q4_K).reshape(n, -1)


@pytest.mark.parametrize("seed", range(4))
def test_fp16_weights_are_the_dequantised_weights_rounded_to_fp16(seed):
    """fl16(q s + b) with s, b rounded to fp16 first: within fp16's rounding of the scale, the bias and the result
    (3 x 2^-11 of the sub-block's largest magnitude) of gguf's fp32 dequantisation; an error in the nibble order,
    the scales or the bias is a whole quantisation step or more."""
    _, raw = q4k_rows(16, 512, seed)
    exact = dequantize(raw.reshape(-1), GGMLType.Q4_K).reshape(16, 512)
    got = qgemm_tc.dequantize_fp16(raw).astype(np.float32)
    sub = np.abs(exact).reshape(16, -1, 32).max(axis=2, keepdims=True)
    err = np.abs(got - exact).reshape(16, -1, 32)
    assert (err <= 3 * 2.0**-11 * sub + 1e-30).all()
    assert np.array_equal(got, qgemm_tc.dequantize_fp16(raw).astype(np.float32))  # deterministic


def test_reference_is_close_to_the_exact_product():
    w, raw = q4k_rows(32, 1024, 7)
    x = np.random.default_rng(8).standard_normal((5, 1024), dtype=np.float32)
    exact = x.astype(np.float64) @ dequantize(raw.reshape(-1), GGMLType.Q4_K).reshape(32, 1024).astype(np.float64).T
    got = qgemm_tc.reference(raw, x)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 2e-3


def test_shape_problem_names_the_shape():
    assert "100 x 512" in qgemm_tc.shape_problem(100, 512)
    assert qgemm_tc.shape_problem(5120, 17408) is None


@pytest.mark.parametrize("spec_name", list_specs())
def test_kernels_compile_without_spills(tmp_path, spec_name):
    result = build(load_spec(spec_name), tiny_config(), qgemm_tc.units(load_spec(spec_name)), root=tmp_path)
    assert {k.name for k in result.kernels} == {*(v[0] for v in qgemm_tc.VARIANTS), "qgemm_tc_x16"}
    for k in result.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"
