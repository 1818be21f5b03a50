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
    """v (fp32 [rows, n]) -> out (int32 [rows]): each row's argmax, all in one launch, for up to max_rows rows.
    Owns the per-block partials and the self-resetting tickets of every row."""

    def __init__(self, module, spec: ChipSpec, max_rows: int = 1):
        self.kernel = module.kernel("argmax_f32")
        self.threads, self.blocks, self.max_rows = spec.tuning.argmax.threads, blocks(spec), max_rows
        self.partials = DeviceArray.empty((max_rows, self.blocks, 2), np.int32)  # {float value, int index} a block
        self.ticket = DeviceArray.zeros(max_rows, np.uint32)

    def __call__(self, v, out, stream=None, rows: int = 1) -> None:
        if not 1 <= rows <= self.max_rows or v.size % rows or out.size < rows:
            raise ValueError(f"argmax of {rows} rows (at most {self.max_rows}) of v {v} into out {out}: v must be "
                             f"whole rows and out hold one index a row")
        self.kernel((self.blocks, rows), self.threads, v, v.size // rows, out, self.partials, self.ticket,
                    stream=stream)

    def free(self) -> None:
        self.partials.free()
        self.ticket.free()
