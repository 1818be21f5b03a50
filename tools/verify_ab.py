"""A/B of the tree verify (the 27B GGUF target's layer-by-layer pass over a DDTree) between source trees, or spec
files, on this GPU (tools/ab.py: a process per variant, the variants alternating): each process builds its tree's
layered engine on random quantized weights of the real shapes, prefills a prompt of random tokens and times the
pass a greedy round makes (TreeVerifier.forward_argmax, its CUDA graph replayed; bench speculative's
spec_verify_greedy_ms) over a tree of each budget, `--medians` times. The trees come from the noisy oracle of
bench speculative's budget sweep, drafting a random continuation, so every variant verifies the same trees.

    python3 tools/verify_ab.py --trees /tmp/main . .@/tmp/h200-variant.yaml --rounds 2 [--budgets 7 15 22]

Prints one JSON line a process and a summary: each variant's median ms a verify per budget.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ab import alternate_or_report

PROMPT = 62  # tokens, as bench speculative's prompt
REPEAT = 20  # verifies a timing (their median)


def measure(model: str, mix: str, budgets: list[int], medians: int, spec_path: str | None) -> dict:
    import numpy as np

    import lucegen
    from lucegen.bench.speculative import DEPTH, sweep_draft
    from lucegen.bench.timing import host_median_ms
    from lucegen.engine.layered import LayeredEngine
    from lucegen.engine.layered_weights import RandomSource
    from lucegen.model.config import load_config
    from lucegen.spec import load_spec, spec_for_current_device
    from lucegen.spec_decode import build_tree

    spec = load_spec(spec_path) if spec_path else spec_for_current_device()
    cfg = load_config(model)
    engine = LayeredEngine(RandomSource(cfg, mix), cfg, spec, max_context=PROMPT + 2 + max(budgets) + DEPTH,
                           chunk=1)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, PROMPT)]
    target = [int(t) for t in rng.integers(0, cfg.vocab_size, DEPTH + 1)]
    context = [*prompt, target[0]]
    logprobs = sweep_draft(target, PROMPT, cfg.vocab_size)(context, DEPTH)
    verifier = engine.verifier()
    engine.prefill(prompt)
    ms = {}
    for b in budgets:
        tree = build_tree(logprobs, b, root=context[-1])
        verifier.forward_argmax(tree.tokens, tree.parents)  # the graph's capture
        ms[str(b)] = [round(host_median_ms(lambda: verifier.forward_argmax(tree.tokens, tree.parents), REPEAT), 4)
                      for _ in range(medians)]
    verifier.free()
    engine.free()
    return {"tree": str(Path(lucegen.__file__).parents[1]), "spec": str(spec.path), "ms": ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="variants to compare: TREE or TREE@SPEC (default: .)")
    ap.add_argument("--model", default="qwen3.5-27b")
    ap.add_argument("--mix", default="q4_k_m")
    ap.add_argument("--budgets", type=int, nargs="+", default=[7, 15, 22])
    ap.add_argument("--rounds", type=int, default=2, help="processes per variant, the variants alternating")
    ap.add_argument("--medians", type=int, default=3, help="timings per budget and process")
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)  # the child's (TREE@SPEC)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.model, a.mix, a.budgets, a.medians, a.spec)))
        return 0
    args = ["--model", a.model, "--mix", a.mix, "--budgets", *map(str, a.budgets), "--medians", str(a.medians)]
    runs = alternate_or_report(__file__, a.trees, a.rounds, args)
    if runs is None:
        return 1
    for tree, rs in runs.items():
        for b in map(str, a.budgets):
            ms = [m for r in rs for m in r["ms"][b]]
            print(f"{tree}: {a.model} {a.mix} greedy verify, budget {b}: median {statistics.median(ms):.3f} ms "
                  f"({min(ms):.3f} .. {max(ms):.3f}, {len(ms)} timings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
