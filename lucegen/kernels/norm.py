"""Zero-centred RMSNorm (HF Qwen3.5's (1+w) form): numpy reference, kernel unit, launcher."""
from __future__ import annotations

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.ops import rms_norm
from ..spec import ChipSpec


def reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w) in float32: the model reference's norm on upcast inputs."""
    return rms_norm(x.astype(np.float32), w.astype(np.float32), eps)


def widths(model: ModelConfig) -> list[int]:
    return sorted({model.hidden_size})


def units(spec: ChipSpec, model: ModelConfig, ws: list[int] | None = None) -> list[KernelUnit]:
    threads = spec.tuning.norm.threads
    ws = ws or widths(model)
    return [KernelUnit("rmsnorm", "norm.cu.j2", {"widths": ws, "threads": threads},
                       tuple(KernelSig(f"rmsnorm_1p_h{h}", threads) for h in ws))]


class RMSNorm:
    """rows of x (bf16 [rows, H]) -> y (bf16), weight w (bf16 [H])."""

    def __init__(self, module, spec: ChipSpec, width: int):
        self.kernel = module.kernel(f"rmsnorm_1p_h{width}")
        self.threads, self.width = spec.tuning.norm.threads, width

    def __call__(self, x, w, y, eps: float, stream=None) -> None:
        rows = x.size // self.width
        self.kernel(rows, self.threads, x, w, y, float(eps), stream=stream)
