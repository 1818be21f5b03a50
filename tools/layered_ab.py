"""A/B of the layer-by-layer step (the 27B GGUF decode path) between source trees, or spec files, on this GPU
(tools/ab.py: a process per variant, the variants alternating): each process builds its tree's step for the model
on random quantized weights of the real shapes (lucegen's rendition of the mix) and times tg128 at each context as
`lucegen bench decode-gguf` does (bench/decode_gguf.py's tg_ms), and with --budgets the pass a greedy round of
speculative decoding makes over a DDTree of each budget (TreeVerifier.forward_argmax after a prompt of PROMPT random
tokens, its CUDA graph replayed: bench speculative's spec_verify_greedy_ms; the trees of bench speculative's noisy
oracle drafting a random continuation, so every variant verifies the same trees), `--medians` times each.

    python3 tools/layered_ab.py --trees /tmp/main . .@/tmp/h200-variant.yaml --rounds 2 [--contexts 512 8192]
    python3 tools/layered_ab.py --trees /tmp/main . --contexts --budgets 7 15 22   (the verify alone)

Prints one JSON line a process and a summary: each variant's median us a token per context, ms a verify per budget.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ab import alternate_or_report


PROMPT = 62          # tokens before a verify, as bench speculative's prompt
VERIFY_REPEAT = 20   # verifies a timing (their median)


def measure(model: str, mix: str, contexts: list[int], budgets: list[int], medians: int, spec_path: str | None) -> dict:
    import numpy as np

    import lucegen
    from lucegen.bench.decode_gguf import TG, WARMUP, tg_ms
    from lucegen.bench.speculative import DEPTH, sweep_draft
    from lucegen.bench.timing import host_median_ms
    from lucegen.engine.layered import LayeredEngine
    from lucegen.engine.layered_weights import RandomSource
    from lucegen.model.config import load_config
    from lucegen.spec import load_spec, spec_for_current_device
    from lucegen.spec_decode import build_tree

    spec = load_spec(spec_path) if spec_path else spec_for_current_device()
    cfg = load_config(model)
    context = max([c + 1 + WARMUP + TG for c in contexts] + [PROMPT + 2 + b + DEPTH for b in budgets])
    engine = LayeredEngine(RandomSource(cfg, mix), cfg, spec, max_context=context, chunk=1)
    out = {"tree": str(Path(lucegen.__file__).parents[1]), "spec": str(spec.path),
           "us_per_token": {str(c): [round(tg_ms(engine, c) * 1e3 / TG, 2) for _ in range(medians)]
                            for c in contexts}}
    if budgets:
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, PROMPT)]
        target = [int(t) for t in rng.integers(0, cfg.vocab_size, DEPTH + 1)]
        logprobs = sweep_draft(target, PROMPT, cfg.vocab_size)([*prompt, target[0]], DEPTH)
        verifier = engine.verifier()
        engine.reset()
        engine.prefill(prompt)
        out["verify_ms"] = {}
        for b in budgets:
            tree = build_tree(logprobs, b, root=target[0])
            verifier.forward_argmax(tree.tokens, tree.parents)  # the graph's capture
            out["verify_ms"][str(b)] = [
                round(host_median_ms(lambda: verifier.forward_argmax(tree.tokens, tree.parents), VERIFY_REPEAT), 4)
                for _ in range(medians)]
        verifier.free()
    engine.free()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="variants to compare: TREE or TREE@SPEC (default: .)")
    ap.add_argument("--model", default="qwen3.5-27b")
    ap.add_argument("--mix", default="q4_k_m")
    ap.add_argument("--contexts", type=int, nargs="*", default=[512], help="tg128 at each (none: no tg128)")
    ap.add_argument("--budgets", type=int, nargs="*", default=[], help="the greedy verify of a DDTree of each")
    ap.add_argument("--rounds", type=int, default=2, help="processes per variant, the variants alternating")
    ap.add_argument("--medians", type=int, default=3, help="timings per context (budget) and process")
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)  # the child's (TREE@SPEC)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.contexts and not a.budgets:
        ap.error("nothing to time: give --contexts, --budgets or both")
    if a.child:
        print(json.dumps(measure(a.model, a.mix, a.contexts, a.budgets, a.medians, a.spec)))
        return 0
    args = ["--model", a.model, "--mix", a.mix, "--contexts", *map(str, a.contexts), "--budgets", *map(str, a.budgets),
            "--medians", str(a.medians)]
    runs = alternate_or_report(__file__, a.trees, a.rounds, args)
    if runs is None:
        return 1
    for tree, rs in runs.items():
        for c in map(str, a.contexts):
            us = [u for r in rs for u in r["us_per_token"][c]]
            print(f"{tree}: {a.model} {a.mix} tg128 at {c}: median {statistics.median(us):.1f} us a token "
                  f"({min(us):.1f} .. {max(us):.1f}, {len(us)} timings), {1e6 / statistics.median(us):.1f} tok/s")
        for b in map(str, a.budgets):
            ms = [m for r in rs for m in r["verify_ms"][b]]
            print(f"{tree}: {a.model} {a.mix} greedy verify, budget {b}: median {statistics.median(ms):.3f} ms "
                  f"({min(ms):.3f} .. {max(ms):.3f}, {len(ms)} timings)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
