"""bench prefill's per-kernel-kind breakdown without a GPU: every prefill kernel maps to a kind without its shape,
and the launch hook it times kernels through sees every launch and enqueues it exactly when asked."""
from __future__ import annotations

import pytest

from lucegen.bench.timing import kernel_kind
from lucegen.engine.prefill import units
from lucegen.kernels import gemm
from lucegen.model.config import load_config
from lucegen.runtime.module import Kernel, observe_launches
from lucegen.spec import all_specs, gemm_methods


@pytest.mark.parametrize("model", ["qwen3.5-0.8b", "qwen3.5-27b"])
def test_kernel_kinds_drop_the_shape_and_keep_the_gemm_epilogue(model):  # gemm_add_split: split-K adds
    cfg = load_config(model)
    for spec in (s.with_prefill(gemm=m) for s in all_specs() for m in gemm_methods(s)):
        kinds = {kernel_kind(k.name) for u in units(spec, cfg) for k in u.kernels}
        assert kinds == {f"gemm_{e}" for e in gemm.KERNEL_EPILOGUES} | {
            "embed", "rmsnorm_f32", "gemv_bf16", "gdn_chunk_prep", "gdn_chunk_scan", "gdn_gated_norm",
            "attention_prep_tokens", "attention_prefill_causal",
            *(["attention_prefill_split"] if spec.tuning.prefill.attention_split > 1 else []),
            *(["attention_prefill_wgmma"] if spec.tuning.prefill.attention == "wgmma" else [])}, spec.name


def test_observed_launches_run_through_the_observer(monkeypatch):
    kernel = Kernel.__new__(Kernel)
    kernel.name = "k"
    launched, seen = [], []
    monkeypatch.setattr(kernel, "_launch", lambda *a: launched.append(a))

    def observer(k, args, stream, launch):
        seen.append((k.name, args, stream, len(launched)))
        launch()

    with observe_launches(observer):
        kernel(4, 128, 1, 2, stream="s")
    assert seen == [("k", (1, 2), "s", 0)] and len(launched) == 1  # the observer ran first, then the launch
    kernel(4, 128, 3)
    assert len(seen) == 1 and len(launched) == 2  # outside the block: launched directly


def test_bench_gemms_times_each_shape_and_variant_over_graph_replays(monkeypatch, tmp_path):
    """bench_gemms' plumbing without a GPU: every GEMM shape of the model with every variant of the spec is captured
    GRAPH_LAUNCHES times into a graph, and one row per (shape, variant) records TFLOP/s from the replay's time per
    launch, with the config the launcher picks and the microseconds."""
    import json
    from types import SimpleNamespace

    from lucegen.bench import prefill as bench
    from lucegen.bench.results import Recorder
    from lucegen.spec import load_spec

    launches, captured = [], []

    class FakeGraph:
        def __init__(self, stream):
            self.n = 0

        @classmethod
        def capture(cls, stream):
            return cls(stream)

        def __enter__(self):
            launches.clear()
            return self

        def __exit__(self, *exc):
            captured.append(len(launches))

        def launch(self, stream):
            pass

        def destroy(self):
            pass

    class FakeArray:
        def __init__(self, *a, **k):
            pass

        def free(self):
            pass

    monkeypatch.setattr(bench, "build", lambda *a, **k: SimpleNamespace(module=lambda name: None))
    monkeypatch.setattr(bench.gemm, "Gemm", lambda module, spec: lambda *a, **k: launches.append(a))
    monkeypatch.setattr(bench, "Graph", FakeGraph)
    monkeypatch.setattr(bench, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "median_ms", lambda fn, stream, **k: 0.2)  # 200 us a replay: 10 us a launch
    monkeypatch.setattr(bench, "peer", lambda *a, **k: None)  # no torch peer
    monkeypatch.setattr(bench.DeviceArray, "from_numpy", staticmethod(lambda a: FakeArray()))
    monkeypatch.setattr(bench.DeviceArray, "zeros", staticmethod(lambda *a, **k: FakeArray()))
    spec, cfg = load_spec("h200"), load_config("qwen3.5-0.8b")
    rec = Recorder("test GPU", out=tmp_path / "r.jsonl", commit="x")
    bench.bench_gemms(rec, spec, cfg, 520, stream=None)
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    variants, shapes = bench.variants(spec), bench.gemm_shapes(cfg)
    assert len(rows) == len(captured) == len(variants) * len(shapes)
    assert set(captured) == {bench.GRAPH_LAUNCHES}
    for row in rows:
        n, k, epilogue = shapes[row["model"].split()[1]]
        assert row["us"] == 10.0 and row["value"] == pytest.approx(2 * 520 * n * k / 10.0 / 1e6)
        assert row["epilogue"] == epilogue and "limit" not in row  # no peer without torch
