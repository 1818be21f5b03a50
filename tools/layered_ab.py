"""A/B of the layer-by-layer step (the 27B GGUF decode path) between source trees, or spec files, on this GPU
(tools/ab.py: a process per variant, the variants alternating): each process builds its tree's step for the model
on random quantized weights of the real shapes (lucegen's rendition of the mix) and times tg128 at each context as
`lucegen bench decode-gguf` does (bench/decode_gguf.py's tg_ms), `--medians` times.

    python3 tools/layered_ab.py --trees /tmp/main . .@/tmp/h200-variant.yaml --rounds 2 [--contexts 512 8192]

Prints one JSON line a process and a summary: each variant's median us a token per context.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ab import alternate_or_report


def measure(model: str, mix: str, contexts: list[int], medians: int, spec_path: str | None) -> dict:
    import lucegen
    from lucegen.bench.decode_gguf import TG, WARMUP, tg_ms
    from lucegen.engine.layered import LayeredEngine
    from lucegen.engine.layered_weights import RandomSource
    from lucegen.model.config import load_config
    from lucegen.spec import load_spec, spec_for_current_device

    spec = load_spec(spec_path) if spec_path else spec_for_current_device()
    cfg = load_config(model)
    engine = LayeredEngine(RandomSource(cfg, mix), cfg, spec, max_context=max(contexts) + 1 + WARMUP + TG, chunk=1)
    out = {"tree": str(Path(lucegen.__file__).parents[1]), "spec": str(spec.path),
           "us_per_token": {str(c): [round(tg_ms(engine, c) * 1e3 / TG, 2) for _ in range(medians)]
                            for c in contexts}}
    engine.free()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="variants to compare: TREE or TREE@SPEC (default: .)")
    ap.add_argument("--model", default="qwen3.5-27b")
    ap.add_argument("--mix", default="q4_k_m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512])
    ap.add_argument("--rounds", type=int, default=2, help="processes per variant, the variants alternating")
    ap.add_argument("--medians", type=int, default=3, help="tg128 timings per context and process")
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)  # the child's (TREE@SPEC)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.model, a.mix, a.contexts, a.medians, a.spec)))
        return 0
    args = ["--model", a.model, "--mix", a.mix, "--contexts", *map(str, a.contexts), "--medians", str(a.medians)]
    runs = alternate_or_report(__file__, a.trees, a.rounds, args)
    if runs is None:
        return 1
    for tree, rs in runs.items():
        for c in map(str, a.contexts):
            us = [u for r in rs for u in r["us_per_token"][c]]
            print(f"{tree}: {a.model} {a.mix} tg128 at {c}: median {statistics.median(us):.1f} us a token "
                  f"({min(us):.1f} .. {max(us):.1f}, {len(us)} timings), {1e6 / statistics.median(us):.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
