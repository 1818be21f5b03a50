"""Tree verification in one forward of the layer-by-layer step (lucegen/engine/layered.py): the Verifier
(lucegen.spec_decode.decode) of LayeredEngine.

forward(tokens, parents) runs the N nodes of a draft tree through every layer at once: the projections over N
rows, per DeltaNet layer the tree DeltaNet (each node's recurrence from its parent's state), per attention layer
attention_kv (node n's K/V into cache row start + n) and the ancestor-masked attention, node n at position
start + depth[n]. The kernels are those the step decodes with (a decode step is their 1-node tree), so node n's
logits are bit for bit those of decoding it after its ancestors. commit(path) replays the accepted path into the
DeltaNet states and conv rings from the in-projection rows the forward kept per DeltaNet layer, and moves the
path's K/V rows to start .. start + len - 1: no second target pass. With the step capturing target features, node
n's are row n, and the commit hands the path's rows to the step's follower (LayeredStep.commit_rows).

Both are captured as CUDA graphs, the forward per (N, DeltaNet stack levels), the commit per (N, path length); the
committed position is read from the step's io on the device.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..kernels.megakernel import lin_in_rows
from ..runtime import DeviceArray
from .base import ContextOverflow
from .layered import LayeredStep, rows


class TreeMixer:
    """The mixers of a verify over the uploaded tree (`tree`, a tree.DeviceTree): every node in one launch per
    kernel. Each DeltaNet layer's in-projection rows go to a buffer of its own, which the commit replays."""
    advances = False  # the position moves on commit

    def __init__(self, step: LayeredStep):
        self.step, self.tree = step, None
        n, width = step.tree.max_nodes, lin_in_rows(step.cfg)
        self.mixed = {i: DeviceArray.empty((n, width), np.float32) for i in step.cfg.linear_layers}

    def in_rows(self, i: int) -> DeviceArray:
        return self.mixed[i]

    def linear(self, L: Mapping, i: int, mixed, out, m: int, stream, normed, normed_q) -> None:
        s, c = self.step, self.step.cfg
        norm = (L["norm"], rows(normed, m, c.value_dim), normed_q)
        s.tree.deltanet(self.tree, rows(mixed, m, L["lin_in"].n), L["conv"], L["a_log"], L["dt_bias"],
                        s.state.conv[i], s.state.recurrent[i], rows(out, m, c.value_dim), 0, s.io, stream=stream,
                        norm=norm)

    def full(self, L: Mapping, i: int, qkv, out, m: int, stream, out_q) -> None:
        s, c = self.step, self.step.cfg
        qkv, width = rows(qkv, m, L["att_in"].n), c.num_attention_heads * c.head_dim
        keys, values = s.state.keys[i], s.state.values[i]
        s.tree.attention_kv(self.tree, qkv, L["k_norm"], keys, values, 0, s.io, stream=stream)
        s.tree.attention(self.tree, qkv, L["q_norm"], keys, values, rows(out, m, width), 0, s.io, stream=stream,
                         out_q=out_q)

    def commit(self, length: int, stream) -> None:
        """Every layer's commit of the path set on the tree kernels (set_path)."""
        s, c, W = self.step, self.step.cfg, self.step.weights
        n = self.tree.n
        for i in c.linear_layers:
            L = W.layers[i]
            s.tree.deltanet_commit(self.tree, length, rows(self.mixed[i], n, L["lin_in"].n), L["conv"], L["a_log"],
                                   L["dt_bias"], s.state.conv[i], s.state.recurrent[i],
                                   rows(s.mix_out, n, c.value_dim), 0, s.io, stream=stream, layer=i)
        for i in c.full_layers:
            s.tree.kv_commit(length, s.state.keys[i], s.state.values[i], 0, s.io, stream=stream)

    def free(self) -> None:
        for a in self.mixed.values():
            a.free()


class NodeLogits:
    """The logits [n, vocab] of a tree's nodes, left on the device: rows[node] copies that node's row to the host.
    Valid until the verifier's next pass."""

    def __init__(self, logits, n: int, vocab: int):
        self.logits, self.n, self.vocab = logits, n, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, node: int) -> np.ndarray:
        if not 0 <= node < self.n:
            raise IndexError(f"node {node} of a tree of {self.n}")
        return self.logits.view(self.vocab, np.float32, 4 * node * self.vocab).numpy()


class TreeVerifier:
    """The Verifier of a LayeredStep's sequence: forward(tokens, parents) -> logits [N, vocab] after the committed
    state (parents topologically ordered, parents[0] = -1), or forward_argmax -> their argmax [N], then
    commit(path) of an accepted path (root first)."""

    def __init__(self, step: LayeredStep):
        self.step, self.mixer = step, TreeMixer(step)

    def forward(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        n = self._run(tokens, parents)
        return self.step.logits.view((n, self.step.cfg.vocab_size)).numpy()

    def forward_rows(self, tokens: Sequence[int], parents: Sequence[int]) -> "NodeLogits":
        """forward's pass, with each node's logits copied to the host only when asked for (rows[node]): a sampled
        round's walk reads the nodes of its path, not N x vocab (65 nodes of the 27B: 65 MB)."""
        return NodeLogits(self.step.logits, self._run(tokens, parents), self.step.cfg.vocab_size)

    def forward_argmax(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """forward's pass, returning each node's argmax [N] (the step's device argmax, numpy's rule) instead of
        N x vocab logits: what a greedy round walks."""
        n = self._run(tokens, parents)
        return self.step.tokens.view(n).numpy()

    def forward_drawn(self, tokens: Sequence[int], parents: Sequence[int], temperature: float,
                      uniforms: Sequence[float]) -> np.ndarray:
        """forward's pass, then node n's token drawn from its logits at the temperature with uniforms[n] (the
        sample kernel, one launch for every node: Sampler's law for the same uniform) [N]: what a sampled round at
        a temperature alone walks."""
        s, V = self.step, self.step.cfg.vocab_size
        if len(uniforms) != len(tokens):
            raise ValueError(f"tree verify: {len(tokens)} nodes but {len(uniforms)} uniforms")
        n = self._run(tokens, parents, then=lambda n: s.sample(s.logits.view(n * V), temperature, uniforms,
                                                               stream=s.stream))
        return s.sample.out.view(n).numpy()

    @property
    def max_top_k(self) -> int:
        """The most best tokens forward_top_k finds a node (tuning.topk.max_k, or the vocabulary if smaller)."""
        return min(self.step.top_k.max_k, self.step.cfg.vocab_size)

    def forward_top_k(self, tokens: Sequence[int], parents: Sequence[int], k: int
                      ) -> tuple[np.ndarray, np.ndarray, NodeLogits]:
        """forward's pass, then each node's k best tokens (best first, ties to the lower id) and their log-softmax
        values [N, k] (the topk kernel over every node's row), with the rows left on the device for the draws that
        need them (a tie at the k-th): what a sampled round under top_k walks."""
        s, V = self.step, self.step.cfg.vocab_size
        found = []
        n = self._run(tokens, parents, then=lambda n: found.extend(s.top_k(s.logits, n, V, k, stream=s.stream)))
        return found[0].numpy(), found[1].numpy(), NodeLogits(s.logits, n, V)

    def forward_top_p(self, tokens: Sequence[int], parents: Sequence[int], temperature: float, k: int
                      ) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float]], NodeLogits]:
        """forward's pass, then each node's k best tokens (best first, ties to the lower id) and their logits [N, k],
        each node's softmax at the temperature ((Z, S), kernels/sample.py's softmax_of), and the rows left on the
        device for the draws whose nucleus reaches past the k: what a sampled round under top_p alone walks."""
        s, V = self.step, self.step.cfg.vocab_size
        found = []

        def then(n: int) -> None:
            found.extend(s.top_k.best(s.logits, n, V, k, stream=s.stream))
            s.sample.softmax(s.logits.view(n * V), temperature, rows=n, stream=s.stream)
        n = self._run(tokens, parents, then=then)
        return (found[0].numpy(), found[2].numpy(), s.sample.softmax_of(n, temperature),
                NodeLogits(s.logits, n, V))

    def _run(self, tokens: Sequence[int], parents: Sequence[int], then=None) -> int:
        """The tree's pass (one graph launch), then(n) enqueued after it, waited for; returns its node count."""
        s, n = self.step, len(tokens)
        if len(parents) != n:
            raise ValueError(f"tree verify: {n} tokens but {len(parents)} parents")
        ids = s.check_ids(tokens, s.tree.max_nodes, "a tree verify")
        if s.state.position + n > s.state.max_context:
            raise ContextOverflow(f"a tree of {n} nodes after {s.state.position} tokens: its K/V rows exceed the "
                                  f"context of {s.state.max_context}")
        t = self.mixer.tree = s.tree.tree(parents, stream=s.stream)  # in order with the launches on the stream
        s.upload(ids)
        s.replay((self, "tree", n, t.levels), lambda stream: s.enqueue(n, stream, self.mixer))
        if then is not None:
            then(n)
        s.wait()
        return n

    def commit(self, path: Sequence[int]) -> None:
        s, t = self.step, self.mixer.tree
        if t is None:
            raise ValueError("tree verify: commit() before forward()")
        length = s.tree.set_path(t, path, stream=s.stream)
        s.replay((self, "commit", t.n, length), lambda stream: self.mixer.commit(length, stream))
        s.commit_rows(path)  # node n's features are row n of the forward's
        s.wait()
        self.mixer.tree = None

    def free(self) -> None:
        self.step.drop(self)
        self.mixer.free()
