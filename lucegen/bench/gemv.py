"""GEMV micro-benchmark: achieved bandwidth on the LM-head shape and time per call on a small shape.

The LM head of Qwen3.5 (248320 x 1024 bf16, 508 MB) is far larger than L2, so one call measures DRAM. The small
shape (6144 x 1024, 12.6 MB) is latency-bound; 64 copies are rotated so that L2 does not serve it. The ceiling is
measured in the same run: one streaming read of 2 GiB (kernels/memread.py).
"""
from __future__ import annotations

import dataclasses
import itertools

import ml_dtypes
import numpy as np

from ..codegen.build import build
from ..kernels import gemv, memread
from ..model.config import tiny_config
from ..runtime import DeviceArray, Stream, device_info
from ..spec import ChipSpec, spec_for_current_device
from .peers import peer
from .results import Recorder
from .timing import median_ms

SHAPES = {"lm_head": (248320, 1024), "small": (6144, 1024)}
# (distinct matrices, calls of each) per timed batch: the LM head is 8x L2, so one copy called back to back
# measures DRAM; the small shape needs 64 copies (805 MB) rotated so that L2 does not serve it.
BATCH = {"lm_head": (1, 8), "small": (64, 1)}
READ_BYTES = 2 << 30


def with_gemv(spec: ChipSpec, **knobs) -> ChipSpec:
    g = dataclasses.replace(spec.tuning.gemv, **knobs)
    return dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, gemv=g))


def measure_read_gbs(spec: ChipSpec, stream: Stream) -> float:
    """A pure streaming read of 2 GiB: the bandwidth ceiling of this GPU right now."""
    op = memread.ReadXor(build(spec, tiny_config(), memread.units(spec)).module("memread"), spec)
    with DeviceArray.empty(READ_BYTES, np.uint8) as buf:
        buf.fill_bytes(0x5A)
        ms = median_ms(lambda s: op.launch(buf, stream=s), stream, repeat=20)
    return READ_BYTES / (ms * 1e-3) / 1e9


def _variants(spec: ChipSpec):
    for threads, rows, bps in itertools.product((128, 256, 512), (1, 2, 4), (2, 4, 8)):
        if bps * threads <= spec.chip.max_threads_per_sm:
            yield dict(method="ldg", threads=threads, rows_per_warp=rows, blocks_per_sm=bps)
    if spec.chip.cc >= 90:
        for threads, stages, tile, bps in itertools.product((128, 256), (2, 3, 4, 6), (8192, 16384, 32768), (1, 2, 3)):
            if stages * tile * bps < spec.chip.smem_per_sm - 8192:
                yield dict(method="bulk", threads=threads, stages=stages, tile_bytes=tile, blocks_per_sm=bps)


def sweep(spec: ChipSpec, stream: Stream, read_gbs: float) -> dict:
    """Time the LM-head shape for every tuning variant, print a table, return the fastest variant's knobs."""
    n, k = SHAPES["lm_head"]
    rng = np.random.default_rng(1)
    w = DeviceArray.from_numpy(rng.standard_normal((n, k), dtype=np.float32).astype(ml_dtypes.bfloat16))
    x = DeviceArray.from_numpy(rng.standard_normal(k, dtype=np.float32).astype(ml_dtypes.bfloat16))
    y = DeviceArray.empty(n, np.float32)
    best = (0.0, {})
    print(f"{'variant':<72} {'us':>7} {'GB/s':>6} {'of read':>7}")
    for knobs in _variants(spec):
        s = with_gemv(spec, **knobs)
        op = gemv.Gemv(build(s, tiny_config(), gemv.units(s, tiny_config(), [k])).module("gemv_bf16"), s, k)
        ms = median_ms(lambda st: op(w, x, y, stream=st), stream, warmup_s=0.05)
        gbs = (n * k * 2) / (ms * 1e-3) / 1e9
        print(f"{str(knobs):<72} {ms * 1e3:7.1f} {gbs:6.0f} {gbs / read_gbs:7.1%}")
        best = max(best, (gbs, knobs), key=lambda b: b[0])
    w.free()
    print(f"fastest: {best[1]} at {best[0]:.0f} GB/s")
    return best[1]


def run(recorder: Recorder | None = None, tune: bool = False) -> None:
    spec = spec_for_current_device()
    rec = recorder or Recorder(gpu=device_info().name)
    stream = Stream()
    read_gbs = measure_read_gbs(spec, stream)
    rec.record("read_gbs", "2 GiB streaming read", read_gbs, "GB/s", spec.chip.bandwidth_gbs)
    torch_gbs = peer("read_gbs", READ_BYTES)
    if torch_gbs is not None:
        rec.record("read_gbs", "2 GiB torch.sum", torch_gbs, "GB/s", spec.chip.bandwidth_gbs, peer="torch")
        read_gbs = max(read_gbs, torch_gbs)
    print(f"read ceiling for the ratios below: {read_gbs:.0f} GB/s (the faster of the two reads)")
    if tune:
        spec = with_gemv(spec, **sweep(spec, stream, read_gbs))
    print(f"spec {spec.name}, gemv {spec.tuning.gemv}")
    ks = sorted({k for _, k in SHAPES.values()})
    op = gemv.Gemv(build(spec, tiny_config(), gemv.units(spec, tiny_config(), ks)).module("gemv_bf16"), spec, 1024)
    rng = np.random.default_rng(0)
    peers = peer("mm_us", [(n, k, 1, *BATCH[label]) for label, (n, k) in SHAPES.items()]) or [None] * len(SHAPES)
    for (label, (n, k)), peer_us in zip(SHAPES.items(), peers):
        distinct, repeats = BATCH[label]
        host = rng.standard_normal((n, k), dtype=np.float32).astype(ml_dtypes.bfloat16)
        ws = [DeviceArray.from_numpy(host) for _ in range(distinct)] * repeats
        x = DeviceArray.from_numpy(rng.standard_normal(k, dtype=np.float32).astype(ml_dtypes.bfloat16))
        y = DeviceArray.empty(n, np.float32)

        def calls(s, ws=ws, x=x, y=y):
            for w in ws:
                op(w, x, y, stream=s)

        ms = median_ms(calls, stream) / len(ws)
        nbytes = n * k * 2 + k * 2 + n * 4
        gbs = nbytes / (ms * 1e-3) / 1e9
        shape = f"bf16 {n}x{k}"
        if label == "lm_head":
            rec.record("gemv_bw_frac", shape, gbs / read_gbs, "fraction", 1.0, achieved_gbs=round(gbs, 1),
                       read_gbs=round(read_gbs, 1), method=spec.tuning.gemv.method)
        rec.record(f"gemv_{label}_us", shape, ms * 1e3, "us", nbytes / read_gbs / 1e3, achieved_gbs=round(gbs, 1))
        if peer_us is not None:
            peer_gbs = nbytes / (peer_us * 1e-6) / 1e9
            rec.record(f"cublas_gemv_{label}_us", shape, peer_us, "us", nbytes / read_gbs / 1e3,
                       achieved_gbs=round(peer_gbs, 1), peer="torch.mv (cuBLAS)")
            print(f"    lucegen / cuBLAS time: {ms * 1e3 / peer_us:.2f}x   ({gbs:.0f} vs {peer_gbs:.0f} GB/s)")
        for w in ws:
            w.free()
