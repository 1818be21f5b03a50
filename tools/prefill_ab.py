"""A/B of the prefill between source trees on this GPU: each tree's prefill graph timed in a process of its own
(PYTHONPATH = the tree), the trees alternating, round after round, and each tree's kernels timed one by one once.

    python3 tools/prefill_ab.py --trees /tmp/main . --model qwen3.5-0.8b --tokens 520 --rounds 3 [--split-k 5]
        [--force add=wt176x192]

Trees as tools/ab.py takes them. Prints one JSON line a process (tree, graph microseconds per replay set, kernels by
kind) and a summary of the medians. Session 16's
A/B runs (results/logs/h200-s16-run1..3-*) were made this way.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ab import alternate_or_report


def measure(model: str, tokens: int, replays: int, split_k: int | None, force: dict[str, str]) -> dict:
    """The prefill graph of `model` at `tokens` tokens: its time over `replays` captures, and the kernels by kind.
    force: epilogue -> GEMM tile config name (gemm.TileConfig.name) that every GEMM of that epilogue takes."""
    import numpy as np

    import lucegen
    from lucegen.bench.prefill import graph_ms, kernel_times
    from lucegen.codegen.build import build
    from lucegen.engine.prefill import Prefill
    from lucegen.engine.state import DeviceState
    from lucegen.engine.weights import DeviceWeights
    from lucegen.kernels import fill, gemm
    from lucegen.model.config import load_config, tiny_config
    from lucegen.runtime import DeviceArray, Stream
    from lucegen.spec import spec_for_current_device

    spec = spec_for_current_device()
    if split_k:
        spec = spec.with_prefill(split_k=split_k)
    if force:
        by_name, choose = {c.name: c for c in gemm.tile_configs(spec)}, gemm.choose
        gemm.choose = lambda s, m, n, k=gemm.BK, epilogue="bf16": (by_name[force[epilogue]] if epilogue in force
                                                                  else choose(s, m, n, k, epilogue))
    cfg = load_config(model)
    weights = DeviceWeights.random(cfg, spec, fill.Fill(build(spec, tiny_config(), fill.units(spec)).module("fill"),
                                                        spec))
    prefill, state, stream = Prefill(spec, cfg), DeviceState(cfg, tokens), Stream()
    ids = DeviceArray.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, tokens).astype(np.int32))
    times = []
    for replay in range(replays):
        graph, ms = graph_ms(prefill, weights, state, ids, tokens, stream)
        times.append(round(ms * 1e3, 1))
        if replay < replays - 1:
            graph.destroy()
    kinds = kernel_times(prefill, weights, state, ids, graph, ms, stream)
    return {"tree": str(Path(lucegen.__file__).parents[1]), "split_k": spec.tuning.prefill.split_k, "force": force,
            "graph_us": times, "kernels_us": {k: round(v[0], 1) for k, v in sorted(kinds.items(),
                                                                                  key=lambda kv: -kv[1][0])}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="source trees to compare (default: this one)")
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--tokens", type=int, default=520)
    ap.add_argument("--rounds", type=int, default=3, help="processes per tree, the trees alternating")
    ap.add_argument("--replays", type=int, default=3, help="graph captures timed per process")
    ap.add_argument("--split-k", type=int, default=None, help="tuning.prefill.split_k instead of the spec's")
    ap.add_argument("--force", action="append", default=[], metavar="EPILOGUE=TILE",
                    help="every GEMM of that epilogue on that tile config, e.g. add=wt176x192 (repeatable)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.model, a.tokens, a.replays, a.split_k, dict(f.split("=") for f in a.force))))
        return 0
    args = ["--model", a.model, "--tokens", str(a.tokens), "--replays", str(a.replays),
            *(["--split-k", str(a.split_k)] if a.split_k else []), *(arg for f in a.force for arg in ("--force", f))]
    runs = alternate_or_report(__file__, a.trees, a.rounds, args)
    if runs is None:
        return 1
    results = {tree: [us for r in rs for us in r["graph_us"]] for tree, rs in runs.items()}
    for tree, times in results.items():
        print(f"{tree}: {a.model} pp{a.tokens} graph median {statistics.median(times):.1f} us "
              f"({min(times):.1f} .. {max(times):.1f}, {len(times)} replays)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
