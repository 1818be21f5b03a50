"""Argmax over the vocabulary in one launch (numpy's rule: lowest index on ties)."""
from __future__ import annotations

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.ops import argmax
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec

reference = argmax  # the numpy reference of this kernel: the first maximum wins


def blocks(spec: ChipSpec) -> int:
    return spec.tuning.argmax.blocks or spec.chip.sm_count


def units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    t = spec.tuning.argmax.threads
    return [KernelUnit("argmax", "argmax.cu.j2", {"threads": t, "max_blocks": blocks(spec)},
                       (KernelSig("argmax_f32", t),))]


class Argmax:
    """v (fp32 [n]) -> out (int32 [1]). Owns its per-block partials and its self-resetting ticket."""

    def __init__(self, module, spec: ChipSpec):
        self.kernel = module.kernel("argmax_f32")
        self.threads, self.blocks = spec.tuning.argmax.threads, blocks(spec)
        self.partials = DeviceArray.empty((self.blocks, 2), np.int32)   # {float value, int index} per block
        self.ticket = DeviceArray.zeros(1, np.uint32)

    def __call__(self, v, out, stream=None) -> None:
        self.kernel(self.blocks, self.threads, v, v.size, out, self.partials, self.ticket, stream=stream)
