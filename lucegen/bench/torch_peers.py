"""The benchmarks' peers on torch: cuBLAS through torch, and HF transformers' Qwen3_5ForCausalLM. Each runs in a
process of its own (bench/peers.py), which imports torch before anything else: in a process that has run lucegen's
kernels, `import torch` has failed on the lab image ("expected ident but found ')'" while torch registers its own
operators), and a failed import cannot be tried again in the same process. Arguments and results are plain JSON
values.
"""
from __future__ import annotations

import importlib.util
import time

import numpy as np
import torch

from .nvml import measure_energy


def event_ms(fn, repeat: int = 20, warmup: int = 3) -> float:
    """The median time of fn() between CUDA events, in milliseconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return float(np.median(times))


def _rotated_us(call, weights: list) -> float:
    """Microseconds a call of call(w), the weights rotated (so that L2 does not serve them)."""
    ms = event_ms(lambda: [call(w) for w in weights], repeat=30, warmup=max(3, 300 // len(weights)))
    return ms * 1e3 / len(weights)


def read_gbs(nbytes: int) -> float:
    """torch.sum over nbytes of fp32: GB/s (the read anchor of research/measured-h200.md)."""
    x = torch.ones(nbytes // 4, device="cuda", dtype=torch.float32)
    ms = event_ms(x.sum, warmup=20)
    return nbytes / (ms * 1e-3) / 1e9


def mm_us(shapes: list) -> list:
    """cuBLAS bf16 on x [m, k] times W [n, k]^T (torch.mv for m = 1), for each (n, k, m, distinct[, repeats]): us a
    call, `distinct` copies of W rotated (so that L2 does not serve them), the rotation `repeats` times a timing."""
    out = []
    for n, k, m, distinct, *repeats in shapes:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(distinct)] * (repeats or [1])[0]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out.append(_rotated_us((lambda w: torch.mv(w, x[0])) if m == 1 else (lambda w: torch.mm(x, w.t())), ws))
    return out


def matmul_tflops(m: int, n: int, k: int) -> float:
    """cuBLAS bf16 (torch.matmul) on an m x k by k x n product: TFLOP/s."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return 2.0 * m * n * k / (event_ms(lambda: torch.matmul(a, b)) * 1e-3) / 1e12


def matmul_graph_us(shapes: list, launches: int) -> list:
    """cuBLAS bf16 (torch.matmul, bf16 out) on each (m, n, k): microseconds a launch of an m x k by k x n product,
    `launches` of them replayed from a CUDA graph (launch gaps as in a graph of ours, no host time)."""
    out = []
    side = torch.cuda.Stream()
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(side):  # cuBLAS's workspace and heuristics settle before the capture
            for _ in range(3):
                torch.matmul(x, w.t(), out=y)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(launches):
                torch.matmul(x, w.t(), out=y)
        out.append(event_ms(graph.replay) * 1e3 / launches)
    return out


def _hf_model(text_config: dict):
    """Qwen3_5ForCausalLM of `text_config` (random bf16 weights made on the GPU, eager attention), and its label.
    Where flash-linear-attention is installed, transformers runs the DeltaNet layers through it."""
    import transformers
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    text = {k: v for k, v in text_config.items() if k not in ("model_type", "dtype")}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters made in bf16 (27B in fp32 would not fit)
    try:
        with torch.device("cuda"):
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text, attn_implementation="eager")).eval()
    finally:
        torch.set_default_dtype(default)
    fla = " + fla" if importlib.util.find_spec("fla") else ""
    return model, f"HF transformers {transformers.__version__} eager bf16{fla}"


def hf_prefill(text_config: dict, tokens: int) -> dict:
    """HF's prefill of a random `tokens`-token prompt (the last token's logits): tok/s."""
    model, label = _hf_model(text_config)
    ids = torch.randint(0, text_config["vocab_size"], (1, tokens), device="cuda")
    with torch.no_grad():
        ms = event_ms(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), repeat=5)
    return {"tok_s": tokens / (ms * 1e-3), "label": label}


def hf_decode(text_config: dict, tokens: int, energy_seconds: float = 0.0, bus_id: str = "") -> dict:
    """HF decoding greedily: a 1-token prompt, then `tokens` steps: tok/s of the steps; with energy_seconds, such
    runs back to back for that long under NVML's energy counter of the GPU at `bus_id` (joules, runs, seconds)."""
    model, label = _hf_model(text_config)

    def decode() -> None:
        with torch.no_grad():
            ids = torch.tensor([[1]], device="cuda")
            out = model(input_ids=ids, use_cache=True)
            for _ in range(tokens):
                ids = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=ids, past_key_values=out.past_key_values, use_cache=True)
        torch.cuda.synchronize()

    decode()  # warm
    t0 = time.perf_counter()
    decode()
    result = {"tok_s": tokens / (time.perf_counter() - t0), "label": label}
    if energy_seconds:
        joules, runs, seconds, _ = measure_energy(bus_id, energy_seconds, decode)
        result.update(joules=joules, runs=runs, seconds=seconds)
    return result
