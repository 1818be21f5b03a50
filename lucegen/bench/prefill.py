"""Prefill throughput: pp520, pp4096 and pp32768 (tokens per second of a prompt prefilled from an empty state) for
Qwen3.5-0.8B and 27B in bf16, with random weights of the real shapes filled on the GPU.

Each prefill is captured once in a CUDA graph (no host launch overhead) and replayed. FLOPs counted: 2 x the
layers' matrix parameters x T, the LM head of the last token, and causal attention (QK^T and PV over T(T+1)/2
query-key pairs per head), as if every layer ran on every token (the prefill runs the last layer past its mixer on
the last token only); the DeltaNet recurrence, norms and convolutions are not counted. The achieved TFLOP/s is
compared with this GPU's bf16 matmul rate measured in the same run (torch.matmul 8192^3), and the GEMM shapes of
the 27B prefill at 4096 tokens and the 0.8B's at 520 are timed alone against torch.matmul on the same shapes (each
over replays of a graph of 20 launches, as the prefill's graph runs them), with
every GEMM variant: each method the chip allows (tuning.prefill.gemm: mma, and wgmma on Hopper), without and with
split-K for the residual adds (tuning.prefill.split_k 1 and 4). A model the spec launches programmatically
(tuning.prefill.pdl, model_pdl) is timed without it as well. HF transformers' pp520 (eager attention, bf16) is
measured beside ours when torch and transformers import. The torch peers run in processes of their own (bench/peers.py).

Where the time goes: at pp520 and pp4096, for every GEMM variant, the prefill's graph is timed and one more pass is
launched eagerly with an event pair around each kernel; each kernel kind's device time is recorded
(prefill_kernel_us_<kind>: gemm_<epilogue>, rmsnorm_f32, gdn_chunk_prep, gdn_chunk_scan, attention_prefill_causal, ...)
with its launches, its share of the kernels' sum and, for GEMMs, TFLOP/s. The pass runs behind >= 200 ms of graph
replays, so the host's launches stay ahead of the GPU and the events time kernels rather than launch gaps.
"""
from __future__ import annotations

import numpy as np

from ..codegen.build import build
from ..engine.prefill import Prefill
from ..engine.state import DeviceState
from ..engine.weights import DeviceWeights
from ..kernels import fill, gemm
from ..kernels.megakernel import BF16
from ..model.config import LINEAR, ModelConfig, load_config, tiny_config
from ..runtime import DeviceArray, Graph, Stream, device_info, synchronize
from ..spec import ChipSpec, gemm_methods, spec_for_current_device
from .peers import peer
from .results import Recorder
from .timing import by_kind, launch_times, median_ms

MODELS = ("qwen3.5-0.8b", "qwen3.5-27b")
LENGTHS = (520, 4096, 32768)
GEMM_TOKENS = {"qwen3.5-27b": 4096, "qwen3.5-0.8b": 520}  # models whose GEMM shapes are timed alone, at how many tokens
MATMUL_N = 8192
GRAPH_LAUNCHES = 20              # launches of one GEMM shape captured in a graph to time it
BREAKDOWN_LENGTHS = (520, 4096)  # prompt lengths whose time is broken down by kernel kind, for every GEMM variant
SPLIT_K = 4                      # the split-K variants' tuning.prefill.split_k


def matrix_params(cfg: ModelConfig) -> int:
    """Parameters of every layer's projections (the GEMMs of the prefill)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    n = 0
    for kind in cfg.layer_types:
        n += 3 * H * I
        if kind == LINEAR:
            n += (cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads) * H + H * cfg.value_dim
        else:
            n += (cfg.q_proj_rows + 2 * cfg.kv_dim) * H + H * cfg.num_attention_heads * cfg.head_dim
    return n


def prefill_flops(cfg: ModelConfig, T: int) -> float:
    attention = 4 * cfg.num_attention_heads * cfg.head_dim * T * (T + 1) / 2 * len(cfg.full_layers)
    return 2.0 * matrix_params(cfg) * T + 2.0 * cfg.vocab_size * cfg.hidden_size + attention


def gemm_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, str]]:
    """(N, K, epilogue) of the prefill's GEMMs, by projection."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"in_proj": (cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads, H, "f32"),
            "out_proj": (H, cfg.value_dim, "add"), "gate_up": (2 * I, H, "silu"), "down": (H, I, "add")}


def variants(spec: ChipSpec) -> list[ChipSpec]:
    """The spec, then the other GEMM variants of its prefill: each method the chip allows, without and with split-K."""
    out = [spec]
    for method in gemm_methods(spec):
        for split_k in (1, SPLIT_K):
            v = spec.with_prefill(gemm=method, split_k=split_k)
            if v.tuning.prefill != spec.tuning.prefill:
                out.append(v)
    return out


def gemm_variant(spec: ChipSpec, model: str) -> dict:
    p = spec.tuning.prefill
    return {"gemm": p.gemm, "split_k": p.split_k, "pdl": p.pdl_for(model)}


def graph_us(launch, stream: Stream) -> float:
    """Microseconds a launch of launch(stream), GRAPH_LAUNCHES of them captured in one graph and replayed: launch
    gaps as in the prefill's own graph, no host time."""
    with Graph.capture(stream) as graph:
        for _ in range(GRAPH_LAUNCHES):
            launch(stream)
    synchronize()
    us = median_ms(lambda st: graph.launch(st), stream, warmup_s=0.2, repeat=20) * 1e3 / GRAPH_LAUNCHES
    graph.destroy()
    return us


def bench_gemms(rec: Recorder, spec: ChipSpec, cfg: ModelConfig, m: int, stream: Stream) -> None:
    """Each GEMM shape of the model alone, at m tokens, with each GEMM variant: our TFLOP/s against torch.matmul's on
    the same shape, both timed over graph replays (a single launch between events would time the host's launch too,
    which on these few-microsecond shapes is most of it)."""
    specs = variants(spec)
    ops = [gemm.Gemm(build(s, tiny_config(), gemm.units(s)).module("prefill_gemm"), s) for s in specs]
    rng = np.random.default_rng(0)
    shapes = gemm_shapes(cfg)
    peers = peer("matmul_graph_us", [(m, n, k) for n, k, _ in shapes.values()], GRAPH_LAUNCHES) or [None] * len(shapes)
    for (name, (n, k, epilogue)), peer_us in zip(shapes.items(), peers):
        x = DeviceArray.from_numpy(rng.standard_normal((m, k), dtype=np.float32).astype(BF16))
        w = DeviceArray.from_numpy((rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(BF16))
        y = DeviceArray.zeros((m, n), np.float32)
        flop = 2.0 * m * n * k
        cublas = flop / peer_us / 1e6 if peer_us else None
        for s, op in zip(specs, ops):
            us = graph_us(lambda st: op(x, w, y, m, n, k, epilogue, stream=st), stream)
            c = gemm.choose(s, m, n, k, epilogue)
            rec.record("gemm_tflops", f"{cfg.name} {name} {m}x{n}x{k}", flop / us / 1e6, "TFLOP/s", cublas,
                       config=c.name, splits=gemm.splits(s, c, m, n, k, epilogue), **gemm_variant(s, cfg.name),
                       epilogue=epilogue, us=round(us, 2), **({"cublas_tflops": round(cublas, 1)} if cublas else {}))
        for a in (x, w, y):
            a.free()


def graph_ms(prefill: Prefill, weights: DeviceWeights, state: DeviceState, ids: DeviceArray, T: int,
             stream: Stream) -> tuple[Graph, float]:
    """The prefill of `ids` captured in a graph (from the prefill's own stream, programmatic where its spec says), and
    the median time of a replay on `stream` in milliseconds."""
    state.reset()
    with Graph.capture(prefill.stream) as graph:
        prefill.enqueue(weights, state, ids, prefill.stream)
    synchronize()
    return graph, median_ms(lambda s: graph.launch(s), stream, warmup_s=1.0, repeat=5 if T > 4096 else 20)


def gemm_flops(name: str, args: tuple) -> float:
    """FLOPs of a GEMM launch (args: X, W, Y, M, N, K); 0 for other kernels."""
    return 2.0 * args[3] * args[4] * args[5] if name.startswith("gemm_") else 0.0


def kernel_times(prefill: Prefill, weights: DeviceWeights, state: DeviceState, ids: DeviceArray, graph: Graph,
                 ms: float, stream: Stream) -> dict[str, list]:
    """{kind: [device microseconds, launches, GEMM FLOPs]} of one eager pass of the prefill timed kernel by kernel
    behind replays of its graph (ms each): timing.launch_times."""
    state.reset()
    return by_kind(launch_times(lambda s: prefill.enqueue(weights, state, ids, s), graph, ms, stream), gemm_flops)


def record_breakdown(rec: Recorder, cfg: ModelConfig, T: int, spec: ChipSpec, kinds: dict[str, list],
                     ms: float) -> None:
    """Each kernel kind's time (prefill_kernel_us_<kind>), longest first."""
    total = sum(us for us, _, _ in kinds.values())
    print(f"{cfg.name} pp{T}, GEMM {gemm_variant(spec, cfg.name)}: the kernels take {total:.0f} us timed one by "
          f"one, the graph {ms * 1e3:.0f} us")
    for kind, (us, n, flops) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        rec.record(f"prefill_kernel_us_{kind}", f"{cfg.name} pp{T}", us, "us", launches=n, share=round(us / total, 3),
                   **gemm_variant(spec, cfg.name),
                   **({"tflops": round(flops / (us * 1e-6) / 1e12, 1)} if flops else {}))


def fits(cfg: ModelConfig, T: int) -> bool:
    """The bf16 weights, the KV cache of T tokens and 8 GiB for activations fit this GPU's memory."""
    kv_cache = T * 2 * cfg.kv_dim * 2 * len(cfg.full_layers)
    return 2 * cfg.n_params() + kv_cache + 8 * 2**30 < device_info().memory_bytes


def run(recorder: Recorder | None = None, models=MODELS, lengths=LENGTHS) -> None:
    spec = spec_for_current_device()
    rec = recorder or Recorder(gpu=device_info().name)
    stream = Stream()
    filler = fill.Fill(build(spec, tiny_config(), fill.units(spec)).module("fill"), spec)
    peak = peer("matmul_tflops", MATMUL_N, MATMUL_N, MATMUL_N)
    if peak:
        rec.record("matmul_tflops", f"torch.matmul bf16 {MATMUL_N}^3", peak, "TFLOP/s", peer="torch (cuBLAS)")
    print(f"spec {spec.name}, prefill {spec.tuning.prefill}, bf16 matmul rate "
          f"{f'{peak:.0f} TFLOP/s' if peak else 'unknown (no torch)'}")
    rng = np.random.default_rng(0)
    for name in models:
        cfg = load_config(name)
        runnable = [T for T in lengths if fits(cfg, T)]
        if not runnable:
            print(f"{name}: {2 * cfg.n_params() / 1e9:.0f} GB of bf16 weights do not fit this GPU; skipped")
            continue
        weights = DeviceWeights.random(cfg, spec, filler)
        prefill = Prefill(spec, cfg)
        state = DeviceState(cfg, max(runnable))
        # timed at the breakdown's lengths: the other GEMM variants, and the spec without programmatic launches
        plain = [spec.with_prefill(pdl=False, model_pdl=())] if spec.tuning.prefill.pdl_for(name) else []
        others = [Prefill(v, cfg) for v in variants(spec)[1:] + plain]
        for T in runnable:
            ids = DeviceArray.from_numpy(rng.integers(0, cfg.vocab_size, T).astype(np.int32))
            for p in [prefill, *others] if T in BREAKDOWN_LENGTHS else [prefill]:
                graph, ms = graph_ms(p, weights, state, ids, T, stream)
                flops = prefill_flops(cfg, T)
                tflops = flops / (ms * 1e-3) / 1e12
                limit = T * peak * 1e12 / flops if peak else None
                rec.record(f"pp{T}_tok_s", cfg.name, T / (ms * 1e-3), "tok/s", limit, ms=round(ms, 3),
                           achieved_tflops=round(tflops, 1), chunk_tokens=p.chunk, **gemm_variant(p.spec, cfg.name),
                           **({"matmul_tflops": round(peak, 1), "of_matmul": round(tflops / peak, 3)} if peak else {}))
                if T in BREAKDOWN_LENGTHS:
                    record_breakdown(rec, cfg, T, p.spec, kernel_times(p, weights, state, ids, graph, ms, stream), ms)
                graph.destroy()
            ids.free()
        for p in others:
            p.free()
        if peak and name in GEMM_TOKENS:
            bench_gemms(rec, spec, cfg, GEMM_TOKENS[name], stream)
        state.free()
        prefill.free()
        weights.free()
        synchronize()
        hf = peer("hf_prefill", cfg.to_hf_dict()["text_config"], 520)
        if hf:
            rec.record("pp520_tok_s", cfg.name, hf["tok_s"], "tok/s", peer=hf["label"])
