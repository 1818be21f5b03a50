"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), seeded per request.

`filtered_probs` is the distribution itself, kept separate so that speculative decoding can accept or reject draft
tokens against exactly the distribution plain sampling draws from.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..reference.ops import argmax


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (the first maximum, as the reference and every kernel break ties); top_k 0 and
    top_p 1 turn those filters off; seed makes a request draw the same tokens every time (None: fresh entropy)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed}")


def drawn_on_device(params: SamplingParams) -> bool:
    """Whether the GPU engines draw this law's tokens on the device (kernels/sample.py: a temperature alone, with
    the request's uniforms); the others are drawn here from the logits."""
    return params.temperature > 0 and params.top_k == 0 and params.top_p == 1


def top_k_on_device(params: SamplingParams, most: int) -> bool:
    """Whether the GPU engines draw this top_k law's tokens from the device's top_k + 1 best of a row
    (kernels/topk.py, `most` at most: the engine's tuning.topk.max_k, or the vocabulary if smaller) and
    Sampler.draw_top_k; the whole row only on a tie at the k-th."""
    return params.temperature > 0 and 0 < params.top_k < most


def top_p_on_device(params: SamplingParams) -> bool:
    """Whether the GPU engines draw this law's tokens (top_p without top_k) from the device's best tokens of a row and
    its softmax (Sampler.draw_top_p); the whole row only where the nucleus reaches past them."""
    return params.temperature > 0 and params.top_k == 0 and params.top_p < 1


def filtered_probs(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The float64 distribution [vocab] a token is drawn from.

    softmax(logits / temperature), restricted to the logits >= the k-th largest (top_k > 0; ties with the k-th are
    kept), then to the smallest set of most probable tokens whose mass reaches top_p (equal probabilities ordered
    by lower id first), renormalized. temperature 0 gives the greedy one-hot on the first maximum.
    """
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        probs = np.zeros_like(logits)
        probs[argmax(logits)] = 1
        return probs
    z = logits / temperature
    if 0 < top_k < z.size:
        z = np.where(z >= np.partition(z, -top_k)[-top_k], z, -np.inf)
    z -= z.max()
    probs = np.exp(z, out=z)  # in place: a row of the vocabulary is 2 MB of float64
    probs /= probs.sum()
    if top_p < 1:
        order, running = most_probable_first(probs, top_p)
        kept = order[np.concatenate(([0.0], running[:-1])) < top_p]  # the mass before each is short of top_p
        nucleus = np.zeros_like(probs)
        nucleus[kept] = probs[kept]
        probs = nucleus / nucleus.sum()
    return probs


def most_probable_first(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Token ids by falling probability (equal ones by lower id first), a prefix of that order at least as long as
    the top_p nucleus, and the running sums of their probabilities. The tokens of probability below (1 - top_p) / vocab hold less than 1 - top_p together, so
    the others (the first in the full order) hold the nucleus, and only they are sorted: a peaked distribution over
    248K tokens sorts a handful, not all of them (~35 ms on the CI machine). Their mass is checked against top_p all
    the same (rounding); the whole vocabulary is sorted where it falls short. The prefix's running sums are the full
    order's (cumsum adds in order), so the cut is the same to the bit."""
    candidates = np.flatnonzero(probs >= (1 - top_p) / probs.size)
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    running = np.cumsum(probs[order])
    if order.size and running[-1] >= top_p:
        return order, running
    order = np.argsort(-probs, kind="stable")
    return order, np.cumsum(probs[order])


class Sampler:
    """Draws one request's tokens, from its own numpy Generator."""

    def __init__(self, params: SamplingParams = SamplingParams()):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature == 0:
            return argmax(logits)
        logits = np.asarray(logits)
        if 0 < p.top_k < logits.size:
            # top_k keeps the logits >= the k-th largest, the same tokens whatever the temperature (dividing by it
            # keeps their order and ties), so the distribution is made over those alone: ~k exponentials, not one a
            # token of the vocabulary (248K: ~5 ms a draw on a CPU core)
            kept = np.flatnonzero(logits >= np.partition(logits, -p.top_k)[-p.top_k])
            return self.draw_among(kept, logits[kept])
        return self.draw_among(None, logits)

    def draw_among(self, ids: np.ndarray | None, logits: np.ndarray) -> int:
        """The token drawn from the law over the candidates `ids` (ascending; None: the whole vocabulary) that
        top_k kept, with their logits: temperature and top_p applied here."""
        p = self.params
        probs = filtered_probs(logits, p.temperature, 0, p.top_p)
        if p.top_p < 1:
            # a filtered draw over the tokens left: the same token as over all of them for the same generator state
            # (the running sums at those tokens are the same)
            left = np.flatnonzero(probs)
            ids, probs = (left if ids is None else ids[left]), probs[left]
        token = self.draw(probs)
        return token if ids is None else int(ids[token])

    def draw_top_k(self, ids: np.ndarray, values: np.ndarray, row: Callable[[], np.ndarray]) -> int:
        """The draw of a top_k law from the top_k + 1 best tokens of a row (ids best first, and their logits or any
        shift of them: the device's log-softmax values), as __call__ draws it from the row; where the (k + 1)-th
        ties the k-th (the law keeps every tie) from the whole row, row()."""
        k = self.params.top_k
        if len(ids) != k + 1:
            raise ValueError(f"a top_k {k} draw takes the {k + 1} best tokens, got {len(ids)}")
        if values[k] == values[k - 1]:
            return self(row())
        order = np.argsort(ids[:k])
        return self.draw_among(np.asarray(ids[:k])[order], np.asarray(values[:k])[order])

    def draw_top_p(self, ids: np.ndarray, values: np.ndarray, zmax: float, total: float,
                   row: Callable[[], np.ndarray]) -> int:
        """The draw of a top_p law (top_k off) from the best tokens of a row (ids best first, ties to the lower id:
        the order of most_probable_first; values: their logits) and the row's softmax at the temperature (zmax: the
        largest logit / T, total: the sum over the row of exp(logit / T - zmax); kernels/sample.py's softmax_of),
        as __call__ draws it from the row: where their probabilities reach top_p the nucleus is a prefix of them,
        and the draw is over it in id order; else from the whole row, row()."""
        p = self.params
        probs = np.exp(np.asarray(values, np.float64) / p.temperature - zmax) / total
        running = np.cumsum(probs)
        if running[-1] < p.top_p:
            return self(row())
        kept = int(np.count_nonzero(np.concatenate(([0.0], running[:-1])) < p.top_p))  # filtered_probs' cut
        order = np.argsort(ids[:kept])
        return int(np.asarray(ids[:kept])[order][self.draw(probs[:kept][order])])

    def uniforms_ahead(self, n: int) -> np.ndarray:
        """The uniforms of the next n draws (each draw takes one, in order), without taking them: a speculative
        round draws every node of a depth with that depth's, then skip()s the ones its walk took."""
        state = self.rng.bit_generator.state
        us = self.rng.random(n)
        self.rng.bit_generator.state = state
        return us

    def skip(self, n: int) -> None:
        """Take the uniforms of n draws made elsewhere (on the device, from uniforms_ahead)."""
        self.rng.random(n)

    def draw(self, probs: np.ndarray) -> int:
        """numpy's Generator.choice(probs.size, p=probs), step for step (the running sums, scaled by the last, and
        the first above one uniform draw), without its checks' passes over probs: the same token from the same
        generator state."""
        cdf = np.cumsum(probs)
        cdf /= cdf[-1]
        return int(cdf.searchsorted(self.rng.random(), side="right"))
