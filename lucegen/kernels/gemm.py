"""bf16 GEMM on tensor cores, Y = X W^T with fp32 accumulation, and its fused epilogues: numpy reference, units,
launcher.

X [M, K] is the prefill's activations (M = tokens), W [N, K] a weight as stored; K a multiple of 64, N even.
Epilogues: `bf16` and `f32` store Y; `add` adds Y into an fp32 [M, N] array (the residual stream); `silu` writes
silu(gate) * up [M, N/2] bf16 from a W whose rows pair gate_proj and up_proj (row 2i = gate row i, row 2i + 1 = up
row i: the packing of kernels.megakernel, whose weight arena the prefill reads).

Two tile shapes are compiled per chip: a large one (the most throughput per block) and a small one (more blocks for
short prompts and narrow outputs); the launcher picks, per call, the one with the shorter estimated time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.ops import silu
from ..spec import ChipSpec

BK = 64          # K columns per pipeline stage

# name -> (epilogue functor, output element type, what it does)
EPILOGUES = {
    "bf16": ("StoreBf16", "bf16", "bf16 out"),
    "f32": ("StoreF32", "float", "fp32 out"),
    "add": ("AddF32", "float", "added into an fp32 residual"),
    "silu": ("SiluMulBf16", "bf16", "silu(gate) * up from paired gate/up rows, bf16 out"),
}


@dataclass(frozen=True)
class TileConfig:
    bm: int
    bn: int
    wm: int          # warps along M
    wn: int          # warps along N
    stages: int
    min_blocks: int  # __launch_bounds__ blocks per SM the register allocation must allow
    efficiency: float  # relative throughput of a block's tile, for choosing between configs

    @property
    def threads(self) -> int:
        return self.wm * self.wn * 32

    @property
    def smem(self) -> int:
        return self.stages * (self.bm + self.bn) * BK * 2

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}"

    def tiles(self, m: int, n: int) -> int:
        return math.ceil(m / self.bm) * math.ceil(n / self.bn)


def _deepest(spec: ChipSpec, bm: int, bn: int, wm: int, wn: int, min_blocks: int, eff: float,
             min_stages: int = 2, max_stages: int = 4) -> TileConfig | None:
    """The config with the most stages (min_stages .. max_stages) whose shared memory fits a block, or None."""
    for stages in range(max_stages, min_stages - 1, -1):
        cfg = TileConfig(bm, bn, wm, wn, stages, min_blocks, eff)
        if cfg.smem <= spec.chip.smem_per_block:
            return cfg
    return None


def tile_configs(spec: ChipSpec) -> tuple[TileConfig, TileConfig]:
    """(large, small) tile shapes for the chip: 128x256 with 8 warps where three stages fit (A100, H100, H200),
    else 128x128 with 4 warps; the small shape is 64x128 with 4 warps. Each takes as many stages (<= 4) as fit."""
    large = _deepest(spec, 128, 256, 2, 4, 1, 1.0, min_stages=3) or _deepest(spec, 128, 128, 2, 2, 1, 0.95)
    small = _deepest(spec, 64, 128, 2, 2, 2, 0.8)
    if large is None or small is None:
        raise ValueError(f"{spec.name}: {spec.chip.smem_per_block} bytes of shared memory per block hold no GEMM tile")
    return large, small


def choose(spec: ChipSpec, m: int, n: int) -> TileConfig:
    """The config with the shorter estimated time: the busiest SM's tiles times the time of one tile (blocks that
    share an SM share its tensor cores, so resident blocks do not shorten it)."""
    return min(tile_configs(spec), key=lambda c: math.ceil(c.tiles(m, n) / spec.chip.sm_count) * c.bm * c.bn
               / c.efficiency)


def reference(x: np.ndarray, w: np.ndarray, epilogue: str, y: np.ndarray | None = None) -> np.ndarray:
    """What the kernel writes, in float32 from the (bf16) inputs; `add` needs the fp32 array it adds into."""
    acc = x.astype(np.float32) @ w.astype(np.float32).T
    if epilogue == "add":
        return y + acc
    if epilogue == "silu":
        return silu(acc[:, 0::2]) * acc[:, 1::2]
    return acc


def kernel_name(config: TileConfig, epilogue: str) -> str:
    return f"gemm_{config.name}_{epilogue}"


def units(spec: ChipSpec, model: ModelConfig | None = None) -> list[KernelUnit]:
    """One unit per chip (the model's shapes are launch arguments)."""
    configs = tile_configs(spec)
    params = {
        "configs": [dict(name=c.name, bm=c.bm, bn=c.bn, wm=c.wm, wn=c.wn, stages=c.stages, threads=c.threads,
                         min_blocks=c.min_blocks) for c in configs],
        "epilogues": [dict(name=e, functor=f, out=t, doc=d) for e, (f, t, d) in EPILOGUES.items()],
    }
    sigs = tuple(KernelSig(kernel_name(c, e), c.threads, dynamic_smem=c.smem) for c in configs for e in EPILOGUES)
    return [KernelUnit("prefill_gemm", "prefill_gemm.cu.j2", params, sigs)]


class Gemm:
    """Y = X W^T for bf16 X [M, K] and W [N, K], with one of EPILOGUES."""

    def __init__(self, module, spec: ChipSpec):
        self.spec = spec
        self.kernels = {}
        for c in tile_configs(spec):
            for e in EPILOGUES:
                k = module.kernel(kernel_name(c, e))
                if c.smem > 48 * 1024:
                    k.set_max_dynamic_smem(c.smem)
                self.kernels[c.name, e] = k

    def __call__(self, x, w, y, m: int, n: int, k: int, epilogue: str, stream=None,
                 config: TileConfig | None = None) -> None:
        """Launch with `config`, or with the one `choose` picks for the shape."""
        if k % BK or n % 2:
            raise ValueError(f"GEMM {m}x{n}x{k} ({epilogue}): K must be a multiple of {BK} and N even")
        c = config or choose(self.spec, m, n)
        self.kernels[c.name, epilogue](c.tiles(m, n), c.threads, x, w, y, m, n, k, smem=c.smem, stream=stream)
