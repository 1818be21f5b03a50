"""The numpy backend: the Engine interface over the float32 reference (lucegen.reference). Slow; runs anywhere."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..model.config import ModelConfig
from ..reference.model import State, decode_step, prefill
from ..spec_decode.decode import ReferenceVerifier, Speculation
from .base import ContextOverflow
from .sampling import Sampler


class NumpyEngine:
    """One sequence on the CPU. Weights (bf16, float16 or float32, any canonical Mapping) become float32 once.
    With `speculation` set (a draft), generate() runs speculative rounds (speculate) instead of decode steps."""

    def __init__(self, weights: Mapping[str, np.ndarray], config: ModelConfig, max_context: int | None = None):
        if max_context is not None and not 0 < max_context <= config.max_position_embeddings:
            raise ValueError(f"max_context {max_context} must be in 1..{config.max_position_embeddings} "
                             f"(the model's max_position_embeddings)")
        self.config = config
        self.max_context = max_context or config.max_position_embeddings
        self.weights = {name: np.asarray(w, np.float32) for name, w in weights.items()}
        self._state = State()
        self.speculation: Speculation | None = None

    @property
    def position(self) -> int:
        return self._state.position

    def reset(self) -> None:
        self._state = State()

    def _check(self, n: int) -> None:
        if not n:
            raise ValueError("no tokens to run")
        if self.position + n > self.max_context:
            raise ContextOverflow(f"{self.position} tokens in the state + {n} new ones exceed the "
                                  f"context of {self.max_context} tokens")

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        self._check(len(tokens))
        return prefill(self.weights, self.config, tokens, self._state)[-1]

    def decode(self, token: int) -> np.ndarray:
        self._check(1)
        return decode_step(self.weights, self.config, token, self._state)

    def speculate(self, context_ids: Sequence[int], max_new: int, sampler: Sampler) -> list[int]:
        """One speculative round (one target pass) after context_ids, the sequence so far whose last token is not
        in the state yet: 1 to max_new new tokens, the accepted draft tokens then the target's bonus token."""
        self._check(self.speculation.tokens_per_round(max_new))
        verifier = ReferenceVerifier(self.weights, self.config, self._state)
        new = self.speculation.round(verifier, context_ids, max_new, sampler)
        self._state = verifier.state
        return new
