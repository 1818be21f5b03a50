"""bench speculative's GPU draft parts (issue #7, benchmark (a)): what one DFlash + DDTree round costs on the real
shapes, beside a cuda LayeredEngine whose target the bundled DFlash draft config fits (DRAFT_CONFIG, the same file
as /work/shared/models/qwen3.5-27b-dflash-draft.config.json; otherwise skipped with the reason printed).

The draft is lucegen/engine/draft_gpu.py's GpuDraft with random bf16 weights of the config's shapes (rows repeat
every TILE_ROWS: a GEMV's speed does not depend on the values, and 1.7 G fp32 normals would cost ~20 s of host
time) and the target engine's own embedding and LM head as it loaded them. Each time is the median of REPEAT calls
after WARMUP, host clock around the call and a synchronize (what a round waits for):

    spec_draft_ms         one forward (block of 16: last token + 15 masks) with the LM head over the depths a round
                          of its budget drafts (at most the budget: logits [min(15, budget), vocab] on the device)
                          over the prompt's context, and over LONG_CONTEXT tokens (random features); also the
                          forward of all 15 depths at the prompt's context (`depths` says which); limit: the bytes
                          a forward must read (draft_forward_bytes: the draft's matrices, the target's LM head,
                          the context K/V rows) at the spec's read rate (spec.chip.read_gbs)
    draft_kernel_us_<kind> the forward at the prompt's context again, kernel by kernel (timing.launch_times, behind
                          replays of its graph): each kernel kind's microseconds in one forward, longest first,
                          and for each GEMM kind its launches by name (the tile each shape took) with the weight
                          bytes they read and their rate
    spec_draft_append_ms  append_context of one round's committed tokens (ACCEPTED: the root and the accepted draft
                          tokens, 5 x hidden features each, already on the device as the target's verify leaves
                          them); limit: draft_append_bytes at the read rate
    spec_topk_ms          the device top-K (lucegen/kernels/topk.py) over those depths' logits, ids and log-probs
                          to the host: k = the spec's DDTree budget capped at the kernel's max_k, and k = 1 (chain);
                          limit: the logits' bytes at the read rate
    spec_tree_ms          build_tree on the host from that top-K, at the round's budget (round_budget: the spec's,
                          or the smallest measured one that holds ACCEPTED - 1 nodes)
    spec_walk_ms          the greedy acceptance walk over the verify's logits (host)
    spec_commit_ms        the engine verifier's commit of a path of ACCEPTED nodes (the root and 7 accepted)
    spec_round_ms_al8     their sum with the verify of that budget (bench speculative's spec_verify_greedy_ms,
                          or spec_verify_ms for a verifier without a greedy pass: the existing verify part): one
                          round at accepted length 8. A round emits its accepted draft tokens and the target's
                          bonus token: 7 + 1 = 8 tokens (the bonus is the next round's root, and the 8 committed
                          positions are the root and the 7 accepted). spec_round_tok_s_al8 =
                          8 tokens / round time, next to the oracle-draft ddtree_tok_s_al8 measured end to end.
                          Limit: the draft's, the append's and top-K's limits plus one decode step (the verify's).

Random draft weights accept nothing of the random target; only the round's shape (tree of the budget, commit of 8)
is that of accepted length 8, which is what these costs depend on.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from ..engine.sampling import Sampler, SamplingParams
from ..model.config import ConfigError, ModelConfig
from ..model.draft_config import DraftConfig
from ..reference.dflash import draft_weight_shapes
from ..reference.weights import tensor_rng
from ..spec_decode import build_tree, chosen, walk
from .timing import host_median_ms, launch_times, record_kinds

DRAFT_CONFIG_NAME = "qwen3.5-27b-dflash-draft"
LONG_CONTEXT = 4096  # the second context the forward is timed at (the spec's default draft window)
ACCEPTED = 8         # accepted length of the derived round: tokens emitted a round, positions committed a round
REPEAT, WARMUP = 20, 3
TILE_ROWS = 64
GREEDY = SamplingParams(temperature=0)


def draft_config_path():
    from ..kernels.draft import DRAFTS_DIR
    return DRAFTS_DIR / f"{DRAFT_CONFIG_NAME}.json"


def config_problem(target: ModelConfig) -> str | None:
    """Why the bundled DFlash draft config does not fit `target` (check_target), or None."""
    try:
        DraftConfig.from_json(draft_config_path()).check_target(target)
    except ConfigError as e:
        return f"{DRAFT_CONFIG_NAME} on {target.name}: {e}"
    return None


def skip_reason(engine) -> str | None:
    """Why the GPU draft parts cannot run beside this engine, or None."""
    if type(engine).__name__ != "LayeredEngine":
        return (f"the GPU draft runs beside the cuda backend's LayeredEngine (its embedding and LM head), not a "
                f"{type(engine).__name__}")
    return config_problem(engine.config)


# ---- bytes and the derived round (pure arithmetic) ------------------------------------------------------------------
def draft_forward_bytes(cfg: DraftConfig, lm_head_bytes: int, n_ctx: int, embed_row_bytes: int = 0) -> int:
    """Bytes one forward must read: every draft layer's bf16 matrices ([q | k | v], o, [gate | up], down), the
    target's LM head, the block's embedding rows, and n_ctx context K and V rows (fp32) of every layer."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = 2 * ((q + 2 * kv) * H + H * q + 2 * I * H + H * I)
    ring = n_ctx * 2 * kv * 4
    return cfg.num_hidden_layers * (layer + ring) + lm_head_bytes + cfg.block_size * embed_row_bytes


def draft_append_bytes(cfg: DraftConfig, tokens: int) -> int:
    """Bytes an append of `tokens` tokens must read (one chunk): fc and every layer's [k | v] (bf16) and the
    features (fp32)."""
    H, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    return 2 * (H * cfg.fc_in + cfg.num_hidden_layers * 2 * kv * H) + 4 * tokens * cfg.fc_in


def limit_ms(nbytes: int, read_gbs: float) -> float:
    """Milliseconds to read nbytes at read_gbs GB/s."""
    return nbytes / (read_gbs * 1e6)


def round_ms(parts: Mapping[str, float]) -> float:
    """One round's time: the sum of its parts (ms), run one after another."""
    return sum(parts.values())


def round_tok_s(ms: float, accepted_length: int) -> float:
    """Tokens a second of rounds of `ms` each at accepted length a: a round emits a tokens (a - 1 accepted draft
    tokens and the bonus token)."""
    return accepted_length * 1e3 / ms


# ---- random draft weights -------------------------------------------------------------------------------------------
class TiledDraftWeights(Mapping):
    """Random float32 draft weights by checkpoint name, made on access: linear ~ N(0, 1/fan_in) in a block of
    TILE_ROWS rows repeated down the matrix, norms ~ N(1, 0.1^2)."""

    def __init__(self, cfg: DraftConfig, seed: int = 0):
        self.shapes, self.seed = draft_weight_shapes(cfg), seed

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        rng = tensor_rng(self.seed, name)
        if len(shape) == 1:
            return 1 + np.float32(0.1) * rng.standard_normal(shape, dtype=np.float32)
        n, k = shape
        tile = rng.standard_normal((min(n, TILE_ROWS), k), dtype=np.float32) / np.float32(np.sqrt(k))
        return np.tile(tile, (-(-n // len(tile)), 1))[:n]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def timed_ms(fn: Callable[[], object], repeat: int = REPEAT, warmup: int = WARMUP) -> float:
    """Median host time of fn() (which must wait for its device work), after `warmup` calls."""
    return host_median_ms(fn, repeat, warmup)


# ---- the measurement ------------------------------------------------------------------------------------------------
def round_budget(spec_budget: int, verify_ms: Mapping[int, float]) -> int | None:
    """The budget of the derived round: the spec's, or the smallest measured one above it whose tree can hold the
    ACCEPTED - 1 accepted nodes (a tuned budget may be smaller: h200's is 4); None if no verify was measured so."""
    fits = [b for b in verify_ms if b >= max(spec_budget, ACCEPTED - 1)]
    return min(fits, default=None)


def forward_kernels(rec, draft, model: str, ms: float, read_gbs: float, depths: int) -> None:
    """The draft's forward of `depths` depths again, kernel by kernel (its graph replayed ahead,
    timing.launch_times): each kind's microseconds (draft_kernel_us_<kind>); per distinct kernel of the prefill GEMM
    (the draft's projections, by their tile) the bf16 weight bytes its launches read (N x K x 2 from their
    arguments) and the rate that makes."""
    launches = launch_times(lambda stream: draft.enqueue(stream, depths), draft.graphs[depths], ms, draft.stream)
    record_kinds(rec, "draft_kernel_us", model, launches, "draft forward", note=f"{ms * 1e3:.0f} us the graph")
    gemms: dict[str, list] = {}
    for name, args, us in launches:
        if name.startswith("gemm"):
            g = gemms.setdefault(name, [0.0, 0, 0])
            g[0] += us
            g[1] += 1
            g[2] += gemm_weight_bytes(args)
    for name, (us, n, nbytes) in sorted(gemms.items(), key=lambda kv: -kv[1][0]):
        print(f"      {name:<40} {n:>3} launches {us:>8.1f} us  {nbytes / 1e6:>7.1f} MB  "
              f"{nbytes / (us * 1e3):>6.0f} GB/s ({nbytes / (us * 1e3) / read_gbs:.0%} of {read_gbs:.0f})")


def gemm_weight_bytes(args: tuple) -> int:
    """The bf16 weight bytes a prefill GEMM launch reads: N x K x 2 from its arguments (kernels/gemm.py's launch:
    A, W, Y, M, N, K, ...); 0 where the arguments are not that."""
    ints = [a for a in args if isinstance(a, (int, np.integer)) and not isinstance(a, bool)]
    return 2 * int(ints[1]) * int(ints[2]) if len(ints) >= 3 else 0


def run(rec, engine, name: str, prompt_ids, root_token: int, verify_ms: Mapping[int, float], step_ms: float | None,
        oracle: Mapping | None = None) -> dict | None:
    """Measure and record the parts above beside `engine` (prefilled again here, reset after). verify_ms: bench
    speculative's spec_verify_ms by budget; step_ms: its decode step; oracle: its ddtree_tok_s_al8 record.
    Returns the round's parts (ms) or None when skipped (the reason printed)."""
    if reason := skip_reason(engine):
        print(f"  GPU draft parts skipped: {reason}")
        return None
    budget = round_budget(engine.spec.tuning.ddtree.budget, verify_ms)
    if budget is None:
        print(f"  GPU draft parts skipped: no verify measured at a budget of at least the spec's "
              f"{engine.spec.tuning.ddtree.budget} and {ACCEPTED - 1} (a round accepting {ACCEPTED - 1} nodes)")
        return None
    from ..codegen.build import build
    from ..engine.draft_gpu import GpuDraft
    from ..kernels import topk
    from ..runtime import DeviceArray

    spec, target, W = engine.spec, engine.config, engine.weights
    cfg = DraftConfig.from_json(draft_config_path())
    # a round of that budget drafts no deeper than the budget (speculative_round), its LM head over those rows alone
    V, depth, read = target.vocab_size, min(cfg.block_size - 1, budget), spec.chip.read_gbs
    model = f"{name} + draft {DRAFT_CONFIG_NAME}"
    P = len(prompt_ids)
    t0 = time.perf_counter()
    try:
        draft = GpuDraft(spec, cfg, TiledDraftWeights(cfg, seed=7), W, target, max_context=LONG_CONTEXT + 64)
    except ValueError as e:  # a shape the draft kernels do not take on this chip
        print(f"  GPU draft parts skipped: {e}")
        return None
    # its own build folder: a manifest per folder, and the target's step has one
    tk = topk.TopKKernel(build(spec, dataclasses.replace(target, name=f"{target.name}-topk"),
                               topk.units(spec, target)).module("topk"), spec, rows=depth, vocab=V)
    rng = np.random.default_rng(11)
    feats = DeviceArray.from_numpy(rng.standard_normal((ACCEPTED, cfg.fc_in), dtype=np.float32))
    verifier = None
    try:
        print(f"  GPU draft: {DRAFT_CONFIG_NAME}, random bf16 weights, the target's {W.embed.parts[0].fmt} "
              f"embedding and {'+'.join(p.fmt for p in W.lm_head.parts)} LM head (set up in "
              f"{time.perf_counter() - t0:.0f} s)")
        lm_bytes, embed_row = W.lm_head.nbytes, W.embed.nbytes // V

        def forward(position: int, depths: int = depth):
            draft.forward(root_token, position, depths)
            draft.wait()

        draft_ms = {}
        draft.append_context(rng.standard_normal((P, cfg.fc_in), dtype=np.float32), 0)
        block_ms = timed_ms(lambda: forward(P, cfg.block_size - 1))  # every depth: the DFlash block's own
        draft_ms[P] = (draft.n_ctx, timed_ms(lambda: forward(P)))
        forward_kernels(rec, draft, model, draft_ms[P][1], read, depth)
        k_tree = min(budget, tk.max_k, V)
        top = {k: topk.device_topk(tk, draft.logits, depth, V, k, stream=draft.stream) for k in (k_tree, 1)}
        topk_ms = {k: timed_ms(lambda: topk.device_topk(tk, draft.logits, depth, V, k, stream=draft.stream))
                   for k in (k_tree, 1)}
        tree_ms = timed_ms(lambda: build_tree(top[k_tree], budget, root=root_token))
        tree = build_tree(top[k_tree], budget, root=root_token)
        positions = np.arange(P, P + ACCEPTED)
        append_ms = timed_ms(lambda: (draft.append_context(feats, positions), draft.wait()))
        draft.reset()
        for first in range(0, LONG_CONTEXT, 1024):  # random features of LONG_CONTEXT tokens, 1024 at a time
            n = min(1024, LONG_CONTEXT - first)
            draft.append_context(rng.standard_normal((n, cfg.fc_in), dtype=np.float32), first)
            draft.wait()
        draft_ms[LONG_CONTEXT] = (draft.n_ctx, timed_ms(lambda: forward(LONG_CONTEXT)))

        # the target's walk and commit of a path of ACCEPTED nodes after the prompt
        engine.reset()
        engine.prefill(prompt_ids)
        verifier = engine.verifier()
        path = tree.path(ACCEPTED - 1)
        if len(path) != ACCEPTED:
            raise RuntimeError(f"the tree's node {ACCEPTED - 1} is at depth {len(path) - 1}, not on the chain")
        logits = verifier.forward(tree.tokens, tree.parents)
        walk_ms = timed_ms(lambda: walk(tree, chosen(logits, Sampler(GREEDY))))

        def commit_once() -> float:
            verifier.forward(tree.tokens, tree.parents)
            t = time.perf_counter()
            verifier.commit(path)
            ms = (time.perf_counter() - t) * 1e3
            engine.state.position -= len(path)  # back to the prompt's end: every commit from the same position
            return ms

        for _ in range(WARMUP):
            commit_once()
        commit_ms = statistics.median(commit_once() for _ in range(REPEAT))
    finally:
        if verifier is not None:
            verifier.free()
        engine.reset()
        draft.free()
        feats.free()
        for a in (tk.lists, tk.stats, tk.tickets, tk.ids, tk.logprobs):
            a.free()

    extra = dict(draft_config=DRAFT_CONFIG_NAME, weights="random bf16")
    limits = {}
    for ctx, (n_ctx, ms) in draft_ms.items():
        nbytes = draft_forward_bytes(cfg, lm_bytes, n_ctx, embed_row)
        limits[ctx] = limit_ms(nbytes, read)
        rec.record("spec_draft_ms", model, ms, "ms", limits[ctx], context=ctx, n_ctx=n_ctx, block=cfg.block_size,
                   depths=depth, bytes=nbytes, read_gbs=read, **extra)
    rec.record("spec_draft_ms", model, block_ms, "ms", limits[P], context=P, n_ctx=draft_ms[P][0],
               block=cfg.block_size, depths=cfg.block_size - 1, bytes=draft_forward_bytes(cfg, lm_bytes,
               draft_ms[P][0], embed_row), read_gbs=read, **extra)
    append_limit = limit_ms(draft_append_bytes(cfg, ACCEPTED), read)
    rec.record("spec_draft_append_ms", model, append_ms, "ms", append_limit, tokens=ACCEPTED,
               features=cfg.fc_in, bytes=draft_append_bytes(cfg, ACCEPTED), **extra)
    topk_limit = limit_ms(4 * depth * V, read)
    for k, ms in topk_ms.items():
        rec.record("spec_topk_ms", model, ms, "ms", topk_limit, k=k, rows=depth, vocab=V,
                   mode="chain" if k == 1 else "ddtree", budget=budget, max_k=tk.max_k, **extra)
    shape = dict(budget=budget, nodes=len(tree.tokens), **extra)
    rec.record("spec_tree_ms", model, tree_ms, "ms", None, **shape)
    rec.record("spec_walk_ms", model, walk_ms, "ms", None, **shape)
    rec.record("spec_commit_ms", model, commit_ms, "ms", None, path_nodes=len(path), **shape)

    parts = {"draft_append": append_ms, "draft": draft_ms[P][1], "topk": topk_ms[k_tree], "tree": tree_ms,
             "verify": verify_ms[budget], "walk": walk_ms, "commit": commit_ms}
    ms = round_ms(parts)
    limit = limits[P] + append_limit + topk_limit + (step_ms or 0.0)
    tok_s = round_tok_s(ms, ACCEPTED)
    oracle_extra = {} if oracle is None else dict(oracle_tok_s=oracle["value"], oracle_budget=oracle["budget"])
    common = dict(context=P, emitted=ACCEPTED, committed=ACCEPTED, parts={p: round(v, 4) for p, v in parts.items()},
                  **shape, **oracle_extra)
    rec.record(f"spec_round_ms_al{ACCEPTED}", model, ms, "ms", limit, tok_s=round(tok_s, 2), **common)
    rec.record(f"spec_round_tok_s_al{ACCEPTED}", model, tok_s, "tok/s", round_tok_s(limit, ACCEPTED),
               round_ms=round(ms, 4), **common)
    print(f"  one round at accepted length {ACCEPTED} (budget {budget}, {len(tree.tokens)} nodes, context {P}): "
          + " + ".join(f"{p} {v:.3f}" for p, v in parts.items()) + f" = {ms:.2f} ms"
          + (f" = {ms / step_ms:.1f} decode steps" if step_ms else ""))
    print(f"  {ACCEPTED} tokens a round ({ACCEPTED - 1} accepted + the bonus): {tok_s:.1f} tok/s"
          + (f"; the oracle draft end to end: {oracle['value']:.1f} tok/s (budget {oracle['budget']})"
             if oracle else ""))
    print(f"  draft forward at context {P}: {draft_ms[P][1]:.3f} ms for {depth} depths, {block_ms:.3f} ms for all "
          f"{cfg.block_size - 1}; at context {LONG_CONTEXT}: {draft_ms[LONG_CONTEXT][1]:.3f} ms")
    return parts
