"""GEMV micro-benchmark: achieved bandwidth on the LM-head shape and time per call on a small shape.

The LM head of Qwen3.5 (248320 x 1024 bf16, 508 MB) is far larger than L2, so one call measures DRAM. The small
shape (6144 x 1024, 12.6 MB) is latency-bound; 64 copies are rotated so that L2 does not serve it.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..codegen.build import build
from ..kernels import gemv
from ..model.config import tiny_config
import dataclasses

from ..runtime import DeviceArray, Stream, device_info
from ..spec import ChipSpec, spec_for_current_device
from .results import Recorder
from .timing import median_ms

SHAPES = {"lm_head": (248320, 1024), "small": (6144, 1024)}
ROTATE = 64


def _torch_peer(n: int, k: int, copies: int):
    """cuBLAS (through torch) on the same shape, timed the same way; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    for w in ws[:3]:
        torch.mv(w, x)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for w in ws:
            torch.mv(w, x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / copies)
    del ws
    torch.cuda.empty_cache()
    return float(np.median(times))


def sweep(spec: ChipSpec, stream: Stream) -> None:
    """Time the LM-head shape for several tunings (rows per warp x blocks per SM) and print a table."""
    n, k = SHAPES["lm_head"]
    rng = np.random.default_rng(1)
    w = DeviceArray.from_numpy(rng.standard_normal((n, k), dtype=np.float32).astype(ml_dtypes.bfloat16))
    x = DeviceArray.from_numpy(rng.standard_normal(k, dtype=np.float32).astype(ml_dtypes.bfloat16))
    y = DeviceArray.empty(n, np.float32)
    print("rows/warp  blocks/SM  threads     us     GB/s  of read")
    for threads in (128, 256, 512):
        for rows in (1, 2, 4):
            for bps in (2, 4, 8, 16):
                if bps * threads > spec.chip.max_threads_per_sm:
                    continue
                g = dataclasses.replace(spec.tuning.gemv, rows_per_warp=rows, blocks_per_sm=bps, threads=threads)
                s = dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, gemv=g))
                op = gemv.Gemv(build(s, tiny_config(), gemv.units(s, tiny_config(), [k])).module("gemv_bf16"), s, k)
                ms = median_ms(lambda st: op(w, x, y, stream=st), stream, warmup_s=0.1)
                gbs = (n * k * 2) / (ms * 1e-3) / 1e9
                print(f"{rows:9d}  {bps:9d}  {threads:7d}  {ms * 1e3:6.1f}  {gbs:7.0f}  {gbs / spec.chip.read_gbs:6.1%}")
    w.free()


def run(recorder: Recorder | None = None, tune: bool = False) -> None:
    spec = spec_for_current_device()
    info = device_info()
    rec = recorder or Recorder(gpu=info.name)
    read_gbs = spec.chip.read_gbs
    print(f"spec {spec.name}: read-bandwidth ceiling {read_gbs:.0f} GB/s")
    ks = sorted({k for _, k in SHAPES.values()})
    result = build(spec, tiny_config(), gemv.units(spec, tiny_config(), ks))
    op = gemv.Gemv(result.module("gemv_bf16"), spec, 1024)
    rng = np.random.default_rng(0)
    stream = Stream()
    if tune:
        sweep(spec, stream)
    for label, (n, k) in SHAPES.items():
        copies = 1 if label == "lm_head" else ROTATE
        host = rng.standard_normal((n, k), dtype=np.float32).astype(ml_dtypes.bfloat16)
        ws = [DeviceArray.from_numpy(host) for _ in range(copies)]
        x = DeviceArray.from_numpy(rng.standard_normal(k, dtype=np.float32).astype(ml_dtypes.bfloat16))
        y = DeviceArray.empty(n, np.float32)

        def calls(s, ws=ws, x=x, y=y):
            for w in ws:
                op(w, x, y, stream=s)

        ms = median_ms(calls, stream) / copies
        nbytes = n * k * 2 + k * 2 + n * 4
        gbs = nbytes / (ms * 1e-3) / 1e9
        peer = _torch_peer(n, k, copies)
        shape = f"{n}x{k}"
        if label == "lm_head":
            rec.record("gemv_bw_frac", f"bf16 {shape}", gbs / read_gbs, "fraction", 1.0,
                       achieved_gbs=round(gbs, 1), read_gbs=read_gbs)
        rec.record(f"gemv_{label}_us", f"bf16 {shape}", ms * 1e3, "us", None,
                   achieved_gbs=round(gbs, 1), floor_us=round(nbytes / read_gbs / 1e3, 3))
        if peer is not None:
            peer_gbs = nbytes / (peer * 1e-3) / 1e9
            rec.record(f"cublas_gemv_{label}_us", f"bf16 {shape}", peer * 1e3, "us", None,
                       achieved_gbs=round(peer_gbs, 1), peer="torch.mv (cuBLAS)")
            print(f"    lucegen / cuBLAS time: {ms / peer:.2f}x   ({gbs:.0f} vs {peer_gbs:.0f} GB/s)")
        for w in ws:
            w.free()
