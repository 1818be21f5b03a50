"""A/B of the decode megakernel between source trees on this GPU (tools/ab.py: a process per tree, the trees
alternating): each process builds its tree's megakernel for the model on random weights, times tg128 (`--medians`
medians of 7 launches of 128 steps, as `lucegen bench decode`) and, with --trace, one traced launch: per phase kind,
the wall time on the critical path and its parts (barrier exit, staging, GEMV, tail; bench/timeline.py).

    python3 tools/decode_ab.py --trees /tmp/main . --rounds 2 [--trace] [--model qwen3.5-0.8b]

Prints one JSON line a process and a summary: each tree's median us a token, and with --trace the per-kind walls
averaged over its processes. The child measures with the tree's own bench/decode.py (tg_ms, traced: trees from
e36a867 on). Session 19's megakernel A/Bs (results/logs/h200-s19-run3..6-*) were made with its lab predecessor.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ab import alternate_or_report

PARTS = ("wall", "exit", "stage", "gemv", "tail", "work")  # bench/timeline.py's KindTime, us a token


def measure(model: str, medians: int, trace: bool) -> dict:
    import numpy as np

    import lucegen
    from lucegen.bench.decode import PP, TG, TRACE_STEPS, Setup, tg_ms, traced
    from lucegen.runtime import Stream

    stream = Stream()
    setup = Setup.open(model, None, PP + TG + 8)
    rng = np.random.default_rng(0)
    token = int(rng.integers(setup.cfg.vocab_size))
    out = {"tree": str(Path(lucegen.__file__).parents[1]),
           "us_per_token": [round(tg_ms(setup.engine, token, stream) * 1e3 / TG, 2) for _ in range(medians)]}
    if trace:
        forced = [int(t) for t in rng.integers(0, setup.cfg.vocab_size, TRACE_STEPS)]
        times, per_token, _, _ = traced(setup, forced, stream)
        out["trace_us_per_token"] = round(per_token, 1)
        out["trace"] = {k: {**{f: round(getattr(t, f), 2) for f in PARTS}, "tiles_ready": t.ready_share}
                        for k, t in times.items()}
    setup.engine.free()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="source trees to compare (default: this one)")
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--rounds", type=int, default=2, help="processes per tree, the trees alternating")
    ap.add_argument("--medians", type=int, default=3, help="tg128 medians timed per process")
    ap.add_argument("--trace", action="store_true", help="also one traced launch per process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.model, a.medians, a.trace)))
        return 0
    args = ["--model", a.model, "--medians", str(a.medians), *(["--trace"] if a.trace else [])]
    runs = alternate_or_report(__file__, a.trees, a.rounds, args)
    if runs is None:
        return 1
    for tree, rs in runs.items():
        us = [u for r in rs for u in r["us_per_token"]]
        print(f"{tree}: {a.model} tg128 median {statistics.median(us):.1f} us a token ({min(us):.1f} .. {max(us):.1f}, "
              f"{len(us)} medians), {1e6 / statistics.median(us):.0f} tok/s")
        if a.trace:
            walls = {k: statistics.mean(r["trace"][k]["wall"] for r in rs) for k in rs[0]["trace"]}
            print("  traced, us a token: " + ", ".join(f"{k} {w:.1f}" for k, w in walls.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
