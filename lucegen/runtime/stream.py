"""Streams, events (timing) and CUDA graphs (capture a stream's launches once, replay them for one launch)."""
from __future__ import annotations

from .driver import _drv, call
from .memory import capture_began, capture_ended


class Stream:
    """A CUDA stream. programmatic: kernels launched on it may start before the kernel ahead of them ends
    (programmatic dependent launch, sm_90+): every kernel launched on such a stream must wait for its predecessor
    where templates/common.cuh says (wait_for_prior_grids), or it races with it."""

    def __init__(self, programmatic: bool = False):
        self.handle = call("cuStreamCreate", _drv().CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.programmatic = programmatic

    def synchronize(self) -> None:
        call("cuStreamSynchronize", self.handle)

    def destroy(self) -> None:
        if self.handle is not None:
            call("cuStreamDestroy", self.handle)
            self.handle = None


class Event:
    def __init__(self):
        self.handle = call("cuEventCreate", _drv().CUevent_flags.CU_EVENT_DEFAULT)

    def record(self, stream: Stream | None = None) -> "Event":
        call("cuEventRecord", self.handle, stream.handle if stream else 0)
        return self

    def synchronize(self) -> None:
        call("cuEventSynchronize", self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both recorded and complete)."""
        end.synchronize()
        fn = "cuEventElapsedTime_v2" if hasattr(_drv(), "cuEventElapsedTime_v2") else "cuEventElapsedTime"
        return float(call(fn, self.handle, end.handle))

    def destroy(self) -> None:
        if self.handle is not None:
            call("cuEventDestroy", self.handle)
            self.handle = None


class Graph:
    """Capture: `with Graph.capture(stream) as g: launches...`, then `g.launch(stream)` replays them all."""

    def __init__(self, stream: Stream):
        self.stream, self.graph, self.exec = stream, None, None

    @classmethod
    def capture(cls, stream: Stream) -> "Graph":
        return cls(stream)

    def __enter__(self) -> "Graph":
        call("cuStreamBeginCapture", self.stream.handle,
             _drv().CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        capture_began()  # DeviceArray frees wait for the end (runtime/memory.py)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            graph = call("cuStreamEndCapture", self.stream.handle)
        finally:
            capture_ended()
        if exc_type is not None:
            call("cuGraphDestroy", graph)
            return
        self.graph = graph
        self.exec = call("cuGraphInstantiate", graph, 0)

    def launch(self, stream: Stream | None = None) -> None:
        if self.exec is None:
            raise RuntimeError("graph was not captured")
        call("cuGraphLaunch", self.exec, (stream or self.stream).handle)

    def destroy(self) -> None:
        if self.exec is not None:
            call("cuGraphExecDestroy", self.exec)
            call("cuGraphDestroy", self.graph)
            self.exec = self.graph = None
