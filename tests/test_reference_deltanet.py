"""Gated DeltaNet reference: the chunked rule equals the recurrent rule, and state carries across calls."""
import numpy as np
from hypothesis import given, settings, strategies as st

from lucegen.reference import relative_error
from lucegen.reference.deltanet import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule
from lucegen.reference.ops import l2norm


def tolerance(g: np.ndarray) -> float:
    """Relative error allowed between two orderings of the rule in g's precision.

    The two rules are the same math in a different order; measured they agree to a few ulps, except that the
    chunked rule forms exp(c_i - c_j) from within-chunk cumulative log-decays c, a cancellation whose error grows
    with |c| <= 64 max|g|. So: 64 ulps, plus 4 ulps of the largest possible |c|. A wrong decay, beta or state
    term shows as 1e-2 or more.
    """
    eps = float(np.finfo(g.dtype).eps)
    return 64 * eps + 4 * eps * 64 * float(np.abs(g).max(initial=0))


def output_error(o: np.ndarray, o_ref: np.ndarray, args, state) -> float:
    """|o - o_ref| relative to the terms each output sums: o_t = S_t^T q_t, so |S_t|^T |q_t| (S_t the reference's
    state after token t, q_t as the rule scales it). An output whose terms cancel (hypothesis finds k_t . q_t near 0
    at T = 1) has no digits of its own to compare; its terms do."""
    q, k, v, g, beta = args
    qn = np.abs(l2norm(q) / q.shape[-1] ** 0.5)
    mags, s = np.empty_like(v), state
    for t in range(len(q)):
        _, s = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        mags[t] = (qn[t][:, None, :] @ np.abs(s))[:, 0]
    return float(np.linalg.norm(o - o_ref) / np.linalg.norm(mags))


lengths = st.one_of(st.sampled_from([1, 2, 63, 64, 65, 127, 128, 130]), st.integers(1, 200))


@st.composite
def rule_inputs(draw, dtype):
    T, H = draw(lengths), draw(st.integers(1, 4))
    dk, dv = draw(st.sampled_from([8, 16, 32])), draw(st.sampled_from([4, 16, 32]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    decay = draw(st.sampled_from([1e-3, 0.1, 1.0, 10.0]))  # typical -g per token, from near 1 to near 0 memory
    q, k = rng.standard_normal((2, T, H, dk)) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    args = [q, k, rng.standard_normal((T, H, dv)), -decay * rng.uniform(0, 2, (T, H)), rng.uniform(0, 1, (T, H))]
    state = rng.standard_normal((H, dk, dv)) if draw(st.booleans()) else None
    return [a.astype(dtype) for a in args], None if state is None else state.astype(dtype)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from([np.float64, np.float32]).flatmap(rule_inputs))
def test_chunked_rule_equals_recurrent_rule(inputs):
    args, state = inputs
    o_ref, s_ref = recurrent_gated_delta_rule(*args, state)
    o, s = chunk_gated_delta_rule(*args, state)
    assert o.dtype == s.dtype == args[0].dtype
    assert output_error(o, o_ref, args, state) < tolerance(args[3])
    assert relative_error(s, s_ref) < tolerance(args[3])


@settings(max_examples=25, deadline=None)
@given(rule_inputs(np.float32), st.floats(0, 1))
def test_chunked_rule_from_a_state_continues_a_sequence(inputs, cut):
    # a verify block on a cache: the chunked rule from the state of a first part equals one pass over both
    args, state = inputs
    split = int(cut * args[0].shape[0])
    o_all, s_all = chunk_gated_delta_rule(*args, state)
    o1, s1 = chunk_gated_delta_rule(*(a[:split] for a in args), state)
    o2, s2 = chunk_gated_delta_rule(*(a[split:] for a in args), s1)
    assert relative_error(np.concatenate([o1, o2]), o_all) < tolerance(args[3])
    assert relative_error(s2, s_all) < tolerance(args[3])


def test_recurrent_rule_single_step_by_hand():
    # one head, dk = dv = 1: S' = S e^g + k beta (v - S e^g k), o = S' q, with q, k normalised to +-1, q / sqrt(1)
    S0, g, beta, v = 0.5, -0.3, 0.25, 2.0
    o, S = recurrent_gated_delta_rule(np.array([[[3.0]]]), np.array([[[-2.0]]]), np.array([[[v]]]),
                                      np.array([[g]]), np.array([[beta]]), np.array([[[S0]]]))
    k = -2.0 / np.sqrt(4 + 1e-6)
    q = 3.0 / np.sqrt(9 + 1e-6)
    S_want = S0 * np.exp(g) + k * beta * (v - S0 * np.exp(g) * k)
    assert np.isclose(S[0, 0, 0], S_want, rtol=1e-12)
    assert np.isclose(o[0, 0, 0], S_want * q, rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.integers(1, 6), st.integers(2, 5), st.data())
def test_conv1d_with_state_split_anywhere_equals_one_shot(seed, T, C, K, data):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((T, C)), rng.standard_normal((C, K))
    zeros = np.zeros((K - 1, C))
    y, state = causal_conv1d(x, w, zeros)

    # direct formula: y[t, c] = sum_j w[c, j] x[t + j - (K-1), c], zero before the sequence
    padded = np.concatenate([zeros, x])
    want = np.array([[w[c] @ padded[t : t + K, c] for c in range(C)] for t in range(T)])
    assert relative_error(y, want) < 1e-12
    assert np.array_equal(state, padded[-(K - 1):])  # the last K-1 raw inputs, oldest first

    cuts = sorted(data.draw(st.lists(st.integers(0, T), max_size=4)))
    parts, s = [], zeros
    for lo, hi in zip([0, *cuts], [*cuts, T]):
        part, s = causal_conv1d(x[lo:hi], w, s)
        parts.append(part)
    assert np.array_equal(np.concatenate(parts), y)
    assert np.array_equal(s, state)
