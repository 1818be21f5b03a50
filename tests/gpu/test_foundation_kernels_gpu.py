"""RMSNorm, bf16 GEMV and argmax on the GPU against their numpy references, on freshly drawn inputs.

Outputs are poisoned (all bits set: NaN) before every launch so an element the kernel fails to write shows.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import dataclasses

from lucegen.codegen.build import build
from lucegen.kernels import argmax, gemv, memread, norm
from lucegen.model.config import tiny_config
from lucegen.runtime import DeviceArray, synchronize
from lucegen.spec import spec_for_current_device

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
GEMV_KS = [64, 136, 1024, 2048, 3584, 5120, 17408]
NORM_WIDTHS = [64, 1024, 5120]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    assert np.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    spec = spec_for_current_device()
    model = tiny_config()
    units = [*norm.units(spec, model, NORM_WIDTHS), *gemv.units(spec, model, GEMV_KS), *argmax.units(spec, model),
             *memread.units(spec)]
    result = build(spec, model, units, root=tmp_path_factory.mktemp("build"))
    return spec, {u.unit.name: result.module(u.unit.name) for u in result.units}


def gemv_methods():
    spec = spec_for_current_device()
    return [m for m in ("ldg", "bulk") if m == "ldg" or spec.chip.cc >= 90]


@pytest.fixture(scope="module", params=["ldg", "bulk"])
def gemv_ops(request, tmp_path_factory):
    """{K: Gemv} for one GEMV method (the copy-engine variant only where the GPU has one)."""
    spec = spec_for_current_device()
    if request.param not in gemv_methods():
        pytest.skip(f"{request.param} GEMV needs sm_90; this GPU is {spec.chip.arch}")
    g = dataclasses.replace(spec.tuning.gemv, method=request.param)
    spec = dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, gemv=g))
    result = build(spec, tiny_config(), gemv.units(spec, tiny_config(), GEMV_KS), root=tmp_path_factory.mktemp("g"))
    module = result.module("gemv_bf16")
    return {k: gemv.Gemv(module, spec, k) for k in GEMV_KS}


def poisoned(shape, dtype) -> DeviceArray:
    a = DeviceArray.empty(shape, dtype)
    a.fill_bytes(0xFF)
    return a


@SETTINGS
@given(k=st.sampled_from(GEMV_KS), n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
def test_gemv_matches_numpy(gemv_ops, k, n, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k), dtype=np.float32).astype(BF16)
    x = rng.standard_normal(k, dtype=np.float32).astype(BF16)
    y = poisoned(n, np.float32)
    gemv_ops[k](DeviceArray.from_numpy(w), DeviceArray.from_numpy(x), y)
    ref = gemv.reference(w, x).astype(np.float64)
    assert rel_err(y.numpy(), ref) < 1e-5  # fp32 accumulation of exact bf16 products


@SETTINGS
@given(h=st.sampled_from(NORM_WIDTHS), rows=st.integers(1, 40), scale=st.floats(1e-3, 1e3),
       seed=st.integers(0, 2**32 - 1))
def test_rmsnorm_matches_numpy(kernels, h, rows, scale, seed):
    spec, mods = kernels
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal((rows, h), dtype=np.float32)).astype(BF16)
    w = (0.5 * rng.standard_normal(h, dtype=np.float32)).astype(BF16)
    y = poisoned((rows, h), BF16)
    norm.RMSNorm(mods["rmsnorm"], spec, h)(DeviceArray.from_numpy(x), DeviceArray.from_numpy(w), y, 1e-6)
    ref = norm.reference(x, w, 1e-6)
    assert rel_err(y.numpy().astype(np.float32), ref) < 8e-3  # bf16 output rounding


@SETTINGS
@given(n=st.integers(1, 300_000), rows=st.integers(1, 5), ties=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_argmax_matches_numpy_including_ties(kernels, n, rows, ties, seed):
    """Each row's argmax, the rows in one launch (a verify's nodes), into a poisoned output a row longer."""
    spec, mods = kernels
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((rows, n), dtype=np.float32)
    if ties:  # several copies of a row's maximum: the lowest index must win, as in numpy
        for r in range(rows):
            v[r, rng.integers(0, n, size=min(n, 5))] = v[r].max() + 1.0
    out = poisoned(rows + 1, np.int32)
    op = argmax.Argmax(mods["argmax"], spec, max_rows=5)
    for _ in range(2):  # the second launch checks that the kernel reset its own tickets
        out.fill_bytes(0xFF)
        op(DeviceArray.from_numpy(v), out, rows=rows)
        got = out.numpy()
        assert [int(i) for i in got[:rows]] == [argmax.reference(row) for row in v]
        assert got[rows] == -1  # the poison past the last row
    synchronize()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.integers(1, 3_000_000), seed=st.integers(0, 2**32 - 1))
def test_read_xor_reads_every_word(kernels, words, seed):
    spec, mods = kernels
    data = np.random.default_rng(seed).integers(0, 2**32, size=4 * words, dtype=np.uint32)
    op = memread.ReadXor(mods["memread"], spec)
    op.launch(DeviceArray.from_numpy(data))
    assert op.result() == memread.reference(data)
