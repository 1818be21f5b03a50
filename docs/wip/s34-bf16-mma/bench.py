"""Lab: the bf16-mma Q4_K GEMM prototype (q4k_bf16.cu): correctness against gguf's dequantization, then us a call
on the 27B's Q4_K shapes at M = 1, 9, 16, 23, weights rotated past L2, replayed from a graph."""
import sys, time
from pathlib import Path
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from lucegen.codegen.nvrtc import base_options, compile_cubin
from lucegen.runtime import DeviceArray, Graph, Module, Stream, device_info
from lucegen.bench.timing import median_ms

ARCH = "sm_90"
src = (Path(__file__).parent / "q4k_bf16.cu").read_text()
t0 = time.time()
comp = compile_cubin(src, "q4k_bf16.cu", ARCH, base_options(ARCH), {})
print(f"compiled in {time.time() - t0:.1f} s")
for name, r in sorted(comp.resources.items()):
    print(f"  {name:32} {r}")
if len(sys.argv) > 1 and sys.argv[1] == "compile":
    sys.exit(0)
mod = Module(comp.cubin)
info = device_info()
stream = Stream()
rng = np.random.default_rng(0)
KERNELS = {}  # (MT, RT, KS, ST) -> kernel
for name in comp.resources:
    KERNELS[tuple(int(p[1:]) for p in name.split("_")[2:])] = mod.kernel(name)


def geo(mt, rt, ks, st, sh):
    w_slot = ks * 144 + (0 if (ks * 144 // 16) % 2 else 16)
    x_slot = ks * 512 + 32
    stage = 16 * rt * w_slot + mt * x_slot
    red = (ks - 1) * rt * (mt // 8) * 32 * 4 * 4
    return max(st * stage + rt * ks * 512, red)


def launch(cfg, w, x, y, n, k, m, stream):
    mt, rt, ks, st, sh = cfg
    kern = KERNELS[cfg]
    smem = geo(*cfg)
    kern.set_max_dynamic_smem(smem)
    blocks = (n // (16 * rt)) * ((m + mt - 1) // mt)
    kern(blocks, 32 * rt * ks, w, x, y, n, k, m, smem=smem, stream=stream)


def random_q4k(n, k, seed):
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    dd = np.random.default_rng(seed + 1).uniform(0.002, 0.02, (n, k // 256, 2)).astype(np.float16)
    raw[:, :, 0:4] = dd.view(np.uint8).reshape(n, k // 256, 4)
    return raw.reshape(n, -1)


def bf16(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def from_bf16(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


# correctness
for cfg in KERNELS:
    n, k = 256, 5120 if cfg[2] != 4 else 6144
    k = 5120 if (5120 // 256) % cfg[2] == 0 else 6144
    raw = random_q4k(n, k, 1)
    wf = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(n, k).astype(np.float64)
    for m in (1, 9, cfg[0]):
        xb = bf16(rng.standard_normal((m, k), dtype=np.float32))
        ref = from_bf16(xb).astype(np.float64) @ wf.T
        w, x = DeviceArray.from_numpy(raw), DeviceArray.from_numpy(xb)
        y = DeviceArray.from_numpy(np.full((m, n), np.nan, np.float32))
        launch(cfg, w, x, y, n, k, m, stream)
        stream.synchronize()
        out = y.numpy()
        err = np.abs(out - ref).max() / np.abs(ref).max()
        print(f"check {cfg} M={m}: max rel err {err:.2e} {'OK' if np.isfinite(out).all() and err < 2e-2 else 'FAIL'}")
        for a in (w, x, y):
            a.free()

SHAPES = [("gate/up", 34816, 5120), ("out", 5120, 6144), ("down", 5120, 17408), ("qkv", 10240, 5120)]
from lucegen.bench.gemv import measure_read_gbs
from lucegen.spec import load_spec
read = measure_read_gbs(load_spec("specs/h200.yaml"), stream)
print(f"read rate {read:.0f} GB/s", flush=True)
for label, n, k in SHAPES:
    raw = random_q4k(n, k, 2)
    copies = max(2, -(-4 * info.l2_bytes // raw.nbytes))
    ws = [DeviceArray.from_numpy(raw) for _ in range(copies)]
    for m in (1, 16, 23):
        xb = bf16(rng.standard_normal((m, k), dtype=np.float32))
        x = DeviceArray.from_numpy(xb)
        y = DeviceArray.empty((m, n), np.float32)
        line = []
        for cfg in KERNELS:
            if (k // 256) % cfg[2] or n % (16 * cfg[1]) or (cfg[0] < m and cfg[0] != 16) or (m > 16 and cfg[0] == 8) or (m <= 8 and cfg[0] > 8) or (8 < m <= 16 and cfg[0] > 16):
                continue
            with Graph.capture(stream) as graph:
                for w in ws:
                    launch(cfg, w, x, y, n, k, m, stream)
            us = median_ms(graph.launch, stream) / len(ws) * 1e3
            graph.destroy()
            line.append(f"{'m%d_r%d_k%d_s%d_h%d' % cfg}={us:.1f}us({raw.nbytes / us / 1e3 / read:.0%})")
        print(f"{label:8} {n}x{k} M={m:<3} " + "  ".join(line), flush=True)
        x.free(); y.free()
    for w in ws:
        w.free()
