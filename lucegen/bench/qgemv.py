"""Quantized GEMV / GEMM micro-benchmark: achieved bandwidth per weight format and per M on the 27B shapes.

Y [M, N] = X [M, K] W^T for W in each format of the spec, M in MS, on the 27B's widest matrices (SHAPES). The
figure of merit is the quantized weight bytes over the time per call: for M = 1 the GEMV should stream them at the
read ceiling, measured in the same run (bench.gemv.measure_read_gbs); larger M shows where the arithmetic per
activation row takes over. Each timed batch rotates distinct copies of the matrix, at least 4x L2 in all, so that
L2 does not serve them. The peer, where torch is installed, is cuBLAS in bf16 (torch.mm) on the same shape and M.

The calls are replayed from a CUDA graph, and for the quantized formats X is quantized to 8 bits per 32 values
once beforehand (in the decode step the kernel that writes X does it): the time is the product's alone. What that
quantization costs in accuracy is recorded beside the speed: the relative error (Frobenius) of the M = 1 output
against the exact product in float64 on normal activations.

Records: qgemv_bw_frac (the fraction of the read ceiling; achieved GB/s and us per call beside it), model
"<format> <N>x<K> M=<M>"; qgemv_time_vs_m1 (time per call over the M = 1 call's, M > 1); qgemv_rel_err per format
and shape (M = 1); cublas_bf16_us for the peer. The batch-invariant tensor-core kernels (kernels/qgemm_tc.py, one
kernel for every M; Q4_K) are timed the same way on the same shapes at TC_MS: qgemm_tc_bw_frac, their X
converted to fp16 beforehand as the quantized formats' XBlocks are.
"""
from __future__ import annotations

import numpy as np

from ..codegen.build import build
from ..kernels import qgemm_tc, qgemv
from ..model.config import tiny_config
from ..runtime import DeviceArray, Graph, Stream, device_info
from ..spec import spec_for_current_device
from .gemv import measure_read_gbs
from .peers import peer
from .results import Recorder
from .timing import median_ms

# (N, K): ffn_gate / ffn_up, ffn_down, the DeltaNet attn_qkv
SHAPES = {"ffn_up": (17408, 5120), "ffn_down": (5120, 17408), "attn_qkv": (10240, 5120)}
MS = (1, 4, 16, 64)
TC_MS = (1, 8, 9, 16, 17, 33, 48)  # the decode GEMV and tree verifies of up to 47 nodes


def _us_per_call(op: qgemv.QMatmul, ws: list[DeviceArray], x: DeviceArray, y: DeviceArray, n: int, m: int,
                 stream: Stream) -> float:
    """Median microseconds of one product, the distinct weight copies `ws` rotated (so that L2 does not serve
    them), replayed from one CUDA graph: launched one by one from Python, a call of a few microseconds on the
    device waits for its launch instead (every 10240 x 5120 Q4_K call took ~39 us whatever its tuning). For the
    quantized formats X's XBlocks are made once beforehand, as the decode step's row kernels make them."""
    op(ws[0], x, y, n, m, stream=stream)  # the quantized formats: X's XBlocks into op.xq
    with Graph.capture(stream) as graph:
        for w in ws:
            op(w, x, y, n, m, stream=stream, xq=op.xq)
    us = median_ms(graph.launch, stream) / len(ws) * 1e3
    graph.destroy()
    return us


def tensor_cores(rec: Recorder, spec, read_gbs: float, stream: Stream, rng: np.random.Generator) -> None:
    """kernels/qgemm_tc.py's kernels on SHAPES at TC_MS, replayed from a graph with the weights rotated as
    _us_per_call does; the same records as qgemv_bw_frac under qgemm_tc_bw_frac."""
    info = device_info()
    module = build(spec, tiny_config(), qgemm_tc.units(spec)).module(qgemm_tc.UNIT)
    for fmt, (label, (n, k)) in ((f, shape) for f in qgemm_tc.TENSOR_CORE_FORMATS for shape in SHAPES.items()):
        op = qgemm_tc.QGemmTC(module, spec, fmt, max(TC_MS), k)
        raw = qgemv.encode(rng.standard_normal((n, k), dtype=np.float32), fmt)
        ws = [qgemm_tc.device_weights(raw, fmt) for _ in range(max(1, -(-4 * info.l2_bytes // raw.nbytes)))]
        for m in TC_MS:
            x = DeviceArray.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
            y = DeviceArray.empty((m, n), np.float32)
            op(ws[0], x, y, n, m, stream=stream)  # X to fp16, once
            with Graph.capture(stream) as graph:
                for w in ws:
                    op.product(w, y, n, m, stream=stream)
            us = median_ms(graph.launch, stream) / len(ws) * 1e3
            graph.destroy()
            gbs = raw.nbytes / (us * 1e-6) / 1e9
            rec.record("qgemm_tc_bw_frac", f"{fmt} {n}x{k} M={m}", gbs / read_gbs, "fraction", 1.0,
                       achieved_gbs=round(gbs, 1), read_gbs=round(read_gbs, 1), us=round(us, 2), shape=label)
            print(f"tensor cores {fmt} {label:<10} {f'{n}x{k}':>12} {m:>3} {us:9.1f} {gbs:7.0f} {gbs / read_gbs:7.1%}")
            x.free()
            y.free()
        for w in ws:
            w.free()
        op.free()


def _weights(raw: np.ndarray, fmt: str, l2_bytes: int) -> list[DeviceArray]:
    """Copies of a matrix (GGUF rows of `fmt`) on the device, at least 4x L2 in all."""
    return [qgemv.device_weights(raw, fmt) for _ in range(max(1, -(-4 * l2_bytes // raw.nbytes)))]


# bench qgemv --tune: the tunings swept, per M class (the spec's own are among them)
TUNE_GEMV = [*(qgemv.Tuning(256, r, 1, s) for r in (1, 2) for s in (1, 2, 4)),
             *(qgemv.Tuning(t, r, 1, s, st) for t in (128, 256) for r in (1, 2) for s in (1, 2) for st in (3, 4, 8)),
             *(qgemv.Tuning(256, 1, 1, 1, min_blocks=b) for b in (4, 5, 6, 8))]
TUNE_GEMM = [qgemv.Tuning(t, r, mt, 1, st) for t, r in ((256, 1), (256, 2), (128, 4)) for mt in (4, 8, 16)
             for st in (0, 3)] + [qgemv.Tuning(256, 1, mt, 1, 3, mma=True) for mt in (16, 32)]
# (rows per warp: each activation load serves that many rows; mma: int8 tensor cores, the formats that have them;
# mb: blocks an SM at least, a register cap for more warps)
TUNE_FORMATS = ("q4_k", "q6_k")  # Q4_K_M's two
TUNE_MS = (1, 16, 64)


def _label(t: qgemv.Tuning) -> str:
    if t.mma:
        return f"mma mt{t.mt}"
    return (f"t{t.threads} r{t.rows} mt{t.mt} s{t.span}" + (f" st{t.stages}" if t.stages else "") +
            (f" mb{t.min_blocks}" if t.min_blocks != 2 else ""))


def tune(rec: Recorder, spec, read_gbs: float, stream: Stream) -> None:
    """Every tuning of TUNE_GEMV (M = 1) and TUNE_GEMM (M in TUNE_MS) on each shape for Q4_K_M's formats; records
    qgemv_tune_bw_frac per tuning and prints the best per format and M."""
    info = device_info()
    pairs = sorted({(f, k) for f in TUNE_FORMATS for _, k in SHAPES.values()})
    result = build(spec, tiny_config(), qgemv.units(spec, tiny_config(), pairs, extra=TUNE_GEMV + TUNE_GEMM))
    rng = np.random.default_rng(1)
    best: dict[tuple[str, int], dict[qgemv.Tuning, list]] = {}  # (format, M): {tuning: [us, bytes] over shapes}
    for fmt in TUNE_FORMATS:
        module, f = result.module(f"qgemv_{fmt}"), qgemv.fmt_of(fmt)
        for label, (n, k) in SHAPES.items():
            raw = qgemv.encode(rng.standard_normal((n, k), dtype=np.float32), fmt)
            ws = _weights(raw, fmt, info.l2_bytes)
            slices = -(-k // f.slice_values)
            for m in TUNE_MS:
                x = DeviceArray.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
                y = DeviceArray.empty((m, n), np.float32)
                for t in TUNE_GEMV if m == 1 else TUNE_GEMM:
                    if t.span > slices:
                        continue
                    op = qgemv.QMatmul(module, spec, fmt, k, kernels=(t,))
                    us = _us_per_call(op, ws, x, y, n, m, stream)
                    frac = raw.nbytes / (us * 1e-6) / 1e9 / read_gbs
                    print(f"  {fmt} {label:<9} M={m:<3} {_label(t)}: {us:8.1f} us "
                          f"{frac:6.1%} of the read rate")
                    best.setdefault((fmt, m), {}).setdefault(t, [0.0, 0])
                    best[fmt, m][t][0] += us
                    best[fmt, m][t][1] += raw.nbytes
                x.free()
                y.free()
            for w in ws:
                w.free()
    for (fmt, m), times in best.items():  # a tuning that skipped a shape (span past its slices) is not ranked
        shapes = max(b for _, b in times.values())
        ranked = sorted(((t, us) for t, (us, b) in times.items() if b == shapes), key=lambda kv: kv[1])
        print(f"{fmt} M={m}: best of {len(ranked)} tunings (us summed over the shapes): " +
              ", ".join(f"{_label(t)} {us:.1f}" for t, us in ranked[:4]))
        t, us = ranked[0]
        rec.record("qgemv_tune_bw_frac", f"{fmt} M={m} (3 shapes)", shapes / (us * 1e-6) / 1e9 / read_gbs, "fraction",
                   1.0, us=round(us, 2), threads=t.threads, rows=t.rows, mt=t.mt, span=t.span)


def run(recorder: Recorder | None = None, tune_knobs: bool = False) -> None:
    spec = spec_for_current_device()
    info = device_info()
    rec = recorder or Recorder(gpu=info.name)
    stream = Stream()
    read_gbs = measure_read_gbs(spec, stream)
    rec.record("read_gbs", "2 GiB streaming read", read_gbs, "GB/s", spec.chip.bandwidth_gbs)
    pairs = sorted({(f, k) for f in spec.tuning.weight_formats for _, k in SHAPES.values()})
    result = build(spec, tiny_config(), qgemv.units(spec, tiny_config(), pairs))
    rng = np.random.default_rng(0)
    # cuBLAS bf16 on the Q4_K shapes, (n, k, m) -> us (copies of W rotated past L2, as ours), in one torch process
    shapes = [(n, k, m) for n, k in SHAPES.values() for m in MS] if "q4_k" in spec.tuning.weight_formats else []
    copies = [max(1, -(-4 * info.l2_bytes // (2 * n * k))) for n, k, _ in shapes]
    peers = dict(zip(shapes, (peer("mm_us", [(*s, c) for s, c in zip(shapes, copies)]) if shapes else None) or []))
    print(f"spec {spec.name}; read ceiling {read_gbs:.0f} GB/s")
    print(f"{'format':<6} {'shape':<10} {'N x K':>12} {'M':>3} {'us':>9} {'GB/s':>7} {'of read':>7} {'cuBLAS bf16 us':>15}")
    for fmt in spec.tuning.weight_formats:
        module = result.module(f"qgemv_{fmt}")
        for label, (n, k) in SHAPES.items():
            op = qgemv.QMatmul(module, spec, fmt, k)
            raw = qgemv.encode(rng.standard_normal((n, k), dtype=np.float32), fmt)
            ws = _weights(raw, fmt, info.l2_bytes)
            for m in MS:
                x = DeviceArray.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
                y = DeviceArray.empty((m, n), np.float32)
                us = _us_per_call(op, ws, x, y, n, m, stream)
                gbs = raw.nbytes / (us * 1e-6) / 1e9
                name = f"{fmt} {n}x{k} M={m}"
                t = op.tuning_for(m, n)
                rec.record("qgemv_bw_frac", name, gbs / read_gbs, "fraction", 1.0, achieved_gbs=round(gbs, 1),
                           read_gbs=round(read_gbs, 1), us=round(us, 2), shape=label,
                           tuning=_label(t))
                if m == 1:
                    us_m1 = us
                    exact = qgemv.reference(raw, fmt, x.numpy().reshape(1, k))
                    err = float(np.linalg.norm(y.numpy().reshape(1, n) - exact) / np.linalg.norm(exact))
                    rec.record("qgemv_rel_err", f"{fmt} {n}x{k} M=1", err, "fraction", None, shape=label)
                else:  # the goal for a tree verify: M = 16 within about 2x of M = 1
                    rec.record("qgemv_time_vs_m1", name, us / us_m1, "ratio", None, shape=label)
                cublas_us = peers.get((n, k, m)) if fmt == "q4_k" else None
                if cublas_us is not None:
                    rec.record("cublas_bf16_us", f"bf16 {n}x{k} M={m}", cublas_us, "us", peer="torch.mm (cuBLAS)")
                print(f"{fmt:<6} {label:<10} {f'{n}x{k}':>12} {m:>3} {us:9.1f} {gbs:7.0f} {gbs / read_gbs:7.1%} "
                      f"{'' if cublas_us is None else f'{cublas_us:15.1f}'}")
                x.free()
                y.free()
            for w in ws:
                w.free()
    tensor_cores(rec, spec, read_gbs, stream, rng)
    if tune_knobs:
        tune(rec, spec, read_gbs, stream)
