"""The DFlash draft of a LayeredEngine on the GPU (issue #7): GpuDraft (lucegen/engine/draft_gpu.py) fed with the
target features the layer-by-layer step captures (LayeredStep.capture_features), and the device top-K of its logits
(lucegen/kernels/topk.py), as a spec_decode draft_fn.

The draft's context is the engine's committed sequence. Every token that enters the state through the step (a
prompt chunk, a decode step, a verify's accepted path: LayeredStep.commit_rows) has its feature row appended to the
draft's rings at its position, on the step's stream: after the launch that wrote the row and before the next one
overwrites it, with no host wait. The rows of an accepted path that are not consecutive (a branch off the draft's
top-1 chain) are gathered first (the place kernel, one launch per run of consecutive rows), so a commit is one
append. A token at position 0 starts a new sequence (after the engine's reset()). A token at any other position
than the next one (the state's position set by hand, as benchmarks do) loses the context until the next sequence:
the draft_fn then raises rather than draft from the features of other tokens.

draft_fn(context_ids, n): context_ids' last token (the root, not yet in the state) at the state's position; one
forward of the draft's block (its LM head over the first n depths alone: a round asks for at most its budget), then
the best k tokens of each of them, on the device. k is the largest tree the engine verifies (tuning.ddtree.capacity:
a tree of budget B holds at most B tokens a depth; a round's budget, the spec's or --budget, is at most that), at
most tuning.topk.max_k; only n x k ids and log-probs reach the host.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..codegen.build import BUILD_DIR, build
from ..kernels import topk
from ..model.draft_config import DraftConfig
from ..runtime import DeviceArray
from ..spec_decode.tree import TopK
from .draft_gpu import GpuDraft
from .layered import LayeredStep, rows as row_view


def runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """rows as runs of consecutive indices, in order: (first row, count) each."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and r == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((int(r), 1))
    return out


class LayeredDraft:
    """A GpuDraft that follows a LayeredStep's committed tokens (the step's follower), called as a draft_fn:
    (context_ids, n) -> TopK of n depths. draft_weights: float32 by checkpoint name (model.draft.load_draft)."""

    def __init__(self, step: LayeredStep, cfg: DraftConfig, draft_weights: Mapping[str, np.ndarray],
                 root: Path = BUILD_DIR):
        spec, target = step.spec, step.cfg
        self.step, self.cfg = step, cfg
        features = step.capture_features(cfg.target_layer_ids)
        # a block starts at the root's position, at most max_context - 1, and runs block_size - 1 past it
        self.draft = GpuDraft(spec, cfg, draft_weights, step.weights, target, step.state.max_context + cfg.block_size,
                              root=root, stream=step.stream)
        # its own build folder, as the speculative bench's (a manifest per folder)
        built = build(spec, dataclasses.replace(target, name=f"{target.name}-topk"), topk.units(spec, target),
                      root=root)
        self.topk = topk.TopKKernel(built.module("topk"), spec, rows=cfg.block_size - 1, vocab=target.vocab_size)
        self.k = min(spec.tuning.ddtree.capacity, topk.max_k(spec), target.vocab_size)
        self.gathered = DeviceArray.empty(features.shape, np.float32)  # a path's rows, consecutive
        self.synced = step.state.position == 0  # the draft's context is the committed tokens 0 .. draft.length - 1
        step.follower = self

    def follow(self, rows: Sequence[int], position: int) -> None:
        """The tokens of `rows` of the step's last forward are now committed at position, position + 1, ...: their
        features into the draft's context (queued on the step's stream)."""
        if position == 0:
            self.draft.reset()
            self.synced = True
        elif position != self.draft.length:
            self.synced = False
        if self.synced and len(rows):
            self.draft.append_context(self.feature_rows(rows), position)

    def feature_rows(self, rows: Sequence[int]) -> DeviceArray:
        """The step's feature rows `rows`, in order, as consecutive rows: a view of the step's where they are
        consecutive, else gathered."""
        s, F = self.step, self.gathered.shape[1]
        parts = runs(rows)
        if len(parts) == 1:
            return row_view(s.features, len(rows), F, parts[0][0])
        t = 0
        for first, count in parts:
            s.kernels.place(row_view(s.features, count, F, first), row_view(self.gathered, count, F, t), F, F, 0, count,
                            stream=s.stream)
            t += count
        return row_view(self.gathered, t, F)

    def __call__(self, context_ids: Sequence[int], n: int) -> TopK:
        """The best k tokens and their log-probs at depths 1 .. n after context_ids, whose last token (the root)
        follows the committed ones."""
        position, B = self.step.state.position, self.cfg.block_size
        if len(context_ids) != position + 1:
            raise ValueError(f"the GPU draft drafts after the engine's state: {position} committed tokens and the "
                             f"root, not a context of {len(context_ids)}")
        if not self.synced or self.draft.length != position:
            raise RuntimeError(f"the GPU draft holds no features of the state's {position} tokens (the position "
                               f"moved other than by steps and commits): reset() and prefill the sequence again")
        if not 0 <= n <= B - 1:
            raise ValueError(f"the draft predicts at most block_size - 1 = {B - 1} tokens, asked {n}")
        if n == 0:
            return TopK(np.empty((0, self.k), np.int64), np.empty((0, self.k), np.float32))
        logits = self.draft.forward(int(context_ids[-1]), position, n)
        return topk.device_topk(self.topk, logits, n, self.step.cfg.vocab_size, self.k, stream=self.draft.stream)

    def free(self) -> None:
        if self.step.follower is self:
            self.step.follower = None
        self.draft.free()
        self.topk.free()
        self.gathered.free()
