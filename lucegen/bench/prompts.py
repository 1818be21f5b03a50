"""The prompt-set runner: HumanEval, GSM8K or MATH-500 prompts (lucegen/bench/data) through one decoding mode.

    lucegen bench prompts --set humaneval|gsm8k|math500 --model M [--draft D] --mode ar|chain|ddtree

Each prompt goes through the model's chat template and is generated greedily (stopping at EOS or its max_tokens,
capped by --tokens). Modes: ar (autoregressive), chain (the draft's top-1 chain verified each target pass) and
ddtree (DDTree trees of --budget nodes); chain and ddtree need a DFlash draft and also run ar on every prompt, to
report the speedup and whether the output is the same token for token (greedy_equal: it must be). Records, per set
and mode: <set>_<mode>_tok_s (output tokens over decode seconds, summed over the prompts; limit: the accepted
length x the ar rate, a target pass costing one decode step) and <set>_<mode>_accepted_length (output tokens
after the first per target pass).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..engine.generate import Generation, generate
from ..engine.sampling import SamplingParams
from .engines import open_engine
from .results import Recorder

DATA = Path(__file__).resolve().parent / "data"
SETS = {"humaneval": "he-10.jsonl", "gsm8k": "gsm-10.jsonl", "math500": "math-10.jsonl"}
MODES = ("ar", "chain", "ddtree")
GREEDY = SamplingParams(temperature=0)


def load_set(name: str) -> list[dict]:
    """The prompts of a set: dicts with at least id, messages and max_tokens."""
    if name not in SETS:
        raise ValueError(f"unknown prompt set {name!r} (known: {', '.join(SETS)})")
    path = DATA / SETS[name]
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        p = json.loads(line)
        missing = {"id", "messages", "max_tokens"} - set(p)
        if missing:
            raise ValueError(f"{path}:{n}: missing {', '.join(sorted(missing))}")
        prompts.append(p)
    return prompts


@dataclass
class Totals:
    """Sums over the prompts of one mode."""
    tokens: int = 0  # output tokens after the first (the decode phase)
    seconds: float = 0.0  # decode seconds
    passes: int = 0  # target passes after the prefill

    def add(self, g: Generation) -> None:
        self.tokens += g.completion_tokens - 1
        self.seconds += g.decode_seconds
        self.passes += g.target_passes

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accepted_length(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0


def run(rec: Recorder, set_name: str, model: str, mode: str = "ar", backend: str = "numpy",
        draft: str | None = None, budget: int | None = None, limit: int | None = None,
        max_tokens: int | None = None) -> dict[str, Totals]:
    """Run the set; returns the totals by mode ("ar", and `mode` when it is not ar)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    if (mode == "ar") != (draft is None):
        raise ValueError(f"--mode {mode} {'needs' if draft is None else 'takes no'} --draft")
    prompts = load_set(set_name)[:limit]
    engine, tokenizer, name = open_engine(model, backend, draft=draft, budget=budget, chain=mode == "chain")
    speculation = getattr(engine, "speculation", None)
    totals = {m: Totals() for m in {"ar", mode}}
    equal = 0
    print(f"{set_name}: {len(prompts)} prompts, {name}, mode {mode}"
          + (f" (budget {speculation.budget})" if speculation and not speculation.chain else ""))
    print(f"  {'prompt':<10} {'in':>5} {'out':>5} {'ar tok/s':>9} " + (
        f"{mode + ' tok/s':>12} {'accepted':>8} {'same':>5}" if mode != "ar" else ""))
    for p in prompts:
        ids = tokenizer.encode(tokenizer.apply_chat_template(p["messages"]))
        n = min(p["max_tokens"], max_tokens or p["max_tokens"], engine.max_context - len(ids))
        if speculation:
            engine.speculation = None
        ar = generate(engine, tokenizer, ids, n, GREEDY)
        totals["ar"].add(ar)
        line = f"  {p['id']:<10} {len(ids):>5} {ar.completion_tokens:>5} {ar.decode_tps:>9.1f}"
        if speculation:
            engine.speculation = speculation
            g = generate(engine, tokenizer, ids, n, GREEDY)
            totals[mode].add(g)
            equal += g.token_ids == ar.token_ids
            same = "yes" if g.token_ids == ar.token_ids else "NO"
            line += f" {g.decode_tps:>12.1f} {g.tokens_per_pass:>8.2f} {same:>5}"
        print(line)
    ar = totals["ar"]
    model_name = f"{name} {set_name}"
    rec.record(f"{set_name}_ar_tok_s", model_name, ar.tok_s, "tok/s", None, prompts=len(prompts), tokens=ar.tokens)
    if mode != "ar":
        t = totals[mode]
        extra = dict(prompts=len(prompts), tokens=t.tokens, greedy_equal=round(equal / len(prompts), 3),
                     speedup=round(t.tok_s / ar.tok_s, 3) if ar.tok_s else None, draft=str(draft),
                     budget=speculation.budget, ar_tok_s=round(ar.tok_s, 3))
        rec.record(f"{set_name}_{mode}_tok_s", model_name, t.tok_s, "tok/s", t.accepted_length * ar.tok_s,
                   accepted_length=round(t.accepted_length, 3), **extra)
        rec.record(f"{set_name}_{mode}_accepted_length", model_name, t.accepted_length, "tokens/pass", None, **extra)
        if equal < len(prompts):
            print(f"  {len(prompts) - equal} of {len(prompts)} outputs differ from ar: speculative decoding must be "
                  f"lossless")
    return totals
