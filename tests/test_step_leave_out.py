"""tools/step_leave_out.py: leaving a kind out of the layer-by-layer step drops exactly that kind's launches from what
the step captures, and the step launches everything again afterwards (the step on the host: tests/host_layered.py)."""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from lucegen.engine.layered import LayeredEngine
from lucegen.spec import load_spec

from host_layered import RATIO3_Q, HostGraph, LayeredHostKernel, checkpoint, layered_on_host

TOOL = Path(__file__).parents[1] / "tools" / "step_leave_out.py"
spec = importlib.util.spec_from_file_location("step_leave_out", TOOL)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    weights, _ = checkpoint(tmp_path_factory, "gguf", peaked=False)
    with pytest.MonkeyPatch.context() as mp, layered_on_host(mp):
        e = LayeredEngine(weights, RATIO3_Q, spec=load_spec("h200"), max_context=16, chunk=1)
        yield e
        e.free()


def launched(step) -> Counter:
    """The kernels a one-token step launches, by name."""
    with HostGraph.capture(step.stream) as g:
        step.enqueue(1, step.stream)
    return Counter(cell.cell_contents.name for run in g.launches for cell in run.__closure__
                   if isinstance(cell.cell_contents, LayeredHostKernel))


def test_each_kind_left_out_drops_its_launches_alone(engine):
    step, layers = engine.step, RATIO3_Q.num_hidden_layers
    whole = launched(step)
    formats = sorted({fmt for fmt, _ in step.mm})
    assert len(formats) >= 2, "the Q4_K_M mix puts the projections in two formats at least"
    gone = {}
    for kind in ["rows", "deltanet", "attention", "lm_head", *formats, "all"]:
        with tool.leaving_out(engine, {kind}):
            gone[kind] = whole - launched(step)
        assert launched(step) == whole, f"after leaving out {kind}"
    assert gone["rows"] == {"layered_add_rmsnorm": 2 * layers + 1, "layered_silu_mul": layers}
    assert gone["deltanet"] and all(n.startswith("tree_") for n in gone["deltanet"])
    assert gone["attention"] and all(n.startswith("tree_") for n in gone["attention"])
    assert not gone["deltanet"] & gone["attention"]
    assert sum(gone["lm_head"].values()) == 1
    for fmt in formats:
        assert gone[fmt] and all(f"_{fmt}_" in n for n in gone[fmt])
    assert whole - gone["all"] == {"layered_embed": 1, "argmax_f32": 1, "layered_advance": 1}
    assert sum(gone["all"].values()) == sum(whole.values()) - 3
    with tool.leaving_out(engine, {"rows", "lm_head"}):
        assert whole - launched(step) == gone["rows"] + gone["lm_head"]
    # a format and a row length: that format's launches of that K alone, and a format's lengths add up to it
    for fmt in formats:
        ks = sorted(k for f, k in step.mm if f == fmt)
        by_k = {}
        for k in ks:
            with tool.leaving_out(engine, {f"{fmt}:{k}"}):
                by_k[k] = whole - launched(step)
            assert by_k[k] and all(f"_{fmt}_k{k}_" in n for n in by_k[k]), (fmt, k)
        assert sum(by_k.values(), Counter()) == gone[fmt]
