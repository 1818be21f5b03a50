"""The reference's norms, activations and RoPE against float64 formulas written out directly."""
import numpy as np
from hypothesis import given, settings, strategies as st

from lucegen.reference import relative_error
from lucegen.reference.ops import (
    apply_rope, argmax, l2norm, rms_norm, rms_norm_gated, rope_cos_sin, sigmoid, silu, softplus,
)

# float32 results of O(dim) reductions against a float64 evaluation of the same formula: a few ulps per element.
F32_RTOL = 1e-6
EPS = 1e-6


def f32(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


vectors = st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 9), st.integers(1, 300),  # seed, rows, dim,
                    st.sampled_from([1e-2, 1.0, 1e2]))  # scale


@settings(max_examples=30, deadline=None)
@given(vectors)
def test_rms_norm_matches_float64(case):
    seed, rows, dim, scale = case
    rng = np.random.default_rng(seed)
    x, w = f32(rng, (rows, dim), scale), f32(rng, dim, 0.1)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + EPS) * (1 + w64)
    got = rms_norm(x, w, EPS)
    assert got.dtype == np.float32
    assert relative_error(got, want) < F32_RTOL


@settings(max_examples=30, deadline=None)
@given(vectors)
def test_rms_norm_gated_matches_float64(case):
    seed, rows, dim, scale = case
    rng = np.random.default_rng(seed)
    x, z, w = f32(rng, (rows, dim), scale), f32(rng, (rows, dim), 3.0), 1 + f32(rng, dim, 0.1)
    x64, z64, w64 = (a.astype(np.float64) for a in (x, z, w))
    want = w64 * x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + EPS) * z64 / (1 + np.exp(-z64))
    got = rms_norm_gated(x, z, w, EPS)
    assert got.dtype == np.float32
    assert relative_error(got, want) < F32_RTOL


@settings(max_examples=30, deadline=None)
@given(vectors)
def test_l2norm_matches_float64(case):
    seed, rows, dim, scale = case
    x = f32(np.random.default_rng(seed), (rows, dim), scale)
    x64 = x.astype(np.float64)
    got = l2norm(x)
    assert got.dtype == np.float32
    assert relative_error(got, x64 / np.sqrt((x64**2).sum(-1, keepdims=True) + EPS)) < F32_RTOL


def test_eps_sits_inside_the_sum_for_l2norm_and_the_mean_for_rms_norm():
    # a small vector tells the placements apart: |x|^2 = 4e-8 is far below eps
    x = np.full(4, 1e-4, np.float64)
    assert np.allclose(l2norm(x), x / np.sqrt(4e-8 + EPS), rtol=1e-12)
    assert np.allclose(rms_norm(x, np.zeros(4), EPS), x / np.sqrt(1e-8 + EPS), rtol=1e-12)


def test_activations_match_float64_and_stay_finite_at_extremes():
    x = np.concatenate([np.linspace(-30, 30, 2001), [-1e4, -100.0, 20.0, 100.0, 1e4]]).astype(np.float32)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        wants = (x64 / (1 + np.exp(-x64)), 1 / (1 + np.exp(-x64)), np.where(x64 > 20, x64, np.log1p(np.exp(x64))))
    for got, want in zip((silu(x), sigmoid(x), softplus(x)), wants):
        assert got.dtype == np.float32
        # elementwise; the 1e-30 floor only admits float32 underflow (e.g. sigmoid(-100) = 3.7e-44)
        assert np.all(np.abs(got - want) <= F32_RTOL * np.abs(want) + 1e-30)


def test_softplus_threshold_matches_torch():
    # visible in float64 only: above 20 softplus returns x itself, below it log1p(exp(x))
    assert softplus(np.float64(20.5)) == 20.5
    assert softplus(np.float64(19.5)) == np.log1p(np.exp(19.5)) != 19.5


ROPE_CASES = st.tuples(st.integers(0, 2**32 - 1), st.sampled_from([(32, 8), (64, 16), (256, 64), (16, 16)]),
                       st.integers(0, 4000), st.integers(1, 12), st.sampled_from([1e4, 1e6, 1e7]))


@settings(max_examples=40, deadline=None)
@given(ROPE_CASES)
def test_partial_rope_matches_direct_rotation(case):
    seed, (head_dim, rotary_dim), start, T, theta = case
    rng = np.random.default_rng(seed)
    x = f32(rng, (T, 3, head_dim))
    positions = np.arange(start, start + T)
    got = apply_rope(x, *rope_cos_sin(positions, rotary_dim, theta))

    # dims i and i + r/2 rotate together by pos * theta^(-2i/r); dims >= r pass through untouched
    half = rotary_dim // 2
    angle = positions[:, None, None] * theta ** (-2.0 * np.arange(half) / rotary_dim)
    a, b = x[..., :half].astype(np.float64), x[..., half:rotary_dim].astype(np.float64)
    want = np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle),
                           x[..., rotary_dim:]], axis=-1)
    # HF rounds the angle to float32 (pos * inv_freq), an error up to ~2 ulp of the angle, i.e. ~pos * 2^-23 rad
    tol = 1e-6 + 4 * (start + T) * 2.0**-24
    assert relative_error(got, want) < tol
    assert np.array_equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_rope_at_position_zero_is_identity():
    x = f32(np.random.default_rng(0), (1, 2, 64))
    assert np.array_equal(apply_rope(x, *rope_cos_sin([0], 16, 1e7)), x)


def test_argmax_takes_the_first_of_equal_maxima():
    assert argmax(np.array([0.0, 3.0, 1.0, 3.0], np.float32)) == 1
