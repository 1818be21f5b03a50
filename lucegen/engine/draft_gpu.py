"""The DFlash draft's forward on the GPU (issue #7): bf16 draft matrices, fp32 activations and sums, the target's
embedding and LM head as the target loaded them (lucegen/engine/layered_weights.py: GGUF bytes or bf16, never
converted). The math is lucegen/reference/dflash.py's draft_forward, every draft matrix multiplying bf16 activations;
the kernels are the tensor-core GEMM of the prefill (kernels/gemm.py: bf16 x bf16, fp32 sums, into fp32 rows, added
into the residual stream, or SiLU x up into bf16), qgemv's for the target's LM head, the layered family's embedding
gather (and column placement), and the draft family's row kernels and attention (lucegen/kernels/draft.py,
templates/draft.cuh).

Context (append_context): each committed token's fused feature C = hidden_norm(fc(its 5 target hidden states)) is
made once, and from it, per draft layer, its context K/V row (k_norm + RoPE at the token's position, v): one fused
projection of C by every layer's [k_proj | v_proj], then draft_context_kv into the layer's ring. These rows depend
on C alone (never on a block or an earlier draft layer: reference/dflash.py's docstring), so computing them once per
token gives what the reference gets by recomputing them from all features each call.

Memory is bounded: the rings hold `window` rows per layer (spec tuning.draft.window, 4096 by default, or less when
max_context is less). A token goes to slot (its index among the appended tokens) % window, so past `window` appended
tokens the draft attends the last `window` of them only. That is a deliberate approximation, and only then: the
published server (lucebox) keeps a feature ring of min(max context, 4096) positions and drafts from the last
min(committed, ring, max(2048, draft_ctx_max)) (research/lucebox.md section 2.2). Up to `window` tokens the draft
is the reference's (unmasked attention does not depend on the order of its keys, so ring slots need not follow
positions).

forward(last_token, position): the block [last_token, mask, ..., mask] at positions position .. position + B - 1
(position: where last_token sits, normally the number of committed tokens) through the draft's layers, then the
draft's final norm and the target's LM head for block rows 1 .. n (the depths asked for, n <= B - 1: a round of
DDTree budget b reads at most b depths, so the LM head, the largest matrix a forward reads, multiplies only those):
    x = embed(block)                                                (the target's table, its format)
    per layer:  h = norm(x) (and in bf16)
                qkv = h [q | k | v]^T -> block_qkv (q_norm, k_norm, RoPE) -> attention over ring + block -> merge
                x += bf16(.) o^T;  h = norm(x);  act = silu(h gate^T) (h up^T) in bf16;  x += act down^T
    h = norm(x) (the draft's final norm; XBlocks for a quantized LM head);  logits = h[1:n+1] lm_head^T
One CUDA graph a depth count (captured on its first forward) replays it: position, token and context length are
read from the device (io = [position, block ids..., context rows]), so a forward is one small copy and one graph
launch. The logits stay on the device, fp32 [B - 1, vocab] (rows past n as an earlier forward left them), valid
once the draft's stream is done (wait(), or later launches on `stream`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np

from ..codegen.build import BUILD_DIR, build
from ..kernels import draft as draft_kernels
from ..kernels import gemm, layered, qgemv
from ..model.config import ModelConfig
from ..model.draft_config import DraftConfig
from ..runtime import DeviceArray, Graph, Stream
from ..spec import ChipSpec
from .layered_weights import Projection

DEFAULT_CHUNK = 64  # context rows per append pass (the scratch for features and K/V rows is sized by it)
BF16 = ml_dtypes.bfloat16


def bf16_rows(matrices: Sequence[np.ndarray], interleave: bool = False) -> DeviceArray:
    """fp32 matrices [n_i, K] stacked row-wise as one bf16 [sum n_i, K] matrix on the device; interleave: two
    matrices' rows alternating (gate_proj row i at 2i, up_proj's at 2i + 1: the GEMM's SiLU epilogue's pairing)."""
    w = np.stack(matrices, axis=1) if interleave else np.concatenate(matrices)
    return DeviceArray.from_numpy(np.ascontiguousarray(np.asarray(w, np.float32).reshape(-1, w.shape[-1])
                                                       .astype(BF16)))


def rows(a: DeviceArray, m: int, width: int, first: int = 0) -> DeviceArray:
    """Rows first .. first + m - 1 of a row-major fp32 buffer of rows `width` wide, as [m, width]."""
    return a.view((m, width), offset_bytes=4 * first * width)


class GpuDraft:
    """The DFlash draft on the GPU. draft_weights: float32 by checkpoint name (model.draft.load_draft); target:
    the target's weights on the device (a LayeredWeights, or anything with its `embed` and `lm_head` Projections);
    max_context: the longest sequence (positions) it will see; window: ring rows (default the spec's
    tuning.draft.window, capped at max_context); stream: where its work goes (default: a stream of its own; the
    target step's, so that appends of the step's features follow the step that wrote them, is not destroyed by
    free())."""

    def __init__(self, spec: ChipSpec, cfg: DraftConfig, draft_weights: Mapping[str, np.ndarray], target,
                 target_cfg: ModelConfig, max_context: int, window: int | None = None, chunk: int = DEFAULT_CHUNK,
                 root: Path = BUILD_DIR, stream: Stream | None = None):
        cfg.check_target(target_cfg)
        if problem := draft_kernels.shape_problem(spec, cfg) or layered.shape_problem(spec, target_cfg):
            raise ValueError(problem)
        if len(target.embed.parts) != 1:
            raise ValueError("the target's embedding must be one matrix of one format")
        self.spec, self.cfg, self.target_cfg, self.target = spec, cfg, target_cfg, target
        self.max_context = max_context
        self.window = min(window or spec.tuning.draft.window, max_context)
        if self.window < 1:
            raise ValueError(f"a draft window of {self.window} rows")
        self.chunk = chunk
        self._upload(draft_weights)
        embed_fmt = target.embed.parts[0].fmt
        pairs = {(p.fmt, target.lm_head.k) for p in target.lm_head.parts}  # the LM head's: qgemv
        units = [*layered.units(spec, target_cfg, [embed_fmt]), *draft_kernels.units(spec, target_cfg, cfg),
                 *qgemv.units(spec, target_cfg, sorted(pairs)), *gemm.units(spec)]
        # a folder of its own: the target's step builds qgemv units of the same names for its own K
        result = build(spec, dataclasses.replace(target_cfg, name=f"{target_cfg.name}-dflash"), units, root=root)
        self.rows_kernels = layered.LayerKernels(result.module(layered.unit_name(embed_fmt)), spec, target_cfg)
        self.kernels = draft_kernels.DraftKernels(result.module(draft_kernels.UNIT), spec, cfg)
        self.gemm = gemm.Gemm(result.module("prefill_gemm"), spec)
        qmods, self.mm = {}, {}
        for fmt, k in sorted(pairs):
            qmods.setdefault(fmt, result.module(f"qgemv_{fmt}"))
            self.mm[fmt, k] = qgemv.QMatmul(qmods[fmt], spec, fmt, k, model=target_cfg.name)
        self.own_stream = stream is None
        self.stream = Stream(programmatic=spec.tuning.layered.pdl) if stream is None else stream
        self.graphs: dict[int, Graph] = {}  # by the depths a forward's LM head multiplies
        self.length = 0  # context tokens appended since reset()
        self._allocate()

    # ---- set-up -------------------------------------------------------------------------------------------------
    def _upload(self, w: Mapping[str, np.ndarray]) -> None:
        cfg = self.cfg
        vec = lambda name: DeviceArray.from_numpy(np.ascontiguousarray(w[name], np.float32))
        self.fc = bf16_rows([w["fc.weight"]])
        self.hidden_norm, self.final_norm = vec("hidden_norm.weight"), vec("norm.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append({
                "qkv": bf16_rows([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
                "o": bf16_rows([w[a + "o_proj.weight"]]),
                "gate_up": bf16_rows([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]], interleave=True),
                "down": bf16_rows([w[m + "down_proj.weight"]]),
                "ln1": vec(p + "input_layernorm.weight"), "ln2": vec(p + "post_attention_layernorm.weight"),
                "q_norm": vec(a + "q_norm.weight"), "k_norm": vec(a + "k_norm.weight")})
        # every layer's context K/V from C in one projection: rows [k_0 | v_0 | k_1 | v_1 | ...] (the block's own
        # k/v rows multiply h through each layer's qkv: the same bf16 rows, held twice)
        self.ctx_kv = bf16_rows([w[f"layers.{i}.self_attn.{n}_proj.weight"]
                                 for i in range(cfg.num_hidden_layers) for n in ("k", "v")])
        self.k_norms = DeviceArray.from_numpy(np.ascontiguousarray(np.stack(
            [w[f"layers.{i}.self_attn.k_norm.weight"] for i in range(cfg.num_hidden_layers)]), np.float32))

    def _allocate(self) -> None:
        cfg, T = self.cfg, self.chunk
        H, I, B, V = cfg.hidden_size, cfg.intermediate_size, cfg.block_size, self.target_cfg.vocab_size
        nh, nkv, hd, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
        f32 = lambda *shape: DeviceArray.empty(shape, np.float32)
        bf16 = lambda *shape: DeviceArray.empty(shape, BF16)
        # io = [position, block ids (last token, then masks), context rows]
        self.io = DeviceArray.empty(2 + B, np.int32)
        self.io.copy_from(np.array([0, 0, *[cfg.mask_token_id] * (B - 1), 0], np.int32))
        self.n_ctx_dev = self.io.view(1, np.int32, 4 * (1 + B))
        self.x, self.x_next, self.h = (f32(B, H) for _ in range(3))
        self.h16, self.att, self.att16, self.act16 = bf16(B, H), f32(B, nh * hd), bf16(B, nh * hd), bf16(B, I)
        self.proj = f32(B, (nh + 2 * nkv) * hd)
        self.q, self.bk, self.bv = f32(B, nh, hd), f32(B, nkv, hd), f32(B, nkv, hd)
        po, pml = self.kernels.partial_sizes()
        self.part_o, self.part_ml = f32(po), f32(pml)
        lm_quantized = H % 32 == 0 and any(qgemv.fmt_of(p.fmt).quantizes_x for p in self.target.lm_head.parts)
        self.hq = DeviceArray.empty(qgemv.xblock_bytes(B - 1, H), np.uint8) if lm_quantized else None
        self.logits = f32(B - 1, V)
        ring = draft_kernels.window_floats(cfg, self.window)
        self.keys, self.values = f32(ring), f32(ring)
        # append scratch
        self.feats, self.feats16 = f32(T, cfg.fc_in), bf16(T, cfg.fc_in)
        self.c_raw, self.c_sum, self.c, self.c16 = f32(T, H), f32(T, H), f32(T, H), bf16(T, H)
        self.ctx_rows = f32(T, L * 2 * nkv * hd)
        self.positions = DeviceArray.empty(T, np.int32)
        # host arrays of the latest copies on the stream (a pageable copy is staged before the call returns; kept
        # anyway, as LayeredStep keeps its io, and dropped at the next call)
        self._keep: list = []

    def ring(self, layer: int, values: bool = False) -> DeviceArray:
        """Layer `layer`'s ring, [window, n_kv, head_dim]."""
        c = self.cfg
        n = self.window * c.num_key_value_heads * c.head_dim
        return (self.values if values else self.keys).view((self.window, c.num_key_value_heads, c.head_dim),
                                                            offset_bytes=4 * layer * n)

    @property
    def n_ctx(self) -> int:
        """Context rows the next forward attends: the appended tokens, at most the window's."""
        return min(self.length, self.window)

    # ---- projections --------------------------------------------------------------------------------------------
    def project(self, P: Projection, x: DeviceArray, y: DeviceArray, m: int, stream, xq=None) -> None:
        """y [m, P.n] = x [m, P.k] P^T (Projection.apply, as the target's step)."""
        P.apply(self.mm, x, y, m, stream, xq)

    # ---- context ------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the context (a new sequence)."""
        self.length = 0

    def append_context(self, features, positions: Sequence[int] | int) -> None:
        """Append committed tokens: their target features [T, len(target_layer_ids) * hidden] (numpy, or fp32 on
        the device) at positions [T] (or the first one, the rest following). Their K/V rows go into every layer's
        ring (the oldest rows give way past the window). On the draft's stream."""
        cfg = self.cfg
        if isinstance(features, DeviceArray):
            if features.dtype != np.float32 or features.size % cfg.fc_in:
                raise ValueError(f"features must be fp32 [T, {cfg.fc_in}]; got {features}")
            T = features.size // cfg.fc_in
        else:
            features = np.ascontiguousarray(features, np.float32)
            if features.ndim != 2 or features.shape[1] != cfg.fc_in:
                raise ValueError(f"features must be [T, {cfg.fc_in}]; got {features.shape}")
            T = features.shape[0]
        positions = (np.arange(T) + positions) if np.isscalar(positions) else np.asarray(positions)
        if positions.shape != (T,):
            raise ValueError(f"{T} feature rows need {T} positions; got {positions.shape}")
        if T and (positions.min() < 0 or positions.max() >= self.max_context):
            raise ValueError(f"positions must be in 0 .. {self.max_context - 1}")
        positions = positions.astype(np.int32)
        H, k, s = cfg.hidden_size, self.kernels, self.stream
        self._keep = []
        for t0 in range(0, T, self.chunk):
            m = min(self.chunk, T - t0)
            if isinstance(features, DeviceArray):
                feats = features.view((m, cfg.fc_in), offset_bytes=4 * t0 * cfg.fc_in)
            else:
                feats = rows(self.feats, m, cfg.fc_in)
                self._keep.append(features[t0:t0 + m])
                feats.copy_from(self._keep[-1], stream=s)
            self._keep.append(positions[t0:t0 + m])
            self.positions.view(m).copy_from(self._keep[-1], stream=s)
            k.to_bf16(feats, self.feats16, m * cfg.fc_in, stream=s)
            self.gemm(self.feats16, self.fc, self.c_raw, m, H, cfg.fc_in, "f32", stream=s)
            k.rmsnorm(self.c_raw, None, self.hidden_norm, self.c_sum, self.c, m, stream=s, h16=self.c16)
            self.gemm(self.c16, self.ctx_kv, self.ctx_rows, m, self.ctx_rows.shape[1], H, "f32", stream=s)
            k.context_kv(self.ctx_rows, self.k_norms, self.positions, self.length % self.window, self.window,
                         self.keys, self.values, m, stream=s)
            self.length += m

    # ---- the forward --------------------------------------------------------------------------------------------
    def enqueue(self, stream, depths: int) -> None:
        """Every launch of a forward of `depths` depths (position, last token and context rows already in io)."""
        cfg, t, k, r = self.cfg, self.target, self.kernels, self.rows_kernels
        B, H, I = cfg.block_size, cfg.hidden_size, cfg.intermediate_size
        r.embed(t.embed.parts[0].w, self.io, self.x, B, stream=stream)
        nq, att = self.proj.shape[1], self.att.shape[1]
        residual = [self.x, self.x_next]  # each norm reads the first and writes it to the second

        def norm(w, h16=None):
            k.rmsnorm(residual[0], None, w, residual[1], self.h, B, stream=stream, h16=h16)
            residual.reverse()

        for i, L in enumerate(self.layers):
            norm(L["ln1"], h16=self.h16)
            self.gemm(self.h16, L["qkv"], self.proj, B, nq, H, "f32", stream=stream)
            k.block_qkv(self.proj, L["q_norm"], L["k_norm"], self.io, self.q, self.bk, self.bv, stream=stream)
            k.attention(self.q, self.bk, self.bv, self.ring(i), self.ring(i, values=True), self.n_ctx_dev,
                        self.part_o, self.part_ml, stream=stream)
            k.merge(self.part_o, self.part_ml, self.n_ctx_dev, self.att, stream=stream)
            k.to_bf16(self.att, self.att16, B * att, stream=stream)
            self.gemm(self.att16, L["o"], residual[0], B, H, att, "add", stream=stream)
            norm(L["ln2"], h16=self.h16)
            self.gemm(self.h16, L["gate_up"], self.act16, B, 2 * I, H, "silu", stream=stream)
            self.gemm(self.act16, L["down"], residual[0], B, H, I, "add", stream=stream)
        # the final norm of depths 1 .. depths alone: the rows the LM head reads, their XBlocks in its layout
        h = rows(self.h, depths, H, 1)
        k.rmsnorm(rows(residual[0], depths, H, 1), None, self.final_norm, rows(residual[1], depths, H, 1), h, depths,
                  stream=stream, xq=self.hq)
        self.project(t.lm_head, h, self.logits, depths, stream, xq=self.hq)

    def forward(self, last_token: int, position: int, depths: int | None = None) -> DeviceArray:
        """Device logits [block_size - 1, vocab] (fp32) after last_token at `position`, over the context appended
        so far (its last `window` tokens): rows 0 .. depths - 1 those of depths 1 .. depths (default all B - 1).
        Queued on the draft's stream (wait())."""
        cfg = self.cfg
        depths = cfg.block_size - 1 if depths is None else depths
        if not 1 <= depths <= cfg.block_size - 1:
            raise ValueError(f"the draft predicts 1 .. block_size - 1 = {cfg.block_size - 1} depths; asked {depths}")
        if not 0 <= last_token < self.target_cfg.vocab_size:
            raise ValueError(f"token id {last_token} outside the vocabulary of {self.target_cfg.vocab_size}")
        if not 0 <= position or position + cfg.block_size > self.max_context:
            raise ValueError(f"a block at position {position} exceeds the context of {self.max_context}")
        head = np.array([position, last_token], np.int32)
        self._keep = [head]
        self.io.view(2).copy_from(head, stream=self.stream)
        n = np.array([self.n_ctx], np.int32)
        self._keep.append(n)
        self.n_ctx_dev.copy_from(n, stream=self.stream)
        if depths not in self.graphs:
            with Graph.capture(self.stream) as g:
                self.enqueue(self.stream, depths)
            self.graphs[depths] = g
        self.graphs[depths].launch(self.stream)
        return self.logits

    def wait(self) -> None:
        self.stream.synchronize()
        self._keep.clear()

    def logits_numpy(self) -> np.ndarray:
        """The last forward's logits on the host (waits for them)."""
        self.wait()
        return self.logits.numpy()

    def free(self) -> None:
        for g in self.graphs.values():
            g.destroy()
        self.graphs.clear()
        flat = [self.fc, self.ctx_kv, *(v for L in self.layers for v in L.values())]
        flat += [self.hidden_norm, self.final_norm, self.k_norms, self.io, self.x, self.x_next, self.h, self.h16,
                 self.proj, self.att, self.att16, self.act16, self.q, self.bk, self.bv, self.part_o,
                 self.part_ml, self.hq, self.logits, self.keys, self.values, self.feats, self.feats16, self.c_raw,
                 self.c_sum, self.c, self.c16, self.ctx_rows, self.positions]
        for a in flat:
            if a is not None:
                a.free()
        for op in self.mm.values():
            op.free()
        self.gemm.free()
        if self.own_stream:
            self.stream.destroy()
