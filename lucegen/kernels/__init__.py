"""Kernel families. Each module holds a numpy reference, the units `lucegen build` renders, and a launcher."""
from __future__ import annotations

from ..codegen.unit import KernelUnit
from ..model.config import ModelConfig
from ..spec import ChipSpec
from . import argmax, gemv, norm

FAMILIES = (norm, gemv, argmax)


def all_units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    return [u for family in FAMILIES for u in family.units(spec, model)]
