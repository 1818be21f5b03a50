"""Deterministic random weights of a Qwen3.5 text model, for tests and checkpoints.

Names (lucegen.model.weights.weight_shapes) are HF's with the "model.language_model." prefix stripped ("embed_tokens.weight",
"layers.0.linear_attn.in_proj_qkv.weight", "norm.weight", "lm_head.weight"), values in HF conventions:
zero-centred (1 + w) norms except the DeltaNet output norm, A_log (not -exp(A_log)), value heads grouped by key head.
"""
from __future__ import annotations

import hashlib
import zlib
from typing import Mapping

import numpy as np

from lucegen.model.config import ModelConfig
from lucegen.model.weights import weight_shapes


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """One PCG64 stream per (seed, tensor name): a tensor does not depend on which others exist."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _random_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int, peaked: bool) -> np.ndarray:
    rng = tensor_rng(seed, name)
    if name.endswith("A_log"):  # decay rate A in [1, 16]; the log in float64, then one rounding
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if peaked and name == "lm_head.weight":
        perm = tensor_rng(seed, "lm_head.permutation").permutation(cfg.vocab_size)
        embed = _random_tensor(cfg, "embed_tokens.weight", shape, seed, peaked=False)
        return embed[perm] / np.float32(np.sqrt(cfg.hidden_size))
    normal = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("linear_attn.norm.weight"):  # plain-w norm: around 1
        return 1 + np.float32(0.1) * normal
    if name.endswith(("norm.weight", "dt_bias")):  # (1 + w) norms: around 0; dt_bias small
        return np.float32(0.1) * normal
    if name == "embed_tokens.weight":
        return normal * np.float32(4 * np.sqrt(cfg.num_hidden_layers)) if peaked else normal
    fan_in = shape[-1] if len(shape) == 2 else shape[-1] * shape[-2]  # conv1d: [C, 1, K]
    return normal / np.float32(np.sqrt(fan_in))


def random_weights(cfg: ModelConfig, seed: int = 0, dtype=np.float32, peaked: bool = False) -> dict[str, np.ndarray]:
    """Random weights with real names and shapes, bit-identical for a given seed on every machine.

    Activations stay O(1): linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), (1 + w) norm weights and
    dt_bias ~ N(0, 0.1^2), the DeltaNet output norm ~ N(1, 0.1^2), A_log = log U(1, 16). Each tensor is drawn
    from its own stream (seed, name) and cast to dtype at once, so peak memory is one float32 tensor over the
    result.

    peaked=True makes greedy decoding stable under small numeric differences: the embeddings are scaled by
    4·sqrt(layers) so each token's embedding dominates the residual stream, and lm_head row v is the
    (unit-scaled) embedding of token perm[v] for a fixed random permutation, so the logit of perm^-1(current token)
    stands out by ~sqrt(hidden) over the rest (tied models predict the current token itself).
    """
    return {name: _random_tensor(cfg, name, shape, seed, peaked).astype(dtype, copy=False)
            for name, shape in weight_shapes(cfg).items()}


def weights_digest(weights: Mapping[str, np.ndarray]) -> str:
    """sha256 over names, dtypes, shapes and bytes in name order: shows when random_weights' output changed."""
    h = hashlib.sha256()
    for name in sorted(weights):
        w = np.ascontiguousarray(weights[name])
        h.update(f"{name} {w.dtype} {w.shape}".encode())
        h.update(w.tobytes())
    return h.hexdigest()
