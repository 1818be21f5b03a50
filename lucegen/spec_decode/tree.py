"""DDTree draft trees (algorithms.md §4.2): the `budget` most probable prefixes under the draft's per-depth
marginals, built best-first with a heap on cumulative log-probability.

Nodes are numbered in insertion order, so a parent's index is below its children's; node 0 is the root (the bonus
token, already chosen by the target) and does not count toward the budget.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def ancestry(parents: Sequence[int], node: int) -> list[int]:
    """The path from the root to `node` (parents[root] = -1): its ancestors root first, then node; [] for -1."""
    chain = []
    while node >= 0:
        chain.append(node)
        node = parents[node]
    return chain[::-1]


@dataclass
class Tree:
    tokens: list[int]  # [N]; tokens[0] the root
    parents: list[int]  # [N]; -1 for the root
    depths: list[int]  # [N]; 0 for the root
    children: list[dict[int, int]]  # node -> {token: child node}

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.children[parent][token] = len(self.tokens) - 1
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The nodes from the root to node, both included."""
        nodes = [node]
        while self.parents[nodes[-1]] >= 0:
            nodes.append(self.parents[nodes[-1]])
        return nodes[::-1]

    def visibility(self) -> np.ndarray:
        """[N, N] bool: node i sees node j iff j is i or one of its ancestors (the tree attention mask)."""
        vis = np.eye(len(self.tokens), dtype=bool)
        for i in range(1, len(self.tokens)):
            vis[i, :i] = vis[self.parents[i], :i]
        return vis


@dataclass(frozen=True)
class TopK:
    """A draft's best tokens per position, best first (ties: the lower token id first): ids [L, K] and their
    log-probs [L, K]. All DDTree needs of a draft (only the top `budget` tokens of a depth can be in a tree, and the
    acceptance walk samples the target alone), without the [L, vocab] log-probs: a draft may hand this instead."""
    ids: np.ndarray
    logprobs: np.ndarray


def top_k_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """The first k columns of a stable descending argsort of each row of scores [L, V] (ties: the lower index
    first), in O(V) per row instead of a sort of the whole vocabulary: the k-th largest value by a partition, the
    values above it, then the ties at it in index order."""
    L, V = scores.shape
    if k >= V:
        return np.argsort(-scores, axis=1, kind="stable")
    out = np.empty((L, max(k, 0)), np.int64)
    for d, row in enumerate(scores):
        if k <= 0:
            break
        kth = -np.partition(-row, k - 1)[k - 1]
        above = np.flatnonzero(row > kth)
        ties = np.flatnonzero(row == kth)[:k - len(above)]
        pick = np.concatenate([above, ties])
        out[d] = pick[np.lexsort((pick, -row[pick]))]
    return out


def build_tree(logprobs: np.ndarray | TopK, budget: int, root: int = 0, chain_seed: bool = True,
               top_k: int | None = None) -> Tree:
    """A tree of at most budget nodes below the root from draft log-probs [L, V] (depth d+1 in row d), or from a
    draft's TopK (then at most its K tokens a depth).

    Only the top_k = min(budget, V) tokens per depth can appear (Lemma 1); top_k=1 gives a chain. chain_seed first
    inserts the top-1 chain, then continues best-first (the LB port's default; off = the paper's pure best-first,
    which yields exactly the budget most probable prefixes).
    """
    if isinstance(logprobs, TopK):
        L, V = logprobs.ids.shape
    else:
        L, V = logprobs.shape
    K = min(budget, V) if top_k is None else min(top_k, budget, V)
    if isinstance(logprobs, TopK):
        ids, lp = logprobs.ids[:, :K], logprobs.logprobs[:, :K].astype(np.float64)
    else:
        ids = top_k_ids(logprobs, K)  # rank 0 = best
        lp = np.take_along_axis(logprobs, ids, axis=1).astype(np.float64)
    tree = Tree([root], [-1], [0], [{}])
    if budget < 1 or L < 1:
        return tree
    if chain_seed:
        for d in range(min(L, budget)):
            tree.add(int(ids[d, 0]), len(tree.tokens) - 1)
    heap = [(-lp[0, 0], 0, 1, 0)]  # (-logw, parent, depth, rank); ties broken by parent, depth, rank
    while heap and len(tree.tokens) <= budget:
        neg_logw, parent, depth, rank = heapq.heappop(heap)
        token = int(ids[depth - 1, rank])
        node = tree.children[parent].get(token)  # present when the chain seed put it there
        if node is None:
            node = tree.add(token, parent)
        if rank + 1 < K:
            heapq.heappush(heap, (neg_logw + lp[depth - 1, rank] - lp[depth - 1, rank + 1], parent, depth, rank + 1))
        if depth < L:
            heapq.heappush(heap, (neg_logw - lp[depth, 0], node, depth + 1, 0))
    return tree
