"""A token drawn on the device from softmax(logits / temperature) with one uniform (templates/sample.cuh): numpy
reference, unit, launcher.

The law is the host's (lucegen.engine.sampling: filtered_probs at that temperature, then Sampler.draw): the first
token whose running sum of probabilities passes u, for u the request's next uniform, so a seed fixes the tokens
wherever they are drawn. The row is cut into one slice a block; the kernel picks the slice from the blocks' partial
sums, then the token in it, in fp64: the same token as the host's but where u lies within rounding (~1e-15) of the
boundary between two. The decode megakernel draws its tokens with the same device functions (mk_decode.cuh).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec
from . import argmax

PART_BYTES = 16  # a SoftmaxPart: the slice's sum (fp64) and largest logit (fp32), padded


def slices(n: int, blocks: int) -> list[tuple[int, int]]:
    """Block b's slice [n b / blocks, n (b + 1) / blocks) of a row of n (sample.cuh: slice_of)."""
    return [(n * b // blocks, n * (b + 1) // blocks) for b in range(blocks)]


def first_past(w: np.ndarray, u: float) -> tuple[int, float]:
    """The first index whose running sum of w passes u times their sum, and how far into its weight that lies (a
    fraction); where rounding leaves none, the last index of positive weight (0 if none has weight) and 1."""
    running = np.cumsum(w)
    target = u * running[-1] if running.size else 0.0
    i = int(np.searchsorted(running, target, side="right"))
    if i == running.size:
        positive = np.flatnonzero(w > 0)
        return (int(positive[-1]) if positive.size else 0), 1.0
    before = running[i - 1] if i else 0.0
    return i, float(np.clip((target - before) / w[i], 0.0, 1.0))


def reference(logits: np.ndarray, temperature: float, u: float, blocks: int) -> int:
    """The token the kernel draws from fp32 logits [n] with u in [0, 1), its row cut among `blocks` blocks."""
    v, inv_t = np.asarray(logits, np.float32).astype(np.float64), 1.0 / temperature
    cuts = slices(v.size, blocks)
    maxes = np.array([v[a:b].max() if b > a else -np.inf for a, b in cuts])
    with np.errstate(invalid="ignore"):  # a slice of -inf logits: its sum is NaN, and weighs nothing (as on the GPU)
        sums = np.array([np.exp(v[a:b] * inv_t - m * inv_t).sum() if b > a else 0.0
                         for (a, b), m in zip(cuts, maxes)])
        zmax = maxes.max() * inv_t
        weights = np.where(sums > 0, sums * np.exp(maxes * inv_t - zmax), 0.0)
    block, frac = first_past(weights, u)
    a, b = cuts[block]
    return a + first_past(np.exp(v[a:b] * inv_t - maxes[block] * inv_t), frac)[0]


def units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    t = spec.tuning.argmax.threads  # a pass over a vocabulary row, as the argmax's
    return [KernelUnit("sample", "sample.cu.j2", {"threads": t, "max_blocks": argmax.blocks(spec)},
                       (KernelSig("sample_f32", t),))]


class Sample:
    """v (fp32 [n]) -> out (int32 [1]): the token drawn with u at a temperature, in one launch. Owns the blocks'
    parts and the self-resetting ticket."""

    def __init__(self, module, spec: ChipSpec):
        self.kernel = module.kernel("sample_f32")
        self.threads, self.blocks = spec.tuning.argmax.threads, argmax.blocks(spec)
        self.parts = DeviceArray.empty(self.blocks * PART_BYTES, np.uint8)
        self.ticket = DeviceArray.zeros(1, np.uint32)
        self.out = DeviceArray.empty(1, np.int32)

    def __call__(self, v: DeviceArray, temperature: float, u: float, stream=None) -> None:
        if not temperature > 0 or not 0 <= u < 1:
            raise ValueError(f"a draw at temperature {temperature} (> 0) with u {u} (in [0, 1))")
        self.kernel(self.blocks, self.threads, v, v.size, (1.0 / temperature, ctypes.c_double), (u, ctypes.c_double),
                    self.out, self.parts, self.ticket, stream=stream)

    def free(self) -> None:
        for a in (self.parts, self.ticket, self.out):
            a.free()
