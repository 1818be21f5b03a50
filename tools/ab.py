"""The A/B tools' driver (tools/prefill_ab.py, tools/decode_ab.py): a measurement in a process of its own per source
tree (PYTHONPATH = the tree, so each process imports that tree's lucegen and renders its templates), the trees
alternating round after round, so that a drift of the GPU's clocks or temperature falls on every tree alike.

A tree is a checkout (or an unpacked `git archive`) with lucegen/, templates/ and specs/; `TREE@SPEC` is that tree
with another spec file (its child gets `--spec SPEC`: tuning knobs side by side without copying trees). The child is
the calling script run again with `--child` and the same arguments; it prints its result as one JSON line, last."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def alternate(script: str, trees: list[str], rounds: int, args: list[str]) -> dict[str, list[dict]]:
    """{tree: [the child's JSON result, a round each]}; each result line is printed as it comes. A child that fails
    stops the run (RuntimeError with the end of its stderr)."""
    results: dict[str, list[dict]] = {}
    for _ in range(rounds):
        for tree in trees:
            path, _, spec = tree.partition("@")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(path).resolve()),
                                                                              os.environ.get("PYTHONPATH")]))}
            proc = subprocess.run([sys.executable, script, "--child", *args, *(["--spec", spec] if spec else [])],
                                  env=env, capture_output=True, text=True, check=False)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode or not lines:
                raise RuntimeError(f"{tree}: the measurement failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
            print(lines[-1], flush=True)
            results.setdefault(tree, []).append(json.loads(lines[-1]))
    return results


def alternate_or_report(script: str, trees: list[str], rounds: int, args: list[str]) -> dict[str, list[dict]] | None:
    """alternate(), or None once a child has failed, what it said printed to stderr (the tools then exit 1)."""
    try:
        return alternate(script, trees, rounds, args)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return None
