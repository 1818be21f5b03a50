"""Where the layer-by-layer step's time goes inside its graph: tg128 at one context (bench/decode_gguf.py's tg_ms)
with kinds of launches left out of the captured step, in one process on this GPU. What a kind saves is what it
costs in the graph, overlaps with its neighbours included (bench decode-gguf's kernel-by-kernel times run each
kernel alone). Left-out kernels leave their outputs stale, so the tokens mean nothing; what remains runs at the
speed it would, since no kernel's time depends on the values it reads.

    python3 tools/step_leave_out.py [--model qwen3.5-27b] [--context 512] [--kinds rows deltanet q6_k ...]

Kinds: rows (add + RMSNorm, SiLU x up), deltanet (the linear layers' mixer), attention (the full layers' mixer),
lm_head (the LM head's projection), a weight format (q4_k, q6_k, ...: every projection part in it, the LM head's
included), a format and row length (q4_k:17408: the parts in that format whose rows hold that many values, the
ffn_down of Q4_K here), all (every one of those); kinds joined by + go out together (rows+deltanet+attention: the
projections alone remain). Prints one JSON line a kind: the median us a token and what leaving it out saved against the whole
step, which is timed before the kinds and again after them (the two show the machine's drift).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys

KINDS = ("rows", "deltanet", "attention", "lm_head")


def _noop(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def leaving_out(engine, kinds: set[str]):
    """The engine's step with `kinds` left out of what it captures (instance attributes over its launchers; its
    graphs dropped before and after)."""
    step = engine.step
    everything, mm = "all" in kinds, step.mm
    gone = {key for key in mm if everything or key[0] in kinds or f"{key[0]}:{key[1]}" in kinds}
    step.drop(step)
    if everything or "rows" in kinds:
        step.kernels.add_rmsnorm = step.kernels.silu_mul = _noop
    if everything or "deltanet" in kinds:
        step.mixer.linear = _noop
    if everything or "attention" in kinds:
        step.mixer.full = _noop
    step.mm = {key: (_noop if key in gone else op) for key, op in mm.items()}
    if everything or "lm_head" in kinds:
        project = type(step).project.__get__(step)
        step.project = lambda P, *a, **k: None if P is step.weights.lm_head else project(P, *a, **k)
    try:
        yield
    finally:
        step.drop(step)
        for obj, names in ((step.kernels, ("add_rmsnorm", "silu_mul")), (step.mixer, ("linear", "full")),
                           (step, ("project",))):
            for name in names:
                vars(obj).pop(name, None)
        step.mm = mm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-27b")
    ap.add_argument("--mix", default="q4_k_m")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--medians", type=int, default=3, help="tg128 timings a kind")
    ap.add_argument("--kinds", nargs="+", default=None,
                    help=f"kinds to leave out, one at a time (default: {', '.join(KINDS)}, each weight format, all)")
    a = ap.parse_args()

    from lucegen.bench.decode_gguf import TG, WARMUP, tg_ms
    from lucegen.engine.layered import LayeredEngine
    from lucegen.engine.layered_weights import RandomSource
    from lucegen.model.config import load_config
    from lucegen.spec import spec_for_current_device

    cfg = load_config(a.model)
    engine = LayeredEngine(RandomSource(cfg, a.mix), cfg, spec_for_current_device(),
                           max_context=a.context + 1 + WARMUP + TG, chunk=1)
    formats = sorted({fmt for fmt, _ in engine.step.mm})
    shapes = sorted(f"{fmt}:{k}" for fmt, k in engine.step.mm)
    kinds = a.kinds or [*KINDS, *formats, "all"]
    unknown = {k for kind in kinds for k in kind.split("+")} - {*KINDS, *formats, *shapes, "all"}
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)} (this model's step has "
                 f"{', '.join([*KINDS, *formats, *shapes, 'all'])})")
    us = lambda: statistics.median(tg_ms(engine, a.context) * 1e3 / TG for _ in range(a.medians))
    whole = us()
    print(json.dumps({"left_out": None, "us_per_token": round(whole, 1)}))
    for kind in kinds:
        with leaving_out(engine, set(kind.split("+"))):
            t = us()
        print(json.dumps({"left_out": kind, "us_per_token": round(t, 1), "saved_us": round(whole - t, 1)}))
    print(json.dumps({"left_out": None, "us_per_token": round(us(), 1), "after": True}))
    engine.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
