"""Prefill on the GPU: a prompt through every layer, in passes of at most `chunk_tokens` tokens, leaving in a
DeviceState exactly the state the decode path continues from, and the logits of the last token.

One pass over n tokens at positions start .. start+n-1 (x: the fp32 residual stream [n, H]):
    x = embed(ids)
    per layer:  h = rmsnorm(x)
      DeltaNet: mixed = h in_proj^T (fp32) -> conv1d + SiLU + gates and the chunked delta rule (prep + scan;
                conv ring and recurrent state updated) -> gated RMSNorm -> x += . out_proj^T
      attention: qkv = h qkv^T (bf16) -> q/k norm, RoPE, K/V into the cache -> causal flash attention with the
                output gate -> x += . o_proj^T
      MLP:      h = rmsnorm(x) -> act = silu(h gate^T) * (h up^T) (one GEMM) -> x += act down^T
In the last layer, everything after the mixer's state and cache updates runs on the pass's last row only (its
output, out-projection and MLP): nothing reads the other rows' (llama.cpp's output-row selection).
after the last pass: logits = lm_head rmsnorm(x[last]) (the bf16 GEMV of the decode path).
Activations between kernels are bf16 where a tensor-core GEMM or attention reads them, fp32 elsewhere (the
residual stream, the in-projection rows of a DeltaNet layer, the DeltaNet output before its norm).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import ml_dtypes
import numpy as np

from ..codegen.build import BUILD_DIR, build
from ..codegen.unit import KernelUnit
from ..kernels import attention, conv1d, gdn, gemm, gemv, rows
from ..model.config import LINEAR, ModelConfig
from ..runtime import DeviceArray, Stream
from ..spec import ChipSpec
from .base import ContextOverflow
from .state import DeviceState
from .weights import DeviceWeights

BF16 = ml_dtypes.bfloat16


def shape_problem(spec: ChipSpec, cfg: ModelConfig) -> str | None:
    """Why the prefill kernels cannot run this model on this chip, or None."""
    if cfg.hidden_size % 64 or cfg.intermediate_size % 64 or cfg.value_dim % 64:
        return f"{cfg.name}: the projections need hidden, intermediate and value widths that are multiples of 64"
    if cfg.linear_layers and (problem := conv1d.shape_problem(cfg) or gdn.shape_problem(cfg)):
        return problem
    return attention.shape_problem(cfg, spec) if cfg.full_layers else None


def units(spec: ChipSpec, cfg: ModelConfig) -> list[KernelUnit]:
    """Every kernel the prefill of `cfg` launches on `spec`."""
    return [*rows.units(spec, cfg), *gemm.units(spec, cfg), *gemv.units(spec, cfg, [cfg.hidden_size]),
            *gdn.units(spec, cfg), *attention.units(spec, cfg)]


class Prefill:
    """prefill(weights, state, token_ids) -> logits (fp32 [vocab], a device array owned by this object).

    `stream`: the stream it launches on unless told another, programmatic where the spec says (tuning.prefill.pdl,
    or the model's entry in tuning.prefill.model_pdl);
    every prefill kernel waits for the one before it (templates/common.cuh), so any stream serves."""

    def __init__(self, spec: ChipSpec, cfg: ModelConfig, chunk_tokens: int | None = None, root: Path = BUILD_DIR):
        self.spec, self.cfg = spec, cfg
        self.chunk = chunk_tokens or spec.tuning.prefill.chunk_tokens
        if self.chunk % gdn.CHUNK:
            raise ValueError(f"chunk_tokens {self.chunk} is not a multiple of the DeltaNet chunk {gdn.CHUNK}")
        if problem := shape_problem(spec, cfg):
            raise ValueError(problem)
        self.stream = Stream(programmatic=spec.tuning.prefill.pdl_for(cfg.name))
        result = build(spec, cfg, units(spec, cfg), root=root)
        modules = {u.unit.template: result.module(u.unit.name) for u in result.units}
        self.rows = rows.Rows(modules["prefill_rows.cu.j2"], spec, cfg)
        self.gemm = gemm.Gemm(modules["prefill_gemm.cu.j2"], spec)
        self.lm_head = gemv.Gemv(modules["gemv.cu.j2"], spec, cfg.hidden_size)
        if cfg.linear_layers:
            self.gdn = gdn.ChunkedDeltaRule(modules["prefill_gdn.cu.j2"], spec, cfg)
        if cfg.full_layers:
            self.attn = attention.Attention(modules["prefill_attention.cu.j2"], spec, cfg)
        self._allocate(self.chunk)

    def _allocate(self, n: int) -> None:
        c = self.cfg
        H, hv = c.hidden_size, c.linear_num_value_heads
        mixed_w = c.conv_dim + c.value_dim + 2 * hv
        qkv_w = c.q_proj_rows + 2 * c.kv_dim
        self.x = DeviceArray.empty((n, H), np.float32)
        self.h = DeviceArray.empty((n, H), BF16)
        self.proj = DeviceArray.empty(n * max(4 * mixed_w, 2 * qkv_w), np.uint8)  # mixed (DeltaNet) or qkv (attention)
        self.mixed = self.proj.view((n, mixed_w), np.float32)
        self.qkv_attn = self.proj.view((n, qkv_w), BF16)
        self.y = DeviceArray.empty((n, max(c.value_dim, c.num_attention_heads * c.head_dim)), BF16)  # mixer output
        self.act = DeviceArray.empty((n, c.intermediate_size), BF16)
        if c.linear_layers:
            self.qkv = DeviceArray.empty((n, c.conv_dim), BF16)
            self.o = DeviceArray.empty((n, hv, c.linear_value_head_dim), np.float32)
            self.scratch = gdn.Scratch(c, n)
        if c.full_layers:
            self.q = DeviceArray.empty((n, c.num_attention_heads, c.head_dim), BF16)
        self.last = DeviceArray.empty(H, BF16)
        self.logits = DeviceArray.empty(c.vocab_size, np.float32)

    def __call__(self, weights: DeviceWeights, state: DeviceState, token_ids: Sequence[int],
                 stream=None) -> DeviceArray:
        """On `stream`, left running; on this object's stream when None, finished on return."""
        self.ids = DeviceArray.from_numpy(np.asarray(token_ids, np.int32).reshape(-1))  # kept until the next call
        self.enqueue(weights, state, self.ids, stream or self.stream)
        if stream is None:
            self.stream.synchronize()
        return self.logits

    def enqueue(self, weights: DeviceWeights, state: DeviceState, ids: DeviceArray, stream=None) -> None:
        """Launch the prefill of the token ids already on the device (int32 [T]) on `stream`; advances
        state.position by T. Nothing is copied to or from the host, so this can be captured in a CUDA graph."""
        T = ids.size
        if T < 1 or state.position + T > state.max_context:
            raise ContextOverflow(f"{T} tokens after {state.position} do not fit a context of {state.max_context}")
        for c0 in range(0, T, self.chunk):
            n = min(self.chunk, T - c0)
            self._pass(weights, state, ids.view(n, offset_bytes=4 * c0), n, stream)
            state.position += n
        H = self.cfg.hidden_size
        self.rows.rmsnorm(self.x.view(H, offset_bytes=(n - 1) * H * 4), weights.final_norm, self.last, 1,
                          self.cfg.rms_norm_eps, stream=stream)
        self.lm_head(weights.lm_head, self.last, self.logits, stream=stream)

    def _pass(self, weights: DeviceWeights, state: DeviceState, ids: DeviceArray, n: int, stream) -> None:
        c, start, eps = self.cfg, state.position, self.cfg.rms_norm_eps
        H, I = c.hidden_size, c.intermediate_size
        self.rows.embed(ids, weights.embed, self.x, n, stream=stream)
        for i, kind in enumerate(c.layer_types):
            L = weights.layers[i]
            r = n - 1 if i == c.num_hidden_layers - 1 else 0  # the first row past the mixer's updates that counts
            m = n - r
            at = lambda a: _rows(a, r, m)
            mm = lambda x, w, y, k, epilogue: self.gemm(at(x), w, at(y), m, w.shape[0], k, epilogue, stream=stream)
            self.rows.rmsnorm(self.x, L["ln1"], self.h, n, eps, stream=stream)
            if kind == LINEAR:
                self.gemm(self.h, L["in"], self.mixed, n, L["in"].shape[0], H, "f32", stream=stream)
                self.gdn(self.mixed, L["conv"], L["a_log"], L["dt_bias"], state.conv[i], self.qkv,
                         state.recurrent[i], self.o, self.scratch, n, start, stream=stream)
                y = self._mixer_out(c.value_dim)
                self.gdn.gated_norm(at(self.o), at(self.mixed), L["norm"], at(y), m, eps, stream=stream)
                mm(y, L["out"], self.x, c.value_dim, "add")
            else:
                self.gemm(self.h, L["in"], self.qkv_attn, n, L["in"].shape[0], H, "bf16", stream=stream)
                self.attn.prep(self.qkv_attn, L["q_norm"], L["k_norm"], self.q, state.keys[i], state.values[i], n,
                               start, stream=stream)
                y = self._mixer_out(c.num_attention_heads * c.head_dim)
                self.attn.attend(at(self.q), state.keys[i], state.values[i], at(self.qkv_attn), at(y), m, start + r,
                                 stream=stream)
                mm(y, L["out"], self.x, y.shape[1], "add")
            self.rows.rmsnorm(at(self.x), L["ln2"], at(self.h), m, eps, stream=stream)
            mm(self.h, L["gate_up"], self.act, H, "silu")
            mm(self.act, L["down"], self.x, I, "add")

    def _mixer_out(self, width: int) -> DeviceArray:
        """The mixer's output buffer as rows of `width` values."""
        return self.y.view((self.y.shape[0], width))

    def free(self) -> None:
        for name in ("x", "h", "proj", "y", "act", "qkv", "o", "q", "last", "logits", "ids"):
            if hasattr(self, name):
                getattr(self, name).free()
        if hasattr(self, "scratch"):
            self.scratch.free()
        self.gemm.free()  # split-K's workspace and tile counters
        self.stream.destroy()


def _rows(a: DeviceArray, first: int, count: int) -> DeviceArray:
    """Rows first .. first + count - 1 of a [rows, ...] array, as a view."""
    row_bytes = a.nbytes // a.shape[0]
    return a.view((count, *a.shape[1:]), offset_bytes=first * row_bytes)
