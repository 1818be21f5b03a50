"""Speculative decoding benchmark on any engine backend (lucegen.engine.base; speculate() where it has one).

    parts    what one round costs, part by part (the numpy backend's functions): the draft, the DDTree build, the
             target pass over the tree (verify, against one decode step: the limit a GPU verify aims at), the
             acceptance walk and the commit
    oracle   the target's greedy continuation is recorded (autoregressive: ar tok/s), then drafted back by an
             oracle with an acceptance profile: right for a-1 positions a round, then the true token out of its top,
             so every round accepts a tokens (a in ACCEPT_LENGTHS, the bonus token included). End-to-end tok/s of
             DDTree and of the top-1 chain, against the limit a x ar tok/s (a target pass costing one decode step),
             each run right after an autoregressive one that its speedup and limit are taken from
    budget   a noisy oracle (the true token first with probability SWEEP_ACCURACY, else second) under DDTree trees
             of BUDGETS nodes: accepted length and tok/s per budget
    verify   engines with a verifier() (the cuda ones): its target pass over a DDTree of each budget (the noisy
             oracle's tree), logits on the host included, against one decode step (spec_verify_ms per budget;
             the spec's DDTree budget among them), and where the verifier has it the pass greedy rounds make,
             argmax ids to the host instead (spec_verify_greedy_ms), and the pass sampled rounds make, every node
             drawn on the device (spec_verify_sampled_ms; at budget 16 also drawn on the host along an accepted
             path of up to 8 instead: host_drawn_ms); for the whole-tree verifier (TreeVerifier)
             each kernel kind's time in that pass at BREAKDOWN_BUDGETS and the spec's budget, timed launch by launch
             (verify_kernel_us_<kind>)
    draft    a cuda LayeredEngine whose target the bundled DFlash draft config fits (the 27B): the GPU draft's
             forward, context append and device top-K, the tree build, walk and commit on the real shapes, and
             their sum with the verify: one round at accepted length 8 (spec_round_ms_al8, spec_round_tok_s_al8,
             next to the oracle's ddtree_tok_s_al8); lucegen/bench/draft_parts.py. Other engines: skipped, the
             reason printed

Every output is checked against the autoregressive one (greedy_equal): speculative decoding is lossless. Models
are named "<backend> <target>"; the headline is ddtree_tok_s_al8. Engines without speculate() record the
autoregressive rate and say what they skipped.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..engine.generate import Generation, generate
from ..engine.loader import model_name
from ..engine.numpy_backend import NumpyEngine
from ..engine.sampling import Sampler, SamplingParams
from ..reference.model import State, prefill
from ..spec import DDTreeTuning
from ..spec_decode import Speculation, build_tree, chosen, commit, oracle_draft, tree_forward, walk
from ..spec_decode.decode import DraftFn
from . import draft_parts
from .engines import open_engine
from .results import Recorder
from .timing import host_median_ms, launch_times, record_kinds

ACCEPT_LENGTHS = (4, 6, 8, 10)
BUDGETS = (2, 4, 8, 16, 32, 64)
BREAKDOWN_BUDGETS = (16, 64)
SWEEP_ACCURACY = 0.8
SWEEP_DRAFT = f"oracle, right with probability {SWEEP_ACCURACY}, else second"
DEPTH = 15  # draft positions per round (DFlash: block size 16 - 1)
TOKENS = 64
BUDGET = DDTreeTuning.budget  # the specs' default
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
GREEDY = SamplingParams(temperature=0)
SAMPLED_TEMPERATURE = 0.8  # the sampled rounds' verify pass (spec_verify_sampled_ms)
SAMPLED_PATH = 9           # nodes a sampled round drawing on the host draws (accepted length 8 + the bonus)
SAMPLED_HOST_BUDGET = 16   # the tree whose sampled pass is also timed drawing on the host


def sweep_draft(target: Sequence[int], prompt_len: int, vocab: int) -> DraftFn:
    """The budget sweep's draft: the noisy oracle (SWEEP_DRAFT) of the greedy continuation `target`."""
    return oracle_draft(target, prompt_len, vocab, accuracy=SWEEP_ACCURACY, seed=1)


def parts(rec: Recorder, engine, name: str, prompt_ids: Sequence[int], target: Sequence[int], draft: Speculation,
          label: str, repeat: int) -> None:
    """Per-part cost of one round after the prompt and the first output token, on the numpy backend's functions."""
    if not isinstance(engine, NumpyEngine):
        print(f"  per-part costs: the numpy backend's functions only; {name} skipped (its verify: spec_verify_ms)")
        return
    weights, cfg = engine.weights, engine.config
    committed = State()
    prefill(weights, cfg, prompt_ids, committed)
    context = [*prompt_ids, target[0]]
    sampler = Sampler(GREEDY)
    draft_fn, depth, budget = draft.draft_fn, draft.depth, draft.budget
    logprobs = draft_fn(context, depth)
    tree = build_tree(logprobs, budget, root=context[-1])
    logits, nodes = tree_forward(weights, cfg, committed, tree.tokens, tree.parents)
    accepted, _ = walk(tree, chosen(logits, sampler))
    engine.reset()
    engine.prefill(prompt_ids)
    step_ms = host_median_ms(lambda: engine.decode(target[0]), repeat * 4)
    costs = {"draft": host_median_ms(lambda: draft_fn(context, depth), repeat),
             "tree": host_median_ms(lambda: build_tree(logprobs, budget, root=context[-1]), repeat),
             "verify": host_median_ms(lambda: tree_forward(weights, cfg, committed, tree.tokens, tree.parents), repeat),
             "walk": host_median_ms(lambda: walk(tree, chosen(logits, Sampler(GREEDY))), repeat),
             "commit": host_median_ms(lambda: commit(committed, nodes, accepted), repeat)}
    extra = dict(budget=budget, nodes=len(tree.tokens), depth=depth, accepted=len(accepted) - 1, draft=label)
    rec.record("decode_step_ms", name, step_ms, "ms", None, context=len(prompt_ids))
    for part, ms in costs.items():
        # the verify pass's limit: one decode step (a tree pass bound by the same weight reads)
        rec.record(f"spec_{part}_ms", name, ms, "ms", step_ms if part == "verify" else None, **extra)
    print(f"  one round: {sum(costs.values()):.2f} ms = {sum(costs.values()) / step_ms:.1f} decode steps "
          f"(tree of {len(tree.tokens)} nodes)")


@dataclass(frozen=True)
class Paired:
    """Runs with a draft, each right after one without: speculative[i] after plain[i]."""
    plain: list[Generation]
    speculative: list[Generation]

    @property
    def ar_tok_s(self) -> float:
        """The autoregressive rate the runs with the draft are compared with: the plain runs' median."""
        return statistics.median(g.decode_tps for g in self.plain)

    @property
    def median(self) -> Generation:
        """The run with the draft of median tok/s (the upper one of an even count)."""
        return sorted(self.speculative, key=lambda g: g.decode_tps)[len(self.speculative) // 2]

    @property
    def greedy_equal(self) -> bool:
        """Every run with the draft gave the tokens of the plain run before it (greedy: it must)."""
        return all(s.token_ids == p.token_ids for p, s in zip(self.plain, self.speculative))


def against_autoregressive(engine, gen: Callable[[], Generation], speculation: Speculation, repeat: int) -> Paired:
    """`repeat` runs of gen() with `speculation` on the engine, each right after one without it (the rate it is
    compared with: load on the machine moves both alike). The engine is left without a draft."""
    plain, speculative = [], []
    for _ in range(repeat):
        plain.append(gen())
        engine.speculation = speculation
        try:
            speculative.append(gen())
        finally:
            engine.speculation = None
    return Paired(plain, speculative)


def fitting(engine, budgets: Sequence[int]) -> list[int]:
    """The budgets whose trees (budget + the root) the engine's verifier takes; the others said to be skipped."""
    most = getattr(engine, "max_tree_nodes", None)
    for b in budgets:
        if most is not None and b + 1 > most:
            print(f"  budget {b} skipped: {type(engine).__name__} verifies trees of at most {most} nodes")
    return [b for b in budgets if most is None or b + 1 <= most]


def verify(rec: Recorder, engine, name: str, prompt_ids: Sequence[int], target: Sequence[int],
           budgets: Sequence[int], repeat: int, breakdown: Sequence[int] = BREAKDOWN_BUDGETS
           ) -> tuple[dict[int, float], float | None]:
    """The engine's verifier (the tree verifier of the layer-by-layer step, node by node on the megakernel's)
    over the tree of each budget after the prompt, against one decode step there; at the `breakdown` budgets also
    kernel by kernel (verify_kernels). Returns (ms by budget of the
    pass a greedy round makes: forward_argmax where the verifier has it, else forward; the decode step's ms); ({},
    None) for an engine without a verifier."""
    if not hasattr(engine, "verifier"):
        return {}, None
    verifier = engine.verifier()
    try:
        engine.reset()
        engine.prefill(prompt_ids)
        context = [*prompt_ids, target[0]]
        logprobs = sweep_draft(target, len(prompt_ids), engine.config.vocab_size)(context, DEPTH)
        times, greedy, sampled = {}, {}, {}
        for b in fitting(engine, budgets):
            tree = build_tree(logprobs, b, root=context[-1])
            verifier.forward(tree.tokens, tree.parents)  # warm-up: graph capture on first use of a shape
            times[b] = (len(tree.tokens), host_median_ms(lambda: verifier.forward(tree.tokens, tree.parents), repeat))
            if hasattr(verifier, "forward_argmax"):  # the pass a greedy round makes: N ids to the host
                greedy[b] = host_median_ms(lambda: verifier.forward_argmax(tree.tokens, tree.parents), repeat)
            if hasattr(verifier, "forward_drawn"):  # a sampled round's: every node drawn on the device
                sampled[b] = sampled_passes(verifier, tree, repeat, host=b == SAMPLED_HOST_BUDGET)
            if b in breakdown:
                verify_kernels(rec, verifier, name, b, times[b][1])
        step_ms = host_median_ms(lambda: engine.decode(target[0]), repeat * 4)
    finally:
        verifier.free()
    rec.record("decode_step_ms", name, step_ms, "ms", None, context=len(prompt_ids))
    for b, (nodes, ms) in times.items():
        rec.record("spec_verify_ms", name, ms, "ms", step_ms, budget=b, nodes=nodes, verifier=type(verifier).__name__)
        line = f"  verify, budget {b} ({nodes} nodes): {ms:.2f} ms = {ms / step_ms:.1f} decode steps"
        if b in greedy:
            rec.record("spec_verify_greedy_ms", name, greedy[b], "ms", step_ms, budget=b, nodes=nodes,
                       verifier=type(verifier).__name__)
            line += f"; greedy (argmax ids to the host) {greedy[b]:.2f} ms"
        if b in sampled:
            device_ms, host_ms, path = sampled[b]
            rec.record("spec_verify_sampled_ms", name, device_ms, "ms", step_ms, budget=b, nodes=nodes,
                       temperature=SAMPLED_TEMPERATURE, host_drawn_ms=host_ms, host_path=path)
            line += f"; sampled (drawn on the device) {device_ms:.2f} ms"
            if host_ms is not None:
                line += f", drawn on the host along a path of {path} nodes {host_ms:.2f} ms"
        print(line)
    return {b: greedy.get(b, ms) for b, (_, ms) in times.items()}, step_ms


def sampled_passes(verifier, tree, repeat: int, host: bool) -> tuple[float, float | None, int | None]:
    """ms of the pass a sampled round at a temperature alone makes (forward_drawn: every node drawn on the device
    with its uniform, N ids to the host) and, where `host`, of the same round drawing on the host instead: the rows
    of a root-first path of up to SAMPLED_PATH nodes (an accepted length of SAMPLED_PATH - 1) copied and drawn
    there; and that path's length."""
    uniforms = np.random.default_rng(0).random(len(tree.tokens))
    device = host_median_ms(lambda: verifier.forward_drawn(tree.tokens, tree.parents, SAMPLED_TEMPERATURE, uniforms),
                            repeat)
    if not host:
        return device, None, None
    path = tree.path(int(np.argmax(tree.depths)))[:SAMPLED_PATH]
    sampler = Sampler(SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=0))

    def on_host():
        rows = verifier.forward_rows(tree.tokens, tree.parents)
        for node in path:
            sampler(rows[node])
    return device, host_median_ms(on_host, repeat), len(path)


def verify_kernels(rec: Recorder, verifier, name: str, budget: int, ms: float) -> None:
    """The last forward of a TreeVerifier (a layer-by-layer step over the tree's N nodes) again, kernel by kernel
    (timing.launch_times, behind replays of its graph): each kernel kind's microseconds in one verify
    (verify_kernel_us_<kind>), longest first. Other verifiers: nothing."""
    step, mixer = getattr(verifier, "step", None), getattr(verifier, "mixer", None)
    tree = getattr(mixer, "tree", None)
    if tree is None:
        return
    graph = step.graphs[verifier, "tree", tree.n, tree.levels]
    launches = launch_times(lambda stream: step.enqueue(tree.n, stream, mixer), graph, ms, step.stream)
    record_kinds(rec, "verify_kernel_us", name, launches, f"verify of {tree.n} nodes", budget=budget, nodes=tree.n,
                 note=f"{ms * 1e3:.0f} us the graph with logits to the host")


def run(recorder: Recorder, model: str = "tiny", backend: str = "numpy", draft: str | None = None,
        budget: int = BUDGET, tokens: int = TOKENS, accept_lengths: Sequence[int] = ACCEPT_LENGTHS,
        budgets: Sequence[int] = BUDGETS, repeat: int = 3) -> None:
    rec = recorder
    if max(accept_lengths, default=1) - 1 > DEPTH:
        raise ValueError(f"accepted lengths up to {DEPTH + 1} (draft depth {DEPTH}), got {max(accept_lengths)}")
    engine, tokenizer, name = open_engine(model, backend, draft=draft, budget=budget if draft else None)
    prompt_ids = tokenizer.encode(PROMPT)
    real_draft = getattr(engine, "speculation", None)  # with --draft: its costs go into the per-part table
    if real_draft:
        engine.speculation = None
    vocab = engine.config.vocab_size

    def gen() -> Generation:
        return generate(engine, tokenizer, prompt_ids, tokens, GREEDY, ignore_eos=True)

    runs = sorted((gen() for _ in range(repeat)), key=lambda g: g.decode_tps)
    ar = runs[repeat // 2]
    target = ar.token_ids
    rec.record("ar_tok_s", name, ar.decode_tps, "tok/s", None, tokens=len(target), prompt_tokens=len(prompt_ids))
    if not hasattr(engine, "speculate"):
        print(f"  {backend} engine has no speculate(): speculative suites skipped")
        return

    recorded = {}

    def speculative(metric: str, draft_fn, tree_budget: int, chain: bool = False, limit_al: float | None = None,
                    **extra) -> None:
        """Runs with the draft, each after an autoregressive run (the rate they are compared with: load on the
        machine moves both alike); limit: limit_al (else the measured accepted length) x that rate."""
        runs = against_autoregressive(engine, gen, Speculation(draft_fn, DEPTH, tree_budget, chain), repeat)
        ar_tps, g = runs.ar_tok_s, runs.median
        recorded[metric] = rec.record(
            metric, name, g.decode_tps, "tok/s", (limit_al or g.tokens_per_pass) * ar_tps,
            accepted_length=round(g.tokens_per_pass, 3), speedup=round(g.decode_tps / ar_tps, 3), budget=tree_budget,
            greedy_equal=g.token_ids == target, ar_tok_s=round(ar_tps, 3), **extra)
        if g.token_ids != target:
            print(f"  {metric}: the output differs from the autoregressive one (speculative decoding must be "
                  f"lossless)")

    parts(rec, engine, f"{name} + draft {model_name(draft)}" if real_draft else name, prompt_ids, target,
          real_draft or Speculation(oracle_draft(target, len(prompt_ids), vocab, run=7), DEPTH, budget),
          f"DFlash {draft}" if real_draft else "oracle, 7 right a round", repeat)
    spec_budget = [engine.spec.tuning.ddtree.budget] if draft_parts.skip_reason(engine) is None else []
    verify_ms, step_ms = verify(rec, engine, name, prompt_ids, target, sorted({*budgets, *spec_budget}), repeat,
                                (*BREAKDOWN_BUDGETS, *spec_budget))
    for a in accept_lengths:
        draft_fn = oracle_draft(target, len(prompt_ids), vocab, run=a - 1)
        for mode in ("ddtree", "chain"):
            speculative(f"{mode}_tok_s_al{a}", draft_fn, budget, mode == "chain", a,
                        draft=f"oracle, {a - 1} right a round")
    for b in fitting(engine, budgets):
        speculative(f"ddtree_tok_s_b{b}", sweep_draft(target, len(prompt_ids), vocab), b, draft=SWEEP_DRAFT)
    draft_parts.run(rec, engine, name, prompt_ids, target[0], verify_ms, step_ms, recorded.get("ddtree_tok_s_al8"))
