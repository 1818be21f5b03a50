"""Loaded cubins and kernel launches (plain and cooperative), and a hook that sees every launch (for profiling)."""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .driver import _drv, call
from .memory import DeviceArray

Dim = int | tuple[int, ...]
# (kernel, args, stream, launch) -> None: while one is set, it runs every launch by calling launch()
LaunchObserver = Callable[["Kernel", tuple, Any, Callable[[], None]], None]
_observers: list[LaunchObserver] = []


@contextmanager
def observe_launches(observer: LaunchObserver):
    """Route every kernel launch through observer(kernel, args, stream, launch) while the block runs; the observer
    enqueues the kernel by calling launch() (e.g. between two events, to time each kernel of a sequence)."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def _dim3(d: Dim) -> tuple[int, int, int]:
    t = (d,) if isinstance(d, int) else tuple(d)
    return (*t, *(1,) * (3 - len(t)))  # type: ignore[return-value]


def _params(args: Sequence[Any]):
    """Kernel parameters as cuda-python's (values, ctypes types) pair."""
    values, types = [], []
    for a in args:
        if isinstance(a, DeviceArray):
            values.append(a.ptr); types.append(ctypes.c_void_p)
        elif isinstance(a, (bool, np.bool_)):
            values.append(int(a)); types.append(ctypes.c_int)
        elif isinstance(a, (int, np.integer)):
            values.append(int(a)); types.append(ctypes.c_int)
        elif isinstance(a, (float, np.floating)):
            values.append(float(a)); types.append(ctypes.c_float)
        elif callable(getattr(a, "getPtr", None)):
            values.append(a); types.append(None)      # a cuda-python struct by value, e.g. a CUtensorMap
        elif isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], type):
            values.append(a[0]); types.append(a[1])   # explicit (value, ctypes type), e.g. (n, c_int64)
        else:
            raise TypeError(f"cannot pass {type(a).__name__} to a kernel")
    return tuple(values), tuple(types)


def _launch_config(g: tuple[int, int, int], b: tuple[int, int, int], smem: int, stream, programmatic: bool,
                   cluster: int):
    """cuLaunchKernelEx's configuration of a launch that may begin before the one ahead of it on the stream ends
    (programmatic stream serialization), and / or whose blocks run in clusters of `cluster` along x (sm_90)."""
    drv = _drv()
    attrs = []
    if programmatic:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if cluster > 1:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        attrs.append(attr)
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = g
    config.blockDimX, config.blockDimY, config.blockDimZ = b
    config.sharedMemBytes, config.hStream = smem, stream
    config.attrs, config.numAttrs = attrs, len(attrs)
    return config


class Kernel:
    def __init__(self, module: "Module", name: str):
        self.module, self.name = module, name
        self.handle = call("cuModuleGetFunction", module.handle, name.encode())

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        drv = _drv()
        call("cuFuncSetAttribute", self.handle,
             drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

    def max_active_blocks_per_sm(self, threads: int, dynamic_smem: int = 0) -> int:
        return call("cuOccupancyMaxActiveBlocksPerMultiprocessor", self.handle, threads, dynamic_smem)

    def __call__(self, grid: Dim, block: Dim, *args: Any, smem: int = 0, stream=None,
                 cooperative: bool = False, cluster: int = 1) -> None:
        """Launch on `stream`; `cluster` > 1 runs the blocks in clusters of that many along x (grid x a multiple)."""
        if _observers:
            _observers[-1](self, args, stream,
                           lambda: self._launch(grid, block, args, smem, stream, cooperative, cluster))
        else:
            self._launch(grid, block, args, smem, stream, cooperative, cluster)

    def _launch(self, grid: Dim, block: Dim, args: Sequence[Any], smem: int, stream, cooperative: bool,
                cluster: int) -> None:
        g, b = _dim3(grid), _dim3(block)
        h = stream.handle if stream is not None else 0
        programmatic = getattr(stream, "programmatic", False)
        if cooperative:
            call("cuLaunchCooperativeKernel", self.handle, *g, *b, smem, h, _params(args))
        elif programmatic or cluster > 1:
            call("cuLaunchKernelEx", _launch_config(g, b, smem, h, programmatic, cluster), self.handle,
                 _params(args), 0)
        else:
            call("cuLaunchKernel", self.handle, *g, *b, smem, h, _params(args), 0)

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


class Module:
    """A cubin loaded into the current context; kernels are looked up by name and cached."""

    def __init__(self, image: bytes, name: str = "<cubin>"):
        self.name = name
        self.handle = call("cuModuleLoadData", image)
        self._kernels: dict[str, Kernel] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> "Module":
        path = Path(path)
        return cls(path.read_bytes(), str(path))

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            self._kernels[name] = Kernel(self, name)
        return self._kernels[name]

    __getitem__ = kernel

    def unload(self) -> None:
        if self.handle is not None:
            call("cuModuleUnload", self.handle)
            self.handle = None
