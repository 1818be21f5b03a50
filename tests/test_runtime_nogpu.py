"""Without a driver the runtime says so clearly instead of failing obscurely."""
from __future__ import annotations

import pytest

from lucegen.runtime import NoDriverError, gpu_available
from lucegen.runtime.driver import init


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: this checks the no-driver path")
def test_no_driver_is_a_clear_error():
    with pytest.raises(NoDriverError, match="no NVIDIA driver|sees no GPU|unusable"):
        init()


def test_a_free_during_a_capture_waits_for_its_end(monkeypatch):
    """cuMemFree inside a stream capture would invalidate it (a collected DeviceArray frees itself whenever Python
    collects it): frees asked for while a Graph captures happen when the capture ends, also when it ends in an
    error; outside a capture a free is immediate. The driver calls recorded instead of made."""
    from types import SimpleNamespace

    import numpy as np

    from lucegen.runtime import DeviceArray, Graph, memory, stream

    calls = []

    def fake(fn, *args):
        calls.append((fn, *args))
        return 99 if fn == "cuStreamEndCapture" else None

    monkeypatch.setattr(memory, "call", fake)
    monkeypatch.setattr(stream, "call", fake)
    modes = SimpleNamespace(CUstreamCaptureMode=SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1))
    monkeypatch.setattr(stream, "_drv", lambda: modes)
    frees = lambda: [c[1] for c in calls if c[0] == "cuMemFree"]
    arrays = [DeviceArray(0x1000 * (i + 1), (4,), np.float32, owner=True) for i in range(4)]
    with Graph.capture(SimpleNamespace(handle=7)):
        arrays[0].free()
        arrays.pop(1)  # the last reference: collected, __del__ frees it
        assert frees() == [] and arrays[0].ptr == 0
    assert sorted(frees()) == [0x1000, 0x2000]
    with pytest.raises(RuntimeError, match="inside"):
        with Graph.capture(SimpleNamespace(handle=7)):
            arrays[1].free()
            raise RuntimeError("inside the capture")
    assert sorted(frees()) == [0x1000, 0x2000, 0x3000]
    arrays[2].free()
    assert frees()[-1] == 0x4000 and memory._captures == 0 and memory._deferred == []
