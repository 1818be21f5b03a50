"""Deterministic pseudo-random fills on the device (benchmark weights of the real shapes, no host copy)."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..spec import ChipSpec

THREADS = 256


def units(spec: ChipSpec, model: ModelConfig | None = None) -> list[KernelUnit]:
    return [KernelUnit("fill", "fill.cu.j2", {}, (KernelSig("fill_uniform_bf16", THREADS),
                                                   KernelSig("fill_uniform_f32", THREADS)))]


class Fill:
    def __init__(self, module, spec: ChipSpec):
        self.kernels = {np.dtype(ml_dtypes.bfloat16): module.kernel("fill_uniform_bf16"),
                        np.dtype(np.float32): module.kernel("fill_uniform_f32")}
        self.blocks = 4 * spec.chip.sm_count

    def uniform(self, a, seed: int, lo: float, hi: float, stream=None) -> None:
        """Fill the bf16 or fp32 device array `a` with values uniform in [lo, hi)."""
        self.kernels[a.dtype](self.blocks, THREADS, a, (a.size, ctypes.c_int64), (seed, ctypes.c_uint64),
                              float(lo), float(hi), stream=stream)
