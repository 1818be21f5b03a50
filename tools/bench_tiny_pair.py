#!/usr/bin/env python3
"""Speculative decoding with the shipped tiny pair, measured with lucegen's own engine (numpy backend on the CPU,
or the cuda backend: the decode megakernel, trees verified node by node through it).

    python3 tools/bench_tiny_pair.py [--backend numpy|cuda] [--prompts 6] [--tokens 48] [--budget 22]
                                     [--model DIR --draft DIR]

On held-out code prompts (tools/pycode_corpus.held_out_prompts) it generates greedily, ignoring EOS, with:
    ar       plain decoding, one target pass per token
    chain    DFlash, the draft's top-1 chain of block_size - 1 tokens verified in one pass
    ddtree   DFlash + DDTree, a best-first tree of --budget nodes verified in one pass
    random   ddtree with a random draft of the same shape (the floor a trained draft must beat)
and prints per prompt and in total: tokens per target pass (the accepted length τ, bonus included), decode time
and speedup over ar (wall clock of the numpy reference, which reruns the target over the context for the
draft's features every round; on cuda, one decode launch per tree node), and whether each mode's tokens equal
ar's (they must: greedy is lossless). The totals go to results/cpu-numpy.jsonl, or results/<gpu>.jsonl on cuda
(lucegen.bench.results.Recorder). Exit status 1 if any output differs.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lucegen.bench.results import Recorder  # noqa: E402
from lucegen.engine import SamplingParams, generate, load_model  # noqa: E402
from lucegen.engine.loader import DEFAULT_DRAFT, DEFAULT_MODEL_DIR, DEFAULT_TARGET  # noqa: E402
from lucegen.model.draft import load_draft, write_draft  # noqa: E402
from lucegen.reference.dflash import random_draft_weights  # noqa: E402
from lucegen.runtime import device_info  # noqa: E402
from pycode_corpus import held_out_prompts  # noqa: E402

MODES = ("ar", "chain", "ddtree", "random")
GREEDY = SamplingParams(temperature=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numpy", choices=["numpy", "cuda"])
    ap.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=22, help="DDTree nodes per target pass")
    ap.add_argument("--results", type=Path, default=None, help="JSONL file (default results/cpu-numpy.jsonl, or "
                                                                 "results/<gpu>.jsonl on cuda)")
    args = ap.parse_args()
    name = f"{DEFAULT_MODEL_DIR.name if args.model == DEFAULT_TARGET else args.model.name} {args.backend}"
    ar, tokenizer = load_model(args.model, args.backend)
    draft_cfg, _ = load_draft(args.draft, ar.config)
    with tempfile.TemporaryDirectory() as tmp:
        random_draft = write_draft(Path(tmp), draft_cfg, random_draft_weights(draft_cfg, seed=0))
        engines = {"ar": ar,
                   "chain": load_model(args.model, args.backend, draft=args.draft, chain=True,
                                       budget=draft_cfg.block_size - 1)[0],
                   "ddtree": load_model(args.model, args.backend, draft=args.draft, budget=args.budget)[0],
                   "random": load_model(args.model, args.backend, draft=random_draft, budget=args.budget)[0]}
    rec = Recorder(gpu="cpu-numpy" if args.backend == "numpy" else device_info().name, out=args.results,
                   command="python3 tools/bench_tiny_pair.py " + shlex.join(sys.argv[1:]))
    totals = {m: {"tokens": 0, "passes": 0, "seconds": 0.0, "equal": True} for m in MODES}
    print(f"{'prompt':<34}" + "".join(f"{m + ' tok/pass':>17}{m + ' s':>10}" for m in MODES))
    for rel, prompt in held_out_prompts(args.prompts):
        ids = tokenizer.encode(prompt)
        runs = {m: generate(e, tokenizer, ids, args.tokens, GREEDY, ignore_eos=True) for m, e in engines.items()}
        row = f"{rel[-33:]:<34}"
        for m, g in runs.items():
            t = totals[m]
            t["tokens"] += g.completion_tokens - 1
            t["passes"] += g.target_passes
            t["seconds"] += g.decode_seconds
            t["equal"] &= g.token_ids == runs["ar"].token_ids
            row += f"{g.tokens_per_pass:>17.2f}{g.decode_seconds:>10.2f}" + ("" if t["equal"] else " DIFFERS")
        print(row, flush=True)
    ar_t = totals["ar"]
    common = {"prompts": args.prompts, "tokens": args.tokens, "draft": str(args.draft)}
    rec.record("ar_decode_tok_s", name, ar_t["tokens"] / ar_t["seconds"], "tok/s", **common)
    for m in MODES[1:]:
        t = totals[m]
        extra = {**common, "mode": m, "budget": args.budget if m != "chain" else draft_cfg.block_size - 1}
        rec.record(f"spec_tokens_per_pass_{m}", name, t["tokens"] / t["passes"], "tok/pass", **extra)
        rec.record(f"spec_speedup_{m}", name, ar_t["seconds"] / t["seconds"], "x", **extra)
        rec.record(f"spec_greedy_equal_{m}", name, float(t["equal"]), "bool", **extra)
    print(f"results appended to {rec.out}")
    return 0 if all(t["equal"] for t in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
