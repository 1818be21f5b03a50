"""Elementwise ops, norms and partial RoPE of Qwen3.5, as HF transformers 5.17 computes them.

Every function computes in the dtype of its inputs (float32 for the reference; float64 where a test wants a
higher-precision check). Scalars are Python floats, which NumPy 2 keeps from promoting float32 arrays.
"""
from __future__ import annotations

import numpy as np


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written as PyTorch's CPU kernel writes it: x / (1 + exp(-x))."""
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives the exact limit 0
        return x / (1 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-x))


def softplus(x: np.ndarray, threshold: float = 20.0) -> np.ndarray:
    """torch.nn.functional.softplus (beta 1): x above the threshold, log1p(exp(x)) below it."""
    return np.where(x > threshold, x, np.log1p(np.exp(np.minimum(x, threshold))))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm over the last axis, (1 + w) form (HF Qwen3_5RMSNorm; weights initialised to 0).

    Used for input_layernorm, post_attention_layernorm, the final norm, q_norm and k_norm.
    """
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + weight)


def rms_norm_gated(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm with a plain weight, then a SiLU gate (HF Qwen3_5RMSNormGated, the DeltaNet output norm)."""
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * silu(gate)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x * rsqrt(sum(x^2) + eps) over the last axis (HF/FLA l2norm: eps on the sum, not the mean)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """inv_freq[i] = 1 / theta^(2i / rotary_dim), i < rotary_dim / 2, in float32 as HF computes it."""
    return 1 / np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))


def rope_cos_sin(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables [T, rotary_dim] for absolute positions, float32 as HF builds them.

    The angles are positions * rope_inv_freq in float32 and repeat once (NEOX half split). For text-only
    input Qwen3.5's interleaved M-RoPE has identical t/h/w positions and reduces exactly to this.
    """
    freqs = np.asarray(positions, dtype=np.float32)[:, None] * rope_inv_freq(rotary_dim, theta)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Partial rotary embedding of x [T, heads, head_dim]: rotates the first cos.shape[-1] dims, passes the rest.

    rotate_half pairs dim i with dim i + rotary_dim/2 (NEOX / half-split style, HF rotate_half).
    """
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = np.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


def argmax(logits: np.ndarray) -> int:
    """Greedy token: the first index of the maximum, as torch.argmax and every kernel must break ties."""
    return int(np.argmax(logits))
