"""The Gated DeltaNet front of the prefill: causal conv1d + SiLU over the prompt (updating the conv state ring in
place) and the per-head gates beta, g: the numpy reference and the ring's layout. The kernel code is
templates/conv1d.cuh, run by the chunked delta rule's prep for its chunk and head (lucegen.kernels.gdn).

Conv state layout (shared with the decode path, lucegen.engine.state): a ring [K][conv_dim] fp32 where slot p % K
holds the raw (pre-conv) input of absolute position p; positions before 0 read as zero.
"""
from __future__ import annotations

import numpy as np

from ..model.config import ModelConfig
from ..reference.deltanet import causal_conv1d
from ..reference.ops import sigmoid, silu, softplus


def ring_to_state(ring: np.ndarray, position: int) -> np.ndarray:
    """The reference's conv state [K-1, C] (inputs of positions position-K+1 .. position-1, oldest first) from a ring."""
    k = ring.shape[0]
    rows = [ring[p % k] if p >= 0 else np.zeros(ring.shape[1], ring.dtype) for p in range(position - k + 1, position)]
    return np.stack(rows)


def state_to_ring(state: np.ndarray, position: int) -> np.ndarray:
    """A ring holding the reference conv state [K-1, C] as the inputs of positions position-K+1 .. position-1
    (the slot of `position` itself, written before it is read, is zero)."""
    k = state.shape[0] + 1
    ring = np.zeros((k, state.shape[1]), state.dtype)
    for i, p in enumerate(range(position - k + 1, position)):
        if p >= 0:
            ring[p % k] = state[i]
    return ring


def reference(cfg: ModelConfig, mixed: np.ndarray, conv_w: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray,
              ring: np.ndarray, start: int):
    """(qkv [T, C] after conv + SiLU, g [T, Hv], beta [T, Hv], the new ring) as the model reference computes them."""
    C, VD, HV = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads
    y, state = causal_conv1d(mixed[:, :C], conv_w, ring_to_state(ring, start))
    b, a = mixed[:, C + VD:C + VD + HV], mixed[:, C + VD + HV:]
    new_ring = ring.copy()
    position = start + mixed.shape[0]
    for i, p in enumerate(range(position - state.shape[0], position)):
        if p >= 0:
            new_ring[p % ring.shape[0]] = state[i]
    return silu(y), -np.exp(a_log) * softplus(a + dt_bias), sigmoid(b), new_ring


def shape_problem(cfg: ModelConfig) -> str | None:
    """Why the conv code cannot take this model's DeltaNet layers (it works on float4 quads of `mixed` rows), or None."""
    if cfg.conv_dim % 4 or cfg.value_dim % 4 or cfg.linear_num_value_heads % 4:
        return f"{cfg.name}: the conv code needs conv channels, value width and value heads in multiples of 4"
    return None
