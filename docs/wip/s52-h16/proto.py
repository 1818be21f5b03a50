"""Session 52 prototype: Q4_K on fp16 mma.sync (h16.cu) against the spec's GEMV / int8-mma GEMM, on the 27B's Q4_K
shapes at M = 1, 8, 16, 23. Checks first (random GGUF rows, fp16 activations): each kernel's Y against float64 over
gguf's dequantization, and h16's rows at M = 23 against its own M = 1 calls bit for bit (one arithmetic for every M).
Then us a call, replayed from a graph with the weights rotated past L2. Run from the repo root (PYTHONPATH=.)."""
import os
import sys
import time
from pathlib import Path

import numpy as np

from lucegen.bench.gemv import measure_read_gbs
from lucegen.bench.qgemv import _us_per_call, _weights
from lucegen.bench.timing import median_ms
from lucegen.codegen.build import build
from lucegen.codegen.nvrtc import base_options, compile_cubin
from lucegen.engine.layered_weights import random_rows
from lucegen.kernels import qgemv
from lucegen.model.config import load_config
from lucegen.model.quants import dequantize
from lucegen.runtime import DeviceArray, Graph, Stream, device_info
from lucegen.runtime.module import Module
from lucegen.spec import load_spec

HERE = Path(__file__).resolve().parent
TSB = 2048 + 256 + 64
# (label, N, K, ksplit)
SHAPES = [("gate/up", 34816, 5120, 1), ("qkv", 10240, 5120, 3), ("out", 5120, 6144, 6), ("down", 5120, 17408, 6)]
MS = [1, 8, 16, 23]
if os.environ.get("H16_SHAPES"):
    SHAPES = [sh for sh in SHAPES if sh[0] in os.environ["H16_SHAPES"].split(",")]


def q4k_fields(raw: np.ndarray, k: int):
    """GGUF Q4_K rows -> q [N, K] (0..15), sc, m [N, K/32], d, dmin [N, K/256] (fp16 bits)."""
    n = raw.shape[0]
    b = raw.reshape(n, k // 256, 144)
    d = b[:, :, 0:2].copy().view(np.uint16)[..., 0]
    dmin = b[:, :, 2:4].copy().view(np.uint16)[..., 0]
    s = b[:, :, 4:16].astype(np.uint32)
    sc = np.empty((n, k // 256, 8), np.uint32)
    m = np.empty_like(sc)
    sc[..., :4], m[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = b[:, :, 16:144].reshape(n, k // 256, 4, 32)
    q = np.empty((n, k // 256, 4, 2, 32), np.uint32)
    q[:, :, :, 0], q[:, :, :, 1] = qs & 0xF, qs >> 4
    return q.reshape(n, k), sc.reshape(n, k // 32), m.reshape(n, k // 32), d, dmin


def repack(raw: np.ndarray, k: int) -> np.ndarray:
    """GGUF Q4_K rows [N, ...] -> h16.cu's layout: per (row tile, super-block) TSB bytes."""
    q, sc, m, d, dmin = q4k_fields(raw, k)
    n, sbs = raw.shape[0], k // 256
    tiles = n // 16
    q = q.reshape(tiles, 16, sbs, 256)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    kk = (4 * np.arange(4)[:, None, None] + np.arange(4)[None, None, :])  # [c, 1, i]
    k0 = 16 * kk + 2 * t[None, :, None]  # [c, lane, i]
    G = np.broadcast_to(g[None, :, None], k0.shape)
    words = np.zeros((tiles, sbs, 4, 32, 4), np.uint32)
    for nib, (dr, dk) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8), (0, 1), (8, 1), (0, 9), (8, 9)]):
        words |= q[:, G + dr, :, k0 + dk].transpose(3, 4, 0, 1, 2) << (4 * nib)
    sc = sc.reshape(tiles, 16, sbs, 8)
    m = m.reshape(tiles, 16, sbs, 8)
    scw = sc[:, :8] | m[:, :8] << 8 | sc[:, 8:] << 16 | m[:, 8:] << 24  # [tile, pair g, sb, j]
    d = d.reshape(tiles, 16, sbs).astype(np.uint32)
    dmin = dmin.reshape(tiles, 16, sbs).astype(np.uint32)
    dw = np.stack([d[:, :8] | d[:, 8:] << 16, dmin[:, :8] | dmin[:, 8:] << 16], -1)  # [tile, g, sb, 2]
    out = np.empty((tiles, sbs, TSB // 4), np.uint32)
    out[:, :, :512] = words.reshape(tiles, sbs, 512)
    out[:, :, 512:576] = scw.transpose(0, 2, 1, 3).reshape(tiles, sbs, 64)
    out[:, :, 576:592] = dw.transpose(0, 2, 1, 3).reshape(tiles, sbs, 16)
    return out.view(np.uint8).ravel()


def h16_call(module, kernels, w, x16, part, y, n, m, k, ksplit, stream):
    mt = 8 if m <= 8 else 16 if m <= 16 else 24
    warps = 8
    kern = kernels[mt]
    smem = 3 * mt * 264 * 2
    grid = (-(-(n // 16) // warps), ksplit)
    kern(grid, 32 * warps, w, x16, part if ksplit > 1 else y, n, m, k, ksplit, smem=smem, stream=stream)
    if ksplit > 1:
        module.kernel("h16_reduce")(264, 256, part, y, m * n, ksplit, stream=stream)


def main() -> int:
    spec = load_spec("specs/h200.yaml")
    info = device_info()
    module = Module(compile_cubin((HERE / "h16.cu").read_text(), "h16.cu", info.arch, base_options(info.arch), {}).cubin)
    kernels = {mt: module.kernel(f"h16_m{mt}_w8_s3") for mt in (8, 16, 24)}
    t0 = time.time()
    model = load_config("qwen3.5-27b")
    result = build(spec, model, qgemv.units(spec, model, sorted({("q4_k", k) for _, _, k, _ in SHAPES})))
    print(f"built in {time.time() - t0:.0f} s", flush=True)
    qmod = result.module("qgemv_q4_k")
    stream = Stream(programmatic=spec.tuning.layered.pdl)
    rng, pool = np.random.default_rng(7), {}
    read = measure_read_gbs(spec, stream)
    print(f"{info.name} read rate {read:.0f} GB/s", flush=True)
    for label, n, k, ksplit in SHAPES:
        raw = random_rows("q4_k", n, k, rng, pool)
        op = qgemv.QMatmul(qmod, spec, "q4_k", k, model=model.name)
        packed = repack(raw, k)
        wdq = dequantize(raw, "q4_k").reshape(n, k).astype(np.float64)
        xs = rng.standard_normal((max(MS), k)).astype(np.float16)
        x32 = DeviceArray.from_numpy(xs.astype(np.float32))
        x16 = DeviceArray.from_numpy(xs)
        part = DeviceArray.empty((ksplit, max(MS), n), np.float32)
        hw = [qgemv.device_bytes(packed) for _ in range(max(1, -(-4 * info.l2_bytes // packed.nbytes)))]
        qw = _weights(raw, "q4_k", info.l2_bytes)
        # checks
        ref = xs.astype(np.float64) @ wdq.T
        y = DeviceArray.from_numpy(np.full((max(MS), n), np.nan, np.float32))
        h16_call(module, kernels, hw[0], x16, part, y, n, max(MS), k, ksplit, stream)
        stream.synchronize()
        yh = y.numpy().reshape(max(MS), n)
        y1 = DeviceArray.from_numpy(np.full((1, n), np.nan, np.float32))
        same = True
        for r in (0, 5, max(MS) - 1):
            xr = DeviceArray.from_numpy(xs[r:r + 1])
            h16_call(module, kernels, hw[0], xr, part, y1, n, 1, k, ksplit, stream)
            stream.synchronize()
            same &= np.array_equal(y1.numpy().reshape(n).view(np.uint32), yh[r].view(np.uint32))
            xr.free()
        yq = DeviceArray.from_numpy(np.full((max(MS), n), np.nan, np.float32))
        op(qw[0], x32, yq, n, max(MS), stream=stream)
        stream.synchronize()
        yqn = yq.numpy().reshape(max(MS), n)
        err = lambda a: float(np.linalg.norm(a - ref) / np.linalg.norm(ref))
        print(f"{label}: rel err h16 {err(yh):.2e} (nan {np.isnan(yh).sum()}), int8 {err(yqn):.2e}; "
              f"h16 rows at M = {max(MS)} equal its M = 1 calls bit for bit: {same}", flush=True)
        for m in MS:
            yt = DeviceArray.empty((m, n), np.float32)
            us_q = _us_per_call(op, qw, x32, yt, n, m, stream)
            with Graph.capture(stream) as graph:
                for w in hw:
                    h16_call(module, kernels, w, x16, part, yt, n, m, k, ksplit, stream)
            us_h = median_ms(graph.launch, stream) / len(hw) * 1e3
            graph.destroy()
            fq = raw.nbytes / (us_q * 1e-6) / 1e9 / read
            fh = packed.nbytes / (us_h * 1e-6) / 1e9 / read
            print(f"q4_k {label:8} {n:6}x{k:<6} M={m:<3} spec {op.tuning_for(m, n).name(qgemv.fmt_of('q4_k'), k):44} "
                  f"{us_q:7.1f} us {fq:6.1%} | h16 ksplit {ksplit} {us_h:7.1f} us {fh:6.1%}", flush=True)
            yt.free()
        for a in (x32, x16, part, y, y1, yq, *hw, *qw):
            a.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
