"""The logits error each KV-cache format gives the numpy reference forward, against bf16 KV.

    python tools/kv_error.py qwen3.5-0.8b                 # random weights of a bundled config (no checkpoint needed)
    python tools/kv_error.py path/to/checkpoint --prompt 256 --decode 32
    python tools/kv_error.py qwen3.5-0.8b --prompt 512 --decode 32 --results results/cpu-numpy.jsonl

A teacher-forced run: prefill `--prompt` tokens, then decode `--decode` more one at a time, once per KV format and
once with bf16 KV; the logits after the prompt and after each decoded token are compared (lucegen.model.kvformats).
With a checkpoint folder the tokens come from its tokenizer over --text; otherwise they are random ids. --results
appends one record per format (kv_logits_rel_error, on the numpy reference: gpu "cpu-numpy").
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lucegen.model import kvformats  # noqa: E402
from lucegen.model.config import load_config  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. " * 64)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a bundled model name or config.json (random weights), or a checkpoint folder / .gguf")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=TEXT)
    p.add_argument("--results", type=Path, default=None, help="append the errors to this results file (jsonl)")
    args = p.parse_args()
    n = args.prompt + args.decode
    source = Path(args.model)
    if source.exists() and (source.suffix == ".gguf" or (source / "config.json").exists()):
        from lucegen.model.tokenizer import Tokenizer
        from lucegen.model.weights import open_weights
        weights = open_weights(source).load_all()
        cfg = load_config(source)
        if source.is_dir():
            tokens = list(Tokenizer.from_dir(source).encode(args.text))[:n]
        else:  # a GGUF: lucegen reads no tokenizer from it
            tokens = list(np.random.default_rng(args.seed).integers(0, cfg.vocab_size, n))
        what = f"checkpoint {source}"
    else:
        from lucegen.reference.weights import random_weights
        cfg = load_config(args.model)
        weights = random_weights(cfg, args.seed)
        tokens = list(np.random.default_rng(args.seed).integers(0, cfg.vocab_size, n))
        what = f"random weights of {cfg.name} (seed {args.seed})"
    if len(tokens) < n:
        raise SystemExit(f"only {len(tokens)} tokens; lower --prompt / --decode or give a longer --text")
    t0 = time.perf_counter()
    errors = kvformats.logits_error(weights, cfg, tokens, args.prompt)
    print(f"{what}: {args.prompt} prompt + {args.decode} decoded tokens, logits vs bf16 KV "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"{'format':<7} {'bits/value':>10} {'rel. error':>11} {'top-1 agree':>12} {'max |diff|':>11}")
    for e in errors:
        print(f"{e.fmt:<7} {8 * kvformats.BYTES_PER_VALUE[e.fmt]:10.2f} {e.rel_error:11.2e} {e.top1_agree:12.1%} "
              f"{e.max_abs:11.3g}")
    if args.results is not None:
        from lucegen.bench.results import Recorder
        rec = Recorder(gpu="cpu-numpy", out=args.results, command="python3 tools/kv_error.py " + " ".join(sys.argv[1:]))
        model = f"{cfg.name}{' random' if what.startswith('random') else ''} prompt={args.prompt} decode={args.decode}"
        for e in errors:
            rec.record("kv_logits_rel_error", f"{model} kv={e.fmt}", e.rel_error, "rel", top1_agree=e.top1_agree,
                       max_abs=e.max_abs, bits_per_value=8 * kvformats.BYTES_PER_VALUE[e.fmt], against="bf16 KV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
