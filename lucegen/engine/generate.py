"""The generation loop: one loop serves `lucegen run`, `lucegen serve` and the tests.

Context rule: the prompt plus max_tokens must fit the engine's context (max_context), as in OpenAI's API. A request
that asks for more is rejected with ContextOverflow, not silently cut; when max_tokens is not given, the output may
fill the rest of the context.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from ..model.tokenizer import Tokenizer
from .base import ContextOverflow, Engine
from .sampling import Sampler, SamplingParams, drawn_on_device, top_k_on_device, top_p_on_device


@dataclass
class Generation:
    """The outcome of one generate() call. finish_reason: "stop" (an EOS token or a stop string), "length"
    (max_tokens reached) or "cancelled" (the cancellation check said so; no client is left to tell)."""
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float  # from the end of the prefill to the last output token
    target_passes: int = 0  # forward passes after the prefill: decode steps or speculative rounds

    @property
    def tokens_per_pass(self) -> float:
        """Output tokens after the first per target pass (1 without a draft; more when drafts are accepted)."""
        return (self.completion_tokens - 1) / self.target_passes if self.target_passes else 0.0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        """Output tokens after the first (each one decode step) per second."""
        steps = self.completion_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


def check_request(engine: Engine, prompt_ids: Sequence[int], max_tokens: int | None) -> int:
    """The number of tokens to generate at most: max_tokens checked against the context, or all the room left
    when it is None. Raises ContextOverflow, or ValueError for an empty prompt or a token outside the vocabulary."""
    n, context, vocab = len(prompt_ids), engine.max_context, engine.config.vocab_size
    if n == 0:
        raise ValueError("the prompt is empty")
    outside = [t for t in prompt_ids if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"token id {outside[0]} is outside the vocabulary (0..{vocab - 1})")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    room = context - n
    if room < 1:
        raise ContextOverflow(f"the prompt has {n} tokens, but the context holds {context} tokens including "
                              f"the output")
    if max_tokens is not None and max_tokens > room:
        raise ContextOverflow(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceed the context of "
                              f"{context} tokens: max_tokens can be at most {room}")
    return room if max_tokens is None else max_tokens


class _StopText:
    """Releases text as soon as it cannot be the start of a stop string; cuts the text before the first one."""

    def __init__(self, stop: Sequence[str], on_text: Callable[[str], None] | None):
        if any(not s for s in stop):
            raise ValueError("a stop string must not be empty")
        self.stop, self.on_text = tuple(stop), on_text
        self.held = ""  # text that may be the start of a stop string
        self.pieces: list[str] = []

    def add(self, piece: str) -> bool:
        """Take a piece of text; True when a stop string is complete (the text before it has been released)."""
        self.held += piece
        hits = [i for i in (self.held.find(s) for s in self.stop) if i >= 0]
        if hits:
            self._release(self.held[:min(hits)])
            self.held = ""
            return True
        keep = max((k for s in self.stop for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        self._release(self.held[:len(self.held) - keep])
        self.held = self.held[len(self.held) - keep:]
        return False

    def flush(self) -> None:
        self._release(self.held)
        self.held = ""

    def _release(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            if self.on_text:
                self.on_text(text)


class _Tokens:
    """The output tokens of the engine: the prefill's, then per target pass one token (engine.decode; greedy:
    engine.decode_argmax where the engine has it, at a temperature alone engine.decode_sample with the sampler's
    next uniform, with top_k engine.decode_top_k's k + 1 best, and with top_p alone engine.decode_top_p's best and
    softmax, all of which leave the logits on the device), or
    with a draft (engine.speculation) a speculative round: the accepted draft tokens and the bonus token. Passes run
    only when their tokens are asked for; `passes` counts them."""

    def __init__(self, engine: Engine, sampler: Sampler, prompt_ids: Sequence[int], max_tokens: int):
        self.engine, self.sampler, self.prompt_ids, self.max_tokens = engine, sampler, prompt_ids, max_tokens
        self.passes = 0

    def __iter__(self) -> Iterator[int]:
        engine, sampler = self.engine, self.sampler
        params, on_device = sampler.params, None
        if params.temperature == 0:
            on_device = getattr(engine, "decode_argmax", None)
        elif drawn_on_device(params) and (draw := getattr(engine, "decode_sample", None)):
            on_device = lambda token: draw(token, params.temperature, sampler.rng.random())
        elif (top := getattr(engine, "decode_top_k", None)) and top_k_on_device(
                params, min(engine.max_top_k, engine.config.vocab_size)):
            def on_device(token: int) -> int:  # the k + 1 best from the device; the whole row only on a tie
                return sampler.draw_top_k(*top(token, params.top_k + 1), engine.step_logits)
        elif top_p_on_device(params) and (top_p := getattr(engine, "decode_top_p", None)):
            most = min(engine.max_top_k, engine.config.vocab_size)

            def on_device(token: int) -> int:  # the best and the softmax; the whole row past them
                return sampler.draw_top_p(*top_p(token, params.temperature, most), engine.step_logits)
        step = on_device or (lambda token: sampler(engine.decode(token)))
        out = [sampler(engine.prefill(self.prompt_ids))]
        yield out[0]
        while True:
            self.passes += 1
            new = (engine.speculate([*self.prompt_ids, *out], self.max_tokens - len(out), sampler)
                   if getattr(engine, "speculation", None) else [step(out[-1])])
            out += new
            yield from new


def generate(engine: Engine, tokenizer: Tokenizer, prompt_ids: Sequence[int], max_tokens: int | None = None,
             sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (), *, ignore_eos: bool = False,
             on_text: Callable[[str], None] | None = None,
             cancelled: Callable[[], bool] = lambda: False) -> Generation:
    """Generate from an empty state (the engine is reset first) until an EOS token (the tokenizer's and the
    config's; not with ignore_eos), a stop string, max_tokens, or `cancelled()` (checked before the prefill and
    between tokens). Text goes to `on_text` piece by piece as it becomes final: whole characters, never a stop
    string or text after one. With a draft on the engine, tokens come in speculative rounds: the same tokens
    (greedy) or the same distribution (sampled) as without."""
    max_tokens = check_request(engine, prompt_ids, max_tokens)
    eos = set() if ignore_eos else {*tokenizer.eos_token_ids, engine.config.eos_token_id} - {None}
    text = _StopText(stop, on_text)
    detokenizer = tokenizer.detokenizer(skip_special_tokens=True)
    source = _Tokens(engine, Sampler(sampling), prompt_ids, max_tokens)
    engine.reset()
    tokens: list[int] = []
    start = first = time.perf_counter()
    finish, at_stop_string = "cancelled", False
    if not cancelled():
        for token in source:
            if not tokens:
                first = time.perf_counter()
            tokens.append(token)
            if token in eos:
                finish = "stop"
                break
            if text.add(detokenizer.feed(token)):
                finish, at_stop_string = "stop", True
                break
            if len(tokens) == max_tokens:
                finish = "length"
                break
            if cancelled():
                break
    if not at_stop_string:  # what the detokenizer and the stop check still hold
        if text.add(detokenizer.finish()):
            finish = "stop"
        text.flush()
    return Generation("".join(text.pieces), tokens, finish, len(prompt_ids), first - start,
                      time.perf_counter() - first, source.passes)
