"""The per-layer row kernels of the layer-by-layer step (lucegen/engine/layered.py): embedding gather of a quantized
table, residual add + RMSNorm, SiLU x up, column placement into fused rows: numpy
references, unit, launchers. The step's mixers are the tree kernels (lucegen/kernels/tree.py).

Rows are fp32 (what qgemv.QMatmul reads and writes). The step's positions and token ids come from the device
(io = [position of token 0, token ids...]), so one captured graph replays at any position.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.ops import rms_norm, silu
from ..spec import ChipSpec
from .qgemv import fmt_of

SILU_CHUNK = 4  # SiLU x up: a block takes this many values per thread of a row (whole XBlocks: threads are warps)
NORM_CHUNK = 2  # add + RMSNorm: likewise (each block also reads the whole row, for its sum of squares)


# ---- numpy references ----------------------------------------------------------------------------------------
def add_rmsnorm_reference(x: np.ndarray, y: np.ndarray | None, w: np.ndarray, eps: float):
    """(x + y, the (1 + w) RMSNorm of it), fp32."""
    x = x.astype(np.float32) + (0 if y is None else y.astype(np.float32))
    return x, rms_norm(x, w.astype(np.float32), eps)


def silu_mul_reference(gate_up: np.ndarray) -> np.ndarray:
    g, u = np.split(gate_up.astype(np.float32), 2, axis=-1)
    return silu(g) * u


def place_reference(src: np.ndarray, dst: np.ndarray, off: int) -> np.ndarray:
    out = dst.copy()
    out[:, off:off + src.shape[1]] = src
    return out


# ---- unit -----------------------------------------------------------------------------------------------------
def shape_problem(spec: ChipSpec, cfg: ModelConfig) -> str | None:
    """Why the row kernels cannot run this model on this chip, or None."""
    if cfg.hidden_size % 8 or cfg.intermediate_size % 4 or cfg.value_dim % 4 or cfg.linear_value_head_dim % 4:
        return (f"{cfg.name}: the row kernels need hidden a multiple of 8, and the intermediate width and value heads "
                "of whole float4 quads")
    return None


def row_threads(spec: ChipSpec) -> int:
    """Threads a block of the row kernels: tuning.layered.row_threads, else tuning.norm.threads."""
    return spec.tuning.layered.row_threads or spec.tuning.norm.threads


def unit_name(embed_fmt: str) -> str:
    return f"layered_{embed_fmt}"


def units(spec: ChipSpec, model: ModelConfig, embed_fmts=None) -> list[KernelUnit]:
    """One unit per embedding format: the row kernels of `model`. By default the spec's weight formats that the
    hidden width takes, and bf16 (an HF checkpoint)."""
    if shape_problem(spec, model):
        return []
    if embed_fmts is None:
        embed_fmts = [f for f in spec.tuning.weight_formats if model.hidden_size % fmt_of(f).row_step == 0]
        embed_fmts += [] if "bf16" in embed_fmts else ["bf16"]
    cfg, rt = model, row_threads(spec)
    hexf = lambda v: float(np.float32(v)).hex() + "f"
    out = []
    for name in embed_fmts:
        fmt = fmt_of(name)
        params = dict(hidden=cfg.hidden_size, inter=cfg.intermediate_size, eps=hexf(cfg.rms_norm_eps),
                      embed_fmt=fmt.name, embed_cls=fmt.cls, row_threads=rt, silu_chunk=SILU_CHUNK * rt,
                      norm_chunk=NORM_CHUNK * rt)
        out.append(KernelUnit(unit_name(fmt.name), "layered.cu.j2", params, (
            KernelSig("layered_embed", rt), KernelSig("layered_add_rmsnorm", rt), KernelSig("layered_silu_mul", rt),
            KernelSig("layered_place", rt), KernelSig("layered_advance", 1))))
    return out


# ---- launchers -------------------------------------------------------------------------------------------------
def _null(a):
    """A kernel's optional pointer argument: the array, or a null pointer."""
    return (0, ctypes.c_void_p) if a is None else a


class LayerKernels:
    """The launchers; every one takes the step's token count m."""

    def __init__(self, module, spec: ChipSpec, cfg: ModelConfig):
        self.cfg, self.row_threads = cfg, row_threads(spec)
        self.silu_blocks = -(-cfg.intermediate_size // (SILU_CHUNK * self.row_threads))
        self.add_norm_blocks = -(-cfg.hidden_size // (NORM_CHUNK * self.row_threads))
        k = lambda name: module.kernel(f"layered_{name}")
        self._embed, self._add_norm, self._silu_mul, self._place = k("embed"), k("add_rmsnorm"), k("silu_mul"), k("place")
        self._advance = k("advance")

    def embed(self, table, io, x, m: int, stream=None) -> None:
        self._embed(m, self.row_threads, table, io, x, stream=stream)

    def add_rmsnorm(self, x, y, w, x_out, h, m: int, stream=None, xq=None) -> None:
        """x_out = x + y (None: x); h = RMSNorm (1 + w) of it; and h's XBlocks into xq when given (every row kernel:
        the quantized GEMVs' activations, qgemv.xblocks). x_out must be another buffer than x."""
        if x_out.ptr == x.ptr:
            raise ValueError("add_rmsnorm writes the sum to another buffer than x (its blocks read x whole)")
        self._add_norm((m, self.add_norm_blocks), self.row_threads, x, _null(y), w, x_out, h, _null(xq),
                       stream=stream)

    def silu_mul(self, gate_up, act, m: int, stream=None, xq=None) -> None:
        self._silu_mul((m, self.silu_blocks), self.row_threads, gate_up, act, _null(xq), stream=stream)

    def place(self, src, dst, n: int, ld: int, off: int, m: int, stream=None) -> None:
        self._place(m, self.row_threads, src, dst, n, ld, off, stream=stream)

    def advance(self, io, tokens, m: int, stream=None) -> None:
        """io = [position + m, tokens[m - 1]]: the next one-token step continues greedily."""
        self._advance(1, 1, io, tokens, m, stream=stream)
