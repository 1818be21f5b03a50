"""`lucegen tune`: the DDTree budget (a spec's tuning.ddtree.budget) measured on this machine, written into the spec.

    lucegen tune --spec h200 [--model M] [--draft D] [--backend cuda|numpy] [--budgets 2 4 7 8 ...] [--write]

For each budget the engine can verify (bench.speculative.fitting), greedy speculative decoding of a few short code
prompts, each run right after a plain one (bench.speculative.against_autoregressive): tok/s and accepted length
summed over the prompts, the speedup over the plain runs, and whether every output is plain decoding's (it must be:
a difference fails the command and nothing is written). The draft is the DFlash draft given with --draft, else the
budget sweep's noisy oracle of the target's own greedy output (bench.speculative.sweep_draft; its acceptance is not a
real draft's). The best budget is the one of highest tok/s (a tie: the smaller). --write puts it on the `budget:`
line under tuning.ddtree of the spec file, every other byte kept, with a comment saying what was measured; the spec
is then loaded again, and the file restored if that fails.
"""
from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .bench.speculative import BUDGETS as SWEEP_BUDGETS
from .bench.speculative import (DEPTH, GREEDY, PROMPT, SWEEP_ACCURACY, SWEEP_DRAFT, Paired, against_autoregressive,
                                fitting, sweep_draft)
from .kernels.qgemv import XGROUP
from .spec import ChipSpec, SpecError, load_spec, match_device
from .spec_decode import Speculation

PROMPTS = (PROMPT,
           "def parse(self, text):\n",
           "class Queue:\n    \"\"\"A first-in, first-out queue.\"\"\"\n\n    def __init__(self):\n",
           "import os\n\n\ndef walk(top):\n",
           "for i, line in enumerate(lines):\n",
           "    def __repr__(self):\n        return ")
# All six prompts of 96 tokens by default: on 3 x 64 the sweep picked budget 15 on an H100 where 6 x 96 picked 7 (373.1
# tok/s against 332.4 for 15; session 49 runs 4-5): too few rounds to tell budgets apart
N_PROMPTS = len(PROMPTS)
TUNE_TOKENS = 96
BUDGETS = tuple(sorted({*SWEEP_BUDGETS, *(XGROUP * i - 1 for i in (1, 2, 3, 4, 8))}))  # 2 4 7 8 15 16 23 31 32 63 64
KEY = ("tuning", "ddtree", "budget")


class TuneError(ValueError):
    """Options the tuner cannot run with; the message names the option or the file."""


@dataclass(frozen=True)
class Measurement:
    """One budget over the prompts: output tokens after the first per decode second (with the draft, and in the
    plain runs beside), per target pass, and the prompts (by index) whose output differs from plain decoding."""
    budget: int
    tok_s: float
    ar_tok_s: float
    accepted_length: float
    differs: tuple[int, ...] = ()

    @property
    def nodes(self) -> int:
        """Tree nodes a target pass verifies at most: the budget and the root."""
        return self.budget + 1

    @property
    def speedup(self) -> float:
        return self.tok_s / self.ar_tok_s if self.ar_tok_s else 0.0


Measure = Callable[[int], Measurement]


def summed(budget: int, runs: Sequence[Paired]) -> Measurement:
    """A Measurement from the paired runs of each prompt: the median run with the draft of each, the plain rate of
    each (tokens over seconds summed over the prompts, so a longer run weighs more)."""
    steps = [r.median.completion_tokens - 1 for r in runs]
    ar_seconds = sum(n / r.ar_tok_s for n, r in zip(steps, runs) if r.ar_tok_s)
    seconds, passes = sum(r.median.decode_seconds for r in runs), sum(r.median.target_passes for r in runs)
    return Measurement(budget, sum(steps) / seconds if seconds else 0.0, sum(steps) / ar_seconds if ar_seconds else 0.0,
                       sum(steps) / passes if passes else 0.0,
                       tuple(i for i, r in enumerate(runs) if not r.greedy_equal))


def measurer(engine, tokenizer, prompts: Sequence[str], tokens: int, repeat: int = 1) -> Measure:
    """measure(budget) on the engine: with its DFlash draft (engine.speculation, as load_model(draft=...) sets it)
    trees of that budget, else the sweep's oracle of each prompt's greedy output."""
    from .engine.generate import check_request, generate
    real = getattr(engine, "speculation", None)
    engine.speculation = None
    ids = [tokenizer.encode(p) for p in prompts]
    for i in ids:
        check_request(engine, i, tokens)  # a ValueError naming the prompt's and the context's sizes
    gens = [lambda i=i: generate(engine, tokenizer, i, tokens, GREEDY, ignore_eos=True) for i in ids]
    targets = None if real else [gen().token_ids for gen in gens]

    def speculation(n: int, budget: int) -> Speculation:
        if real:
            return replace(real, budget=budget, chain=False)
        return Speculation(sweep_draft(targets[n], len(ids[n]), engine.config.vocab_size), DEPTH, budget)

    def measure(budget: int) -> Measurement:
        return summed(budget, [against_autoregressive(engine, gen, speculation(n, budget), repeat)
                               for n, gen in enumerate(gens)])
    return measure


HEADER = f"  {'budget':>6} {'nodes':>5} {'accepted':>8} {'tok/s':>10} {'ar tok/s':>10} {'speedup':>7}  same as plain"


def row(m: Measurement) -> str:
    same = "yes" if not m.differs else "NO: prompt " + ", ".join(str(i) for i in m.differs)
    return (f"  {m.budget:>6} {m.nodes:>5} {m.accepted_length:>8.2f} {m.tok_s:>10.1f} {m.ar_tok_s:>10.1f} "
            f"{m.speedup:>6.2f}x  {same}")


def sweep(budgets: Sequence[int], measure: Measure) -> list[Measurement]:
    """measure(b) for each budget, a table row printed as each comes."""
    print(HEADER)
    out = []
    for b in budgets:
        out.append(measure(b))
        print(row(out[-1]), flush=True)
    return out


def best(measurements: Sequence[Measurement]) -> Measurement:
    """The measurement of highest tok/s; of equal ones, the first (the smallest budget in a sweep)."""
    return max(measurements, key=lambda m: m.tok_s)


# ---- the spec file -------------------------------------------------------------------------------------------

_KEY_LINE = re.compile(r"^(\s*)([A-Za-z_][\w-]*)\s*:(.*)$")


def budget_line(lines: Sequence[str], source: str) -> int:
    """The index of the one `budget:` line under tuning.ddtree (block mappings, by indentation)."""
    stack: list[tuple[int, str]] = []
    found = []
    for n, line in enumerate(lines):
        m = _KEY_LINE.match(line.rstrip("\r\n"))
        if not m or line.lstrip().startswith("#"):
            continue
        indent = len(m.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, m.group(2)))
        if tuple(k for _, k in stack) == KEY:
            found.append(n)
    if len(found) != 1:
        raise TuneError(f"{source}: {'no' if not found else len(found)} `budget:` lines under tuning.ddtree; "
                        f"the tuner rewrites exactly one")
    return found[0]


def with_budget(text: str, budget: int, comment: str, source: str = "spec") -> str:
    """`text` with the budget line under tuning.ddtree set to `budget` and `# comment` after it; every other line,
    and that line's indentation and line ending, as they were."""
    lines = text.splitlines(keepends=True)
    n = budget_line(lines, source)
    line = lines[n]
    body = line.rstrip("\r\n")
    indent = body[:len(body) - len(body.lstrip())]
    lines[n] = f"{indent}budget: {budget}  # {comment}{line[len(body):]}"
    return "".join(lines)


def write_budget(path: Path, budget: int, comment: str) -> ChipSpec:
    """Rewrite the spec file's budget line in place and load the file again; if that fails (or reads another
    budget), the original bytes go back and a SpecError says why."""
    original = path.read_bytes()
    updated = with_budget(original.decode(), budget, comment, str(path)).encode()
    try:
        path.write_bytes(updated)
    except OSError as e:
        raise TuneError(f"{path}: cannot write: {e}") from None
    try:
        spec = load_spec(path)
        if spec.tuning.ddtree.budget != budget:
            raise SpecError(f"{path}: tuning.ddtree.budget reads {spec.tuning.ddtree.budget} after writing {budget}")
    except SpecError as e:
        path.write_bytes(original)
        raise SpecError(f"{e} (budget {budget} not written: {path} restored)") from None
    return spec


# ---- the command ---------------------------------------------------------------------------------------------

def tune(spec: str, model: str, backend: str = "cuda", draft: str | None = None, budgets: Sequence[int] = BUDGETS,
         tokens: int = TUNE_TOKENS, prompts: int = N_PROMPTS, repeat: int = 1, write: bool = False,
         measure: Measure | None = None) -> int:
    """The sweep on this machine (measure: instead of measuring, for tests), its table and best budget, that budget
    written into the spec with `write`. Returns 0, or 1 when an output differed from plain decoding (nothing
    written). Bad options raise ValueError (TuneError, SpecError, the loader's errors) naming what was wrong."""
    from .bench.engines import bench_device, open_engine
    chip = load_spec(spec)
    if not budgets or min(budgets) < 1:
        raise TuneError(f"--budgets {' '.join(map(str, budgets))}: each budget must be at least 1 (tree nodes below "
                        f"the root)")
    if tokens < 2:
        raise TuneError(f"--tokens {tokens}: at least 2 (the first output token comes from the prefill)")
    if not 1 <= prompts <= len(PROMPTS):
        raise TuneError(f"--prompts {prompts}: between 1 and {len(PROMPTS)}")
    if repeat < 1:
        raise TuneError(f"--repeat {repeat}: at least 1")
    engine, tokenizer, name = open_engine(model, backend, draft=draft,
                                          **({"spec": str(chip.path)} if backend == "cuda" else {}))
    device = bench_device(backend)
    print(f"lucegen tune: spec {chip.name} ({chip.path}, budget {chip.tuning.ddtree.budget} now), {name} on "
          f"{device}, {tokens} tokens x {prompts} prompts, greedy")
    if backend == "cuda":
        _check_device(chip)
    if not hasattr(engine, "speculate"):
        raise TuneError(f"the {backend} engine of {model} has no speculative decoding (speculate())")
    print(f"draft: DFlash {draft}" if draft else f"draft: {SWEEP_DRAFT} (no --draft given: an oracle of the "
          f"target's own greedy output; its acceptance is not a real draft's)")
    fit = fitting(engine, sorted(set(budgets)))
    if not fit:
        raise TuneError(f"no budget of {' '.join(map(str, budgets))} fits: the engine verifies trees of at most "
                        f"{engine.max_tree_nodes} nodes (the budget + the root)")
    results = sweep(fit, measure or measurer(engine, tokenizer, PROMPTS[:prompts], tokens, repeat))
    bad = [m for m in results if m.differs]
    if bad:
        print(f"lucegen tune: output differs from plain decoding at budget {', '.join(str(m.budget) for m in bad)}: "
              f"speculative decoding must be lossless; nothing written", file=sys.stderr)
        return 1
    top = best(results)
    print(f"best budget: {top.budget} ({top.tok_s:.1f} tok/s, {top.speedup:.2f}x autoregressive, accepted length "
          f"{top.accepted_length:.2f})")
    if not write:
        print(f"(--write puts it into {chip.path})")
        return 0
    kind = f"DFlash draft {draft}" if draft else f"oracle draft, accuracy {SWEEP_ACCURACY}"
    comment = (f"lucegen tune {time.strftime('%Y-%m-%d')} on {device}: {top.tok_s:.1f} tok/s, "
               f"{top.speedup:.2f}x autoregressive ({name}, {kind})")
    write_budget(chip.path, top.budget, comment)
    print(f"{chip.path}: tuning.ddtree.budget {chip.tuning.ddtree.budget} -> {top.budget}")
    if chip.tuning.ddtree.max_budget is None and top.budget < chip.tuning.ddtree.capacity:
        print(f"note: the engines now verify trees of at most {top.budget} nodes below the root; to keep larger ones "
              f"(another sweep, --budget), set tuning.ddtree.max_budget: {chip.tuning.ddtree.capacity}")
    return 0


def _check_device(chip: ChipSpec) -> None:
    """A warning when the GPU measured is not the chip the spec describes."""
    from .runtime import device_info
    info = device_info()
    here = match_device(info.arch, info.sm_count, info.memory_bytes)
    if here is None or here.name != chip.name:
        print(f"warning: measuring on {info.name} ({here.name if here else 'no spec'}), not on the chip of spec "
              f"{chip.name}")
