"""Where a decode megakernel step's time goes, from the timeline a traced launch writes (mk_decode.cuh: TraceField).

Phase g of the launch (steps one after another) is over when its last block finishes its work: release[g]. Its wall
time is release[g] - release[g - 1]. The phase's last block to finish sets it; its time splits into
  exit    start of its work - release[g - 1]: the barrier's (or ready counters') latency as that block saw it
  stage   GEMV start - start: the staged input and its norm (loads from L2, a block reduction)
  gemv    GEMV end - GEMV start in warp 1 (ring waits included)
  tail    done - GEMV end: the other consumer warps, the K-split sums, the block's arrival
For phases without a GEMV (the mixers) the whole work is `work`. `ready` is the share of a GEMV's first ring slots
whose tiles had landed when it started: near 1, DRAM ran ahead of the block; near 0, the block waited for DRAM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..kernels.megakernel import TRACE_FIELDS

START, GEMV, GEMV_END, DONE, READY, TILES = range(len(TRACE_FIELDS))


@dataclass
class KindTime:
    """Microseconds per token of one phase kind, summed over its phases, averaged over the steps."""
    wall: float = 0.0
    exit: float = 0.0
    stage: float = 0.0
    gemv: float = 0.0
    tail: float = 0.0
    work: float = 0.0
    ready: list = field(default_factory=lambda: [0, 0])  # tiles landed at GEMV start, tiles looked at

    @property
    def ready_share(self) -> float:
        return self.ready[0] / self.ready[1] if self.ready[1] else float("nan")


def analyse(trace: np.ndarray, kinds: list[str], slots: int, skip_steps: int = 1) -> tuple[dict[str, KindTime], float]:
    """trace [steps, phases, blocks, TRACE_FIELDS] (uint64) -> ({kind: KindTime}, us per token). kinds[k] names
    phase k of a step; the first skip_steps steps are left out (their first phase has no previous release)."""
    steps, phases = trace.shape[:2]
    if steps <= skip_steps:
        raise ValueError(f"a trace of {steps} steps leaves nothing after skipping {skip_steps}")
    t = trace.astype(np.int64).reshape(steps * phases, *trace.shape[2:])
    release = t[:, :, DONE].max(axis=1)
    out = {k: KindTime() for k in dict.fromkeys(kinds)}
    first = skip_steps * phases
    for g in range(first, steps * phases):
        kt = out[kinds[g % phases]]
        last = int(t[g, :, DONE].argmax())
        row, prev = t[g, last], release[g - 1]
        kt.wall += release[g] - prev
        kt.exit += row[START] - prev
        kt.work += row[DONE] - row[START]
        if row[GEMV]:
            kt.stage += row[GEMV] - row[START]
            kt.gemv += row[GEMV_END] - row[GEMV]
            kt.tail += row[DONE] - row[GEMV_END]
            looked = np.minimum(t[g, :, TILES], slots)
            kt.ready[0] += int(t[g, :, READY].sum())
            kt.ready[1] += int(looked.sum())
    n = steps - skip_steps
    for kt in out.values():
        for name in ("wall", "exit", "stage", "gemv", "tail", "work"):
            setattr(kt, name, getattr(kt, name) / n / 1e3)
    return out, (release[-1] - release[first - 1]) / n / 1e3
