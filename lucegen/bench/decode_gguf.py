"""Decode benchmark of the layer-by-layer step (lucegen/engine/layered.py) on Qwen3.5-27B in lucegen's Q4_K_M mix,
with random quantized weights of the real shapes (random block bytes with valid fp16 scales: speed does not
depend on the values; a real 27B GGUF through the numpy quantizer would take hours).

    tg128 at ctx N   128 one-token steps from position N (the KV cache and states hold N positions), each step one
                     graph launch fed by the previous step's argmax on the device, back to back: tok/s, time per
                     token; the limit is the bytes a step must read (every matrix, one embedding row, the KV cache
                     up to N, the DeltaNet states read and written) at the read rate measured in the same run.

    kernels          after tg128 at the first context (512): one step at that position timed kernel by kernel (its
                     launches made eagerly, an event pair around each, behind >= 200 ms of replays of its graph so
                     that no kernel waits for its launch: timing.launch_times), per kernel kind (qgemv_q4_k,
                     qgemv_q6_k, tree_deltanet, tree_attention, layered_add_rmsnorm, ...): time per step, launches and
                     share of the kernels' sum; the graph step's time (tg128's per token) less that sum: positive
                     where the graph leaves gaps between launches, negative where its programmatic launches overlap
                     what the timing one by one runs alone (each kernel's start and drain: ~0.5 us a boundary with
                     PDL, tools/kernel_boundary.py)

    projections      the step's quantized projections alone (one graph of every layer's, M = 1): their time per
                     token and read rate; the rest of a step is mixers, row kernels and the gaps between ~600 launches

Results, through Recorder: tg128_tok_s (model "qwen3.5-27b q4_k_m ctx=N"; "... kv=q8_0 ctx=N" with a quantized KV
cache, --kv); decode_kernel_us_<kind> and decode_launch_gap_us (model "qwen3.5-27b q4_k_m ctx=512", with launches
and, per kind, share); step_projections_us.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..engine.layered import LayeredEngine, LayeredStep
from ..engine.layered_weights import Projection, RandomSource
from ..model import kvformats
from ..model.config import load_config
from ..runtime import Event, Graph
from ..spec import spec_for_current_device
from .gemv import measure_read_gbs
from .results import Recorder
from .timing import by_kind, launch_times, queued_replays

TG = 128
WARMUP = 8
CONTEXTS = (512, 8192, 32768, 131072)


def state_bytes_per_token(cfg, ctx: int, kv_format: str = "bf16") -> int:
    """KV rows read (K and V of every position, in kv_format) and DeltaNet state read and written (fp32), per
    step."""
    kv = len(cfg.full_layers) * ctx * cfg.num_key_value_heads * kvformats.row_bytes(kv_format, cfg.head_dim) * 2
    rec = len(cfg.linear_layers) * cfg.linear_num_value_heads * cfg.linear_value_head_dim * \
        cfg.linear_key_head_dim * 4 * 2
    return kv + rec


def run(recorder: Recorder | None = None, model: str = "qwen3.5-27b", mix: str = "q4_k_m",
        contexts=CONTEXTS, kv_format: str | None = None) -> None:
    """tg128 at each context; kv_format: the KV cache's (default: the spec's tuning.kv_format)."""
    spec = spec_for_current_device()
    if kv_format is not None:
        spec = dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, kv_format=kv_format))
    cfg = load_config(model)
    rec = recorder or Recorder(gpu=spec.name)
    engine = LayeredEngine(RandomSource(cfg, mix), cfg, spec, max_context=max(contexts) + 1 + WARMUP + TG,
                           chunk=1)
    step, stream = engine.step, engine.step.stream
    read_gbs = measure_read_gbs(spec, stream)
    weights = engine.weights.matrix_bytes_per_token()
    kv = engine.state.kv_format
    print(f"spec {spec.name}: read ceiling {read_gbs:.0f} GB/s measured now; {weights / 1e9:.2f} GB of matrices "
          f"per token ({mix}); {kv} KV")
    tag = f"{cfg.name} {mix}" + ("" if kv == "bf16" else f" kv={kv}")
    for ctx in contexts:
        ms = tg_ms(engine, ctx)
        per_token = weights + state_bytes_per_token(cfg, ctx + 1 + WARMUP + TG // 2, kv)  # mean context
        limit = read_gbs * 1e9 / per_token
        tok_s = TG / (ms * 1e-3)
        rec.record("tg128_tok_s", f"{tag} ctx={ctx}", tok_s, "tok/s", limit,
                   ms_per_token=round(ms / TG, 4), bytes_per_token=per_token, read_gbs=round(read_gbs, 1),
                   achieved_gbs=round(per_token * tok_s / 1e9, 1), path="layered step, one CUDA graph a token")
        if ctx == contexts[0]:
            step_breakdown(rec, step, f"{tag} ctx={ctx}", ctx, ms / TG)
    proj_us = projections_us(step)
    proj_bytes = weights - engine.weights.embed.nbytes // cfg.vocab_size
    rec.record("step_projections_us", f"{cfg.name} {mix}", proj_us, "us", proj_bytes / (read_gbs * 1e3),
               achieved_gbs=round(proj_bytes / (proj_us * 1e3), 1), bytes=proj_bytes)
    engine.free()


def tg_ms(engine: LayeredEngine, ctx: int) -> float:
    """Milliseconds of TG one-token steps from position ctx (after WARMUP), each step's graph fed by the one
    before's argmax on the device."""
    step, stream = engine.step, engine.step.stream
    engine.reset()
    engine.state.position = ctx
    step.launch([1])           # captures the graph; io now feeds the next step
    step.launch_greedy(WARMUP)  # warm-up
    start, end = Event(), Event()
    start.record(stream)
    step.launch_greedy(TG)
    end.record(stream)
    return start.elapsed_ms(end)


def step_breakdown(rec: Recorder, step: LayeredStep, model: str, ctx: int, step_ms: float) -> None:
    """One decode step at position ctx timed kernel by kernel behind replays of its graph (step_ms each, captured
    already): each kernel kind's time per step (decode_kernel_us_<kind>), longest first, and the graph step less
    their sum (decode_launch_gap_us: negative where the graph's overlap of launches saves more than its gaps cost).
    Leaves the state's position where the device's is."""
    state = step.state
    steps = queued_replays(step_ms) + 1  # the replays and the eager pass each advance io's position on the device
    if steps > state.max_context:
        print(f"{model}: no kernel breakdown ({steps} steps do not fit a context of {state.max_context})")
        return
    state.position = min(ctx, state.max_context - steps)
    step.upload(np.array([1]))  # io = [position, any token]
    launches = launch_times(lambda s: step.enqueue(1, s), step.graphs[step, 1], step_ms, step.stream)
    state.position += steps
    kinds = sorted(by_kind(launches).items(), key=lambda kv: -kv[1][0])
    total, step_us = sum(us for _, (us, _, _) in kinds), step_ms * 1e3
    print(f"{model}: one decode step kernel by kernel\n  {'kind':<26} {'launches':>8} {'us/step':>9} {'share':>6}")
    for kind, (us, n, _) in kinds:
        print(f"  {kind:<26} {n:>8} {us:>9.1f} {us / total:>6.1%}")
    print(f"graph step {step_us:.0f} us, kernels timed one by one {total:.0f} us: the graph "
          + (f"leaves {step_us - total:.0f} us of gaps" if step_us >= total else
             f"overlaps {total - step_us:.0f} us of what runs alone one by one"))
    for kind, (us, n, _) in kinds:
        rec.record(f"decode_kernel_us_{kind}", model, us, "us", launches=n, share=round(us / total, 3))
    rec.record("decode_launch_gap_us", model, step_us - total, "us", launches=len(launches))


def projections_us(step, repeat: int = 20) -> float:
    """Microseconds of one step's projections alone (M = 1, in one graph), median of `repeat` replays."""
    c, W = step.cfg, step.weights
    inputs = {c.hidden_size: step.h, c.value_dim: step.normed, c.num_attention_heads * c.head_dim: step.mix_out,
              c.intermediate_size: step.act}
    with Graph.capture(step.stream) as g:
        for L in W.layers:
            for P in (p for p in L.values() if isinstance(p, Projection)):
                step.project(P, inputs[P.k], step.proj, 1, step.stream)
        step.project(W.lm_head, step.h, step.logits, 1, step.stream)
    times = []
    for _ in range(repeat):
        start, end = Event().record(step.stream), Event()
        g.launch(step.stream)
        times.append(start.elapsed_ms(end.record(step.stream)) * 1e3)
    g.destroy()
    return sorted(times)[len(times) // 2]
