"""The DFlash draft's kernels (templates/draft.cu.j2 over draft.cuh and layered.cuh): numpy references, unit,
launchers. lucegen/engine/draft_gpu.py drives them with the tensor-core GEMM (kernels/gemm.py: bf16 draft matrices,
bf16 activations, fp32 sums; SiLU x up in its epilogue), the target's LM head as loaded (qgemv) and the layered
family's embedding gather.

Kernels (rows fp32):
    rmsnorm      x_out = x + y, h = w * x_hat (the plain Qwen3RMSNorm: layered.cuh's add + RMSNorm with its
                 zero-centred flag off), h's XBlocks optionally (the target's quantized LM head reads them), h in
                 bf16 optionally (the GEMM reads it)
    to_bf16      fp32 rows rounded to bf16 (the features and the attention's output, as the GEMM reads them)
    block_qkv    the block's [q | k | v] rows: q = RoPE(q_norm(q)) * head_dim^-1/2, k = RoPE(k_norm(k)), v, at
                 positions io[0] + t
    context_kv   context rows [T, layers, 2, n_kv, head_dim] (k_proj | v_proj of the fused feature C per draft
                 layer) into each layer's K/V ring: k_norm + RoPE at the token's position, slot (slot0 + t) % window
    attention    the block's queries over the ring's n_ctx rows then the block's own K/V rows, no mask: per kv
                 head, the keys cut into `splits` ranges of whole 32-key chunks (split_ranges), each range's
                 unnormalised partial (max, sum, output) per query row (attention_partials)
    merge        the partials of a row added in split order (merge_reference)

The attention's query rows of kv head g: r = hh * block_size + t for query head g * group + hh and block token t.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ConfigError, ModelConfig
from ..model.draft_config import DraftConfig
from ..reference.dflash import block_attention, rms_norm_plain
from ..reference.ops import apply_rope, rope_cos_sin, rope_inv_freq
from ..spec import ChipSpec
from .gemm import BK as GEMM_BK
from .layered import NORM_CHUNK

KC = 32          # keys per chunk (draft.cuh: DRAFT_KC): one per lane when scoring
QK_WARPS = 4     # block_qkv / context_kv: a warp per head
ATT_WARPS = 8    # the attention block's warps (at most: fewer when the query rows are fewer)
MAX_ROWS_PER_WARP = 16  # query rows a warp keeps in registers (online softmax and 4 output dims each)
BLOCKS_PER_SM = 2       # attention blocks per SM the splits aim at (at the longest contexts)
DRAFTS_DIR = Path(__file__).resolve().parent.parent / "model" / "configs" / "drafts"


# ---- numpy references -------------------------------------------------------------------------------------------
def rmsnorm_reference(x: np.ndarray, y: np.ndarray | None, w: np.ndarray, eps: float):
    """(x + y, the plain w * x_hat RMSNorm of it), fp32."""
    x = x.astype(np.float32) + (0 if y is None else y.astype(np.float32))
    return x, rms_norm_plain(x, w.astype(np.float32), np.float32(eps)).astype(np.float32)


def norm_rope(x: np.ndarray, w: np.ndarray, positions, cfg: DraftConfig) -> np.ndarray:
    """Heads x [T, heads, head_dim] -> RoPE(w * x_hat) at positions [T] (full head dim, theta of the draft)."""
    cos, sin = rope_cos_sin(np.asarray(positions), cfg.head_dim, cfg.rope_theta)
    return apply_rope(rms_norm_plain(x.astype(np.float32), w.astype(np.float32), np.float32(cfg.rms_norm_eps)),
                      cos, sin).astype(np.float32)


def block_qkv_reference(cfg: DraftConfig, qkv: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, position: int):
    """(q [B, NH, HD] scaled by HD^-1/2, k [B, NKV, HD], v [B, NKV, HD]) of the block's rows qkv [B, (NH + 2 NKV) HD]
    at positions position .. position + B - 1."""
    B, nh, nkv, hd = qkv.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pos = position + np.arange(B)
    q = qkv[:, :nh * hd].reshape(B, nh, hd)
    k = qkv[:, nh * hd:(nh + nkv) * hd].reshape(B, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:(nh + 2 * nkv) * hd].reshape(B, nkv, hd)
    return (norm_rope(q, q_norm, pos, cfg) * np.float32(hd ** -0.5), norm_rope(k, k_norm, pos, cfg),
            v.astype(np.float32))


def context_kv_reference(cfg: DraftConfig, kv: np.ndarray, k_norms: np.ndarray, positions):
    """(keys, values) [T, layers, NKV, HD] of context rows kv [T, layers * 2 * NKV * HD] (per layer [k | v])."""
    T, L, nkv, hd = kv.shape[0], cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    rows = kv.reshape(T, L, 2, nkv, hd)
    keys = np.stack([norm_rope(rows[:, l, 0], k_norms[l], positions, cfg) for l in range(L)], axis=1)
    return keys, rows[:, :, 1].astype(np.float32)


def ring_slots(slot0: int, t: int, window: int) -> np.ndarray:
    """The ring slots context rows 0 .. t - 1 of an append go to (the append order, not the positions: unmasked
    attention does not depend on the order of its keys)."""
    return (slot0 + np.arange(t)) % window


def split_ranges(keys: int, splits: int) -> list[tuple[int, int]]:
    """The key ranges [k0, k1) of the non-empty splits of `keys` keys over `splits` blocks: whole 32-key chunks,
    ceil(chunks / splits) a split (draft.cuh: draft_splits)."""
    chunks = -(-keys // KC)
    per = -(-chunks // splits)
    return [(s * per * KC, min(keys, (s + 1) * per * KC)) for s in range(-(-chunks // per))]


def attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """out [B, NH * HD]: the already scaled queries q [B, NH, HD] over every row of keys, values [S, NKV, HD]."""
    return block_attention(q.astype(np.float32), keys.astype(np.float32), values.astype(np.float32),
                           1.0).reshape(q.shape[0], -1).astype(np.float32)


def query_rows(q: np.ndarray, nkv: int) -> np.ndarray:
    """q [B, NH, HD] as the attention's rows [NKV, G * B, HD] (row r = hh * B + t)."""
    B, nh, hd = q.shape
    return q.reshape(B, nkv, nh // nkv, hd).transpose(1, 2, 0, 3).reshape(nkv, -1, hd)


def attention_partials(q: np.ndarray, bk: np.ndarray, bv: np.ndarray, ring_k: np.ndarray, ring_v: np.ndarray,
                       n_ctx: int, splits: int):
    """What the attention kernel writes: (part_o [NKV, splits, ROWS, HD], part_ml [NKV, splits, ROWS, 2]) over the
    keys ring rows 0 .. n_ctx - 1 then the block's bk, bv [B, NKV, HD]; splits past the non-empty ones are NaN
    (the kernel leaves them unwritten)."""
    nkv, hd = bk.shape[1], bk.shape[2]
    keys = np.concatenate([ring_k[:n_ctx], bk]).astype(np.float64)
    values = np.concatenate([ring_v[:n_ctx], bv]).astype(np.float64)
    rows = query_rows(q, nkv).astype(np.float64)
    part_o = np.full((nkv, splits, rows.shape[1], hd), np.nan, np.float32)
    part_ml = np.full((nkv, splits, rows.shape[1], 2), np.nan, np.float32)
    for s, (k0, k1) in enumerate(split_ranges(len(keys), splits)):
        for g in range(nkv):
            scores = rows[g] @ keys[k0:k1, g].T  # [ROWS, keys]
            m = scores.max(axis=-1, keepdims=True)
            p = np.exp(scores - m)
            part_o[g, s] = p @ values[k0:k1, g]
            part_ml[g, s, :, 0], part_ml[g, s, :, 1] = m[:, 0], p.sum(axis=-1)
    return part_o, part_ml


def merge_reference(part_o: np.ndarray, part_ml: np.ndarray, n_ctx: int, block: int, nh: int) -> np.ndarray:
    """out [B, NH * HD]: each row's non-empty splits weighted by exp(m_s - max m) and added in split order."""
    nkv, splits, rows, hd = part_o.shape
    n = len(split_ranges(n_ctx + block, splits))
    m, l = part_ml[:, :n, :, 0].astype(np.float64), part_ml[:, :n, :, 1].astype(np.float64)
    w = np.exp(m - m.max(axis=1, keepdims=True))  # [NKV, n, ROWS]
    out = (w[..., None] * part_o[:, :n]).sum(axis=1) / (w * l).sum(axis=1)[..., None]  # [NKV, ROWS, HD]
    g = nh // nkv
    return out.reshape(nkv, g, block, hd).transpose(2, 0, 1, 3).reshape(block, nh * hd).astype(np.float32)


# ---- unit -------------------------------------------------------------------------------------------------------
def bundled_drafts(model: ModelConfig) -> list[DraftConfig]:
    """The bundled draft configs (lucegen/model/configs/drafts) that fit `model` (check_target)."""
    out = []
    for path in sorted(DRAFTS_DIR.glob("*.json")):
        cfg = DraftConfig.from_json(path)
        try:
            cfg.check_target(model)
        except ConfigError:
            continue
        out.append(cfg)
    return out


def att_warps(cfg: DraftConfig) -> int:
    """The attention block's warps: the most (up to ATT_WARPS) that split the G x B query rows evenly."""
    rows = cfg.num_attention_heads // cfg.num_key_value_heads * cfg.block_size
    return max(w for w in range(1, ATT_WARPS + 1) if rows % w == 0)


def splits(spec: ChipSpec, cfg: DraftConfig) -> int:
    """Attention blocks per kv head: BLOCKS_PER_SM blocks an SM over the kv heads (at the longest contexts; a short
    one fills fewer, the rest return at once)."""
    return max(1, -(-BLOCKS_PER_SM * spec.chip.sm_count // cfg.num_key_value_heads))


def att_smem(cfg: DraftConfig) -> int:
    """Dynamic shared memory of an attention block, bytes (draft.cuh: draft_attention_floats)."""
    hd, rows = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads * cfg.block_size
    return 4 * (rows * hd + KC * (hd + 4) + KC * hd + rows * KC)


def merge_threads(cfg: DraftConfig) -> int:
    return min(128, max(32, cfg.head_dim))


def shape_problem(spec: ChipSpec, cfg: DraftConfig) -> str | None:
    """Why the draft kernels cannot take this draft on this chip, or None."""
    hd, d4 = cfg.head_dim, cfg.head_dim // 4
    rows = cfg.num_attention_heads // cfg.num_key_value_heads * cfg.block_size
    if hd % 4 or not (32 % d4 == 0 if d4 < 32 else d4 % 32 == 0):
        return f"draft head_dim {hd}: the attention takes 16 .. 128 (a power of two) or a multiple of 128"
    if cfg.hidden_size % 8:
        return f"draft hidden {cfg.hidden_size}: the row kernels need a multiple of 8"
    widths = {"hidden": cfg.hidden_size, "fc input": cfg.fc_in, "attention output": cfg.num_attention_heads * hd,
              "intermediate": cfg.intermediate_size}
    if bad := [f"{what} {k}" for what, k in widths.items() if k % GEMM_BK]:
        return f"draft {', '.join(bad)}: the projections' tensor-core GEMM takes K a multiple of {GEMM_BK}"
    if rows // att_warps(cfg) > MAX_ROWS_PER_WARP:
        return f"draft: {rows} query rows a kv head over {att_warps(cfg)} warps exceed {MAX_ROWS_PER_WARP} a warp"
    if att_smem(cfg) > spec.chip.smem_per_block:
        return f"{spec.name}: the draft attention needs {att_smem(cfg)} bytes of shared memory a block"
    return None


UNIT = "draft"


def units(spec: ChipSpec, model: ModelConfig, draft: DraftConfig | None = None) -> list[KernelUnit]:
    """The draft unit of `draft` (by default of each bundled draft that fits `model`; none for other models)."""
    drafts = bundled_drafts(model) if draft is None else [draft]
    out, seen = [], set()
    for cfg in drafts:
        if shape_problem(spec, cfg) or cfg in seen:
            continue
        seen.add(cfg)
        hexf = lambda v: float(np.float32(v)).hex() + "f"
        rt = spec.tuning.norm.threads
        params = dict(hidden=cfg.hidden_size, inter=cfg.intermediate_size, nh=cfg.num_attention_heads,
                      nkv=cfg.num_key_value_heads, hd=cfg.head_dim, block=cfg.block_size,
                      layers=cfg.num_hidden_layers, eps=hexf(cfg.rms_norm_eps), scale=hexf(cfg.head_dim ** -0.5),
                      inv_freq=[hexf(v) for v in rope_inv_freq(cfg.head_dim, cfg.rope_theta)],
                      row_threads=rt, norm_chunk=NORM_CHUNK * rt, qk_warps=QK_WARPS,
                      att_threads=32 * att_warps(cfg), splits=splits(spec, cfg), merge_threads=merge_threads(cfg))
        name = UNIT if len(drafts) == 1 else f"{UNIT}_{len(out)}"
        out.append(KernelUnit(name, "draft.cu.j2", params, (
            KernelSig("draft_rmsnorm", rt), KernelSig("draft_to_bf16", rt),
            KernelSig("draft_block_qkv", 32 * QK_WARPS), KernelSig("draft_context_kv", 32 * QK_WARPS),
            KernelSig("draft_attention", 32 * att_warps(cfg), dynamic_smem=att_smem(cfg)),
            KernelSig("draft_merge", merge_threads(cfg)))))
    return out


# ---- launchers --------------------------------------------------------------------------------------------------
def _null(a):
    import ctypes
    return (0, ctypes.c_void_p) if a is None else a


class DraftKernels:
    """The launchers of one draft unit; `m` is a call's row count. The attention's partial buffers are the
    caller's (partial_sizes)."""

    def __init__(self, module, spec: ChipSpec, cfg: DraftConfig):
        self.cfg, self.row_threads = cfg, spec.tuning.norm.threads
        self.splits, self.att_threads, self.smem = splits(spec, cfg), 32 * att_warps(cfg), att_smem(cfg)
        self.group = cfg.num_attention_heads // cfg.num_key_value_heads
        self.rows = self.group * cfg.block_size
        self.norm_blocks = -(-cfg.hidden_size // (NORM_CHUNK * self.row_threads))
        self.qk_blocks = -(-(cfg.num_attention_heads + cfg.num_key_value_heads) // QK_WARPS)
        k = lambda name: module.kernel(f"draft_{name}")
        self._norm, self._qkv, self._ctx = k("rmsnorm"), k("block_qkv"), k("context_kv")
        self._bf16, self.sm_count = k("to_bf16"), spec.chip.sm_count
        self._att, self._merge = k("attention"), k("merge")
        if self.smem > 48 * 1024:
            self._att.set_max_dynamic_smem(self.smem)

    def partial_sizes(self) -> tuple[int, int]:
        """Floats of part_o and part_ml."""
        n = self.cfg.num_key_value_heads * self.splits * self.rows
        return n * self.cfg.head_dim, n * 2

    def rmsnorm(self, x, y, w, x_out, h, m: int, stream=None, xq=None, h16=None) -> None:
        """x_out = x + y (None: x); h = w * x_hat; h's XBlocks into xq and h in bf16 into h16 when given. x_out must
        not be x."""
        if x_out.ptr == x.ptr:
            raise ValueError("rmsnorm writes the sum to another buffer than x (its blocks read x whole)")
        self._norm((m, self.norm_blocks), self.row_threads, x, _null(y), w, x_out, h, _null(xq), _null(h16),
                   stream=stream)

    def to_bf16(self, x, y, n: int, stream=None) -> None:
        """y [n] bf16 = x [n] fp32 rounded to nearest; n a multiple of 4."""
        self._bf16(min(-(-n // (4 * self.row_threads)), 8 * self.sm_count), self.row_threads, x, y, n, stream=stream)

    def block_qkv(self, qkv, q_norm, k_norm, io, q, k, v, stream=None) -> None:
        """The block's rows at positions io[0] + t (io: int32 on the device)."""
        self._qkv((self.cfg.block_size, self.qk_blocks), 32 * QK_WARPS, qkv, q_norm, k_norm, io, q, k, v,
                  stream=stream)

    def context_kv(self, kv, k_norms, positions, slot0: int, window: int, keys, values, t: int, stream=None) -> None:
        """t context rows (positions: int32 [t] on the device) into ring slots (slot0 + i) % window."""
        self._ctx((t, self.cfg.num_hidden_layers), 32 * QK_WARPS, kv, k_norms, positions, slot0 % window, window,
                  keys, values, stream=stream)

    def attention(self, q, bk, bv, keys, values, n_ctx, part_o, part_ml, stream=None) -> None:
        """Partials over the ring's n_ctx rows (n_ctx: an int32 on the device) and the block's rows."""
        self._att((self.cfg.num_key_value_heads, self.splits), self.att_threads, q, bk, bv, keys, values, n_ctx,
                  part_o, part_ml, smem=self.smem, stream=stream)

    def merge(self, part_o, part_ml, n_ctx, out, stream=None) -> None:
        self._merge((self.cfg.num_key_value_heads, self.rows), merge_threads(self.cfg), part_o, part_ml, n_ctx, out,
                    stream=stream)


def window_floats(cfg: DraftConfig, window: int) -> int:
    """Floats of one of the rings (keys or values) of every layer: [layers, window, n_kv, head_dim]."""
    return cfg.num_hidden_layers * window * cfg.num_key_value_heads * cfg.head_dim

