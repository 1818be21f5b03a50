"""What a kernel boundary costs in a CUDA graph on this GPU: graphs of N launches of a kernel that does nothing but
the programmatic-launch handshake (and one store), with and without programmatic dependent launch, at grids of a
row kernel's size up to a GEMV's. Prints the median time a launch over 7 replays of each graph.

    python3 tools/kernel_boundary.py [--launches 600]

Session 27 (results/logs/h200-s27-run4-kernel-boundary.txt): ~0.5 us a boundary with PDL for grids of up to 132
blocks; past a wave the grid's blocks themselves cost ~1.3 ns each (4,352 blocks: 5.65 us).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lucegen.codegen.nvrtc import base_options, compile_cubin  # noqa: E402
from lucegen.runtime import DeviceArray, Event, Graph, Stream, device_info  # noqa: E402
from lucegen.runtime.module import Module  # noqa: E402

SOURCE = r'''
extern "C" __global__ void handshake(float* out) {
    asm volatile("griddepcontrol.launch_dependents;" :::);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] += 1.f;
}
'''
GRIDS = ((1, 32), (10, 256), (132, 256), (1584, 128), (4352, 128))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=600, help="launches a graph (default 600: a 27B step's)")
    a = ap.parse_args()
    arch = device_info().arch
    kernel = Module(compile_cubin(SOURCE, "handshake.cu", arch, base_options(arch), {}).cubin).kernel("handshake")
    out = DeviceArray.from_numpy(np.zeros(4, np.float32))
    for programmatic in (False, True):
        stream = Stream(programmatic=programmatic)
        for blocks, threads in GRIDS:
            with Graph.capture(stream) as graph:
                for _ in range(a.launches):
                    kernel(blocks, threads, out, stream=stream)
            graph.launch(stream)
            times = []
            for _ in range(7):
                start, end = Event().record(stream), Event()
                graph.launch(stream)
                times.append(start.elapsed_ms(end.record(stream)) * 1e3 / a.launches)
            graph.destroy()
            print(f"pdl={programmatic} grid {blocks:5d} x {threads:3d}: {sorted(times)[3]:.2f} us a launch", flush=True)
        stream.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
