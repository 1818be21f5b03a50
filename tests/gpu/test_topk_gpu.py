"""Top-k per position on the GPU (templates/topk.cuh) against its numpy reference, on freshly drawn logits of the
real vocabulary (248,320) and of small and awkward row lengths.

Outputs are poisoned (all bits set: id -1, value NaN) before every launch, so an entry the kernel fails to write
shows; every case runs twice, the second launch checking that the last block of each row reset its ticket. Ids are
compared exactly (the kernel selects on the logits' own bits, ties to the lower id, so it must equal the stable sort
on any input); values within topk.logprob_tolerance (argued there from fp32).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lucegen.codegen.build import build
from lucegen.kernels import topk
from lucegen.model.config import tiny_config
from lucegen.runtime import DeviceArray, Event, Stream, synchronize
from lucegen.spec import spec_for_current_device
from lucegen.spec_decode.tree import TopK, build_tree

pytestmark = pytest.mark.gpu
VOCAB = 248320  # Qwen3.5's
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def op(tmp_path_factory):
    spec = spec_for_current_device()
    result = build(spec, tiny_config(), topk.units(spec, tiny_config()), root=tmp_path_factory.mktemp("topk"))
    return topk.TopKKernel(result.module("topk"), spec, rows=16, vocab=VOCAB)


def draw(rng: np.random.Generator, kind: str, n: int, vocab: int) -> np.ndarray:
    if kind == "normal":  # a draft's logits: a few large ones over a wide spread
        x = rng.standard_normal((n, vocab)) * rng.uniform(0.5, 8)
        x[rng.random((n, vocab)) < 1e-3] += rng.uniform(5, 20)
        return x.astype(np.float32)
    if kind == "ties":  # a few distinct values, -0.0 and +0.0 among them: long runs of exact ties
        return rng.choice(np.array([-3.0, -0.0, 0.0, 1.5, 2.0], np.float32), size=(n, vocab))
    if kind == "constant":
        return np.full((n, vocab), np.float32(rng.standard_normal()), np.float32)
    if kind == "ramp":  # the best all at one end of the row
        r = np.arange(vocab, dtype=np.float32) * np.float32(rng.choice([-1e-3, 1e-3]))
        return np.broadcast_to(r, (n, vocab)).copy()
    raise ValueError(kind)


def poisoned(shape, dtype) -> DeviceArray:
    a = DeviceArray.empty(shape, dtype)
    a.fill_bytes(0xFF)
    return a


def check(op, x: np.ndarray, k: int, stream=None) -> None:
    n, vocab = x.shape
    ref_ids, ref_lp = topk.reference(x, k)
    tol = topk.logprob_tolerance(x, ref_lp)
    logits = DeviceArray.from_numpy(x)
    ids, lp, values = poisoned((n, k), np.int32), poisoned((n, k), np.float32), poisoned((n, k), np.float32)
    for with_values in (False, True):  # the second launch also checks that every row's ticket was reset
        for a in (ids, lp, values):
            a.fill_bytes(0xFF)
        synchronize()  # the upload and the memsets ran on the legacy stream, which a lucegen Stream does not wait for
        op(logits, n, vocab, k, stream=stream, ids=ids, logprobs=lp, values=values if with_values else None)
        if stream is not None:
            stream.synchronize()
        got_ids, got_lp = ids.numpy(), lp.numpy()
        np.testing.assert_array_equal(got_ids, ref_ids)
        if with_values:  # the logits themselves
            np.testing.assert_array_equal(values.numpy(), np.take_along_axis(x, ref_ids, axis=1))
        else:
            assert np.isnan(values.numpy()).all(), "values written though none were asked for"
        assert np.isfinite(got_lp).all(), "non-finite value (unwritten?)"
        err = np.abs(got_lp.astype(np.float64) - ref_lp)
        assert (err <= tol).all(), f"value error {err.max():.3g} (tolerance there {tol.flat[err.argmax()]:.3g})"
    synchronize()


@SETTINGS
@given(n=st.integers(1, 16), kfrac=st.floats(0, 1), kind=st.sampled_from(["normal", "normal", "ties", "ramp"]),
       seed=st.integers(0, 2**32 - 1))
def test_topk_real_vocab_matches_numpy(op, n, kfrac, kind, seed):
    k = 1 + round(kfrac * (op.max_k - 1))
    check(op, draw(np.random.default_rng(seed), kind, n, VOCAB), k)


@SETTINGS
@given(n=st.integers(1, 16),
       vocab=st.one_of(st.sampled_from([1, 2, 31, 64, 65, 255, 8191, 8192, 8193, 16384 + 17]), st.integers(1, 60000)),
       kfrac=st.floats(0, 1), kind=st.sampled_from(["normal", "ties", "constant", "ramp"]),
       seed=st.integers(0, 2**32 - 1))
def test_topk_small_and_awkward_rows_match_numpy(op, n, vocab, kfrac, kind, seed):
    k = 1 + round(kfrac * (min(op.max_k, vocab) - 1))
    check(op, draw(np.random.default_rng(seed), kind, n, vocab), k)


@pytest.mark.parametrize("k", [1, 2, 63, 64])
def test_exact_ties_go_to_the_lower_id(op, k):
    """Whole rows equal, -0.0 against +0.0, and the maximum repeated across slices: the stable sort's order."""
    rng = np.random.default_rng(k)
    x = np.zeros((4, VOCAB), np.float32)
    x[0] = 1.25                                           # all equal: ids 0 .. k-1
    x[1, rng.integers(0, VOCAB, 2000)] = -0.0             # -0 ties +0
    x[2] = -5.0
    x[2, rng.integers(0, VOCAB, 40)] = 7.0                # the maximum in many slices
    x[2, rng.integers(0, VOCAB, 40)] = 6.0
    x[3] = rng.choice(np.array([1.0, 2.0], np.float32), VOCAB)
    check(op, x, min(k, op.max_k))
    ids, _ = op(DeviceArray.from_numpy(x), 4, VOCAB, min(k, op.max_k))
    assert ids.numpy()[0].tolist() == list(range(min(k, op.max_k)))


def test_top_on_a_stream_feeds_ddtree(op):
    rng = np.random.default_rng(11)
    x = draw(rng, "normal", 16, VOCAB)
    s = Stream()
    try:
        check(op, x, op.max_k, stream=s)
        logits = DeviceArray.from_numpy(x)
        synchronize()
        top = topk.device_topk(op, logits, 16, VOCAB, 1000, s)  # k above max_k: max_k
        assert isinstance(top, TopK) and top.ids.shape == top.logprobs.shape == (16, op.max_k)
        ref_ids, ref_lp = topk.reference(x, op.max_k)
        np.testing.assert_array_equal(top.ids, ref_ids)
        assert (np.abs(top.logprobs - ref_lp) <= topk.logprob_tolerance(x, ref_lp)).all()
        tree = build_tree(top, op.max_k, root=3)  # chain seed first: the best token of every position
        assert tree.tokens[1:17] == ref_ids[:, 0].tolist() and len(tree.tokens) == op.max_k + 1
    finally:
        s.destroy()


def test_same_bits_every_run(op):
    x = draw(np.random.default_rng(5), "normal", 16, VOCAB)
    logits = DeviceArray.from_numpy(x)
    runs = []
    for _ in range(5):
        ids, lp = op(logits, 16, VOCAB, op.max_k)
        runs.append((ids.numpy().copy(), lp.numpy().view(np.uint32).copy()))
    for ids, bits in runs[1:]:
        np.testing.assert_array_equal(ids, runs[0][0])
        np.testing.assert_array_equal(bits, runs[0][1])


@pytest.mark.parametrize("n", [1, 4, 16])
def test_topk_time(op, n):
    """Not a pass/fail measure beyond a loose ceiling: prints the launch's time at the real vocabulary (pytest -s)."""
    x = draw(np.random.default_rng(n), "normal", n, VOCAB)
    logits = DeviceArray.from_numpy(x)
    synchronize()
    s = Stream()
    try:
        for _ in range(3):
            op(logits, n, VOCAB, op.max_k, stream=s)
        start = Event().record(s)
        reps = 50
        for _ in range(reps):
            op(logits, n, VOCAB, op.max_k, stream=s)
        end = Event().record(s)
        us = start.elapsed_ms(end) * 1e3 / reps
        read = n * VOCAB * 4 / (us * 1e-6) / 1e9
        print(f"\ntopk n={n} vocab={VOCAB} k={op.max_k}: {us:.1f} us a launch ({read:.0f} GB/s of logits)")
        assert us < 2000
    finally:
        s.destroy()
