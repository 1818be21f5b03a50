"""Device memory with clear ownership, and host <-> device copies of numpy arrays (bf16 through ml_dtypes).

A DeviceArray either owns its allocation (freed by `free()`, by leaving a `with` block, or when collected) or is a
view into another array's memory (never frees). Shapes and dtypes travel with the pointer so copies are checked.
"""
from __future__ import annotations

import math
from typing import Sequence

import ml_dtypes  # noqa: F401  (registers numpy's bfloat16 dtype)
import numpy as np

from .driver import call

# cuMemFree while this thread captures a stream is an unsafe call: it fails and invalidates the capture (the next
# launch: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED). Python may collect an unreachable DeviceArray, and free it, at any
# allocation, including inside the code a capture runs; so frees asked for during a capture wait for its end
# (runtime.stream.Graph calls capture_began / capture_ended).
_captures = 0
_deferred: list[int] = []


def capture_began() -> None:
    global _captures
    _captures += 1


def capture_ended() -> None:
    """The capture is over: the frees it deferred happen now (once no capture is left)."""
    global _captures
    _captures -= 1
    while not _captures and _deferred:
        call("cuMemFree", _deferred.pop())


class DeviceArray:
    def __init__(self, ptr: int, shape: Sequence[int], dtype, owner: bool):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self._owner = owner

    # ---- allocation ---------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, shape: Sequence[int] | int, dtype) -> "DeviceArray":
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = max(1, math.prod(shape) * np.dtype(dtype).itemsize)
        return cls(int(call("cuMemAlloc", nbytes)), shape, dtype, owner=True)

    @classmethod
    def zeros(cls, shape, dtype) -> "DeviceArray":
        a = cls.empty(shape, dtype)
        a.fill_bytes(0)
        return a

    @classmethod
    def from_numpy(cls, host: np.ndarray) -> "DeviceArray":
        a = cls.empty(host.shape, host.dtype)
        a.copy_from(host)
        return a

    # ---- properties ---------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def view(self, shape: Sequence[int] | int, dtype=None, offset_bytes: int = 0) -> "DeviceArray":
        """A non-owning view of part of this memory with another shape or dtype."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = np.dtype(dtype or self.dtype)
        if offset_bytes < 0 or offset_bytes + math.prod(shape) * dtype.itemsize > self.nbytes:
            raise ValueError(f"view of {shape} {dtype} at byte {offset_bytes} exceeds {self.nbytes} bytes")
        return DeviceArray(self.ptr + offset_bytes, shape, dtype, owner=False)

    # ---- copies -------------------------------------------------------------------------------------------
    def copy_from(self, host: np.ndarray, stream=None) -> None:
        host = np.ascontiguousarray(host)
        if host.dtype != self.dtype or host.size != self.size:
            raise ValueError(f"copy of {host.shape} {host.dtype} into device array {self.shape} {self.dtype}")
        if stream is None:
            call("cuMemcpyHtoD", self.ptr, host.ctypes.data, host.nbytes)
        else:
            call("cuMemcpyHtoDAsync", self.ptr, host.ctypes.data, host.nbytes, stream.handle)

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        call("cuMemcpyDtoH", out.ctypes.data, self.ptr, self.nbytes)
        return out

    def copy_to(self, other: "DeviceArray") -> None:
        if other.nbytes != self.nbytes:
            raise ValueError(f"device copy of {self.nbytes} bytes into {other.nbytes}")
        call("cuMemcpyDtoD", other.ptr, self.ptr, self.nbytes)

    def fill_bytes(self, value: int) -> None:
        call("cuMemsetD8", self.ptr, value, self.nbytes)

    # ---- ownership ----------------------------------------------------------------------------------------
    def free(self) -> None:
        if self._owner and self.ptr:
            if _captures:
                _deferred.append(self.ptr)
            else:
                call("cuMemFree", self.ptr)
        self.ptr, self._owner = 0, False

    def __enter__(self) -> "DeviceArray":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __del__(self):
        if getattr(self, "_owner", False) and self.ptr:
            try:
                self.free()
            except Exception:  # interpreter shutdown: the context may already be gone
                pass

    def __repr__(self) -> str:
        return f"DeviceArray(0x{self.ptr:x}, shape={self.shape}, dtype={self.dtype}, owner={self._owner})"
