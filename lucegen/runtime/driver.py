"""The CUDA driver through cuda.bindings.driver: checked calls, device discovery, the primary context.

Every driver call goes through `call`, which raises CudaError naming the call and the CUDA error
(e.g. "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory").
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str, text: str):
        super().__init__(f"{call}: {name} ({code}): {text}")
        self.call, self.code, self.name = call, code, name


class NoDriverError(RuntimeError):
    """No NVIDIA driver (libcuda) or no GPU on this machine."""


def _drv():
    from cuda.bindings import driver
    return driver


_thread = threading.local()  # .ordinal: the device whose primary context is current in this thread

# Driver calls that need no current context; every other call first makes the primary context current in the
# calling thread (a context is current per thread: a server's engine thread needs it as much as the main thread).
_CONTEXT_FREE = frozenset({
    "cuInit", "cuDriverGetVersion", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetAttribute", "cuDeviceGetName",
    "cuDeviceTotalMem", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuGetErrorName", "cuGetErrorString",
    "cuTensorMapEncodeTiled"})


def call(fn_name: str, *args: Any) -> Any:
    """Call driver.<fn_name>(*args); raise CudaError on failure; return the result(s) after the status code."""
    if fn_name not in _CONTEXT_FREE and getattr(_thread, "ordinal", None) is None:
        context()
    drv = _drv()
    result = getattr(drv, fn_name)(*args)
    err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if int(err) != 0:
        _, name = drv.cuGetErrorName(err)
        _, text = drv.cuGetErrorString(err)
        dec = lambda b: b.decode() if isinstance(b, bytes) else str(b)
        raise CudaError(fn_name, int(err), dec(name), dec(text))
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    arch: str
    sm_count: int
    memory_bytes: int
    l2_bytes: int
    smem_per_block_optin: int
    driver_version: str


@lru_cache(maxsize=None)
def init() -> None:
    """cuInit, or NoDriverError when there is no driver library or no device."""
    try:
        call("cuInit", 0)
    except CudaError as e:
        raise NoDriverError(f"CUDA driver present but unusable: {e}") from e
    except Exception as e:  # cuda.pathfinder raises DynamicLibNotFoundError (a RuntimeError) without libcuda
        raise NoDriverError(f"no NVIDIA driver on this machine ({type(e).__name__}: {e})") from e
    if call("cuDeviceGetCount") < 1:
        raise NoDriverError("the NVIDIA driver sees no GPU")


def gpu_available() -> bool:
    try:
        init()
        return True
    except NoDriverError:
        return False


def device_info(ordinal: int = 0) -> DeviceInfo:
    init()
    drv = _drv()
    dev = call("cuDeviceGet", ordinal)
    attr = lambda a: call("cuDeviceGetAttribute", getattr(drv.CUdevice_attribute, a), dev)
    major = attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
    minor = attr("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
    ver = call("cuDriverGetVersion")
    return DeviceInfo(
        ordinal=ordinal,
        name=call("cuDeviceGetName", 256, dev).split(b"\0")[0].decode(),
        arch=f"sm_{major}{minor}",
        sm_count=attr("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        memory_bytes=call("cuDeviceTotalMem", dev),
        l2_bytes=attr("CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
        smem_per_block_optin=attr("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        driver_version=f"{ver // 1000}.{ver % 1000 // 10}",
    )


@lru_cache(maxsize=None)
def _primary_context(ordinal: int):
    """The device's primary context, retained for the life of the process."""
    init()
    return call("cuDevicePrimaryCtxRetain", call("cuDeviceGet", ordinal))


def context(ordinal: int = 0):
    """Make the device's primary context current in the calling thread and return it. A context is current per
    thread: a server's engine thread needs this as much as the main thread does."""
    ctx = _primary_context(ordinal)
    if getattr(_thread, "ordinal", None) != ordinal:
        call("cuCtxSetCurrent", ctx)
        _thread.ordinal = ordinal
    return ctx


def synchronize() -> None:
    call("cuCtxSynchronize")
