"""The chunked gated delta rule of the prefill (chunk 64, WY form, tensor cores) and the gated RMSNorm of its output:
numpy references, units, launchers.

The prep starts with the DeltaNet front of its chunk and head (lucegen.kernels.conv1d: conv1d + SiLU of the
in-projection rows `mixed` into qkv [T, conv_dim] bf16, which the scan reads, and the gates g, beta), reading the
conv ring; the scan's first slice of each head writes the ring's new state. The l2 norms of q and k are taken in
fp32 from the bf16 qkv. The recurrent state is [Hv, dv, dk] fp32 (S transposed, the decode path's layout); o is
[T, Hv, dv] fp32.

Precision: q k^T and k k^T are bf16 tensor-core products of the bf16 inputs (exact products, fp32 sums); the
triangular inverse is fp32 forward substitution; every product with the state S, with v' and with the inverse runs
on tf32 tensor cores (operands rounded to 11 significant bits, sums in fp32), while S itself is accumulated in fp32
across the whole prompt and only its per-chunk operand copy is rounded. See tests/gpu/test_prefill_gpu.py for the
tolerances this gives against reference.deltanet.chunk_gated_delta_rule.
"""
from __future__ import annotations

import math

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.deltanet import chunk_gated_delta_rule
from ..reference.ops import rms_norm_gated
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec

CHUNK = 64
MAT_LD = 68   # padded fp32 row of a 64 x 64 matrix in shared memory
FAC = 5 * 64  # per-token factors per (chunk, head)
THREADS = 128       # the gated norm's blocks
PREP_THREADS = 256  # the front's q and k by all, then v by warps 4-7 beside the WY work of warps 0-3


def reference(cfg: ModelConfig, qkv: np.ndarray, g: np.ndarray, beta: np.ndarray,
              state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(o [T, Hv, dv], new state [Hv, dv, dk]) from the front's outputs (conv1d.reference), by the reference's
    chunked rule.

    state is in the kernels' layout [Hv, dv, dk] (None: zeros, as at position 0)."""
    T = qkv.shape[0]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kd = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.key_dim
    x = qkv.astype(np.float32)
    q = np.repeat(x[:, :kd].reshape(T, Hk, dk), Hv // Hk, axis=1)
    k = np.repeat(x[:, kd:2 * kd].reshape(T, Hk, dk), Hv // Hk, axis=1)
    v = x[:, 2 * kd:].reshape(T, Hv, dv)
    s0 = None if state is None else state.transpose(0, 2, 1)
    o, s = chunk_gated_delta_rule(q, k, v, g.astype(np.float32), beta.astype(np.float32), s0, chunk_size=CHUNK)
    return o, np.ascontiguousarray(s.transpose(0, 2, 1))


def gated_norm_reference(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm_gated per head: o, z [T, Hv, dv] -> [T, Hv * dv]."""
    return rms_norm_gated(o, z, w, eps).reshape(o.shape[0], -1)


def prep_smem(cfg: ModelConfig) -> int:
    return 2 * CHUNK * cfg.linear_key_head_dim * 2 + 2 * CHUNK * MAT_LD * 4 + 5 * CHUNK * 4


def scan_smem(cfg: ModelConfig, bv: int, stages: int) -> int:
    dk = cfg.linear_key_head_dim
    stage = 2 * CHUNK * dk * 2 + CHUNK * (bv + 8) * 2 + 2 * CHUNK * MAT_LD * 4 + FAC * 4
    return stages * stage + bv * (dk + 4) * 4 + bv * MAT_LD * 4


def scan_config(spec: ChipSpec, cfg: ModelConfig) -> tuple[int, int]:
    """(BV, stages) of the scan: 32-column slices where they still give a block per SM (fewer re-reads of the
    chunk's q, k, T, Aqk), else 16; two chunk stages in flight where shared memory holds them."""
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    widths = [bv for bv in (32, 16) if dv % bv == 0]
    wide = [bv for bv in widths if hv * dv // bv >= spec.chip.sm_count]
    for bv in (wide[:1] or []) + widths[::-1]:
        for stages in (2, 1):
            if scan_smem(cfg, bv, stages) <= spec.chip.smem_per_block:
                return bv, stages
    raise ValueError(f"{spec.name}: the DeltaNet scan of dk={cfg.linear_key_head_dim} needs "
                     f"{scan_smem(cfg, 16, 1)} bytes of shared memory; a block may use {spec.chip.smem_per_block}")


def scan_warps(spec: ChipSpec, cfg: ModelConfig, bv: int) -> int:
    """Warps of a scan block: two roles of four (the output beside the state update) where the blocks fit one wave,
    so that each block's chain of products is the whole time (0.8B pp520 on the H200: 628 -> 567 us); else four (the
    27B's 192 blocks: 4,433 us against 4,883 with eight)."""
    return 8 if cfg.linear_num_value_heads * cfg.linear_value_head_dim // bv <= spec.chip.sm_count else 4


def shape_problem(cfg: ModelConfig) -> str | None:
    """Why the chunked DeltaNet kernels cannot take this model's heads, or None."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if dk % 64 or dk > 256 or dv % 32:
        return (f"{cfg.name}: the chunked DeltaNet kernels need dk a multiple of 64 (<= 256) and dv a multiple of "
                f"32; got dk={dk}, dv={dv}")
    return None


def units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    """The unit for the model's DeltaNet heads; none when the model has no DeltaNet layer or heads the tiles
    cannot take (shape_problem)."""
    if not model.linear_layers or shape_problem(model):
        return []
    bv, stages = scan_config(spec, model)
    warps = scan_warps(spec, model, bv)
    # two prep blocks an SM where shared memory holds them (a prompt's chunks x heads pass the SM count: 144 blocks of
    # the 0.8B's 520 tokens on 132 SMs), so a thread gets 128 registers; else one, with no such cap (sm_120 spills
    # under it)
    prep_blocks = min(2, spec.max_coresident_blocks(PREP_THREADS, smem=prep_smem(model)) // spec.chip.sm_count)
    params = {"warps": warps, "dk": model.linear_key_head_dim, "dv": model.linear_value_head_dim,
              "hk": model.linear_num_key_heads, "hv": model.linear_num_value_heads, "bv": bv, "stages": stages,
              "c": model.conv_dim, "vd": model.value_dim, "k": model.linear_conv_kernel_dim,
              "mw": model.conv_dim + model.value_dim + 2 * model.linear_num_value_heads,
              "prep_smem": prep_smem(model), "prep_blocks": max(1, prep_blocks), "scan_smem": scan_smem(model, bv, stages)}
    name = f"prefill_gdn_k{model.linear_num_key_heads}x{model.linear_key_head_dim}_v{model.linear_num_value_heads}"
    return [KernelUnit(name, "prefill_gdn.cu.j2", params, (
        KernelSig("gdn_chunk_prep", PREP_THREADS, dynamic_smem=prep_smem(model)),
        KernelSig("gdn_chunk_scan", 32 * warps, dynamic_smem=scan_smem(model, bv, stages)),
        KernelSig("gdn_gated_norm", THREADS)))]


class Scratch:
    """The per-chunk WY quantities of up to `tokens` tokens: T and Aqk [chunks, Hv, 64, 64], factors [chunks, Hv, 320]."""

    def __init__(self, cfg: ModelConfig, tokens: int):
        chunks, hv = math.ceil(tokens / CHUNK), cfg.linear_num_value_heads
        self.wy = DeviceArray.empty((chunks, hv, CHUNK, CHUNK), np.float32)
        self.aqk = DeviceArray.empty((chunks, hv, CHUNK, CHUNK), np.float32)
        self.fac = DeviceArray.empty((chunks, hv, FAC), np.float32)
        self.tokens = chunks * CHUNK

    def free(self) -> None:
        for a in (self.wy, self.aqk, self.fac):
            a.free()


class ChunkedDeltaRule:
    """prep + scan: (the in-projection rows `mixed`, the conv ring and recurrent state in/out) -> qkv, o for T
    tokens at positions start .. (at start 0 the sequence starts here: neither state is read, as the decode path
    treats position 0)."""

    def __init__(self, module, spec: ChipSpec, cfg: ModelConfig):
        self.cfg = cfg
        self.bv, stages = scan_config(spec, cfg)
        self.scan_threads = 32 * scan_warps(spec, cfg, self.bv)
        self.prep_smem, self.scan_smem = prep_smem(cfg), scan_smem(cfg, self.bv, stages)
        self.prep, self.scan = module.kernel("gdn_chunk_prep"), module.kernel("gdn_chunk_scan")
        self.norm = module.kernel("gdn_gated_norm")
        for k, n in ((self.prep, self.prep_smem), (self.scan, self.scan_smem)):
            if n > 48 * 1024:
                k.set_max_dynamic_smem(n)

    def __call__(self, mixed, conv_w, a_log, dt_bias, ring, qkv, state, o, scratch: Scratch, T: int, start: int,
                 stream=None) -> None:
        """mixed fp32 [T, conv_dim + value_dim + 2 Hv]; conv_w fp32 [conv_dim, K]; a_log, dt_bias fp32 [Hv]; ring
        fp32 [K, conv_dim] and state fp32 [Hv, dv, dk], updated in place; qkv bf16 [T, conv_dim] and o fp32
        [T, Hv, dv] written."""
        if T > scratch.tokens:
            raise ValueError(f"{T} tokens exceed the scratch's {scratch.tokens}")
        hv, dv = self.cfg.linear_num_value_heads, self.cfg.linear_value_head_dim
        self.prep((hv, math.ceil(T / CHUNK)), PREP_THREADS, mixed, conv_w, a_log, dt_bias, ring, qkv, scratch.wy,
                  scratch.aqk, scratch.fac, T, start, smem=self.prep_smem, stream=stream)
        self.scan((hv, dv // self.bv), self.scan_threads, qkv, scratch.wy, scratch.aqk, scratch.fac, state, o, mixed,
                  ring, T, start, smem=self.scan_smem, stream=stream)

    def gated_norm(self, o, mixed, w, y, T: int, eps: float, stream=None) -> None:
        """y bf16 [T, Hv * dv] = gated RMSNorm of o with z from the in-projection rows `mixed`."""
        self.norm(math.ceil(T * self.cfg.linear_num_value_heads / 4), THREADS, o, mixed, w, y, float(eps), T,
                  stream=stream)
