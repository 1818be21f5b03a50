"""The spec's quantized GEMMs (QMatmul: the int8 mma from each format's first M, tuning.qgemv.gemm_mma_from or
format_mma_from; dp4a's M-tiles below it) on the 27B's projection shapes at a tree verify's M, for A/B runs of
kernel variants (a lab copy of the tree each, run from its root):

    python3 tools/verify_gemm_time.py [spec] [M,M,...] [fmt:label,...]

Weights are random blocks with valid fp16 scales (layered_weights.random_rows, as bench's random: models; speed
does not depend on the values), rotated past L2; the calls are replayed from a CUDA
graph (bench qgemv's _us_per_call) on a programmatic stream where the spec's layer-by-layer step (the verify) uses
one. Prints us a call and the fraction of the read rate measured in the same run
(bench.gemv.measure_read_gbs). Not a benchmark of record: bench speculative's verify is."""
import sys
import time

import numpy as np
from lucegen.bench.gemv import measure_read_gbs
from lucegen.bench.qgemv import _us_per_call, _weights
from lucegen.codegen.build import build
from lucegen.engine.layered_weights import random_rows
from lucegen.kernels import qgemv
from lucegen.model.config import tiny_config
from lucegen.runtime import DeviceArray, Stream, device_info
from lucegen.spec import load_spec

SHAPES = [("q4_k", "gate/up", 34816, 5120), ("q4_k", "qkv", 10240, 5120), ("q4_k", "out", 5120, 6144),
          ("q4_k", "down", 5120, 17408), ("q6_k", "down", 5120, 17408), ("q6_k", "qkv", 10240, 5120)]
MS = [int(a) for a in sys.argv[2].split(",")] if len(sys.argv) > 2 else [9, 16, 23]
only = sys.argv[3].split(",") if len(sys.argv) > 3 else None


spec = load_spec(sys.argv[1] if len(sys.argv) > 1 else "specs/h200.yaml")
info = device_info()
pairs = sorted({(f, k) for f, _, _, k in SHAPES})
t0 = time.time()
result = build(spec, tiny_config(), qgemv.units(spec, tiny_config(), pairs))
print(f"built in {time.time() - t0:.0f} s", flush=True)
stream = Stream(programmatic=spec.tuning.layered.pdl)  # as the verify step launches them
rng, pool = np.random.default_rng(1), {}
read = measure_read_gbs(spec, stream)
print(f"read rate {read:.0f} GB/s", flush=True)
for fmt, label, n, k in SHAPES:
    if only and f"{fmt}:{label}" not in only:
        continue
    module = result.module(f"qgemv_{fmt}")
    raw = random_rows(fmt, n, k, rng, pool)
    ws = _weights(raw, fmt, info.l2_bytes)
    op = qgemv.QMatmul(module, spec, fmt, k)  # (the GEMV of the tiny config the units were built for: M = 1 is not timed)
    for m in MS:
        x = DeviceArray.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
        y = DeviceArray.empty((m, n), np.float32)
        us = _us_per_call(op, ws, x, y, n, m, stream)
        frac = raw.nbytes / (us * 1e-6) / 1e9 / read
        print(f"{fmt} {label:8} {n:6}x{k:<6} M={m:<3} {op.tuning_for(m, n).name(qgemv.fmt_of(fmt), k):48} {us:8.1f} us {frac:6.1%}", flush=True)
        x.free()
        y.free()
    for w in ws:
        w.free()
