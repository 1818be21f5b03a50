"""Tree verification on a GPU engine, node by node: every node of the tree runs the engine's own decode step
after its ancestors, so the verify is plain decoding's arithmetic bit for bit and greedy speculative output equals
plain greedy output token for token, on any engine that keeps its sequence in a DeviceState (the decode
megakernel, the layer-by-layer step).

The nodes run in depth-first order. Before node n runs, the DeltaNet state (conv ring and recurrent state) of its
parent is copied back in (the committed state for the root); its K/V rows need no copying: rows are indexed by
position, and in depth-first order the rows at n's ancestors' positions still hold theirs (a node at the same
depth in another branch is visited only after n's subtree). After each node, its DeltaNet state and its K/V rows
are kept, so the commit of the accepted path copies the last node's DeltaNet state in and the path's K/V rows back
to their positions: no second target pass.

Cost: one decode launch per node and the copies (DeltaNet state per node: 0.4 MB on the tiny pair, 19 MB on the
0.8B). The decode megakernel's engine verifies so; the layer-by-layer step verifies a whole tree in one forward of
the tree kernels (lucegen/engine/layered_verify.py: TreeVerifier).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..engine.state import DeviceState
from ..runtime import DeviceArray, synchronize


def depth_first(parents: Sequence[int]) -> list[int]:
    """The nodes (parents[n] < n, one root) in depth-first order, children in index order."""
    children: list[list[int]] = [[] for _ in parents]
    for n, p in enumerate(parents):
        if p >= 0:
            children[p].append(n)
    order, stack = [], [n for n, p in enumerate(parents) if p < 0][::-1]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(children[n]))
    return order


def depths(parents: Sequence[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


class _Snapshot:
    """A copy of a DeviceState's DeltaNet tables (conv rings and recurrent states)."""

    def __init__(self, state: DeviceState):
        self.conv = {i: DeviceArray.empty(a.shape, a.dtype) for i, a in state.conv.items()}
        self.recurrent = {i: DeviceArray.empty(a.shape, a.dtype) for i, a in state.recurrent.items()}

    def save(self, state: DeviceState) -> None:
        for mine, theirs in ((self.conv, state.conv), (self.recurrent, state.recurrent)):
            for i, a in theirs.items():
                a.copy_to(mine[i])

    def load(self, state: DeviceState) -> None:
        for mine, theirs in ((self.conv, state.conv), (self.recurrent, state.recurrent)):
            for i, a in mine.items():
                a.copy_to(theirs[i])

    def free(self) -> None:
        for a in (*self.conv.values(), *self.recurrent.values()):
            a.free()


class NodeVerifier:
    """The Verifier (lucegen.spec_decode.decode) of a GPU engine: an object with .state (DeviceState) and
    decode(token) -> logits [vocab] at state.position (advancing it)."""

    def __init__(self, engine):
        self.engine, self.state = engine, engine.state
        self.base: _Snapshot | None = None
        self.snapshots: list[_Snapshot] = []
        self.rows: list[dict[int, tuple[DeviceArray, DeviceArray]]] = []
        self.start = 0

    def _row(self, cache: DeviceArray, position: int) -> DeviceArray:
        row = cache.shape[1] * cache.shape[2]
        return cache.view((1, *cache.shape[1:]), offset_bytes=position * row * cache.dtype.itemsize)

    def _grow(self, n: int) -> None:
        st = self.state
        if self.base is None:
            self.base = _Snapshot(st)
        while len(self.snapshots) < n:
            self.snapshots.append(_Snapshot(st))
            self.rows.append({i: (DeviceArray.empty((1, *st.keys[i].shape[1:]), st.keys[i].dtype),
                                  DeviceArray.empty((1, *st.values[i].shape[1:]), st.values[i].dtype))
                              for i in st.keys})

    def forward(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        st, n = self.state, len(tokens)
        self._grow(n)
        self.start = st.position
        if st.position + max(depths(parents)) + 1 > st.max_context:
            raise ValueError(f"a tree {max(depths(parents)) + 1} deep after {st.position} tokens exceeds the "
                             f"context of {st.max_context}")
        self.base.save(st)
        depth = depths(parents)
        logits = np.empty((n, self.engine.config.vocab_size), np.float32)
        for node in depth_first(parents):
            (self.base if parents[node] < 0 else self.snapshots[parents[node]]).load(st)
            synchronize()  # the copies (legacy stream) before the engine's launch (maybe on a stream of its own)
            st.position = self.start + depth[node]
            logits[node] = self.engine.decode(int(tokens[node]))
            self.snapshots[node].save(st)
            for i, (k, v) in self.rows[node].items():
                self._row(st.keys[i], st.position - 1).copy_to(k)
                self._row(st.values[i], st.position - 1).copy_to(v)
        st.position = self.start  # the DeltaNet state is the last node's until commit() loads the path's
        return logits

    def commit(self, path: Sequence[int]) -> None:
        st = self.state
        self.snapshots[path[-1]].load(st)
        for j, node in enumerate(path):
            for i, (k, v) in self.rows[node].items():
                k.copy_to(self._row(st.keys[i], self.start + j))
                v.copy_to(self._row(st.values[i], self.start + j))
        st.position = self.start + len(path)
        synchronize()

    def free(self) -> None:
        for s in ([self.base] if self.base else []) + self.snapshots:
            s.free()
        for rows in self.rows:
            for k, v in rows.values():
                k.free(), v.free()
