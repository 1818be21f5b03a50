"""Gated full attention, the `full_attention` layers of Qwen3.5 (HF transformers 5.17 `Qwen3_5Attention`, eager).

KV cache layout per layer, float32: keys and values [S, n_kv_heads, head_dim], keys stored after k_norm and RoPE.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from lucegen.model.config import ModelConfig
from lucegen.reference.ops import apply_rope, rms_norm, rope_cos_sin, sigmoid


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Causal softmax attention with grouped KV heads; the T queries are the last T of the S cached positions.

    q [T, nh, hd]; k, v [S, nkv, hd]; query head i reads kv head i // (nh / nkv). Returns [T, nh, hd].
    """
    T, nh, hd = q.shape
    S, nkv, _ = k.shape
    qg = q.reshape(T, nkv, nh // nkv, hd).transpose(1, 2, 0, 3)  # [nkv, group, T, hd]
    scores = (qg @ k.transpose(1, 2, 0)[:, None]) * scale  # [nkv, group, T, S]
    visible = np.arange(S) <= np.arange(S - T, S)[:, None]  # [T, S]
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    out = weights @ v.transpose(1, 0, 2)[:, None]  # [nkv, group, T, hd]
    return out.transpose(2, 0, 1, 3).reshape(T, nh, hd)


def gated_attention(p: Mapping[str, np.ndarray], cfg: ModelConfig, x: np.ndarray, position: int,
                    keys: np.ndarray | None = None, values: np.ndarray | None = None,
                    kv_codec: Callable[[np.ndarray], np.ndarray] | None = None):
    """One gated attention mixer over x [T, hidden] at absolute positions position .. position+T-1.

    p holds the layer's weights by HF name without the "layers.{i}.self_attn." prefix; keys/values are the
    cache (None when empty). kv_codec, when given, is what storing a row [.., head_dim] in the cache's format and
    reading it back does (lucegen.model.kvformats.codec): this block's K/V pass through it before attention reads
    them. Returns (out [T, hidden], keys, values) with this block's K/V appended.
    """
    T = x.shape[0]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    qg = (x @ p["q_proj.weight"].T).reshape(T, nh, 2 * hd)  # per head: [query | gate]
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    q = rms_norm(q, p["q_norm.weight"], eps)
    k = rms_norm((x @ p["k_proj.weight"].T).reshape(T, nkv, hd), p["k_norm.weight"], eps)
    v = (x @ p["v_proj.weight"].T).reshape(T, nkv, hd)
    cos, sin = rope_cos_sin(np.arange(position, position + T), cfg.rotary_dim, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if kv_codec is not None:
        k, v = kv_codec(k), kv_codec(v)
    if keys is not None:
        k, v = np.concatenate([keys, k]), np.concatenate([values, v])
    o = causal_attention(q, k, v, hd**-0.5).reshape(T, nh * hd) * sigmoid(gate)
    return o @ p["o_proj.weight"].T, k, v
