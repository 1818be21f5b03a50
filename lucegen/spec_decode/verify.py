"""One target pass over a draft tree (algorithms.md §4.3, §4.6) on the numpy reference, and the cache commit.

Node n (its token at absolute position start + depth) is computed exactly as a decode step after the committed
sequence followed by n's ancestors: attention layers read the committed KV plus the ancestors' rows only (the
ancestor mask, as a gather), DeltaNet layers start from the parent's recurrent and conv state (node 0: the
committed state), so the conv window runs along the parent chain and falls back into the committed conv state past
the root. Being the decode step's arithmetic, not merely its math, greedy speculative output is bit-identical to
plain greedy decoding. Every node's state is kept, so committing an accepted path needs no second forward.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lucegen.model.config import ModelConfig
from lucegen.reference.model import State, Weights, decode_step
from lucegen.spec_decode.tree import ancestry


def commit(state: State, nodes: Sequence[State], path: Sequence[int]) -> State:
    """The committed state followed by the tokens of path (root-first tree nodes): their K/V rows appended in
    order, the conv and recurrent state of the last one. state is left unchanged."""
    last = nodes[path[-1]] if path else state
    keys, values = ({i: np.concatenate([cache[i], *(getattr(nodes[n], name)[i] for n in path)]) for i in cache}
                    for name, cache in (("keys", state.keys), ("values", state.values)))
    return State(dict(last.conv), dict(last.recurrent), keys, values, state.position + len(path), state.kv_codec)


def tree_forward(weights: Weights, cfg: ModelConfig, state: State, tokens: Sequence[int],
                 parents: Sequence[int]) -> tuple[np.ndarray, list[State]]:
    """Logits [N, vocab] of the tree nodes after the committed state (left unchanged), and each node's State:
    its conv and recurrent state after it, and its own K/V row [1, n_kv, head_dim] per attention layer."""
    nodes: list[State] = []
    logits = np.empty((len(tokens), cfg.vocab_size), np.float32)
    for n, token in enumerate(tokens):
        view = commit(state, nodes, ancestry(parents, parents[n]))
        logits[n] = decode_step(weights, cfg, int(token), view)
        nodes.append(State(view.conv, view.recurrent, {i: k[-1:] for i, k in view.keys.items()},
                           {i: v[-1:] for i, v in view.values.items()}, view.position, state.kv_codec))
    return logits, nodes
