"""The acceptance walk (algorithms.md §4.4); commit (from verify) then keeps exactly the accepted path.

The walk draws the target's own token at each visited node (greedy: the argmax; sampled: a draw from the
request's filtered distribution with its own Generator) and follows the child holding that token, so every
committed token is exactly what plain decoding would have produced at that prefix.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lucegen.engine.sampling import Sampler
from lucegen.spec_decode.tree import Tree
from lucegen.spec_decode.verify import commit

__all__ = ["chosen", "commit", "walk"]


def walk(tree: Tree, pick: Callable[[int], int]) -> tuple[list[int], int]:
    """The accepted nodes (root first) and the bonus token, the target's choice after the last of them; pick(node)
    is the target's token at a node (chosen(logits, sampler), or its argmax from the device for greedy decoding).

    Only visited nodes are sampled: the same law as one independent draw per node, with fewer draws."""
    node, accepted = 0, [0]
    token = pick(0)
    while token in tree.children[node]:
        node = tree.children[node][token]
        accepted.append(node)
        token = pick(node)
    return accepted, token


def chosen(logits: np.ndarray, sampler: Sampler) -> Callable[[int], int]:
    """walk's pick from the tree's logits [N, vocab]: the sampler's draw (greedy: the argmax) at each node."""
    return lambda node: sampler(logits[node])
