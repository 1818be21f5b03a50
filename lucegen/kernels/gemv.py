"""bf16 GEMV, y = W x with fp32 accumulation: numpy reference, kernel unit, launcher."""
from __future__ import annotations

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..spec import ChipSpec


def reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return w.astype(np.float32) @ x.astype(np.float32)


def reduction_widths(model: ModelConfig) -> list[int]:
    """Every K a decode-time matrix-vector product of the model reduces over."""
    return sorted({model.hidden_size, model.intermediate_size, model.value_dim,
                   model.num_attention_heads * model.head_dim})


def unroll_for(k: int, rows: int) -> int:
    """16-byte loads per row in flight: the lane's whole share of a short row, at most 8 loads per lane."""
    per_lane = -(-k // (8 * 32))
    return max(1, min(per_lane, 8 // rows))


def tile_rows(spec: ChipSpec, k: int) -> int:
    """bulk: whole rows per shared-memory tile (at least one, within the spec's tile size where a row fits)."""
    return max(1, spec.tuning.gemv.tile_bytes // (2 * k))


def dynamic_smem(spec: ChipSpec, k: int) -> int:
    """bulk: x, the tiles and one 8-byte mbarrier per stage."""
    g = spec.tuning.gemv
    return 2 * k + g.stages * tile_rows(spec, k) * 2 * k + 8 * g.stages if g.method == "bulk" else 0


def units(spec: ChipSpec, model: ModelConfig, ks: list[int] | None = None) -> list[KernelUnit]:
    g = spec.tuning.gemv
    ks = [k for k in (ks or reduction_widths(model)) if dynamic_smem(spec, k) <= spec.chip.smem_per_block]
    shapes = [{"k": k, "unroll": unroll_for(k, g.rows_per_warp), "tile_rows": tile_rows(spec, k)} for k in ks]
    params = {"shapes": shapes, "threads": g.threads, "rows": g.rows_per_warp, "method": g.method,
              "stages": g.stages}
    return [KernelUnit("gemv_bf16", "gemv.cu.j2", params,
                       tuple(KernelSig(f"gemv_bf16_k{k}", g.threads, dynamic_smem=dynamic_smem(spec, k))
                             for k in ks))]


class Gemv:
    """W (bf16 [N, K]) times x (bf16 [K]) -> y (fp32 [N])."""

    def __init__(self, module, spec: ChipSpec, k: int):
        self.kernel = module.kernel(f"gemv_bf16_k{k}")
        self.k, self.threads = k, spec.tuning.gemv.threads
        self.blocks = spec.tuning.gemv.blocks_per_sm * spec.chip.sm_count
        self.smem = dynamic_smem(spec, k)
        if self.smem > 48 * 1024:
            self.kernel.set_max_dynamic_smem(self.smem)

    def __call__(self, w, x, y, stream=None) -> None:
        n = w.size // self.k
        self.kernel(self.blocks, self.threads, w, x, y, n, smem=self.smem, stream=stream)
