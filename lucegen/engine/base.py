"""The engine interface: one sequence's state and the two forward operations every backend provides.

Backends: `numpy` (lucegen.reference, slow, the truth; runs anywhere) and `cuda` (the generated kernels). Sampling,
speculative decoding, `lucegen run` and `lucegen serve` are written against this interface only, so they run and are
tested on the numpy backend in CI and on the cuda backend on a GPU. An engine with a draft attached (the numpy
backend's `speculation`) also has speculate(context_ids, max_new, sampler) -> new tokens, one round per target pass.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..model.config import ModelConfig


class ContextOverflow(ValueError):
    """A prompt or generation that would not fit the engine's context."""


class Engine(Protocol):
    config: ModelConfig
    max_context: int  # tokens the state can hold

    @property
    def position(self) -> int:
        """Tokens already in the state (the position the next token will take)."""

    def reset(self) -> None:
        """Forget the sequence: empty KV cache, zero conv and recurrent state, position 0."""

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens` to the state; return the float32 logits [vocab] after the last one."""

    def decode(self, token: int) -> np.ndarray:
        """Append one token; return the float32 logits [vocab] after it. An engine may also have
        decode_argmax(token) -> int: the same step, returning the argmax of those logits (numpy's rule: the lowest
        index of the largest) without copying them to the host; greedy generation takes it where it is. And
        decode_sample(token, temperature, u) -> int: the token drawn on the device from softmax(logits /
        temperature) with the uniform u, as Sampler would draw it with u (kernels/sample.py). And
        decode_top_k(token, k) -> (ids, log-softmax values) of the k <= max_top_k best tokens, with step_logits()
        -> the step's logits where the law needs the whole row (Sampler.draw_top_k)."""
