"""The speculative decode loop: draft, build a tree, one target pass over it, walk, commit.

draft_fn(context_ids, n) returns log-probs [n, vocab] for the next n positions after the context (the DFlash draft
plugs in here), or their best tokens per position (tree.TopK: all a DDTree needs). Each round emits the accepted draft tokens and the bonus token; the bonus is the next round's root.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lucegen.engine.sampling import Sampler, SamplingParams, drawn_on_device, top_k_on_device, top_p_on_device
from lucegen.model.config import ModelConfig
from lucegen.reference.model import State, Weights, prefill
from lucegen.spec_decode.accept import chosen, commit, walk
from lucegen.spec_decode.tree import TopK, Tree, build_tree
from lucegen.spec_decode.verify import tree_forward

DraftFn = Callable[[Sequence[int], int], "np.ndarray | TopK"]
GREEDY = SamplingParams(temperature=0)


@dataclass(frozen=True)
class Speculation:
    """How an engine drafts: draft_fn, depth (draft positions per round; DFlash: block size - 1), budget (tree
    nodes below the root) and chain (verify the draft's top-1 chain instead of a tree)."""
    draft_fn: DraftFn
    depth: int
    budget: int
    chain: bool = False

    def tokens_per_round(self, max_new: int) -> int:
        """Tokens a round may commit when at most max_new are wanted: the root and up to depth drafted ones."""
        return min(self.depth, max_new - 1) + 1

    def round(self, verifier: "Verifier", context_ids: Sequence[int], max_new: int, sampler: Sampler) -> list[int]:
        """One round (speculative_round) emitting 1 .. max_new tokens."""
        return speculative_round(verifier, context_ids, self.tokens_per_round(max_new) - 1, self.draft_fn,
                                 self.budget, sampler, self.chain)


class Verifier(Protocol):
    """One target pass over a tree after a committed state, then the commit of an accepted path (root first).
    ReferenceVerifier (numpy) and lucegen.spec_decode.device.NodeVerifier (a GPU engine) implement it. A verifier
    may also have the passes verified_walk takes instead of copying N x vocab logits to the host:
    forward_argmax(tokens, parents) -> the argmax of each node's logits [N] (numpy's rule: the lowest index on ties);
    forward_drawn(tokens, parents, temperature, uniforms) -> the token drawn from each node's row at the temperature
    with its uniform [N] (Sampler's law); forward_top_k(tokens, parents, k) -> (ids [N, k] best first, log-softmax
    values [N, k], rows) for k <= max_top_k; forward_top_p(tokens, parents, temperature, k) -> (ids [N, k], their
    logits [N, k], each node's softmax (Z, S), rows); forward_rows(tokens, parents) -> rows, with rows[node] that
    node's logits [vocab], copied when asked for (the walk reads its path's nodes only)."""

    def forward(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray: ...

    def commit(self, path: Sequence[int]) -> None: ...


class ReferenceVerifier:
    """tree_forward on the numpy reference; .state is the committed state (a new State after each commit)."""

    def __init__(self, weights: Weights, cfg: ModelConfig, state: State):
        self.weights, self.cfg, self.state, self.nodes = weights, cfg, state, []

    def forward(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        logits, self.nodes = tree_forward(self.weights, self.cfg, self.state, tokens, parents)
        return logits

    def commit(self, path: Sequence[int]) -> None:
        self.state = commit(self.state, self.nodes, path)


def speculative_round(verifier: Verifier, context_ids: Sequence[int], n: int, draft_fn: DraftFn, budget: int,
                      sampler: Sampler, chain: bool = False) -> list[int]:
    """One round after context_ids, whose last token (the root) is not in the verifier's state yet: draft n
    positions (at most budget: a tree of budget nodes below the root is no deeper), one target pass over the tree,
    the walk, the commit of the accepted path. Returns the new tokens (the accepted draft tokens, then the bonus
    token, the next root)."""
    tree = build_tree(draft_fn(context_ids, min(n, budget)), budget, root=context_ids[-1],
                      top_k=1 if chain else None)
    accepted, bonus = verified_walk(verifier, tree, sampler)
    verifier.commit(accepted)
    return [tree.tokens[a] for a in accepted[1:]] + [bonus]


def verified_walk(verifier: Verifier, tree: Tree, sampler: Sampler) -> tuple[list[int], int]:
    """The target pass over the tree and the walk (accept.walk) of the target's tokens, through the cheapest pass
    the verifier has for the sampler's law (none copies N x vocab logits to the host):
      greedy           forward_argmax: the argmax of every node;
      temperature      forward_drawn: every node drawn on the device with the uniform of its depth. The walk
                       visits one node a depth, root first, and the host would draw each with the sampler's next
                       uniform: the same uniform, so the same token; the sampler then skips the uniforms the walk
                       took;
      top_k            forward_top_k: each node's top_k + 1 best, which the sampler draws from (its row only on a
                       tie at the k-th);
      top_p alone      forward_top_p: each node's best tokens and softmax, the nucleus drawn from them where they
                       hold it (its row only where it reaches past them);
      else             forward_rows: the rows of the nodes the walk visits (forward: all of them), drawn here."""
    p, tokens, parents = sampler.params, tree.tokens, tree.parents
    if p.temperature == 0 and hasattr(verifier, "forward_argmax"):
        ids = verifier.forward_argmax(tokens, parents)
        return walk(tree, lambda node: int(ids[node]))
    if drawn_on_device(p) and hasattr(verifier, "forward_drawn"):
        uniforms = sampler.uniforms_ahead(max(tree.depths) + 1)
        ids = verifier.forward_drawn(tokens, parents, p.temperature, uniforms[tree.depths])
        accepted, bonus = walk(tree, lambda node: int(ids[node]))
        sampler.skip(len(accepted))  # one draw a node visited
        return accepted, bonus
    if hasattr(verifier, "forward_top_k") and top_k_on_device(p, verifier.max_top_k):
        ids, values, rows = verifier.forward_top_k(tokens, parents, p.top_k + 1)
        return walk(tree, lambda node: sampler.draw_top_k(ids[node], values[node], lambda: rows[node]))
    if hasattr(verifier, "forward_top_p") and top_p_on_device(p):
        ids, values, softmax, rows = verifier.forward_top_p(tokens, parents, p.temperature, verifier.max_top_k)
        return walk(tree, lambda node: sampler.draw_top_p(ids[node], values[node], *softmax[node], lambda: rows[node]))
    forward = getattr(verifier, "forward_rows", verifier.forward)
    return walk(tree, chosen(forward(tokens, parents), sampler))


def speculative_generate(weights: Weights, cfg: ModelConfig, prompt_ids: Sequence[int], max_new_tokens: int,
                         draft_fn: DraftFn, budget: int, sampling: SamplingParams = GREEDY,
                         eos_token_id: int | None = None, depth: int = 15, chain: bool = False) -> list[int]:
    """Up to max_new_tokens tokens, ending after the first eos_token_id; the same tokens as plain greedy decoding
    (temperature 0) or a draw from the same distribution as plain sampling. depth: draft positions per round
    (DFlash: block size - 1); chain: verify the draft's top-1 chain (at most budget long) instead of a tree."""
    sampler = Sampler(sampling)
    verifier = ReferenceVerifier(weights, cfg, State())
    out = [sampler(prefill(weights, cfg, prompt_ids, verifier.state)[-1])]
    while out[-1] != eos_token_id and len(out) < max_new_tokens:
        n = min(depth, max_new_tokens - len(out) - 1)  # a round emits at most n + 1 tokens
        new = speculative_round(verifier, [*prompt_ids, *out], n, draft_fn, budget, sampler, chain)
        if eos_token_id in new:
            new = new[:new.index(eos_token_id) + 1]
        out += new
    return out


ORACLE_SPREAD = 64  # random tokens per position the oracle ranks below its guesses
ORACLE_TOP = 128    # tokens per position it hands DDTree (a TopK): more than any budget it is run with
LOW = -30.0         # the log-prob (before normalisation) of the tokens it does not rank


def oracle_draft(target: Sequence[int], prompt_len: int, vocab_size: int, accuracy: float = 1.0,
                 seed: int = 0, run: int | None = None) -> DraftFn:
    """A draft that knows the continuation target (tokens after the prompt): at each position it ranks the true
    token first with probability accuracy, else a random wrong token first (the true one second); below them
    ORACLE_SPREAD random tokens with random log-probs, then the rest of the vocabulary at the log-prob LOW. Off the
    target's path (after a rejected guess) its guesses are simply random.
    Every draw of a position comes from a generator seeded by (seed, the position after the prompt), so what the
    oracle says there does not depend on how many positions a call asks for or on the calls before: runs that
    differ only in their trees (the budget sweep, lucegen tune) meet the same right and wrong guesses.
    run: only the first `run` positions of each call are guessed so; past them the true token ranks last (below
    LOW), out of any tree smaller than the vocabulary (with accuracy 1, every round then accepts run tokens + the bonus).
    It hands over the best ORACLE_TOP tokens of each position (a TopK, normalised log-probs), exactly the first
    columns of a stable sort of the whole distribution: building and normalising [n, vocab] rows on the host cost
    more than the GPU verify they feed."""
    top = min(ORACLE_TOP, vocab_size)
    spread = min(ORACLE_SPREAD, vocab_size)

    @functools.lru_cache(maxsize=None)
    def position(i: int) -> tuple[dict[int, float], int, bool]:
        """Position i's random tokens (token -> log-prob, not LOW), its wrong guess and whether the guess is right."""
        rng = np.random.default_rng((seed, i))
        ids = rng.integers(0, vocab_size, spread)
        values = np.minimum(rng.normal(size=spread) - 4, -2.0)  # below the guesses' 0 and -1
        wrong = int((target[i] + 1 + rng.integers(vocab_size - 1)) % vocab_size) if i < len(target) else 0
        return dict(zip(map(int, ids), values)), wrong, bool(rng.random() < accuracy)

    for i in range(len(target)):  # drawn here, not in the rounds a benchmark times
        position(i)

    def draft(context: Sequence[int], n: int) -> TopK:
        at = len(context) - prompt_len
        rows = [dict(position(at + d)[0]) for d in range(n)]
        on_path = list(context[prompt_len:]) == list(target[:at])
        for d in range(n):
            i = at + d
            if not on_path or i >= len(target):
                break
            if run is not None and d >= run:
                rows[d][int(target[i])] = LOW - 1.0
                continue
            _, wrong, right = position(i)
            first, second = (target[i], wrong) if right else (wrong, target[i])
            rows[d][int(first)], rows[d][int(second)] = 0.0, -1.0
        ids, lps = np.empty((n, top), np.int64), np.empty((n, top))
        for d, row in enumerate(rows):
            # the best `top` of the whole row are among its ranked tokens and the `top` lowest ids at LOW
            fill = [t for t in range(min(vocab_size, len(row) + top)) if t not in row][:top]
            cand = {**row, **dict.fromkeys(fill, LOW)}
            order = sorted(cand, key=lambda t: (-cand[t], t))[:top]
            vals = np.array(list(row.values()) + [LOW])
            weights = np.append(np.ones(len(row)), vocab_size - len(row))  # normalised over the whole vocabulary
            peak = vals.max()
            ids[d] = order
            lps[d] = [cand[t] for t in order] - (peak + np.log(weights @ np.exp(vals - peak)))
        return TopK(ids, lps)

    return draft
