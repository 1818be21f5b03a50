"""NVML's energy counter around repeated runs (the pynvml package, nvidia-ml-py); no CUDA of its own, so that the
torch peers' process (bench/torch_peers.py) measures with it too."""
from __future__ import annotations

import time
from typing import Callable


def measure_energy(bus_id: str, seconds: float, run: Callable[[], None]) -> tuple[float, int, float, float]:
    """(joules, calls, seconds, enforced power limit in watts) of the GPU at PCI bus id `bus_id` over calls of
    `run` (which waits for the GPU) back to back for at least `seconds`, after one untimed call. By bus id: NVML
    numbers every GPU of the machine, whatever CUDA_VISIBLE_DEVICES hides from CUDA."""
    import pynvml
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        run()  # warm
        e0, t0, n = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            run()
            n += 1
        elapsed = time.perf_counter() - t0
        joules = (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - e0) / 1e3  # mJ
        return joules, n, elapsed, pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3  # mW
    finally:
        pynvml.nvmlShutdown()
