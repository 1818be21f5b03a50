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
            "embed", "rmsnorm_f32", "gemv_bf16", "conv1d_gates", "gdn_chunk_prep", "gdn_chunk_scan", "gdn_gated_norm",
            "attention_prep_tokens", "attention_prefill_causal"}, spec.name


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
