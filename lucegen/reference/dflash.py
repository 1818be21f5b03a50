"""numpy float32 reference of the DFlash block-diffusion draft (z-lab `DFlashDraftModel`, algorithms.md §3.1-3.2).

One draft call predicts block_size - 1 tokens at once. Its input is a block [b, m, ..., m] (b = the last committed
token, not yet run through the target; m = mask_token_id) embedded with the *target's* embed_tokens, plus one fused
feature vector per context token: C = hidden_norm(fc(concat of the target's hidden states at target_layer_ids)).
Every layer is a Qwen3 decoder layer whose attention takes queries from the block only and keys/values from
k_proj/v_proj of concat(C, the layer's normed block input), with no mask: block positions see all context and
each other. The final norm's output goes through the *target's* LM head.

Weights: a dict keyed by the draft checkpoint's names ("fc.weight", "layers.0.self_attn.q_proj.weight", ...).
All draft norms are Qwen3RMSNorm, plain w * x_hat (not the target's 1 + w); RoPE covers the full head_dim.

The z-lab draft KV cache holds each layer's context K/V; these depend only on C (never on the block or earlier
draft layers), so recomputing them from all context features, as draft_forward does, gives the same result.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lucegen.model.config import ModelConfig
from lucegen.model.draft_config import DraftConfig
from lucegen.reference.model import Output, State, Weights, sub_weights, forward, lm_head, mlp
from lucegen.reference.ops import apply_rope, rope_cos_sin
from lucegen.reference.weights import tensor_rng


def draft_weight_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """The draft checkpoint's tensor names and shapes (algorithms.md §3.4)."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"fc.weight": (H, cfg.fc_in), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        })
    return shapes


def random_draft_weights(cfg: DraftConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 draft weights, one stream per (seed, name): linear ~ N(0, 1/fan_in), norms ~ N(1, 0.1^2)."""
    weights = {}
    for name, shape in draft_weight_shapes(cfg).items():
        normal = tensor_rng(seed, name).standard_normal(shape, dtype=np.float32)
        weights[name] = 1 + np.float32(0.1) * normal if len(shape) == 1 else normal / np.float32(np.sqrt(shape[1]))
    return weights


def rms_norm_plain(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Qwen3RMSNorm over the last axis: w * x_hat (the target's norms are (1 + w) * x_hat instead)."""
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def block_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Unmasked softmax attention with grouped KV heads: q [T, nh, hd] reads every row of k, v [S, nkv, hd]."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    qg = q.reshape(T, nkv, nh // nkv, hd).transpose(1, 2, 0, 3)  # [nkv, group, T, hd]
    scores = (qg @ k.transpose(1, 2, 0)[:, None]) * scale  # [nkv, group, T, S]
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ v.transpose(1, 0, 2)[:, None]).transpose(2, 0, 1, 3).reshape(T, nh, hd)


def draft_attention(p: Weights, cfg: DraftConfig, h: np.ndarray, ctx: np.ndarray, cos: np.ndarray,
                    sin: np.ndarray) -> np.ndarray:
    """One draft attention over the normed block h [B, H] and the fused context ctx [T, H]; cos/sin [T + B, hd]."""
    B, T = h.shape[0], ctx.shape[0]
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    kv_in = np.concatenate([ctx, h])
    q = rms_norm_plain((h @ p["q_proj.weight"].T).reshape(B, nh, hd), p["q_norm.weight"], eps)
    k = rms_norm_plain((kv_in @ p["k_proj.weight"].T).reshape(T + B, nkv, hd), p["k_norm.weight"], eps)
    v = (kv_in @ p["v_proj.weight"].T).reshape(T + B, nkv, hd)
    q, k = apply_rope(q, cos[T:], sin[T:]), apply_rope(k, cos, sin)
    return block_attention(q, k, v, hd**-0.5).reshape(B, nh * hd) @ p["o_proj.weight"].T


def draft_forward(draft_weights: Weights, target_weights: Weights, cfg: DraftConfig, target_cfg: ModelConfig,
                  context_features: np.ndarray, block_ids: Sequence[int],
                  positions: Sequence[int] | None = None) -> np.ndarray:
    """Logits [block_size, vocab] of the block from the target's LM head (row 0 belongs to the known token b).

    context_features [T_ctx, len(target_layer_ids) * H] (see context_features); block_ids [block_size];
    positions [T_ctx + block_size], the absolute positions of the context tokens then the block's (default
    0 .. T_ctx + block_size - 1: the features cover the whole committed sequence and b sits right after it).
    """
    cfg.check_target(target_cfg)
    T, B = context_features.shape[0], len(block_ids)
    if context_features.shape[1] != cfg.fc_in:
        raise ValueError(f"context_features have width {context_features.shape[1]}, expected {cfg.fc_in}")
    positions = np.arange(T + B) if positions is None else np.asarray(positions)
    if positions.shape != (T + B,):
        raise ValueError(f"positions must have T_ctx + block_size = {T + B} entries, got {positions.shape}")
    eps = cfg.rms_norm_eps
    ctx = rms_norm_plain(context_features @ draft_weights["fc.weight"].T, draft_weights["hidden_norm.weight"], eps)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
    x = target_weights["embed_tokens.weight"][np.asarray(block_ids)]
    for i in range(cfg.num_hidden_layers):
        p = sub_weights(draft_weights, f"layers.{i}.")
        h = rms_norm_plain(x, p["input_layernorm.weight"], eps)
        x = x + draft_attention(sub_weights(p, "self_attn."), cfg, h, ctx, cos, sin)
        x = x + mlp(sub_weights(p, "mlp."), rms_norm_plain(x, p["post_attention_layernorm.weight"], eps))
    return rms_norm_plain(x, draft_weights["norm.weight"], eps) @ lm_head(target_weights).T


def context_features(output: Output, layer_ids: Sequence[int]) -> np.ndarray:
    """[T, len(layer_ids) * H]: the target's hidden states after layers layer_ids (0-indexed), concatenated in
    order; HF hidden_states[layer_id + 1] (z-lab extract_context_feature). output: forward(...,
    output_hidden_states=True)."""
    if output.hidden_states is None:
        raise ValueError("the target forward was run without output_hidden_states=True")
    return np.concatenate([output.hidden_states[i + 1] for i in layer_ids], axis=-1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def draft_logprobs(draft_weights: Weights, target_weights: Weights, cfg: DraftConfig, target_cfg: ModelConfig,
                   context_features: np.ndarray, last_token: int) -> np.ndarray:
    """Log-probs [block_size - 1, vocab] for depths 1 .. block_size - 1 after last_token, the token right after
    the T_ctx context tokens whose features are given (the block [last_token, mask, ..., mask])."""
    block = [last_token] + [cfg.mask_token_id] * (cfg.block_size - 1)
    return log_softmax(draft_forward(draft_weights, target_weights, cfg, target_cfg, context_features, block)[1:])


def dflash_draft_fn(draft_weights: Weights, target_weights: Weights, cfg: DraftConfig, target_cfg: ModelConfig):
    """A spec_decode draft_fn(context_ids, n) -> [n, vocab] (n <= block_size - 1) backed by this draft.

    The target's features of context_ids[:-1] come from the reference target run over them. They are kept between
    calls with the state that run left: a call whose context extends the last one's (speculative rounds: the
    context grows by the accepted tokens) runs the target over the new tokens alone; any other context starts
    again. (An engine instead keeps the features its verify pass produced for the accepted tokens.)"""
    seen: list[int] = []
    state = State()
    feats = np.zeros((0, len(cfg.target_layer_ids) * target_cfg.hidden_size), np.float32)

    def features(ids: list[int]) -> np.ndarray:
        nonlocal seen, state, feats
        if ids[:len(seen)] != seen:
            seen, state, feats = [], State(), feats[:0]
        if len(ids) > len(seen):
            out = forward(target_weights, target_cfg, ids[len(seen):], state, output_hidden_states=True)
            feats = np.concatenate([feats, context_features(out, cfg.target_layer_ids)])
            seen = ids
        return feats

    def draft(context_ids: Sequence[int], n: int) -> np.ndarray:
        if not 0 <= n <= cfg.block_size - 1:
            raise ValueError(f"the draft predicts at most block_size - 1 = {cfg.block_size - 1} tokens, asked {n}")
        feats = features([int(t) for t in context_ids[:-1]])
        return draft_logprobs(draft_weights, target_weights, cfg, target_cfg, feats, context_ids[-1])[:n]

    return draft
