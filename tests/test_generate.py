"""NumpyEngine against the reference, and the generation loop: EOS, stop strings, streaming, cancellation, context."""
from __future__ import annotations

import numpy as np
import pytest

from lucegen import reference
from lucegen.engine import (
    ContextOverflow, LoadError, SamplingParams, check_request, generate, load_model, model_name,
)
from lucegen.engine.numpy_backend import NumpyEngine
from lucegen.model.checkpoint import make_checkpoint
from lucegen.model.config import tiny_config
from lucegen.model.tokenizer import Tokenizer
from lucegen.model.weights import open_weights
from lucegen.runtime import gpu_available


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def weights32(checkpoint):
    return {name: np.asarray(w, np.float32) for name, w in open_weights(checkpoint).items()}


class ScriptedEngine:
    """An Engine whose logits pick the tokens of a script in turn: the loop's behaviour token by token."""

    def __init__(self, script: list[int], max_context: int = 4096, **config):
        self.config = tiny_config(**config)
        self.max_context, self.script = max_context, script
        self.calls: list[str] = []
        self.position = 0

    def reset(self) -> None:
        self.calls.append("reset")
        self.position = 0

    def _next(self, n: int) -> np.ndarray:
        logits = np.zeros(self.config.vocab_size, np.float32)
        logits[self.script[sum(c.startswith("decode") for c in self.calls)]] = 1
        self.position += n
        assert self.position <= self.max_context
        return logits

    def prefill(self, tokens) -> np.ndarray:
        self.calls.append("prefill")
        return self._next(len(tokens))

    def decode(self, token: int) -> np.ndarray:
        self.calls.append("decode")
        return self._next(1)


@pytest.fixture(scope="module")
def tokenizer(model) -> Tokenizer:
    return model[1]


def run(tokenizer, text: str, stop=(), max_tokens=None, max_context=4096, **kwargs):
    """Generate `text` (scripted byte by byte) after a 3-token prompt; returns (generation, pieces, engine)."""
    engine = ScriptedEngine(tokenizer.encode(text), max_context=max_context, **kwargs.pop("config", {}))
    pieces = []
    out = generate(engine, tokenizer, [1, 2, 3], max_tokens or len(engine.script), SamplingParams(temperature=0),
                   stop, on_text=pieces.append, **kwargs)
    assert "".join(pieces) == out.text
    return out, pieces, engine


# ---- NumpyEngine ---------------------------------------------------------------------------------------------
def test_numpy_engine_is_the_reference(model, weights32):
    engine, _ = model
    assert all(w.dtype == np.float32 for w in engine.weights.values())
    cfg, ids = engine.config, [5, 17, 300, 42, 9]
    state = reference.State()
    want = [reference.prefill(weights32, cfg, ids[:3], state)[-1]]
    want += [reference.decode_step(weights32, cfg, t, state) for t in ids[3:]]
    for _ in range(2):  # the second round shows that reset() forgets the sequence
        engine.reset()
        got = [engine.prefill(ids[:3])] + [engine.decode(t) for t in ids[3:]]
        assert engine.position == len(ids)
        np.testing.assert_array_equal(np.array(got), np.array(want))


def test_numpy_engine_context(checkpoint):
    engine = NumpyEngine(open_weights(checkpoint), open_weights(checkpoint).config, max_context=4)
    engine.prefill([1, 2, 3])
    engine.decode(4)
    with pytest.raises(ContextOverflow, match="4 tokens in the state \\+ 1 new ones exceed the context of 4"):
        engine.decode(5)
    with pytest.raises(ValueError, match="max_context 5000 must be in 1..4096"):
        NumpyEngine({}, engine.config, max_context=5000)


def test_loader_opens_a_gguf_with_the_tokenizer_beside_it(tmp_path):
    paths = make_checkpoint(tmp_path / "ck", tiny_config(name="q"), peaked=True, formats=("hf", "gguf"),
                            mix="q8_0", progress=False)
    engine, tokenizer = load_model(paths["gguf"])
    gguf = open_weights(paths["gguf"])
    assert engine.config == gguf.config and tokenizer.eos_token_ids == Tokenizer.from_dir(paths["hf"]).eos_token_ids
    np.testing.assert_array_equal(engine.weights["layers.0.mlp.up_proj.weight"], gguf["layers.0.mlp.up_proj.weight"])
    assert (model_name(paths["gguf"]), model_name(paths["hf"]), model_name("Qwen/Qwen3.5-0.8B")) == \
        ("q-q8_0", "ck", "Qwen/Qwen3.5-0.8B")


def test_loader_errors(checkpoint):
    if not gpu_available():
        with pytest.raises(LoadError, match="the cuda backend needs an NVIDIA GPU"):
            load_model(checkpoint, "cuda")
    with pytest.raises(LoadError, match="unknown backend 'tpu'"):
        load_model(checkpoint, "tpu")
    with pytest.raises(ValueError, match="some-draft: expected a DFlash draft directory"):
        load_model(checkpoint, draft="some-draft")


# ---- the loop on the real model ------------------------------------------------------------------------------
def test_greedy_is_the_reference(model, weights32, tokenizer):
    engine, _ = model
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}]))
    want = reference.generate(weights32, engine.config, ids, 24, eos_token_id=tokenizer.eos_token_ids[0])
    pieces = []
    out = generate(engine, tokenizer, ids, 24, SamplingParams(temperature=0), on_text=pieces.append)
    assert out.token_ids == want
    assert out.text == "".join(pieces) == tokenizer.decode(want, skip_special_tokens=True)
    assert (out.prompt_tokens, out.completion_tokens) == (len(ids), len(want))
    assert out.finish_reason == ("length" if len(want) == 24 else "stop")
    assert out.prefill_tps > 0 and out.decode_tps > 0


def test_seeded_sampling_repeats_and_state_is_clean(model, tokenizer):
    engine, _ = model
    ids = tokenizer.encode("Once upon a time")

    def sample(seed, prompt=ids):
        return generate(engine, tokenizer, prompt, 30, SamplingParams(temperature=1.0, seed=seed),
                        ignore_eos=True).token_ids

    first = sample(11)
    sample(12, tokenizer.encode("something else in between"))
    assert sample(11) == first  # the same tokens: nothing of the request in between is left in the state
    assert sample(12) != first


# ---- the loop, token by token ----------------------------------------------------------------------------------
def test_length_and_counts(tokenizer):
    out, pieces, engine = run(tokenizer, "Hello, world", max_tokens=5)
    assert (out.text, out.finish_reason, out.completion_tokens, out.prompt_tokens) == ("Hello", "length", 5, 3)
    assert engine.calls == ["reset", "prefill"] + ["decode"] * 4  # no step for a token that is not needed


class DeviceArgmaxEngine(ScriptedEngine):
    """A ScriptedEngine that also has decode_argmax, as the cuda engines (their device argmax: no logits copied)."""

    def decode_argmax(self, token: int) -> int:
        self.calls.append("decode_argmax")
        return int(np.argmax(self._next(1)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_greedy_steps_take_the_engines_argmax(tokenizer, temperature):
    """Greedy decode steps go through decode_argmax where the engine has it; sampled ones through decode's logits."""
    script = tokenizer.encode("Hello, world")
    engine = DeviceArgmaxEngine(script)
    out = generate(engine, tokenizer, [1, 2, 3], len(script), SamplingParams(temperature=temperature, seed=0))
    step = "decode_argmax" if temperature == 0 else "decode"
    assert engine.calls == ["reset", "prefill"] + [step] * (len(script) - 1)
    if temperature == 0:
        assert out.token_ids == script and out.text == "Hello, world"


@pytest.mark.parametrize("stop, text, through", [
    (["world"], "Hello, ", "Hello, world"),
    (["lo, w"], "Hel", "Hello, w"),  # spans five tokens
    (["world", "llo"], "He", "Hello"),  # the earliest stop string wins
    (["é"], "Hello, world! Caf", "Hello, world! Café"),  # one character of two byte tokens
    (["Hello"], "", "Hello"),
])
def test_stop_strings(tokenizer, stop, text, through):
    out, pieces, _ = run(tokenizer, "Hello, world! Café au lait", stop=stop)
    assert out.text == text and out.finish_reason == "stop"
    assert out.completion_tokens == len(tokenizer.encode(through))  # generation ends with the stop string


def test_a_partial_stop_string_is_held_then_released(tokenizer):
    out, pieces, _ = run(tokenizer, "abcxyxy", stop=["xyz"])
    assert out.text == "abcxyxy" and out.finish_reason == "length"
    assert pieces == ["a", "b", "c", "xy", "xy"]  # "x" and "xy" are held while they could become "xyz"


def test_multibyte_characters_come_out_whole(tokenizer):
    out, pieces, _ = run(tokenizer, "é€😀")
    assert pieces == ["é", "€", "😀"] and len(tokenizer.encode("é€😀")) == 9


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_tokens(tokenizer, ignore_eos):
    # the tokenizer's EOS (<|im_end|>) and the config's eos_token_id ("!", token 33 in the byte vocabulary)
    out, _, _ = run(tokenizer, "ab<|im_end|>cd!ef", ignore_eos=ignore_eos, config={"eos_token_id": 33})
    if ignore_eos:
        assert out.text == "abcd!ef" and out.finish_reason == "length"  # <|im_end|> is special: skipped in text
    else:
        assert out.text == "ab" and out.finish_reason == "stop" and out.completion_tokens == 3
    out, _, _ = run(tokenizer, "abcd!ef", config={"eos_token_id": 33})
    assert out.text == "abcd" and out.finish_reason == "stop"


def test_cancellation(tokenizer):
    checks = []

    def cancelled() -> bool:
        checks.append(1)
        return len(checks) > 3

    out, _, engine = run(tokenizer, "abcdefghij", cancelled=cancelled)
    assert out.finish_reason == "cancelled" and out.text == "abc"
    assert engine.calls == ["reset", "prefill", "decode", "decode"]
    out, _, engine = run(tokenizer, "abcdefghij", cancelled=lambda: True)
    assert out.finish_reason == "cancelled" and out.token_ids == [] and engine.calls == ["reset"]


def test_context(tokenizer):
    out, _, engine = run(tokenizer, "abcdefghij", max_context=8, max_tokens=5)
    assert out.text == "abcde"
    engine = ScriptedEngine([0], max_context=8)
    assert check_request(engine, [1, 2, 3], None) == 5  # no max_tokens: the room left
    with pytest.raises(ContextOverflow, match=r"plus max_tokens \(6\) exceed the context of 8 tokens: "
                                              r"max_tokens can be at most 5"):
        generate(engine, tokenizer, [1, 2, 3], 6)
    with pytest.raises(ContextOverflow, match="the prompt has 8 tokens, but the context holds 8"):
        check_request(engine, list(range(8)), None)
    with pytest.raises(ValueError, match="the prompt is empty"):
        check_request(engine, [], 3)
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        check_request(engine, [1, 512], 3)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        check_request(engine, [1], 0)
    with pytest.raises(ValueError, match="a stop string must not be empty"):
        generate(engine, tokenizer, [1], 1, stop=[""])
    assert engine.calls == []  # nothing ran
