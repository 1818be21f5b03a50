"""The device draw's law (lucegen/kernels/sample.py): its blocked numpy reference against the host's Sampler for
the same uniform; a top_k draw from the device's k + 1 best; the generation loop's use of an engine's decode_sample
and decode_top_k."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from lucegen.engine import load_model
from lucegen.engine.generate import generate
from lucegen.engine.sampling import Sampler, SamplingParams, drawn_on_device, filtered_probs
from lucegen.kernels import sample, topk
from lucegen.kernels.megakernel import Layout
from lucegen.model.config import tiny_config
from lucegen.spec import load_spec


def host_token(logits: np.ndarray, temperature: float, u: float) -> tuple[int, float]:
    """Sampler.draw's token for the uniform u, and u's distance to the nearest boundary between two tokens."""
    cdf = np.cumsum(filtered_probs(logits, temperature))
    cdf /= cdf[-1]
    return int(cdf.searchsorted(u, side="right")), float(np.abs(cdf - u).min())


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3000), blocks=st.integers(1, 160), temperature=st.floats(0.05, 4.0),
       scale=st.sampled_from([0.1, 1.0, 3.0, 30.0]), seed=st.integers(0, 2**32 - 1), u=st.floats(0.0, 1.0,
                                                                                                  exclude_max=True))
def test_reference_draws_the_hosts_token(n, blocks, temperature, scale, seed, u):
    logits = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    token, margin = host_token(logits, temperature, u)
    assume(margin > 1e-12)  # rounding decides a u on a boundary
    assert sample.reference(logits, temperature, u, blocks) == token


def test_reference_at_the_ends_of_the_unit_interval():
    logits = np.array([-np.inf, 2.0, -np.inf, 1.0, 2.0, -np.inf], np.float32)
    for blocks in (1, 2, 3, 6, 9):  # more blocks than tokens: empty slices weigh nothing
        assert sample.reference(logits, 1.0, 0.0, blocks) == 1  # the first token of positive probability
        assert sample.reference(logits, 1.0, np.nextafter(1.0, 0.0), blocks) == 4  # the last one
        assert sample.reference(logits, 1e-3, 0.7, blocks) == 4  # a tie at the top shares its mass
        assert sample.reference(logits, 1e-3, 0.3, blocks) == 1


def test_first_past_falls_back_to_the_last_positive_weight():
    w = np.array([0.0, 1.0, 0.0, 2.0, 0.0])
    assert sample.first_past(w, 0.0) == (1, 0.0)
    assert sample.first_past(w, 0.5) == (3, 0.25)
    assert sample.first_past(np.zeros(3), 0.5) == (0, 1.0)


def test_slices_are_the_megakernels_lm_head_rows():
    spec = load_spec("h200")
    lay = Layout(tiny_config(), spec)
    V = tiny_config().vocab_size
    assert sample.slices(V, lay.blocks) == [lay.block_rows(V, b) for b in range(lay.blocks)]


def test_drawn_on_device_is_a_temperature_alone():
    assert drawn_on_device(SamplingParams(temperature=0.7))
    for params in (SamplingParams(temperature=0), SamplingParams(top_k=20), SamplingParams(top_p=0.9)):
        assert not drawn_on_device(params)


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (5, 1.0), (20, 0.8), (50, 0.95)])
def test_a_top_k_draw_from_the_best_k_plus_one_is_the_rows(top_k, top_p):
    """Sampler.draw_top_k on the device's k + 1 best (ids best first, log-softmax values: topk.reference) draws what
    Sampler draws from the whole row, from the same generator state."""
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    rng = np.random.default_rng(top_k)
    for seed in range(40):
        logits = (rng.standard_normal(1000) * 3).astype(np.float32)
        ids, values = topk.reference(logits, top_k + 1)
        a, b = Sampler(dataclasses.replace(params, seed=seed)), Sampler(dataclasses.replace(params, seed=seed))
        assert a.draw_top_k(ids[0], values[0], row=lambda: pytest.fail("no tie: the row is not read")) == b(logits)
        assert a.rng.bit_generator.state == b.rng.bit_generator.state


def test_a_tie_at_the_kth_leaves_the_draw_to_the_whole_row():
    logits = np.array([0.0, 3.0, 1.0, 3.0, 1.0, -2.0], np.float32)  # the 3rd and 4th best tie (ids 2 and 4)
    params = SamplingParams(temperature=1.0, top_k=3)
    ids, values = topk.reference(logits, 4)
    for seed in range(20):
        sampler, host = Sampler(dataclasses.replace(params, seed=seed)), Sampler(dataclasses.replace(params, seed=seed))
        read = []
        assert sampler.draw_top_k(ids[0], values[0], row=lambda: read.append(1) or logits) == host(logits)
        assert read == [1]  # the row, once
    with pytest.raises(ValueError, match="takes the 4 best"):
        sampler.draw_top_k(ids[0][:3], values[0][:3], row=lambda: logits)


def test_uniforms_ahead_are_the_next_draws_uniforms():
    """uniforms_ahead(n) are the uniforms the next n draws take (one each), and leaves them there; skip(k) takes k."""
    a, b = Sampler(SamplingParams(seed=11)), Sampler(SamplingParams(seed=11))
    ahead = a.uniforms_ahead(6)
    assert a.rng.bit_generator.state == b.rng.bit_generator.state
    np.testing.assert_array_equal(ahead, [b.rng.random() for _ in range(6)])  # one draw's uniform at a time
    a.skip(4)
    assert a.rng.random() == ahead[4]


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.8), (1.0, 0.5), (0.3, 0.95)])
def test_a_top_p_draw_from_the_best_and_the_rows_softmax_is_the_rows(temperature, top_p):
    """Sampler.draw_top_p on the device's 64 best (topk.reference: ids, and their logits) and the row's softmax at
    the temperature from the sample kernel's parts (their reference) draws what Sampler draws from the whole row,
    from the same generator state; the row is read only where the nucleus reaches past the 64."""
    params = SamplingParams(temperature=temperature, top_p=top_p)
    rng = np.random.default_rng(int(temperature * 10))
    from_row = 0
    for seed in range(60):
        logits = (rng.standard_normal(1000) * rng.choice([1.0, 3.0, 6.0])).astype(np.float32)
        ids = topk.reference(logits, 64)[0][0]
        zmax, total = sample.softmax_of(*sample.parts(logits, temperature, 7), temperature)
        a, b = Sampler(dataclasses.replace(params, seed=seed)), Sampler(dataclasses.replace(params, seed=seed))
        read = []
        assert a.draw_top_p(ids, logits[ids], zmax, total, row=lambda: read.append(1) or logits) == b(logits)
        assert a.rng.bit_generator.state == b.rng.bit_generator.state
        from_row += len(read)
    assert 0 < from_row < 60  # both ways were taken


def test_softmax_of_the_parts_is_the_rows():
    logits = (np.random.default_rng(3).standard_normal(5000) * 4).astype(np.float32)
    for temperature, blocks in [(0.5, 1), (1.0, 7), (2.0, 132)]:
        zmax, total = sample.softmax_of(*sample.parts(logits, temperature, blocks), temperature)
        z = logits.astype(np.float64) / temperature
        assert zmax == pytest.approx(z.max(), rel=1e-15)
        assert total == pytest.approx(np.exp(z - z.max()).sum(), rel=1e-13)


class FlatEngine:
    """An engine whose logits are a fixed function of the position and token (numpy), with or without the device
    paths (decode_sample drawing by the kernel's reference, decode_top_k by topk's, decode_top_p by both): generation
    must draw the same tokens either way."""
    max_top_k = 64

    def __init__(self, on_device: bool):
        self.config = tiny_config()
        self.max_context, self._pos, self.device_draws, self.top_k_steps = 4096, 0, 0, 0
        if on_device:
            self.decode_sample, self.decode_top_k = self._decode_sample, self._decode_top_k
            self.decode_top_p = self._decode_top_p

    @property
    def position(self) -> int:
        return self._pos

    def reset(self) -> None:
        self._pos = 0

    def _logits(self, token: int) -> np.ndarray:
        rng = np.random.default_rng([self._pos, token])
        return (rng.standard_normal(self.config.vocab_size) * 2).astype(np.float32)

    def prefill(self, tokens) -> np.ndarray:
        self._pos += len(tokens) - 1
        return self.decode(tokens[-1])

    def decode(self, token: int) -> np.ndarray:
        logits = self._logits(token)
        self._pos += 1
        return logits

    def _decode_sample(self, token: int, temperature: float, u: float) -> int:
        self.device_draws += 1
        return sample.reference(self.decode(token), temperature, u, blocks=7)

    def _decode_top_k(self, token: int, k: int):
        self.top_k_steps += 1
        self.last = self.decode(token)
        ids, values = topk.reference(self.last, k)
        return ids[0], values[0]

    def _decode_top_p(self, token: int, temperature: float, k: int):
        self.top_k_steps += 1
        self.last = self.decode(token)
        ids = topk.reference(self.last, k)[0][0]
        return (ids, self.last[ids], *sample.softmax_of(*sample.parts(self.last, temperature, 7), temperature))

    def step_logits(self) -> np.ndarray:
        return self.last


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_model(checkpoint)[1]  # the tiny checkpoint's: tiny_config's vocabulary


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.3, seed=9)])
def test_generation_draws_on_the_device_the_hosts_tokens(params, tokenizer):
    host, device = FlatEngine(False), FlatEngine(True)
    a = generate(host, tokenizer, [5, 6, 7], 40, params, ignore_eos=True)
    b = generate(device, tokenizer, [5, 6, 7], 40, params, ignore_eos=True)
    assert device.device_draws == 39  # every token after the prefill's
    assert b.token_ids == a.token_ids


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=20, seed=3),
                                    SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=4),
                                    SamplingParams(temperature=0.5, top_p=0.9, seed=3),
                                    SamplingParams(temperature=1.0, top_p=0.6, seed=4)])
def test_top_k_and_top_p_take_the_devices_best_and_draw_the_hosts_tokens(params, tokenizer):
    host, device = FlatEngine(False), FlatEngine(True)
    a = generate(host, tokenizer, [5, 6, 7], 30, params, ignore_eos=True)
    b = generate(device, tokenizer, [5, 6, 7], 30, params, ignore_eos=True)
    assert (device.top_k_steps, device.device_draws) == (29, 0)
    assert b.token_ids == a.token_ids


def test_a_top_k_past_the_devices_stays_on_the_host(tokenizer):
    engine = FlatEngine(True)
    generate(engine, tokenizer, [5], 10, SamplingParams(temperature=0.8, top_k=64, seed=1), ignore_eos=True)
    assert (engine.top_k_steps, engine.device_draws) == (0, 0)
