"""Decode benchmark of the layer-by-layer step (lucegen/engine/layered.py) on Qwen3.5-27B in lucegen's Q4_K_M mix,
with random quantized weights of the real shapes (random block bytes with valid fp16 scales: speed does not
depend on the values; a real 27B GGUF through the numpy quantizer would take hours).

    tg128 at ctx N   128 one-token steps from position N (the KV cache and states hold N positions), each step one
                     graph launch fed by the previous step's argmax on the device, back to back: tok/s, time per
                     token; the limit is the bytes a step must read (every matrix, one embedding row, the KV cache
                     up to N, the DeltaNet states read and written) at the read rate measured in the same run.

Results: metric tg128_tok_s, model "qwen3.5-27b q4_k_m ctx=N", through Recorder.
"""
from __future__ import annotations

from ..engine.layered import LayeredEngine
from ..engine.layered_weights import RandomSource
from ..model.config import load_config
from ..runtime import Event
from ..spec import spec_for_current_device
from .gemv import measure_read_gbs
from .results import Recorder

TG = 128
CONTEXTS = (512, 8192, 32768, 131072)


def state_bytes_per_token(cfg, ctx: int) -> int:
    """KV rows read (bf16 K and V of every position) and DeltaNet state read and written (fp32), per step."""
    kv = len(cfg.full_layers) * ctx * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    rec = len(cfg.linear_layers) * cfg.linear_num_value_heads * cfg.linear_value_head_dim * \
        cfg.linear_key_head_dim * 4 * 2
    return kv + rec


def run(recorder: Recorder | None = None, model: str = "qwen3.5-27b", mix: str = "q4_k_m",
        contexts=CONTEXTS) -> None:
    spec = spec_for_current_device()
    cfg = load_config(model)
    rec = recorder or Recorder(gpu=spec.name)
    engine = LayeredEngine(RandomSource(cfg, mix), cfg, spec, max_context=max(contexts) + TG + 1, chunk=1)
    step, stream = engine.step, engine.step.stream
    read_gbs = measure_read_gbs(spec, stream)
    weights = engine.weights.matrix_bytes_per_token()
    print(f"spec {spec.name}: read ceiling {read_gbs:.0f} GB/s measured now; {weights / 1e9:.2f} GB of matrices "
          f"per token ({mix})")
    for ctx in contexts:
        engine.reset()
        engine.state.position = ctx
        step.launch([1])           # captures the graph; io now feeds the next step
        step.launch_greedy(8)      # warm-up
        start, end = Event(), Event()
        start.record(stream)
        step.launch_greedy(TG)
        end.record(stream)
        ms = start.elapsed_ms(end)
        per_token = weights + state_bytes_per_token(cfg, ctx + 9 + TG // 2)
        limit = read_gbs * 1e9 / per_token
        tok_s = TG / (ms * 1e-3)
        rec.record("tg128_tok_s", f"{cfg.name} {mix} ctx={ctx}", tok_s, "tok/s", limit,
                   ms_per_token=round(ms / TG, 4), bytes_per_token=per_token, read_gbs=round(read_gbs, 1),
                   achieved_gbs=round(per_token * tok_s / 1e9, 1), path="layered step, one CUDA graph a token")
    engine.free()
