"""Lab: stream_copy.cu (the verify GEMM's bytes moved the decode GEMV's way, no multiply): us a call on the 27B's
Q4_K shapes at M = 9, 16, 23 (weights rotated past L2, replayed from a graph), against the weights at the read
rate. Run from a lab copy of the tree: python3 ../stream/bench.py"""
import sys, time
from pathlib import Path
import numpy as np
from lucegen.bench.gemv import measure_read_gbs
from lucegen.bench.timing import median_ms
from lucegen.codegen.nvrtc import base_options, compile_cubin
from lucegen.runtime import DeviceArray, Graph, Module, Stream, device_info
from lucegen.spec import load_spec

ARCH = "sm_90"
comp = compile_cubin((Path(__file__).parent / "stream_copy.cu").read_text(), "stream_copy.cu", ARCH,
                     base_options(ARCH), {})
for name, r in sorted(comp.resources.items()):
    print(f"  {name:32} {r}")
if sys.argv[1:] == ["compile"]:
    sys.exit(0)
mod = Module(comp.cubin)
info = device_info()
stream = Stream()
read = measure_read_gbs(load_spec("specs/h200.yaml"), stream)
print(f"{info.name}: read rate {read:.0f} GB/s", flush=True)
kernels = {tuple(int(p[1:]) for p in n.split("_")[2:]): mod.kernel(n) for n in comp.resources}


def smem(mt, tiles, st, mb):
    return 8 * st * 16 * (16 * tiles * 5 + mt * 4 * 48 // 16)


rng = np.random.default_rng(0)
for label, n, k in [("gate/up", 34816, 5120), ("qkv", 10240, 5120), ("out", 5120, 6144), ("down", 5120, 17408)]:
    wbytes = n * k // 256 * 144
    ws = [DeviceArray.from_numpy(rng.integers(0, 256, wbytes, dtype=np.uint8))
          for _ in range(max(2, -(-4 * info.l2_bytes // wbytes)))]
    for m in (9, 16, 23):
        x = DeviceArray.from_numpy(rng.integers(0, 256, m * k // 32 * 48, dtype=np.uint8))
        y = DeviceArray.empty(64 * 1024, np.float32)
        line = []
        for cfg, kern in kernels.items():
            mt, tiles = cfg[0], cfg[1]
            kern.set_max_dynamic_smem(smem(*cfg))
            blocks = -(-n // (16 * tiles)) * -(-m // mt)
            with Graph.capture(stream) as graph:
                for w in ws:
                    kern(blocks, 256, w, x, y, n, k, m, smem=smem(*cfg), stream=stream)
            us = median_ms(graph.launch, stream) / len(ws) * 1e3
            graph.destroy()
            line.append(f"{'m%d_r%d_s%d_b%d' % cfg}={us:.1f}us({wbytes / us / 1e3 / read:.0%})")
        print(f"{label:8} {n}x{k} M={m:<3} " + "  ".join(line), flush=True)
        x.free(); y.free()
    for w in ws:
        w.free()
