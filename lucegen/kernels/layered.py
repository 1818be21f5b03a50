"""The per-layer kernels of the layer-by-layer step (lucegen/engine/layered.py): embedding gather of a quantized
table, residual add + RMSNorm, SiLU x up, column placement into fused rows, and the decode megakernel's mixers
(templates/mk_deltanet.cuh deltanet_item, mk_attention.cuh attention_item) as standalone launches of one token
each: numpy references, unit, launchers.

Rows are fp32 (what qgemv.QMatmul reads and writes). The step's positions come from the device (io = [position of
token 0, token ids...]), so one captured graph replays at any position. DeltaNet value heads are in llama.cpp's
tiled order for a GGUF checkpoint, HF's grouped order for an HF one (LIN_TILED; engine/layered_weights.py).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.ops import rms_norm, silu
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec
from .megakernel import _divisor_at_most, att_in_rows, lin_in_rows, rope_inv_freq
from .qgemv import fmt_of

ATT_BLOCKS_PER_SM = 2
MIN_MIX_WARPS = 8


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


# ---- shapes ----------------------------------------------------------------------------------------------------
class Shape:
    """The launch shape of the mixers on a chip: threads (the attention item needs a warp per query head of a kv
    head plus two; MIN_MIX_WARPS warps where that is enough, which leaves each thread up to 255 registers),
    DeltaNet items of `dn_slice` value columns (about two items per SM), attention blocks and the least positions
    per attention item, shared memory of each."""

    def __init__(self, spec: ChipSpec, cfg: ModelConfig):
        self.row_threads = spec.tuning.norm.threads
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        warps = max(MIN_MIX_WARPS, group + 2)
        self.mix_threads = 32 * warps
        hv, dv, dk = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim
        self.dn_slice = dv // _divisor_at_most(dv, 2 * spec.chip.sm_count // hv)
        self.dn_items = hv * (dv // self.dn_slice)
        self.dn_smem = 4 * (2 * dk + self.dn_slice + 2)
        self.att_blocks = ATT_BLOCKS_PER_SM * spec.chip.sm_count
        self.att_min_chunk = 2 * warps
        self.max_chunks = max(1, self.att_blocks // cfg.num_key_value_heads)
        hd = cfg.head_dim
        item = group * hd + 2 * hd + cfg.rotary_dim + 2 * warps + warps * hd
        self.att_smem = 4 * max(item, self.max_chunks * group + group)


def shape_problem(spec: ChipSpec, cfg: ModelConfig) -> str | None:
    """Why the per-layer kernels cannot run this model on this chip, or None."""
    s = Shape(spec, cfg)
    if cfg.hidden_size % 8 or cfg.value_dim % 4 or cfg.linear_value_head_dim % 4:
        return f"{cfg.name}: the row kernels need hidden a multiple of 8 and value heads of whole float4 quads"
    if s.att_smem > spec.chip.smem_per_block:
        return f"{spec.name}: the attention item needs {s.att_smem} bytes of shared memory"
    return None


def unit_name(embed_fmt: str, tiled: bool) -> str:
    return f"layered_{embed_fmt}" + ("_tiled" if tiled else "")


def units(spec: ChipSpec, model: ModelConfig, variants=None) -> list[KernelUnit]:
    """One unit per (embedding format, tiled value heads) variant: the row kernels and the mixers of `model`. By
    default the GGUF variants (tiled) of the spec's weight formats that the hidden width takes, and bf16 in HF's
    order (an HF checkpoint)."""
    if shape_problem(spec, model):
        return []
    if variants is None:
        variants = [(f, f != "bf16") for f in spec.tuning.weight_formats
                    if model.hidden_size % fmt_of(f).block_values == 0]
        variants += [] if ("bf16", False) in variants else [("bf16", False)]
    s = Shape(spec, model)
    cfg = model
    hexf = lambda v: float(np.float32(v)).hex() + "f"
    out = []
    for name, tiled in variants:
        fmt = fmt_of(name)
        params = dict(
            hidden=cfg.hidden_size, inter=cfg.intermediate_size, eps=hexf(cfg.rms_norm_eps), tiled=tiled,
            lin=dict(hk=cfg.linear_num_key_heads, hv=cfg.linear_num_value_heads, dk=cfg.linear_key_head_dim,
                     dv=cfg.linear_value_head_dim, conv_k=cfg.linear_conv_kernel_dim, key_dim=cfg.key_dim,
                     value_dim=cfg.value_dim, conv_dim=cfg.conv_dim, in_rows=lin_in_rows(cfg), slice=s.dn_slice),
            att=dict(nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, hd=cfg.head_dim, rot=cfg.rotary_dim,
                     in_rows=att_in_rows(cfg), min_chunk=s.att_min_chunk),
            inv_freq=[hexf(v) for v in rope_inv_freq(cfg)], embed_fmt=fmt.name, embed_cls=fmt.cls,
            row_threads=s.row_threads, mix_threads=s.mix_threads, att_blocks=s.att_blocks, dn_smem=s.dn_smem,
            att_smem=s.att_smem)
        rt, mt = s.row_threads, s.mix_threads
        out.append(KernelUnit(unit_name(fmt.name, tiled), "layered.cu.j2", params, (
            KernelSig("layered_embed", rt), KernelSig("layered_add_rmsnorm", rt), KernelSig("layered_silu_mul", rt),
            KernelSig("layered_place", rt), KernelSig("layered_deltanet", mt), KernelSig("layered_deltanet_norm", mt),
            KernelSig("layered_attention", mt, dynamic_smem=s.att_smem), KernelSig("layered_advance", 1))))
    return out


# ---- launchers -------------------------------------------------------------------------------------------------
class LayerKernels:
    """The launchers; every one takes the step's token count m and the io buffer where it needs positions."""

    def __init__(self, module, spec: ChipSpec, cfg: ModelConfig):
        self.cfg, self.shape = cfg, Shape(spec, cfg)
        k = lambda name: module.kernel(f"layered_{name}")
        self._embed, self._add_norm, self._silu_mul, self._place = k("embed"), k("add_rmsnorm"), k("silu_mul"), k("place")
        self._deltanet, self._dn_norm, self._attention = k("deltanet"), k("deltanet_norm"), k("attention")
        self._advance = k("advance")
        if self.shape.att_smem > 48 * 1024:
            self._attention.set_max_dynamic_smem(self.shape.att_smem)
        if cfg.full_layers:
            nkv, g, hd = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
            self.part_ml = DeviceArray.empty(nkv * self.shape.max_chunks * g * 2, np.float32)
            self.part_acc = DeviceArray.empty(nkv * self.shape.max_chunks * g * hd, np.float32)
            self.tickets = DeviceArray.zeros(nkv, np.uint32)

    def embed(self, table, io, x, m: int, stream=None) -> None:
        self._embed(m, self.shape.row_threads, table, io, x, stream=stream)

    def add_rmsnorm(self, x, y, w, h, m: int, stream=None) -> None:
        """x += y (None: no add); h = RMSNorm (1 + w) of x."""
        self._add_norm(m, self.shape.row_threads, x, (0, ctypes.c_void_p) if y is None else y, w, h,
                       stream=stream)

    def silu_mul(self, gate_up, act, m: int, stream=None) -> None:
        self._silu_mul(m, self.shape.row_threads, gate_up, act, stream=stream)

    def place(self, src, dst, n: int, ld: int, off: int, m: int, stream=None) -> None:
        self._place(m, self.shape.row_threads, src, dst, n, ld, off, stream=stream)

    def deltanet(self, mixed, conv_w, a_log, dt_bias, ring, state, out, io, t: int, stream=None) -> None:
        self._deltanet(self.shape.dn_items, self.shape.mix_threads, mixed, conv_w, a_log, dt_bias, ring, state, out,
                       io, t, stream=stream)

    def deltanet_norm(self, out, mixed, w, y, m: int, stream=None) -> None:
        self._dn_norm(m, self.shape.mix_threads, out, mixed, w, y, stream=stream)

    def attention(self, qkv, q_norm, k_norm, keys, values, out, io, t: int, stream=None) -> None:
        self._attention(self.shape.att_blocks, self.shape.mix_threads, qkv, q_norm, k_norm, keys, values,
                        self.part_ml, self.part_acc, self.tickets, out, io, t, smem=self.shape.att_smem,
                        stream=stream)

    def advance(self, io, tokens, m: int, stream=None) -> None:
        """io = [position + m, tokens[m - 1]]: the next one-token step continues greedily."""
        self._advance(1, 1, io, tokens, m, stream=stream)

    def free(self) -> None:
        for name in ("part_ml", "part_acc", "tickets"):
            if hasattr(self, name):
                getattr(self, name).free()
