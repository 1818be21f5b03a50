"""The gated full-attention layer of the prefill, after the fused q|gate, k, v projection: q/k norm + partial RoPE +
KV-cache write (prep), and causal flash attention with the sigmoid output gate: numpy references, unit, launchers.

qkv rows are [q_0 gate_0 ... q_{nh-1} gate_{nh-1} | k | v] (q_proj's per-head [query | gate] rows, then k_proj and
v_proj); the KV cache of a layer is [context, n_kv, head_dim] bf16 (lucegen.engine.state). Queries at absolute
positions start .. start+T-1 attend to the cache [0, start+T), so a prompt continues a cached sequence.
"""
from __future__ import annotations

import math

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.attention import causal_attention
from ..reference.ops import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, sigmoid
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec
from .gemm import tiled_map

BM = 64       # queries per block
BN = 64       # keys per tile
THREADS = 128
WGMMA_BM, WGMMA_THREADS, WGMMA_STAGES = 128, 384, 2  # attention_wgmma.cuh: a producer and two consumer warpgroups


def prep_threads(cfg: ModelConfig) -> int:
    """Threads of the prep's block (a token): a warp per head vector (q, k and v heads), at most 16 warps."""
    return 32 * min(cfg.num_attention_heads + 2 * cfg.num_key_value_heads, 16)


def split_qkv(cfg: ModelConfig, qkv: np.ndarray):
    """q [T, nh, hd], gate [T, nh * hd], k and v [T, n_kv, hd] from fused projection rows."""
    T, nh, nkv, hd = qkv.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = qkv.astype(np.float32)
    qg = x[:, :2 * nh * hd].reshape(T, nh, 2 * hd)
    k = x[:, 2 * nh * hd:(2 * nh + nkv) * hd].reshape(T, nkv, hd)
    v = x[:, (2 * nh + nkv) * hd:].reshape(T, nkv, hd)
    return qg[..., :hd], qg[..., hd:].reshape(T, nh * hd), k, v


def prep_reference(cfg: ModelConfig, qkv: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, start: int):
    """(q [T, nh, hd], k [T, n_kv, hd], v [T, n_kv, hd]) after q/k norm and RoPE at positions start .., as
    reference.attention.gated_attention computes them."""
    q, _, k, v = split_qkv(cfg, qkv)
    cos, sin = rope_cos_sin(np.arange(start, start + qkv.shape[0]), cfg.rotary_dim, cfg.rope_theta)
    q = apply_rope(rms_norm(q, q_norm, cfg.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(k, k_norm, cfg.rms_norm_eps), cos, sin)
    return q, k, v


def reference(cfg: ModelConfig, q: np.ndarray, keys: np.ndarray, values: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """[T, nh * hd]: causal attention of q [T, nh, hd] (the last T positions) over keys/values [S, n_kv, hd],
    times sigmoid(gate [T, nh * hd])."""
    T = q.shape[0]
    o = causal_attention(q.astype(np.float32), keys.astype(np.float32), values.astype(np.float32),
                         cfg.head_dim ** -0.5)
    return o.reshape(T, -1) * sigmoid(gate.astype(np.float32))


def smem(cfg: ModelConfig) -> int:
    return (BM + 2 * BN) * cfg.head_dim * 2


def wgmma_smem(cfg: ModelConfig) -> int:
    """attention_wgmma.cuh's AttnWgmma::SMEM: alignment slack, Q of 128 queries, the K and V stages, barriers."""
    return 1024 + WGMMA_BM * cfg.head_dim * 2 + WGMMA_STAGES * 2 * BN * cfg.head_dim * 2 + (1 + 2 * WGMMA_STAGES) * 8


def shape_problem(cfg: ModelConfig, spec: ChipSpec) -> str | None:
    """Why the attention kernels cannot take this model's heads on this chip, or None."""
    hd, rot = cfg.head_dim, cfg.rotary_dim
    e = hd // 32
    partner = rot // 2 // e if e else 0
    if hd % 64 or rot % (2 * e) or partner & (partner - 1):
        return (f"{cfg.name}: the attention kernels need head_dim a multiple of 64 and the RoPE pairs (rotary dim "
                f"{rot}) a power-of-two lanes apart; got head_dim={hd}")
    need = max(smem(cfg), wgmma_smem(cfg) if spec.tuning.prefill.attention == "wgmma" else 0)
    if need > spec.chip.smem_per_block:
        return (f"{spec.name}: attention over head_dim {hd} needs {need} bytes of shared memory; a block may "
                f"use {spec.chip.smem_per_block}")
    if spec.tuning.prefill.attention == "wgmma" and hd > 256:
        return f"{spec.name}: the wgmma attention takes head_dim up to 256 (wgmma's N); got {hd}"
    return None


def units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    """The unit for the model's attention heads; none when the model has no attention layer or heads the kernels
    cannot take (shape_problem)."""
    if not model.full_layers or shape_problem(model, spec):
        return []
    split, wgmma = spec.tuning.prefill.attention_split, spec.tuning.prefill.attention == "wgmma"
    params = {"hd": model.head_dim, "nh": model.num_attention_heads, "nkv": model.num_key_value_heads,
              "rot": model.rotary_dim, "smem": smem(model), "split": split, "wgmma": wgmma,
              "prep_threads": prep_threads(model),
              "wgmma_smem": wgmma_smem(model)}
    name = f"prefill_attention_h{model.num_attention_heads}x{model.head_dim}_kv{model.num_key_value_heads}"
    attends = ["attention_prefill_causal"] + (["attention_prefill_split"] if split > 1 else [])
    sigs = [KernelSig("attention_prep_tokens", prep_threads(model)),
            *(KernelSig(k, THREADS, dynamic_smem=smem(model)) for k in attends)]
    if wgmma:
        sigs.append(KernelSig("attention_prefill_wgmma", WGMMA_THREADS, dynamic_smem=wgmma_smem(model)))
    return [KernelUnit(name + (f"_split{split}" if split > 1 else "") + ("_wgmma" if wgmma else ""),
                       "prefill_attention.cu.j2", params, tuple(sigs), arch_specific=wgmma)]


def splits(spec: ChipSpec, cfg: ModelConfig, T: int) -> int:
    """Blocks sharing each query tile's keys: the spec's attention_split where the (query tile, head) blocks are
    fewer than the SMs (a short prompt: the last tile would walk every key tile alone while SMs idle), else 1."""
    return spec.tuning.prefill.attention_split if math.ceil(T / BM) * cfg.num_attention_heads < spec.chip.sm_count \
        else 1


class Attention:
    """prep(qkv, norms, q out, the layer's K/V cache, start) then attend(q, caches, qkv (gate), out, T, start): one
    block per (query tile, head), or a cluster of `splits` blocks sharing the tile's keys."""

    def __init__(self, module, spec: ChipSpec, cfg: ModelConfig):
        self.spec, self.cfg = spec, cfg
        self._prep = module.kernel("attention_prep_tokens")
        self._attend = {1: module.kernel("attention_prefill_causal")}
        if spec.tuning.prefill.attention_split > 1:
            self._attend[spec.tuning.prefill.attention_split] = module.kernel("attention_prefill_split")
        self.smem = smem(cfg)
        if self.smem > 48 * 1024:
            for k in self._attend.values():
                k.set_max_dynamic_smem(self.smem)
        self._wgmma = module.kernel("attention_prefill_wgmma") if spec.tuning.prefill.attention == "wgmma" else None
        if self._wgmma:
            self._wgmma.set_max_dynamic_smem(wgmma_smem(cfg))
        self.inv_freq = DeviceArray.from_numpy(rope_inv_freq(cfg.rotary_dim, cfg.rope_theta).astype(np.float32))

    def prep(self, qkv, q_norm, k_norm, q, k_cache, v_cache, T: int, start: int, stream=None) -> None:
        self._prep(T, prep_threads(self.cfg), qkv, q_norm, k_norm, self.inv_freq, q, k_cache, v_cache,
                   float(self.cfg.rms_norm_eps), start, stream=stream)

    def attend(self, q, k_cache, v_cache, qkv, out, T: int, start: int, stream=None) -> None:
        c, n = self.cfg, splits(self.spec, self.cfg, T)
        if n == 1 and self._wgmma:
            hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
            box = (64, 1, 64)
            maps = [tiled_map(q.ptr, (hd, nh, T), (hd * 2, nh * hd * 2), box)]
            maps += [tiled_map(a.ptr, (hd, nkv, start + T), (hd * 2, nkv * hd * 2), box) for a in (k_cache, v_cache)]
            self._wgmma((math.ceil(T / WGMMA_BM), nh), WGMMA_THREADS, *maps, qkv, out, T, start,
                        smem=wgmma_smem(c), stream=stream)
            return
        self._attend[n]((n * math.ceil(T / BM), c.num_attention_heads), THREADS, q, k_cache, v_cache, qkv, out, T,
                        start, smem=self.smem, stream=stream)
