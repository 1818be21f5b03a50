"""A small torch-free CUDA runtime over cuda.bindings.driver."""
from .driver import CudaError, NoDriverError, context, device_info, gpu_available, init, synchronize
from .memory import DeviceArray
from .module import Kernel, Module, observe_launches
from .stream import Event, Graph, Stream

__all__ = ["CudaError", "NoDriverError", "context", "device_info", "gpu_available", "init", "synchronize",
           "DeviceArray", "Kernel", "Module", "observe_launches", "Event", "Graph", "Stream"]
