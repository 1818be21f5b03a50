"""The read-bandwidth ceiling, measured by the benchmarks in the same run as the kernels they rate."""
from __future__ import annotations

import ctypes

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec

THREADS, UNROLL, BLOCKS_PER_SM = 512, 4, 4


def reference(data: np.ndarray) -> int:
    """XOR of every 32-bit word."""
    return int(np.bitwise_xor.reduce(data.view(np.uint32).ravel()))


def units(spec: ChipSpec) -> list[KernelUnit]:
    return [KernelUnit("memread", "memread.cu.j2", {"threads": THREADS, "unroll": UNROLL},
                       (KernelSig("read_xor_u128", THREADS),))]


class ReadXor:
    """Reads a whole device buffer (a multiple of 16 bytes) once; returns the XOR of its 32-bit words."""

    def __init__(self, module, spec: ChipSpec):
        self.kernel = module.kernel("read_xor_u128")
        self.blocks = BLOCKS_PER_SM * spec.chip.sm_count
        self.partials = DeviceArray.empty(self.blocks, np.uint32)

    def launch(self, data: DeviceArray, stream=None) -> None:
        if data.nbytes % 16:
            raise ValueError(f"read_xor reads 16-byte words; the buffer has {data.nbytes} bytes")
        self.kernel(self.blocks, THREADS, data, (data.nbytes // 16, ctypes.c_longlong), self.partials, stream=stream)

    def result(self) -> int:
        return int(np.bitwise_xor.reduce(self.partials.numpy()))
