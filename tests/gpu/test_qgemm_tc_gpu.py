"""The tensor-core GEMM (lucegen/kernels/qgemm_tc.py, Q4_K) on the GPU: against its numpy reference on fresh
inputs, and batch-invariant: a token's outputs are the same bits whatever M and its row in the launch.

Tolerance 1e-4 (relative, ||out - ref|| / ||ref||): the reference takes the kernel's fp16 operands exactly and sums
in float64; what is left is the order and width of the tensor core's fp32 sums (~1e-6). A wrong nibble, slot,
scale or row is O(1)."""
from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucegen.codegen.build import build
from lucegen.kernels import qgemm_tc, qgemv
from lucegen.model.config import tiny_config
from lucegen.model.quants import ggml_type, quantize
from lucegen.reference import relative_error
from lucegen.runtime import DeviceArray, synchronize
from lucegen.spec import TENSOR_CORE_FORMATS, spec_for_current_device

pytestmark = pytest.mark.gpu
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MAX_ROWS = 100


@cache
def module():
    spec = spec_for_current_device()
    return build(spec, tiny_config(), qgemm_tc.units(spec)).module(qgemm_tc.UNIT), spec


def weights(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) / np.sqrt(k)
    return quantize(w, ggml_type(fmt)).reshape(n, -1)


def run(fmt: str, raw: np.ndarray, x: np.ndarray, k: int, w: DeviceArray | None = None) -> np.ndarray:
    """Y from the kernel; w: raw already on the device (device_weights), else uploaded for the call."""
    mod, spec = module()
    n, m = raw.shape[0], x.shape[0]
    op = qgemm_tc.QGemmTC(mod, spec, fmt, MAX_ROWS, k)
    buf = w or qgemm_tc.device_weights(raw, fmt)  # the layout the kernel reads (qgemm_tc.repack)
    dx = DeviceArray.from_numpy(np.ascontiguousarray(x, np.float32))
    y = DeviceArray.empty((m, n), np.float32)
    y.fill_bytes(0xFF)  # poison: an unwritten output shows as NaN
    op(buf, dx, y, n, m)
    synchronize()
    out = y.numpy()
    for a in (op, dx, y, *([] if w else [buf])):
        a.free()
    return out


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
@SETTINGS
@given(m=st.one_of(st.sampled_from([1, 2, 8, 9, 16, 17, 23, 24, 25, 48, 49, 100]), st.integers(1, MAX_ROWS)),
       n=st.integers(1, 2400), kb=st.integers(1, 24), seed=st.integers(0, 2**32 - 1))
def test_matches_numpy(fmt, m, n, kb, seed):
    """Any N (row tiles past it store nothing), K split into shares or not (qgemm_tc.ksplit: N up to 2,400 on the
    GPU's SMs), launches of 24 rows and a last partial one."""
    k = 256 * kb
    raw = weights(fmt, n, k, seed)
    x = np.random.default_rng(seed + 1).standard_normal((m, k), dtype=np.float32)
    out = run(fmt, raw, x, k)
    assert np.isfinite(out).all(), "unwritten outputs"
    assert relative_error(out, qgemm_tc.reference(raw, fmt, x)) < 1e-4


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
def test_rows_past_the_fp16_range(fmt):
    """Activations up to 1e9 (fp16 ends at 65504): each row scaled into fp16 by a power of two and back; a small row
    beside them keeps its own precision."""
    n, k = 48, 512
    raw = weights(fmt, n, k, 7)
    x = np.random.default_rng(8).standard_normal((4, k), dtype=np.float32) * np.float32([1e9, 7e4, 1.0, 1e-3])[:, None]
    out = run(fmt, raw, x, k)
    ref = qgemm_tc.reference(raw, fmt, x)
    assert np.isfinite(out).all()
    for r in range(4):
        assert relative_error(out[r], ref[r]) < 1e-4, f"row {r}"


def test_weights_not_in_the_tensor_core_layout_are_refused():
    """GGUF's own rows (as the qgemv kernels take them) are shorter than the repacked layout: refused, not misread."""
    mod, spec = module()
    raw = weights("q4_k", 64, 512, 0)
    op = qgemm_tc.QGemmTC(mod, spec, "q4_k", 1, 512)
    w, x, y = (qgemv.device_weights(raw, "q4_k"), DeviceArray.from_numpy(np.ones((1, 512), np.float32)),
               DeviceArray.empty((1, 64), np.float32))
    with pytest.raises(ValueError, match="tensor-core layout"):
        op(w, x, y, 64, 1)
    for a in (op, w, x, y):
        a.free()


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
@pytest.mark.parametrize("n, k", [(64, 1024), (5120, 5120), (34816, 5120)])
def test_a_token_gives_the_same_bits_whatever_m_and_its_row(fmt, n, k):
    """Each of 48 tokens alone (M = 1, the decode GEMV), all 48 (launches of 24) in two row orders, and in launches
    of 17 and 31 rows (other token-tile counts): the same bits for every token, K split or not."""
    raw = weights(fmt, n, k, 3)
    w = qgemm_tc.device_weights(raw, fmt)
    x = np.random.default_rng(4).standard_normal((48, k), dtype=np.float32)
    together = run(fmt, raw, x, k, w)
    order = np.random.default_rng(5).permutation(48)
    shuffled = run(fmt, raw, x[order], k, w)
    split = np.concatenate([run(fmt, raw, x[:17], k, w), run(fmt, raw, x[17:], k, w)])
    assert np.isfinite(together).all(), "unwritten outputs"
    for t in range(48):
        alone = run(fmt, raw, x[t:t + 1], k, w)[0]
        assert np.array_equal(alone, together[t]), f"token {t}: M = 1 and M = 48 differ"
        assert np.array_equal(shuffled[np.flatnonzero(order == t)[0]], together[t]), f"token {t}: row order"
        assert np.array_equal(split[t], together[t]), f"token {t}: launches of 17 and 31 rows"
    w.free()
