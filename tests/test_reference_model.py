"""The reference model: cached decoding equals one pass, hidden-state indexing, weights, greedy generation."""
from functools import cache

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from lucegen.model.config import tiny_config
from lucegen.reference import (
    State, decode_step, forward, generate, prefill, random_weights, relative_error, weight_shapes,
)
from lucegen.reference.model import decoder_layer
from lucegen.reference.ops import rms_norm

CONFIGS = {
    "tiny": tiny_config(),  # 2 value heads per key head, 2 query heads per KV head
    "ratio3": tiny_config(  # 3 value heads per key head and 6 query heads per KV head, as 27B
        name="ratio3", num_hidden_layers=8, linear_num_key_heads=2, linear_num_value_heads=6,
        num_attention_heads=6, num_key_value_heads=1, head_dim=64),
    "tied": tiny_config(name="tied", tie_word_embeddings=True, linear_num_value_heads=2),  # Hv == Hk, as 0.8B
}
# Decoding token by token, a block on a cache and one pass over all tokens are the same math rounded differently
# (recurrent vs chunked DeltaNet rule, other chunk boundaries, 1 vs T queries). The tests run the reference in
# float64 (it computes in its weights' dtype): in float32 the orders agree to 1e-6 .. 6e-6 on most draws, but some
# are ill-conditioned (ratio3, T = 65, B = 64, seed 11711: each float32 order 2.8e-3 from the float64 result, the
# two 1.4e-4 apart), while in float64 they agree to 1e-15 .. 4e-14 on every draw measured. A wrong position, state
# or cache entry moves the logits by 1e-2 or more.
RTOL64 = 1e-10


@cache
def weights(name: str, peaked: bool = False):
    return random_weights(CONFIGS[name], seed=7, peaked=peaked)


@cache
def weights64(name: str):
    return {k: v.astype(np.float64) for k, v in weights(name).items()}


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


lengths = st.one_of(st.sampled_from([1, 3, 63, 64, 65, 70, 128, 130]), st.integers(1, 140))


@pytest.mark.parametrize("name", ["tiny", "ratio3"])
@settings(max_examples=6, deadline=None)
@given(T=lengths, N=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_decode_steps_continue_prefill(name, T, N, seed):
    cfg, w = CONFIGS[name], weights64(name)
    ids = tokens(seed, T + N, cfg.vocab_size)
    full = prefill(w, cfg, ids)
    state = State()
    head = prefill(w, cfg, ids[:T], state)
    steps = np.array([decode_step(w, cfg, t, state) for t in ids[T:]])
    assert state.position == T + N
    assert relative_error(head, full[:T]) < RTOL64
    assert relative_error(steps, full[T:]) < RTOL64


@pytest.mark.parametrize("name", ["tiny", "ratio3"])
@settings(max_examples=6, deadline=None)
@given(T=lengths, B=st.sampled_from([2, 16, 64, 70]), seed=st.integers(0, 2**16))
@example(T=65, B=64, seed=11711)
def test_block_on_a_cache_continues_prefill(name, T, B, seed):
    # a verify block: the chunked DeltaNet rule from the cached state, attention over cache + block
    cfg, w = CONFIGS[name], weights64(name)
    ids = tokens(seed, T + B, cfg.vocab_size)
    state = State()
    prefill(w, cfg, ids[:T], state)
    assert relative_error(prefill(w, cfg, ids[T:], state), prefill(w, cfg, ids)[T:]) < RTOL64


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_follow_hf_indexing(name):
    cfg, w = CONFIGS[name], weights(name)
    ids = tokens(1, 20, cfg.vocab_size)
    out = forward(w, cfg, ids, output_hidden_states=True)
    hidden = out.hidden_states
    assert len(hidden) == cfg.num_hidden_layers + 1
    assert np.array_equal(hidden[0], w["embed_tokens.weight"][ids])
    state = State()  # hidden[j] is layer j-1's output, run here layer by layer on the previous entry
    for j in range(1, cfg.num_hidden_layers):
        assert np.array_equal(decoder_layer(w, cfg, j - 1, hidden[j - 1], state), hidden[j])
    last = decoder_layer(w, cfg, cfg.num_hidden_layers - 1, hidden[-2], state)
    assert np.array_equal(hidden[-1], rms_norm(last, w["norm.weight"], cfg.rms_norm_eps))  # HF: final-normed
    head = w["embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    assert np.array_equal(out.logits, hidden[-1] @ head.T)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weight_shapes_count_the_config_parameters(name):
    cfg = CONFIGS[name]
    shapes = weight_shapes(cfg)
    assert sum(int(np.prod(s)) for s in shapes.values()) == cfg.n_params()
    assert ("lm_head.weight" in shapes) != cfg.tie_word_embeddings
    w = weights(name)
    assert {k: v.shape for k, v in w.items()} == shapes
    assert all(v.dtype == np.float32 and np.all(np.isfinite(v)) for v in w.values())


def test_random_weights_are_determined_by_seed_and_name():
    cfg = CONFIGS["tiny"]
    a, b, c = random_weights(cfg, 3), random_weights(cfg, 3), random_weights(cfg, 4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not any(np.array_equal(a[k], c[k]) for k in a if a[k].size > 1)
    deeper = random_weights(tiny_config(num_hidden_layers=8), 3)  # other tensors do not shift a tensor's values
    assert all(np.array_equal(a[k], deeper[k]) for k in a)


def test_random_weights_magnitudes():
    w = weights("tiny")
    A = np.exp(w["layers.0.linear_attn.A_log"].astype(np.float64))
    assert np.all((A >= 1) & (A <= 16))
    assert abs(w["layers.0.input_layernorm.weight"].mean()) < 0.1  # (1 + w) norm: w around 0
    assert abs(w["layers.0.linear_attn.norm.weight"].mean() - 1) < 0.1  # plain-w norm: around 1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_is_greedy_and_peaked_weights_have_clear_margins(name):
    cfg, w = CONFIGS[name], weights(name, peaked=True)
    prompt = tokens(2, 66, cfg.vocab_size)
    out = generate(w, cfg, prompt, 10)
    logits = prefill(w, cfg, prompt + out[:-1])[len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == out
    top2 = np.sort(logits, axis=-1)[:, -2:]
    # the winning logit leads by far more than float32 / bf16 rounding could move it (measured: > 0.4)
    assert np.all(top2[:, 1] - top2[:, 0] > 0.1 * np.abs(logits).max(-1))


def test_generate_stops_at_eos():
    cfg, w = CONFIGS["tiny"], weights("tiny", peaked=True)
    out = generate(w, cfg, [5, 6, 7], 8)
    assert generate(w, cfg, [5, 6, 7], 8, eos_token_id=out[2]) == out[:3]


def test_state_copy_is_independent():
    cfg, w = CONFIGS["ratio3"], weights("ratio3")
    state = State()
    prefill(w, cfg, tokens(3, 10, cfg.vocab_size), state)
    fork = state.copy()
    a = decode_step(w, cfg, 11, fork)
    decode_step(w, cfg, 12, fork)  # advancing the fork leaves the original where it was
    assert state.position == 10
    assert np.array_equal(decode_step(w, cfg, 11, state), a)
