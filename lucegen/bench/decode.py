"""Decode benchmark: the megakernel on Qwen3.5-0.8B with pseudo-random weights of the real shape.

    tg128        one launch of 128 steps (a 1-token prompt, 127 tokens fed back on the device), median of several
                 launches after a warm-up: tok/s, time per token, achieved bandwidth (weight bytes per token x tok/s)
                 against the read ceiling measured in the same run (and the spec's)
    pp520        520 prompt tokens through the decode path in one launch (there is no prefill kernel in this path)
    tok/J        tg128 launches back to back for several seconds, energy from NVML's total-energy counter
    phases       where a token's time goes: tg128 with one phase kind left out (work and weight reads; barriers stay)
                 gives that kind's share; every kind left out gives the barriers alone; prefetch off gives what the
                 L2 prefetches (weight tiles beyond the ring; state and KV where prefetch_distance > 0) are worth
    HF           transformers' Qwen3_5ForCausalLM (bf16, eager) decoding greedily in the same run, when torch and
                 transformers import

Every number goes to results/<gpu>.jsonl through Recorder, with its limit where one applies.
"""
from __future__ import annotations

import time

import numpy as np

from ..engine.decode import DecodeEngine
from ..kernels.megakernel import PHASE_KINDS, Layout
from ..model.config import LINEAR, ModelConfig, load_config
from ..runtime import Stream
from ..spec import spec_for_current_device
from .gemv import measure_read_gbs
from .results import Recorder
from .timing import median_ms

TG, PP = 128, 520
ENERGY_SECONDS = 6.0
HF_TOKENS = 32
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


def _hf_tok_s(cfg: ModelConfig) -> float | None:
    """HF transformers' greedy decode (bf16, eager attention, random init) in tok/s; None without torch."""
    try:
        import torch
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError:
        return None
    text = {k: v for k, v in cfg.to_hf_dict()["text_config"].items() if k not in ("model_type", "dtype")}
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text, attn_implementation="eager")).to(torch.bfloat16).eval()

    def decode(n: int) -> None:
        ids = torch.tensor([[1]], device="cuda")
        out = model(input_ids=ids, use_cache=True)
        for _ in range(n):
            ids = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=ids, past_key_values=out.past_key_values, use_cache=True)

    with torch.no_grad():
        decode(4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        decode(HF_TOKENS)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return HF_TOKENS / seconds


def _energy_j(seconds: float, run) -> tuple[float, int, float] | None:
    """(joules, launches, seconds) over launches of `run` back to back for at least `seconds`; None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        e0, t0, n = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            run()
            n += 1
        elapsed = time.perf_counter() - t0
        return (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - e0) / 1e3, n, elapsed
    finally:
        pynvml.nvmlShutdown()


def run(recorder: Recorder | None = None, model: str = "qwen3.5-0.8b") -> None:
    spec = spec_for_current_device()
    cfg = load_config(model)
    rec = recorder or Recorder(gpu=spec.name)
    stream = Stream()
    read_gbs = measure_read_gbs(spec, stream)
    print(f"spec {spec.name}: read ceiling {read_gbs:.0f} GB/s measured now ({spec.chip.read_gbs:.0f} in the spec)")
    engine = DecodeEngine(None, cfg, spec, max_context=PP + TG + 8)
    lay = engine.kernel.layout
    per_token = lay.weight_bytes_per_token()
    limit = read_gbs * 1e9 / per_token
    print(f"megakernel: {lay.blocks} blocks x {lay.threads} threads, ring {lay.slots} x {lay.slot_bytes} B, "
          f"{per_token / 1e9:.3f} GB of weights per token: limit {limit:.0f} tok/s at {read_gbs:.0f} GB/s")
    name = f"{cfg.name} bf16"
    rng = np.random.default_rng(0)

    def launch_ms(tokens, n_new=0, **kw) -> float:
        return median_ms(lambda s: engine.enqueue(tokens, n_new, stream=s, **kw), stream, repeat=7)

    # tg128: one launch of 128 steps, the tokens fed back on the device
    ms = launch_ms([int(rng.integers(cfg.vocab_size))], TG - 1)
    tok_s = TG / (ms * 1e-3)
    gbs = per_token * tok_s / 1e9
    rec.record("tg128_tok_s", name, tok_s, "tok/s", limit, ms_per_token=round(ms / TG, 4),
               achieved_gbs=round(gbs, 1), read_gbs=round(read_gbs, 1), spec_read_gbs=spec.chip.read_gbs,
               weight_bytes_per_token=per_token)
    rec.record("tg128_us_per_token", name, ms * 1e3 / TG, "us", per_token / (read_gbs * 1e3))
    rec.record("decode_bw_frac", name, gbs / read_gbs, "fraction", 1.0, achieved_gbs=round(gbs, 1))

    # pp520 through the decode path
    ms_pp = launch_ms([int(t) for t in rng.integers(0, cfg.vocab_size, PP)])
    rec.record("pp520_tok_s", name, PP / (ms_pp * 1e-3), "tok/s", limit, path="decode megakernel, one step a token")

    # tok/J over a sustained run
    energy = _energy_j(ENERGY_SECONDS, lambda: (engine.enqueue([1], TG - 1, stream=stream), stream.synchronize()))
    if energy is None:
        print("  tok_per_joule: pynvml not installed, skipped")
    else:
        joules, launches, seconds = energy
        rec.record("tok_per_joule", name, launches * TG / joules, "tok/J", None, watts=round(joules / seconds, 1),
                   tok_s=round(launches * TG / seconds, 1), seconds=round(seconds, 2))

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

    hf = _hf_tok_s(cfg)
    if hf is None:
        print("  HF transformers: torch or transformers not installed, skipped")
    else:
        rec.record("hf_tg_tok_s", name, hf, "tok/s", None, megakernel_speedup=round(tok_s / hf, 1),
                   peer="transformers Qwen3_5ForCausalLM bf16 eager")
    engine.free()
