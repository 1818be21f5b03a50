"""Kernel families. Each module holds a numpy reference, the units `lucegen build` renders, and a launcher (conv1d:
the reference and device code of the DeltaNet front, which the gdn family's prep runs)."""
from __future__ import annotations

from ..codegen.unit import KernelUnit
from ..model.config import ModelConfig
from ..spec import ChipSpec
from . import argmax, attention, draft, gdn, gemm, gemv, layered, megakernel, norm, qgemv, rows, topk, tree

# the prefill families (rows .. attention) skip model shapes their tiles cannot take; so does the decode megakernel
# where a model's rows exceed a block's shared memory
FAMILIES = (norm, gemv, argmax, rows, gemm, gdn, attention, qgemv, megakernel, layered, tree, draft, topk)


def all_units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    return [u for family in FAMILIES for u in family.units(spec, model)]
