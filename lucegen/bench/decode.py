"""Decode benchmark: the megakernel on Qwen3.5-0.8B with pseudo-random weights of the real shape.

    tg128        one launch of 128 steps (a 1-token prompt, 127 tokens fed back on the device), median of several
                 launches after a warm-up: tok/s, time per token, achieved bandwidth (weight bytes per token x tok/s)
                 against the read ceiling measured in the same run (and the spec's)
    sampled      tg128 with every token drawn at temperature 0.8 on the device (one launch, the draws' uniforms
                 uploaded with it), beside drawing on the host from each step's logits (a launch a token: the
                 engine's path before the device draw, and still top_k's and top_p's)
    pp520        520 prompt tokens through the decode path in one launch (there is no prefill kernel in this path)
    phases       where a token's time goes: tg128 with one phase kind left out (work and weight reads; barriers stay)
                 gives that kind's share; every kind left out gives the barriers alone; prefetch off gives what the
                 L2 prefetches (weight tiles beyond the ring; state and KV where prefetch_distance > 0) are worth
    timeline     one traced launch (every phase of every block time-stamped on the device, bench/timeline.py):
                 per phase kind, the wall time and its parts (barrier exit, staging, GEMV, tail) on the critical
                 path, and how often DRAM had the GEMV's first tiles in the ring before it started
    HF           transformers' Qwen3_5ForCausalLM (bf16, eager) decoding greedily in the same run, when torch and
                 transformers import (in a process of its own: bench/peers.py, torch_peers.hf_decode)

Every number goes to results/<gpu>.jsonl through Recorder, with its limit where one applies. Energy (tok/J) is the
`energy` suite (bench/energy.py), over the same engine and the same HF peer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..engine.decode import DecodeEngine
from ..engine.sampling import Sampler, SamplingParams
from ..kernels.megakernel import PHASE_KINDS, TRACE_FIELDS, Layout
from ..model.config import LINEAR, ModelConfig, load_config
from ..runtime import DeviceArray, Stream
from ..spec import ChipSpec, spec_for_current_device
from .gemv import measure_read_gbs
from .peers import peer
from .results import Recorder
from .timeline import analyse
from .timing import median_ms

TG, PP = 128, 520
TRACE_STEPS = 24
HF_TOKENS = 32
SAMPLED_TEMPERATURE, HOST_DRAWS = 0.8, 32
WEIGHT_PREFETCH_SWEEP = (0, 2, 4, 8, 16)  # weight tiles an SM asks L2 for beyond its ring (32 KB each on the H200)


def kind_bytes(layout: Layout) -> dict[str, int]:
    """Weight (and state) bytes per token that each phase kind reads; the recurrence reads and writes its state."""
    cfg = layout.cfg
    out = dict.fromkeys(PHASE_KINDS, 0)
    for i, kind in enumerate(cfg.layer_types):
        t = layout.layer_tensors(i)
        pre = "lin" if kind == LINEAR else "att"
        out[f"{pre}_in"] += t["in"].nbytes
        out[f"{pre}_out"] += t["out"].nbytes
        out["mlp_gu"] += t["gate_up"].nbytes
        out["mlp_down"] += t["down"].nbytes
        if kind == LINEAR:
            out["lin_rec"] += 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    out["lm_head"] = layout.lm_head.nbytes
    return out


def tg_ms(engine: DecodeEngine, token: int, stream: Stream) -> float:
    """tg128: milliseconds of one launch of TG steps from `token`, the argmax fed back on the device (a median)."""
    return median_ms(lambda s: engine.enqueue([token], TG - 1, stream=s), stream, repeat=7)


def traced(setup: "Setup", tokens: list[int], stream: Stream) -> tuple[dict, float, float, float]:
    """One traced launch over `tokens` (forced) of the kernel built with its stamps (same weights), after untraced
    ones: ({kind: KindTime} on the critical path, us a token traced, us a token of the plain build and of the
    traced build untraced)."""
    engine = DecodeEngine(None, setup.cfg, setup.spec, max_context=setup.engine.max_context, traced=True)
    lay = engine.kernel.layout
    trace = DeviceArray.zeros(engine.kernel.trace_size(len(tokens)), np.uint64)
    plain = median_ms(lambda s: setup.engine.enqueue(tokens, stream=s), stream, repeat=5) * 1e3 / len(tokens)
    stamped = median_ms(lambda s: engine.enqueue(tokens, stream=s), stream, repeat=5) * 1e3 / len(tokens)
    engine.enqueue(tokens, stream=stream, trace=trace)
    stream.synchronize()
    engine.free()
    a = trace.numpy().reshape(len(tokens), lay.phases_per_token(), lay.blocks, len(TRACE_FIELDS))
    trace.free()
    times, per_token = analyse(a, [lay.phase_kind(k) for k in range(lay.phases_per_token())], lay.slots)
    return times, per_token, plain, stamped


def timeline(setup: "Setup", tokens: list[int], stream: Stream, rec: Recorder) -> None:
    """The traced launch (traced()): per phase kind, where its time goes; the traced build's time a token beside the
    plain build's."""
    times, per_token, plain, stamped = traced(setup, tokens, stream)
    lay = setup.engine.kernel.layout
    print(f"\n  {len(tokens)} forced tokens: {plain:.1f} us a token, {stamped:.1f} with the stamps compiled in")
    moved = kind_bytes(lay)
    print(f"\n  timeline of one traced launch ({len(tokens)} forced tokens, the first left out): {per_token:.1f} us "
          f"a token; per phase kind, us a token on the critical path (the last block of each phase)")
    print(f"  {'phase kind':<10} {'wall':>7} {'exit':>6} {'stage':>6} {'gemv':>6} {'tail':>6} {'work':>6} "
          f"{'ready':>6} {'GB/s':>6}")
    for kind, t in times.items():
        gbs = moved[kind] / (t.wall * 1e3) if t.wall > 0 else 0.0
        print(f"  {kind:<10} {t.wall:7.1f} {t.exit:6.1f} {t.stage:6.1f} {t.gemv:6.1f} {t.tail:6.1f} {t.work:6.1f} "
              f"{t.ready_share:6.0%} {gbs:6.0f}")
        rec.record(f"trace_us_{kind}", setup.name, t.wall, "us", moved[kind] / (setup.read_gbs * 1e3),
                   exit_us=round(t.exit, 2), stage_us=round(t.stage, 2), gemv_us=round(t.gemv, 2),
                   tail_us=round(t.tail, 2), work_us=round(t.work, 2), tiles_ready=round(t.ready_share, 3),
                   gbs=round(gbs, 1))
    exits = sum(t.exit for t in times.values())
    print(f"  {'total':<10} {per_token:7.1f} {exits:6.1f}   (exit: barrier and ready-counter latency, "
          f"{exits / lay.phases_per_token():.2f} us a phase)")
    rec.record("trace_us_per_token", setup.name, per_token, "us", setup.per_token / (setup.read_gbs * 1e3),
               exit_us=round(exits, 1), steps=len(tokens) - 1, untraced_us=round(plain, 2))


@dataclass
class Setup:
    """The decode megakernel on random weights of the model's real shapes, and its bandwidth limit."""
    spec: ChipSpec
    cfg: ModelConfig
    engine: DecodeEngine
    read_gbs: float  # the read ceiling the limit is taken at
    per_token: int  # weight bytes read per token
    name: str

    @property
    def limit(self) -> float:
        """tok/s if every token only streamed its weights at read_gbs."""
        return self.read_gbs * 1e9 / self.per_token

    @classmethod
    def open(cls, model: str, stream: Stream | None, max_context: int) -> "Setup":
        """With a stream, the read ceiling is measured now; without one, the spec's is taken."""
        spec = spec_for_current_device()
        cfg = load_config(model)
        read_gbs = measure_read_gbs(spec, stream) if stream else spec.chip.read_gbs
        print(f"spec {spec.name}: read ceiling {read_gbs:.0f} GB/s {'measured now' if stream else 'of the spec'} "
              f"({spec.chip.read_gbs:.0f} in the spec)")
        engine = DecodeEngine(None, cfg, spec, max_context=max_context)
        lay = engine.kernel.layout
        setup = cls(spec, cfg, engine, read_gbs, lay.weight_bytes_per_token(), f"{cfg.name} bf16")
        print(f"megakernel: {lay.blocks} blocks x {lay.threads} threads, ring {lay.slots} x {lay.slot_bytes} B, "
              f"{setup.per_token / 1e9:.3f} GB of weights per token: limit {setup.limit:.0f} tok/s at "
              f"{read_gbs:.0f} GB/s")
        return setup


def run(recorder: Recorder | None = None, model: str = "qwen3.5-0.8b") -> None:
    stream = Stream()
    setup = Setup.open(model, stream, PP + TG + 8)
    spec, cfg, engine, read_gbs, per_token, limit = (setup.spec, setup.cfg, setup.engine, setup.read_gbs,
                                                     setup.per_token, setup.limit)
    lay = engine.kernel.layout
    rec = recorder or Recorder(gpu=spec.name)
    name = setup.name
    rng = np.random.default_rng(0)

    def launch_ms(tokens, n_new=0, **kw) -> float:
        return median_ms(lambda s: engine.enqueue(tokens, n_new, stream=s, **kw), stream, repeat=7)

    ms = tg_ms(engine, int(rng.integers(cfg.vocab_size)), stream)
    tok_s = TG / (ms * 1e-3)
    gbs = per_token * tok_s / 1e9
    rec.record("tg128_tok_s", name, tok_s, "tok/s", limit, ms_per_token=round(ms / TG, 4),
               achieved_gbs=round(gbs, 1), read_gbs=round(read_gbs, 1), spec_read_gbs=spec.chip.read_gbs,
               weight_bytes_per_token=per_token)
    rec.record("tg128_us_per_token", name, ms * 1e3 / TG, "us", per_token / (read_gbs * 1e3))
    rec.record("decode_bw_frac", name, gbs / read_gbs, "fraction", 1.0, achieved_gbs=round(gbs, 1))

    # sampled: drawn on the device in the launch, and on the host a step at a time
    sampler = Sampler(SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=0))
    first = int(rng.integers(cfg.vocab_size))
    ms_sampled = launch_ms([first], TG - 1, temperature=SAMPLED_TEMPERATURE, uniforms=sampler.rng.random(TG))
    engine.reset()
    token, start = first, time.perf_counter()
    for _ in range(HOST_DRAWS):
        token = sampler(engine.decode(token))
    host_ms = (time.perf_counter() - start) * 1e3 / HOST_DRAWS
    engine.reset()
    sampled_tok_s = TG / (ms_sampled * 1e-3)
    print(f"\n  sampled at temperature {SAMPLED_TEMPERATURE}: {sampled_tok_s:.0f} tok/s drawn on the device in one "
          f"launch ({tok_s / sampled_tok_s:.3f}x greedy's time); drawn on the host a step at a time "
          f"{1e3 / host_ms:.0f} tok/s")
    rec.record("tg128_sampled_tok_s", name, sampled_tok_s, "tok/s", limit, temperature=SAMPLED_TEMPERATURE,
               greedy_tok_s=round(tok_s, 1), host_draw_tok_s=round(1e3 / host_ms, 1),
               vs_host_draw=round(sampled_tok_s * host_ms / 1e3, 2))

    # pp520 through the decode path
    ms_pp = launch_ms([int(t) for t in rng.integers(0, cfg.vocab_size, PP)])
    rec.record("pp520_tok_s", name, PP / (ms_pp * 1e-3), "tok/s", limit, path="decode megakernel, one step a token")

    # where the time goes: every token forced (a phase left out leaves no argmax to feed back)
    forced = [int(t) for t in rng.integers(0, cfg.vocab_size, TG)]
    base = launch_ms(forced) * 1e3 / TG
    print(f"\n  per token: {base:.1f} us with every phase ({TG} forced tokens)")
    print(f"  {'phase kind':<14} {'us/token':>9} {'share':>7} {'GB/s':>7}")
    moved = kind_bytes(lay)
    for bit, kind in enumerate(PHASE_KINDS):
        us = base - launch_ms(forced, skip_mask=1 << bit) * 1e3 / TG
        phase_gbs = moved[kind] / (us * 1e3) if us > 0 else 0.0
        print(f"  {kind:<14} {us:9.1f} {us / base:7.1%} {phase_gbs:7.0f}")
        rec.record(f"phase_us_{kind}", name, us, "us", None, bytes_per_token=moved[kind], gbs=round(phase_gbs, 1))
    barriers = lay.barriers_per_token()
    idle = launch_ms(forced, skip_mask=(1 << len(PHASE_KINDS)) - 1) * 1e3 / TG
    print(f"  {'barriers only':<14} {idle:9.1f} {idle / base:7.1%}   ({barriers} a token: {idle / barriers:.2f} us each)")
    rec.record("barrier_us", name, idle / barriers, "us", None, barriers_per_token=barriers, idle_us_per_token=idle)
    no_prefetch = launch_ms(forced, prefetch=False) * 1e3 / TG
    rec.record("prefetch_saves_us", name, no_prefetch - base, "us", None, without_prefetch_us=no_prefetch)
    if spec.tuning.megakernel.weight_prefetch_tiles:  # compiled in: sweep how far ahead of the ring L2 is asked
        for tiles in WEIGHT_PREFETCH_SWEEP:
            us = launch_ms(forced, prefetch=tiles) * 1e3 / TG
            print(f"  weight tiles prefetched {tiles:>2} beyond the ring: {us:7.1f} us a token")
            rec.record("weight_prefetch_us_per_token", name, us, "us", None, tiles=tiles,
                       spec_tiles=spec.tuning.megakernel.weight_prefetch_tiles)

    timeline(setup, forced[:TRACE_STEPS], stream, rec)

    hf = peer("hf_decode", cfg.to_hf_dict()["text_config"], HF_TOKENS)
    if hf is None:
        print("  HF transformers: no torch peer (not installed, or its process failed), skipped")
    else:
        rec.record("hf_tg_tok_s", name, hf["tok_s"], "tok/s", None, megakernel_speedup=round(tok_s / hf["tok_s"], 1),
                   peer=hf["label"])
    engine.free()
