"""KernelUnit: one rendered CUDA file and the kernels it defines."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class KernelSig:
    """A kernel entry point and the block size it is launched with (for the occupancy column of the manifest)."""
    name: str
    threads: int
    cooperative: bool = False
    dynamic_smem: int = 0


@dataclass(frozen=True)
class KernelUnit:
    """A template rendered with `params` into one .cu file, compiled into one cubin."""
    name: str
    template: str
    params: Mapping[str, Any]
    kernels: tuple[KernelSig, ...]
    options: tuple[str, ...] = field(default=())
    arch_specific: bool = False  # compiled for the arch's "a" target (sm_90a: wgmma, setmaxnreg), not portable
