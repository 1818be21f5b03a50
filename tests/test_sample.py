"""The device draw's law (lucegen/kernels/sample.py): its blocked numpy reference against the host's Sampler for
the same uniform, and the generation loop's use of an engine's decode_sample."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from lucegen.engine import load_model
from lucegen.engine.generate import generate
from lucegen.engine.sampling import SamplingParams, drawn_on_device, filtered_probs
from lucegen.kernels import sample
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


class FlatEngine:
    """An engine whose logits are a fixed function of the position and token (numpy), with or without a
    decode_sample that draws by the kernel's reference: generation must draw the same tokens either way."""

    def __init__(self, on_device: bool):
        self.config = tiny_config()
        self.max_context, self._pos, self.device_draws = 4096, 0, 0
        if on_device:
            self.decode_sample = self._decode_sample

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


def test_top_k_and_top_p_stay_on_the_host(tokenizer):
    engine = FlatEngine(True)
    generate(engine, tokenizer, [5], 10, SamplingParams(temperature=0.8, top_k=20, seed=1), ignore_eos=True)
    generate(engine, tokenizer, [5], 10, SamplingParams(temperature=0.8, top_p=0.9, seed=1), ignore_eos=True)
    assert engine.device_draws == 0
