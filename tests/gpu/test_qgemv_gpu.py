"""Quantized GEMV / small-M GEMM on the GPU against numpy, on freshly drawn blocks (quantized normal values, or
random bytes with finite fp16 scales) and activations (some 32-value blocks zero, some with an outlier): the decode
bit for bit, the activation quantization bit for bit, Y bit for bit numpy's emulation of the kernels' arithmetic
(qgemv.emulate; bf16: within the fp32 summation bound of X W^T) and within the quantization bound of the exact
X W^T, and each row of an M-row GEMM bit-equal to the GEMV of that row. Outputs are poisoned (all bits set: NaN)
and allocated longer than the kernel may write, so a missed element and a stray write both show.

Run for the GPU's own spec, for the RTX 3090 spec emulated at the GPU's arch (its M-tile, stages and grid) and for
the H200 spec (its verify GEMM the mma one, so its Q4_K sums by quads of lanes: qgemv.sums_by_quads) where the GPU
runs it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lucegen.codegen.build import build
from lucegen.kernels import qgemv
from lucegen.model.config import tiny_config
from lucegen.model.quants import dequantize
from lucegen.runtime import DeviceArray, device_info
from lucegen.spec import SpecError, load_spec, spec_for_current_device

from test_qgemv import draw_rows, draw_x

pytestmark = pytest.mark.gpu
# K per format: whole blocks, one not a whole number of K-slices, the 27B widths (Q6_K: odd numbers of GGUF blocks,
# the GPU's last pair half filled, in a first and a later slice)
KS = {f: ([136, 256] if f == "bf16" else [160] if f in ("q8_0", "q4_0") else [256]) + (f == "q6_k") * [1280] +
      [1024, 3584, 5120, 17408] for f in qgemv.FORMATS}
PAIRS = [(f, k) for f, ks in KS.items() for k in ks]
MS = [1, 2, 3, 8, 16, 23, 33, 64]
TAIL = 64  # poisoned elements past the end of every output
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# other tunings (threads, rows per warp, M-tile, span, the warps' shared-memory rings, int8 tensor cores for the
# formats that have them, one or two row tiles a block, a floor of blocks an SM): the same arithmetic, so the same
# bits
VARIANTS = [qgemv.Tuning(128, 2, 1, 1), qgemv.Tuning(256, 1, 1, 8), qgemv.Tuning(128, 1, 16, 1),
            qgemv.Tuning(256, 2, 4, 2), qgemv.Tuning(256, 1, 1, 2, 4), qgemv.Tuning(128, 2, 1, 1, 2),
            qgemv.Tuning(256, 1, 8, 1, 3), qgemv.Tuning(256, 1, 8, 1, 3, mma=True),
            qgemv.Tuning(256, 1, 16, 1, 2, mma=True), qgemv.Tuning(256, 2, 8, 1, 2, mma=True),
            qgemv.Tuning(256, 2, 16, 1, 2, mma=True),  # (the main ops' small N take one row tile a block: for_rows)
            qgemv.Tuning(256, 1, 1, 1, min_blocks=6)]  # the 27B's GEMV floor (specs/h200 model_min_blocks)


def fits(spec, t: qgemv.Tuning) -> bool:
    """Whether tuning t's kernels fit the spec's shared memory for every pair that gets them (Q6_K's two row tiles at
    an M-tile of 16 do not fit an RTX 3090's block)."""
    return all(t.smem(f, k, qgemv.sums_by_quads(spec, f)) <= spec.chip.smem_per_block
               for f, k in ((qgemv.fmt_of(f), k) for f, k in PAIRS) if f.mma or not t.mma)


@pytest.fixture(scope="module", params=["device", "rtx3090", "h200"])
def ops(request, tmp_path_factory):
    """({(format, K): QMatmul}, {format: Dequant}, {(format, K): [QMatmul of each of VARIANTS]}) built for the
    device's spec, the 3090's or the H200's."""
    spec = spec_for_current_device()
    if request.param == spec.name:
        pytest.skip(f"the {spec.name} spec is the device's own")
    if request.param != "device":
        try:
            spec = load_spec(request.param).with_arch(device_info().arch)
        except SpecError as e:
            pytest.skip(f"this GPU cannot run the {request.param} spec: {e}")
    model = tiny_config()
    extra = [t for t in VARIANTS if fits(spec, t)]
    result = build(spec, model, qgemv.units(spec, model, PAIRS, extra=extra), root=tmp_path_factory.mktemp("qgemv"))
    modules = {f: result.module(f"qgemv_{f}") for f in KS}

    def variant(f, k, t):
        t = dataclasses.replace(t, span=min(t.span, -(-k // qgemv.fmt_of(f).slice_values)))
        return qgemv.QMatmul(modules[f], spec, f, k, kernels=(t,))
    return ({(f, k): qgemv.QMatmul(modules[f], spec, f, k) for f, k in PAIRS},
            {f: qgemv.Dequant(modules[f].kernel(f"qdequant_{f}"), spec, spec.tuning.qgemv.threads) for f in KS},
            {(f, k): [variant(f, k, t) for t in extra if qgemv.fmt_of(f).mma or not t.mma] for f, k in PAIRS})


def poisoned(n: int) -> DeviceArray:
    a = DeviceArray.empty(n + TAIL, np.float32)
    a.fill_bytes(0xFF)
    return a


def written(a: DeviceArray, n: int) -> np.ndarray:
    """The first n elements; the tail must still hold the poison."""
    host = a.numpy()
    assert (host[n:].view(np.uint32) == 0xFFFFFFFF).all(), "the kernel wrote past its output"
    assert np.isfinite(host[:n]).all(), "non-finite output (unwritten or NaN)"
    return host[:n]


def draw(fmt: str, n: int, k: int, m: int, seed: int):
    return draw_rows(fmt, n, k, seed), draw_x(m, k, seed ^ 0x5EED)


def expected(raw: np.ndarray, fmt: str, x: np.ndarray, quads: bool) -> tuple[np.ndarray, np.ndarray]:
    """(what the kernel computes, in float64; a bound on |Y - that|). Quantized formats: qgemv.emulate, bit for bit
    (bound 0), its sums by lanes or by quads of them as the build's. bf16: X W^T (exact decoded weights), every term through at most 8 roundings in its dot8, one per
    later slice of its lane and 5 in the warp's butterfly: (that count) * 2^-24 * |X| |W|^T."""
    f = qgemv.fmt_of(fmt)
    if f.quantizes_x:
        y = qgemv.emulate(raw, fmt, x, quads).astype(np.float64)
        return y, np.zeros_like(y)
    slices = -(-x.shape[1] // f.slice_values)
    w = np.abs(dequantize(raw, f.ggml)).astype(np.float64)
    return qgemv.reference(raw, fmt, x), (8 + slices + 5) * 2.0**-24 * (np.abs(x).astype(np.float64) @ w.T)


@SETTINGS
@given(fmt=st.sampled_from(sorted(KS)), n=st.integers(1, 300), blocks=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1))
def test_dequant_is_bit_equal_to_gguf(ops, fmt, n, blocks, seed):
    f = qgemv.fmt_of(fmt)
    k = blocks * (256 if fmt == "bf16" else f.row_step)
    raw = draw_rows(fmt, n, k, seed)
    out = poisoned(n * k)
    ops[1][fmt](qgemv.device_weights(raw, fmt), out, n, k)
    ours = written(out, n * k).reshape(n, k)
    np.testing.assert_array_equal(ours.view(np.uint32), dequantize(raw, f.ggml).view(np.uint32))


@SETTINGS
@given(pair=st.sampled_from(PAIRS), m=st.sampled_from(MS), n=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_qmatmul_matches_numpy(ops, pair, m, n, seed):
    fmt, k = pair
    raw, x = draw(fmt, n, k, m, seed)
    y = poisoned(m * n)
    op = ops[0][pair]
    op(qgemv.device_weights(raw, fmt), DeviceArray.from_numpy(x), y, n, m)
    out = written(y, m * n).reshape(m, n).astype(np.float64)
    ref, bound = expected(raw, fmt, x, op.quads)
    assert (np.abs(out - ref) <= bound).all()
    if qgemv.fmt_of(fmt).quantizes_x:  # and the exact product within the argued quantization bound
        exact_bound = qgemv.quantization_bound(raw, fmt, x, op.quads)
        assert (np.abs(out - qgemv.reference(raw, fmt, x)) <= exact_bound + bound).all()
    elif m * n >= 64:  # over enough outputs that the norm is not one cancelling sum
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


@SETTINGS
@given(pair=st.sampled_from([p for p in PAIRS if p[0] != "bf16"]), m=st.sampled_from(MS),
       seed=st.integers(0, 2**32 - 1))
def test_activation_quantization_is_bit_equal_to_numpy(ops, pair, m, seed):
    fmt, k = pair
    raw, x = draw(fmt, 1, k, m, seed)
    op = ops[0][pair]
    op(qgemv.device_weights(raw, fmt), DeviceArray.from_numpy(x), poisoned(m), 1, m)
    np.testing.assert_array_equal(qgemv.xblocks_of(op.xq.numpy(), m, k), qgemv.xblocks(x))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=st.sampled_from(PAIRS), m=st.sampled_from(MS[1:]), n=st.integers(1, 400), seed=st.integers(0, 2**32 - 1))
def test_every_gemm_row_is_the_gemv_bit_for_bit(ops, pair, m, n, seed):
    fmt, k = pair
    raw, x = draw(fmt, n, k, m, seed)
    w, xd = qgemv.device_weights(raw, fmt), DeviceArray.from_numpy(x)
    op = ops[0][pair]
    y = poisoned(m * n)
    op(w, xd, y, n, m)
    gemm = written(y, m * n).reshape(m, n)
    for i in range(m):
        yi = poisoned(n)
        op(w, xd.view(k, offset_bytes=4 * k * i), yi, n, 1)
        np.testing.assert_array_equal(written(yi, n).view(np.uint32), gemm[i].view(np.uint32))


@SETTINGS
@given(pair=st.sampled_from(PAIRS), m=st.sampled_from(MS), n=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_every_tuning_gives_the_same_bits(ops, pair, m, n, seed):
    fmt, k = pair
    raw, x = draw(fmt, n, k, m, seed)
    w, xd = qgemv.device_weights(raw, fmt), DeviceArray.from_numpy(x)
    y = poisoned(m * n)
    ops[0][pair](w, xd, y, n, m)
    want = written(y, m * n).view(np.uint32)
    for op in ops[2][pair]:
        y = poisoned(m * n)
        op(w, xd, y, n, m)
        np.testing.assert_array_equal(written(y, m * n).view(np.uint32), want, err_msg=str(op.tuning_for(m)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=st.sampled_from(PAIRS), m=st.sampled_from(MS[1:]), n=st.integers(1, 300), gap=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1))
def test_rows_of_y_apart_get_the_same_bits_and_nothing_between(ops, pair, m, n, gap, seed):
    """Y's rows ldy = n + gap apart (a part of a fused projection written into its columns): every GEMM kernel
    (the spec's, and each variant with an M-tile past one row) writes the packed product's bits there, and the
    poison between the rows stays."""
    fmt, k = pair
    raw, x = draw(fmt, n, k, m, seed)
    w, xd = qgemv.device_weights(raw, fmt), DeviceArray.from_numpy(x)
    y = poisoned(m * n)
    ops[0][pair](w, xd, y, n, m)
    want = written(y, m * n).reshape(m, n).view(np.uint32)
    ldy = n + gap
    for op in [ops[0][pair], *(v for v in ops[2][pair] if v.tuning_for(m).mt > 1)]:
        ys = poisoned(m * ldy)
        op(w, xd, ys, n, m, ldy=ldy)
        rows = ys.numpy()[:m * ldy].reshape(m, ldy).view(np.uint32)
        np.testing.assert_array_equal(rows[:, :n], want, err_msg=str(op.tuning_for(m)))
        assert (rows[:, n:] == 0xFFFFFFFF).all(), f"{op.tuning_for(m)} wrote between Y's rows"
        assert (ys.numpy()[m * ldy:].view(np.uint32) == 0xFFFFFFFF).all()
