"""The Qwen3.5 text model forward pass in numpy float32: prefill, decode step and greedy generation.

Mirrors HF transformers 5.17 `Qwen3_5ForCausalLM` (eager attention, torch fallbacks for the DeltaNet ops).
Weights: a dict keyed by HF names without the "model.language_model." prefix (see reference.weights), float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from lucegen.model.config import LINEAR, ModelConfig
from lucegen.reference.attention import gated_attention
from lucegen.reference.deltanet import gated_deltanet
from lucegen.reference.ops import argmax, rms_norm, silu

Weights = Mapping[str, np.ndarray]


@dataclass
class State:
    """One sequence's cache. A layer's entry is absent until the sequence's first forward.

    conv[i] [K-1, conv_dim], recurrent[i] [Hv, dk, dv] for DeltaNet layers; keys[i], values[i] [S, n_kv, head_dim]
    for attention layers; position = tokens seen so far (the next token's absolute position); kv_codec: a KV-cache
    format's round trip applied to every K/V row entering the cache (None: float32 KV).
    """
    conv: dict[int, np.ndarray] = field(default_factory=dict)
    recurrent: dict[int, np.ndarray] = field(default_factory=dict)
    keys: dict[int, np.ndarray] = field(default_factory=dict)
    values: dict[int, np.ndarray] = field(default_factory=dict)
    position: int = 0
    kv_codec: Callable[[np.ndarray], np.ndarray] | None = None

    def copy(self) -> "State":
        tables = (self.conv, self.recurrent, self.keys, self.values)
        return State(*({i: a.copy() for i, a in t.items()} for t in tables), position=self.position,
                     kv_codec=self.kv_codec)


class Output(NamedTuple):
    logits: np.ndarray  # [T, vocab]
    hidden_states: list[np.ndarray] | None  # HF semantics, see forward


def sub_weights(weights: Weights, prefix: str) -> dict[str, np.ndarray]:
    return {name[len(prefix):]: w for name, w in weights.items() if name.startswith(prefix)}


def lm_head(weights: Weights) -> np.ndarray:
    """lm_head.weight [vocab, hidden], or the embeddings when they are tied (no lm_head tensor)."""
    return weights["lm_head.weight"] if "lm_head.weight" in weights else weights["embed_tokens.weight"]


def mlp(p: Weights, x: np.ndarray) -> np.ndarray:
    return (silu(x @ p["gate_proj.weight"].T) * (x @ p["up_proj.weight"].T)) @ p["down_proj.weight"].T


def decoder_layer(weights: Weights, cfg: ModelConfig, i: int, x: np.ndarray, state: State) -> np.ndarray:
    """Layer i over x [T, hidden] at positions state.position ...; updates layer i's entries of state."""
    p = sub_weights(weights, f"layers.{i}.")
    eps = cfg.rms_norm_eps
    h = rms_norm(x, p["input_layernorm.weight"], eps)
    if cfg.layer_types[i] == LINEAR:
        h, state.conv[i], state.recurrent[i] = gated_deltanet(
            sub_weights(p, "linear_attn."), cfg, h, state.conv.get(i), state.recurrent.get(i))
    else:
        h, state.keys[i], state.values[i] = gated_attention(
            sub_weights(p, "self_attn."), cfg, h, state.position, state.keys.get(i), state.values.get(i), state.kv_codec)
    x = x + h
    return x + mlp(sub_weights(p, "mlp."), rms_norm(x, p["post_attention_layernorm.weight"], eps))


def forward(weights: Weights, cfg: ModelConfig, token_ids: Sequence[int], state: State | None = None,
            output_hidden_states: bool = False) -> Output:
    """Run T tokens after the state's position; state (if given) is advanced in place.

    hidden_states, as HF returns them: L+1 arrays [T, hidden]; [0] the embeddings, [j] the output of layer j-1
    (residual stream, before the final norm) for j < L, and [L] the final-normed output that lm_head reads.
    """
    state = State() if state is None else state
    x = weights["embed_tokens.weight"][np.asarray(token_ids)]
    hidden = [x]
    for i in range(cfg.num_hidden_layers):
        x = decoder_layer(weights, cfg, i, x, state)
        hidden.append(x)
    state.position += x.shape[0]
    hidden[-1] = rms_norm(x, weights["norm.weight"], cfg.rms_norm_eps)
    return Output(hidden[-1] @ lm_head(weights).T, hidden if output_hidden_states else None)


def prefill(weights: Weights, cfg: ModelConfig, token_ids: Sequence[int], state: State | None = None) -> np.ndarray:
    """Logits [T, vocab] for every token. Pass a State to keep the cache for decoding; on a state that already
    holds a sequence this runs a block after it (a speculative verify: the chunked DeltaNet rule from the state)."""
    return forward(weights, cfg, token_ids, state).logits


def decode_step(weights: Weights, cfg: ModelConfig, token_id: int, state: State) -> np.ndarray:
    """Logits [vocab] for one token after the cached sequence (the recurrent DeltaNet rule)."""
    return forward(weights, cfg, [token_id], state).logits[0]


def generate(weights: Weights, cfg: ModelConfig, prompt_ids: Sequence[int], max_new_tokens: int,
             eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding: prefill, then one decode step per token; stops after eos_token_id."""
    state = State()
    logits = prefill(weights, cfg, prompt_ids, state)[-1]
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        tokens.append(argmax(logits))
        if tokens[-1] == eos_token_id or len(tokens) == max_new_tokens:
            break
        logits = decode_step(weights, cfg, tokens[-1], state)
    return tokens
