"""bench.timing's kernel-by-kernel timing without a GPU: launch_times on a fake device (a clock that each graph
replay and kernel advances, events that read it), by_kind's sums, kernel_kind on the layered decode step's kernel
names, and bench decode-gguf's step breakdown on a fake step (its position stays inside the context, its records)."""
from __future__ import annotations

import json
import math

import pytest

from lucegen.bench import decode_gguf, timing
from lucegen.bench.prefill import gemm_flops
from lucegen.bench.results import Recorder
from lucegen.bench.timing import by_kind, kernel_kind, launch_times, queued_replays
from lucegen.kernels import argmax, layered, qgemv, tree
from lucegen.model.config import load_config
from lucegen.runtime.module import Kernel
from lucegen.spec import all_specs


class Device:
    """One stream's work in order: a clock in ms that graph replays and kernels advance, and what ran."""

    def __init__(self):
        self.clock, self.ran, self.synchronized, self.events = 0.0, [], False, []

    def synchronize(self):
        self.synchronized = True

    def kernel(self, name: str, ms: float) -> Kernel:
        k = Kernel.__new__(Kernel)
        k.name = name

        def launch(grid, block, args, smem, stream, cooperative, cluster):
            assert stream is self
            self.clock += ms
            self.ran.append(name)
        k._launch = launch
        return k

    def event_class(self):
        device = self

        class Event:
            def __init__(self):
                self.at, self.destroyed = None, False
                device.events.append(self)

            def record(self, stream):
                assert stream is device
                self.at = device.clock
                return self

            def elapsed_ms(self, end):
                assert device.synchronized, "events read before the stream finished"
                return end.at - self.at

            def destroy(self):
                self.destroyed = True
        return Event


class FakeGraph:
    def __init__(self, device: Device, ms: float):
        self.device, self.ms = device, ms

    def launch(self, stream):
        assert stream is self.device
        self.device.clock += self.ms
        self.device.ran.append("graph")


@pytest.fixture
def device(monkeypatch):
    d = Device()
    monkeypatch.setattr(timing, "Event", d.event_class())
    return d


def test_launch_times_time_each_kernel_of_the_eager_pass_behind_the_replays(device):
    kernels = [device.kernel("gemm_wg128x256_silu", 0.5), device.kernel("rmsnorm_f32_h1024", 0.01),
               device.kernel("gemm_wg128x256_silu", 0.25)]

    def enqueue(stream):
        for i, k in enumerate(kernels):
            k(1, 32, "x", i, stream=stream)

    out = launch_times(enqueue, FakeGraph(device, 3.0), 3.0, device)
    replays = math.ceil(timing.QUEUED_MS / 3.0)
    assert device.ran == ["graph"] * replays + [k.name for k in kernels]  # every replay queued before the pass
    assert [(n, a) for n, a, _ in out] == [(k.name, ("x", i)) for i, k in enumerate(kernels)]
    assert [us for _, _, us in out] == pytest.approx([500.0, 10.0, 250.0])  # each kernel alone, not the replays
    assert len(device.events) == 6 and all(e.destroyed for e in device.events)
    kernels[0](1, 32, stream=device)  # after the pass: launched directly, no events
    assert len(device.events) == 6 and device.ran[-1] == kernels[0].name


@pytest.mark.parametrize("ms", [0.013, 0.7, 3.0, 250.0])
def test_queued_replays_cover_the_queue_time(ms):
    n = queued_replays(ms)
    assert n * ms >= timing.QUEUED_MS and (n - 1) * ms < timing.QUEUED_MS


def test_by_kind_sums_time_launches_and_flops_per_kind_in_order_of_first_launch():
    launches = [("rmsnorm_f32_h1024", (), 2.0), ("gemm_wg128x256_add", (0, 0, 0, 4, 8, 16), 10.0),
                ("rmsnorm_f32_h1024", (), 3.0), ("gemm_128x128_add", (0, 0, 0, 2, 8, 16), 5.0),
                ("gemm_wg128x256_silu", (0, 0, 0, 1, 1, 1), 1.0)]
    assert by_kind(launches) == {"rmsnorm_f32": [5.0, 2, 0.0], "gemm_add": [15.0, 2, 0.0],
                                 "gemm_silu": [1.0, 1, 0.0]}
    kinds = by_kind(launches, gemm_flops)
    assert list(kinds) == ["rmsnorm_f32", "gemm_add", "gemm_silu"]
    assert kinds["gemm_add"][2] == 2.0 * (4 * 8 * 16 + 2 * 8 * 16) and kinds["rmsnorm_f32"][2] == 0.0
    assert by_kind([]) == {}


def test_record_kinds_records_each_kind_longest_first_with_its_share(tmp_path, capsys):
    launches = [("rmsnorm_f32_h1024", (), 2.0), ("gemm_wg128x256_add", (), 10.0), ("rmsnorm_f32_h1024", (), 3.0),
                ("gemm_wt16x64_add", (), 5.0)]
    rec = Recorder(gpu="test", out=tmp_path / "r.jsonl")
    timing.record_kinds(rec, "verify_kernel_us", "m", launches, "verify of 3 nodes", "21 us the graph", nodes=3)
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["metric"], r["value"], r["launches"], r["share"], r["nodes"]) for r in rows] == [
        ("verify_kernel_us_gemm_add", 15.0, 2, 0.75, 3), ("verify_kernel_us_rmsnorm_f32", 5.0, 2, 0.25, 3)]
    out = capsys.readouterr().out
    assert "verify of 3 nodes kernel by kernel (20 us timed one by one, 21 us the graph):" in out
    assert out.index("gemm_add") < out.index("rmsnorm_f32")


def test_layered_step_kernel_kinds_drop_the_shape_and_keep_the_format():
    cfg = load_config("qwen3.5-27b")
    for spec in all_specs():
        names = [k.name for u in (*layered.units(spec, cfg), *tree.units(spec, cfg),
                                  *qgemv.units(spec, cfg, qgemv.mix_pairs(cfg, "q4_k_m")), *argmax.units(spec, cfg))
                 for k in u.kernels]
        mma = {"qgemm_mma_q4_k", "qgemm_mma_q6_k"} if spec.tuning.qgemv.gemm == "mma" else set()  # (its own kind)
        assert {kernel_kind(n) for n in names} == {
            "layered_embed", "layered_add_rmsnorm", "layered_silu_mul", "layered_place",
            "layered_advance", "tree_deltanet", "tree_attention_kv", "tree_attention", "tree_kv_commit",
            "qgemm_q4_k", "qdequant_q4_k", "qgemm_q6_k", "qdequant_q6_k", "qquant_x", "qgemv_q4_k", "qgemv_q6_k",
            "argmax_f32", *mma}, spec.name


@pytest.mark.parametrize("stages", [0, 3])
def test_qgemv_kinds_name_the_format(stages):
    for fmt in qgemv.FORMATS.values():
        gemv = qgemv.Tuning(256, 2, 1, 4, stages).name(fmt, 17408)
        gemm = qgemv.Tuning(128, 1, 16, 2, stages).name(fmt, 5120)
        assert (kernel_kind(gemv), kernel_kind(gemm)) == (f"qgemv_{fmt.name}", f"qgemm_{fmt.name}"), (gemv, gemm)


class FakeStep:
    """The step's io position on the device: upload sets it, each graph replay and eager pass advances it."""

    def __init__(self, device: Device, position: int, max_context: int, step_ms: float):
        self.device, self.stream, self.io = device, device, None
        self.state = type("State", (), {"position": position, "max_context": max_context})()
        self.graphs = {(self, 1): self.Graph(self, step_ms)}
        self.kernels = [device.kernel("qgemv_q4_k_k5120_r1_s2_t256", step_ms * 0.6),
                        device.kernel("tree_deltanet", step_ms * 0.2), device.kernel("layered_advance", 0.0)]

    class Graph(FakeGraph):
        def __init__(self, step, ms):
            super().__init__(step.device, ms)
            self.step = step

        def launch(self, stream):
            self.step.advance()
            super().launch(stream)

    def advance(self):
        assert self.io is not None and 0 <= self.io < self.state.max_context, self.io
        self.io += 1

    def upload(self, ids):
        assert list(ids) == [1]
        self.io = self.state.position

    def enqueue(self, m, stream):
        assert m == 1
        for k in self.kernels:
            k(1, 32, stream=stream)
        self.advance()


@pytest.mark.parametrize("max_context", [512 + 137, 131072 + 137])  # decode_gguf.run's with contexts (512,), CONTEXTS
def test_decode_step_breakdown_stays_in_the_context_and_records_kinds_and_gaps(device, tmp_path, max_context):
    step_ms = 1.0
    step = FakeStep(device, 512 + 137, max_context, step_ms)  # where tg128 at ctx 512 left it
    rec = Recorder(gpu="fake", out=tmp_path / "r.jsonl")
    decode_gguf.step_breakdown(rec, step, "m ctx=512", 512, step_ms)
    steps = queued_replays(step_ms) + 1
    assert step.state.position == step.io == min(512, max_context - steps) + steps  # host and device agree
    rows = {r["metric"]: r for r in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    assert list(rows) == ["decode_kernel_us_qgemv_q4_k", "decode_kernel_us_tree_deltanet",
                          "decode_kernel_us_layered_advance", "decode_launch_gap_us"]  # longest first, then the gap
    assert {r["model"] for r in rows.values()} == {"m ctx=512"} and {r["unit"] for r in rows.values()} == {"us"}
    assert rows["decode_kernel_us_qgemv_q4_k"]["value"] == pytest.approx(600.0)
    assert rows["decode_kernel_us_qgemv_q4_k"]["share"] == 0.75 and rows["decode_kernel_us_qgemv_q4_k"]["launches"] == 1
    assert rows["decode_launch_gap_us"]["value"] == pytest.approx(200.0) and rows["decode_launch_gap_us"]["launches"] == 3
