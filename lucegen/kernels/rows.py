"""Per-token-row kernels of the prefill: embedding gather into the fp32 residual stream, and the zero-centred
RMSNorm of that stream into bf16 (the input of every projection): numpy references, unit, launchers."""
from __future__ import annotations

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.ops import rms_norm
from ..spec import ChipSpec


def embed_reference(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return table[np.asarray(ids)].astype(np.float32)


def rmsnorm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The model reference's (1 + w) RMSNorm of fp32 rows, before the kernel's bf16 rounding."""
    return rms_norm(x.astype(np.float32), w.astype(np.float32), eps)


def units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    t, h = spec.tuning.norm.threads, model.hidden_size
    return [KernelUnit(f"prefill_rows_h{h}", "prefill_rows.cu.j2", {"h": h, "threads": t},
                       (KernelSig(f"embed_h{h}", t), KernelSig(f"rmsnorm_f32_h{h}", t)))]


class Rows:
    """embed(ids int32 [T], table bf16 [V, H], x fp32 [T, H]); rmsnorm(x fp32 [T, H], w fp32 [H], y bf16 [T, H])."""

    def __init__(self, module, spec: ChipSpec, model: ModelConfig):
        h = model.hidden_size
        self.threads = spec.tuning.norm.threads
        self._embed, self._norm = module.kernel(f"embed_h{h}"), module.kernel(f"rmsnorm_f32_h{h}")

    def embed(self, ids, table, x, rows: int, stream=None) -> None:
        self._embed(rows, self.threads, ids, table, x, stream=stream)

    def rmsnorm(self, x, w, y, rows: int, eps: float, stream=None) -> None:
        self._norm(rows, self.threads, x, w, y, float(eps), stream=stream)
