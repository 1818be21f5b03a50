"""The runtime over cuda.bindings.driver, on a real GPU: memory, copies, launches, streams, events, graphs."""
from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from lucegen.codegen.nvrtc import base_options, compile_cubin
from lucegen.codegen.render import headers
from lucegen.runtime import CudaError, DeviceArray, Event, Graph, Module, Stream, device_info

pytestmark = pytest.mark.gpu

SRC = r'''
#include "common.cuh"
#include <cooperative_groups.h>
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
// Two phases split by a grid-wide barrier: phase 2 reads what other blocks wrote in phase 1.
extern "C" __global__ void grid_rotate(const float* x, float* tmp, float* y, int n) {
    namespace cg = cooperative_groups;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) tmp[i] = 2.f * x[i];
    cg::this_grid().sync();
    if (i < n) y[i] = tmp[(i + blockDim.x) % n];
}
'''


@pytest.fixture(scope="module")
def module():
    arch = device_info().arch
    return Module(compile_cubin(SRC, "rt.cu", arch, base_options(arch), headers()).cubin)


def test_bf16_round_trip_through_device_memory():
    host = np.random.default_rng(0).standard_normal((37, 129)).astype(ml_dtypes.bfloat16)
    with DeviceArray.from_numpy(host) as d:
        back = d.numpy()
    assert back.dtype == host.dtype and np.array_equal(back.view(np.uint16), host.view(np.uint16))


def test_views_and_device_copies():
    host = np.arange(100, dtype=np.float32)
    a = DeviceArray.from_numpy(host)
    b = DeviceArray.empty(50, np.float32)
    a.view(50, offset_bytes=200).copy_to(b)
    assert np.array_equal(b.numpy(), host[50:])
    with pytest.raises(ValueError):
        a.view(60, offset_bytes=200)


def test_launch_on_a_stream_timed_with_events(module):
    rng = np.random.default_rng(1)
    n = 100_003
    x, y = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    dx, dy = DeviceArray.from_numpy(x), DeviceArray.from_numpy(y)
    s = Stream()
    start, end = Event().record(s), None
    module.kernel("axpy")((n + 255) // 256, 256, 3.0, dx, dy, n, stream=s)
    end = Event().record(s)
    assert start.elapsed_ms(end) > 0
    # the GPU fuses a*x + y into one FMA (one rounding): compare with the exact value, not numpy's two roundings
    np.testing.assert_allclose(dy.numpy(), 3.0 * x.astype(np.float64) + y, rtol=1e-6, atol=1e-7)


def test_graph_capture_replays_the_launches(module):
    n = 4096
    x = np.random.default_rng(2).standard_normal(n, dtype=np.float32)
    dx, dy = DeviceArray.from_numpy(x), DeviceArray.zeros(n, np.float32)
    s = Stream()
    with Graph.capture(s) as g:
        for _ in range(3):
            module.kernel("axpy")(n // 256, 256, 1.0, dx, dy, n, stream=s)
    s.synchronize()
    assert not dy.numpy().any(), "capture must not execute"
    g.launch(); g.launch()
    s.synchronize()
    np.testing.assert_allclose(dy.numpy(), 6.0 * x, rtol=1e-6)
    g.destroy()


def test_cooperative_launch_synchronises_the_grid(module):
    info = device_info()
    threads = 256
    blocks = info.sm_count * module.kernel("grid_rotate").max_active_blocks_per_sm(threads)
    n = blocks * threads
    x = np.random.default_rng(3).standard_normal(n, dtype=np.float32)
    dx, tmp, dy = DeviceArray.from_numpy(x), DeviceArray.empty(n, np.float32), DeviceArray.empty(n, np.float32)
    module.kernel("grid_rotate")(blocks, threads, dx, tmp, dy, n, cooperative=True)
    np.testing.assert_array_equal(dy.numpy(), 2.0 * np.roll(x, -threads))


def test_failing_calls_name_the_call_and_the_cuda_error(module):
    with pytest.raises(CudaError, match=r"cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY"):
        DeviceArray.empty(1 << 50, np.uint8)
    with pytest.raises(CudaError, match=r"cuModuleGetFunction: CUDA_ERROR_NOT_FOUND"):
        module.kernel("no_such_kernel")
    with pytest.raises(CudaError, match=r"cuLaunchKernel: CUDA_ERROR_INVALID_VALUE"):
        module.kernel("axpy")(1, 4096, 1.0, DeviceArray.empty(1, np.float32), DeviceArray.empty(1, np.float32), 1)


def test_another_thread_allocates_copies_and_launches(module):
    """A context is current per thread: a thread that never touched the GPU (a server's engine thread) can
    allocate, copy and launch a kernel loaded by another."""
    x = np.arange(1000, dtype=np.float32)
    result = {}

    def work():
        dx, dy = DeviceArray.from_numpy(x), DeviceArray.from_numpy(np.ones_like(x))
        module.kernel("axpy")(4, 256, 2.0, dx, dy, x.size)
        result["y"] = dy.numpy()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    np.testing.assert_array_equal(result["y"], 2 * x + 1)
