"""Gated DeltaNet, the `linear_attention` layers of Qwen3.5 (HF transformers 5.17 `Qwen3_5GatedDeltaNet`).

Shapes: T new tokens; Hk key heads and Hv value heads (Hv a multiple of Hk); dk, dv head dims; C = 2·Hk·dk + Hv·dv
conv channels; K conv taps. State layouts, float32:

    conv state       [K-1, C]       the last K-1 raw (pre-conv, pre-SiLU) in_proj_qkv rows, oldest first;
                                    zeros before the first token. (HF keeps K columns; only the last K-1 matter.)
    recurrent state  [Hv, dk, dv]   S with o_t = S_t^T q_t, per value head

Which rule runs (as in HF): with no previous state (a prefill, any T >= 1) the chunked rule from a zero state;
with a previous state and T == 1 (decode) the recurrent rule; with a previous state and T > 1 (a verify block)
the chunked rule from that state. Both rules are the same math; they differ in rounding only.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from lucegen.model.config import ModelConfig
from lucegen.reference.ops import l2norm, rms_norm_gated, sigmoid, silu, softplus


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv over time, no activation.

    x [T, C] new raw inputs; weight [C, K] (HF conv1d.weight [C, 1, K] squeezed), weight[:, K-1] multiplies the
    current token; state [K-1, C] the previous K-1 inputs. Returns y [T, C] and the new state [K-1, C].
    """
    T, K = x.shape[0], weight.shape[1]
    window = np.concatenate([state, x])  # [K-1+T, C]: row K-1+t is token t
    y = sum(weight[:, j] * window[j : j + T] for j in range(K))
    return y, window[T:]


def recurrent_gated_delta_rule(q, k, v, g, beta, state=None):
    """The gated delta rule token by token (HF torch_recurrent_gated_delta_rule, q/k l2norm in the kernel).

    q, k [T, H, dk] (raw, before l2norm); v [T, H, dv]; g [T, H] log-decay (<= 0); beta [T, H];
    state [H, dk, dv] or None (zeros). Returns o [T, H, dv] and the final state [H, dk, dv].
    Per head and token: S = S·exp(g); S += k ⊗ beta·(v − S^T k); o = S^T q (the updated state).
    """
    T, H, dk = k.shape
    q = l2norm(q) / dk**0.5
    k = l2norm(k)
    S = np.zeros((H, dk, v.shape[-1]), v.dtype) if state is None else state.astype(v.dtype)
    o = np.empty_like(v)
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        delta = (v[t] - (k[t][:, None, :] @ S)[:, 0]) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        o[t] = (q[t][:, None, :] @ S)[:, 0]
    return o, S


def _solve_unit_lower(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """X with (I + strictly_lower(A)) X = B, batched over the leading axes (forward substitution).

    The diagonal and upper triangle of A are ignored, as torch.linalg.solve_triangular(unitriangular=True) does.
    """
    X = B.copy()
    for i in range(1, A.shape[-1]):
        X[..., i, :] -= (A[..., i : i + 1, :i] @ X[..., :i, :])[..., 0, :]
    return X


def chunk_gated_delta_rule(q, k, v, g, beta, state=None, chunk_size: int = 64):
    """The gated delta rule in chunks, WY / UT-transform form (HF torch_chunk_gated_delta_rule).

    Same arguments and results as recurrent_gated_delta_rule. Within a chunk of C tokens with inclusive
    cumulative log-decay c, P[i, j] = exp(c_i − c_j) for j <= i (else 0):
        A = (k·beta) k^T ∘ P,  U = (I + strictly_lower A)^-1 (v·beta),  W = (I + strictly_lower A)^-1 (k·beta·e^c)
    then, chunk after chunk:
        v' = U − W S;   o = (q e^c) S + (q k^T ∘ P) v';   S = e^{c_last} S + (k e^{c_last − c})^T v'.
    Vectorised over heads and chunks; only the scan over chunks is a loop. Numerics: exp(c_i − c_j) is formed from
    cumulative sums, so in float32 it carries ~|c|·2^-24 relative error when decays are strong (as in HF and FLA).
    """
    T, H, dk = k.shape
    dv = v.shape[-1]
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)
    pad = -T % chunk_size
    N = (T + pad) // chunk_size

    def chunks(x):  # [T, H, ...] -> [H, N, C, ...], zero-padded at the end
        x = np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return np.moveaxis(x, 0, 1).reshape(H, N, chunk_size, *x.shape[2:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    c = np.cumsum(g, axis=-1)  # [H, N, C]
    causal = np.tril(np.ones((chunk_size, chunk_size), dtype=bool))
    P = np.exp(np.where(causal, c[..., :, None] - c[..., None, :], -np.inf))
    k_beta = k * beta[..., None]
    A = (k_beta @ k.swapaxes(-1, -2)) * P
    Aqk = (q @ k.swapaxes(-1, -2)) * P
    UW = _solve_unit_lower(A, np.concatenate([v * beta[..., None], k_beta * np.exp(c)[..., None]], axis=-1))
    U, W = UW[..., :dv], UW[..., dv:]
    q_decayed = q * np.exp(c)[..., None]
    k_decayed = k * np.exp(c[..., -1:] - c)[..., None]
    chunk_decay = np.exp(c[..., -1])[..., None, None]  # [H, N, 1, 1]

    S = np.zeros((H, dk, dv), v.dtype) if state is None else state.astype(v.dtype)
    o = np.empty_like(v)
    for n in range(N):
        v_new = U[:, n] - W[:, n] @ S
        o[:, n] = q_decayed[:, n] @ S + Aqk[:, n] @ v_new
        S = S * chunk_decay[:, n] + k_decayed[:, n].swapaxes(-1, -2) @ v_new
    return np.moveaxis(o.reshape(H, N * chunk_size, dv), 0, 1)[:T], S


def gated_deltanet(p: Mapping[str, np.ndarray], cfg: ModelConfig, x: np.ndarray,
                   conv_state: np.ndarray | None = None, recurrent_state: np.ndarray | None = None):
    """One Gated DeltaNet mixer over x [T, hidden].

    p holds the layer's weights by HF name without the "layers.{i}.linear_attn." prefix. conv_state and
    recurrent_state are None before the sequence's first forward. Returns (out [T, hidden], conv_state,
    recurrent_state).
    """
    T = x.shape[0]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if conv_state is None:
        conv_state = np.zeros((cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), x.dtype)

    mixed, conv_state = causal_conv1d(x @ p["in_proj_qkv.weight"].T, p["conv1d.weight"][:, 0], conv_state)
    q, k, v = np.split(silu(mixed), [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    z = (x @ p["in_proj_z.weight"].T).reshape(T, Hv, dv)
    beta = sigmoid(x @ p["in_proj_b.weight"].T)
    g = -np.exp(p["A_log"]) * softplus(x @ p["in_proj_a.weight"].T + p["dt_bias"])
    # value head j reads key head j // (Hv / Hk) (HF repeat_interleave; GGUF tiles instead)
    q = np.repeat(q.reshape(T, Hk, dk), Hv // Hk, axis=1)
    k = np.repeat(k.reshape(T, Hk, dk), Hv // Hk, axis=1)

    rule = recurrent_gated_delta_rule if recurrent_state is not None and T == 1 else chunk_gated_delta_rule
    o, recurrent_state = rule(q, k, v.reshape(T, Hv, dv), g, beta, recurrent_state)
    o = rms_norm_gated(o, z, p["norm.weight"], cfg.rms_norm_eps)
    return o.reshape(T, cfg.value_dim) @ p["out_proj.weight"].T, conv_state, recurrent_state
