"""Render + NVRTC compile of every kernel for every spec (no GPU needed), the cache and compile errors."""
from __future__ import annotations

import json

import pytest

from lucegen.codegen import nvrtc
from lucegen.codegen.build import build
from lucegen.kernels import all_units, attention
from lucegen.model.config import load_config, tiny_config
from lucegen.spec import list_specs, load_spec


@pytest.mark.parametrize("spec_name", list_specs())
@pytest.mark.parametrize("model_name", ["qwen3.5-0.8b", "qwen3.5-27b"])
def test_every_kernel_compiles_for_every_spec(tmp_path, spec_name, model_name):
    spec, model = load_spec(spec_name), load_config(model_name)
    units = all_units(spec, model)
    result = build(spec, model, units, root=tmp_path)
    listed = {k.name for u in units for k in u.kernels}
    assert {k.name for k in result.kernels} == listed
    for k in result.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"
        assert k.coresident_blocks >= 1, f"{k.name} cannot run on {spec_name}"
    manifest = json.loads((result.directory / "manifest.json").read_text())
    assert manifest["arch"] == spec.chip.arch and manifest["model"]["hidden_size"] == model.hidden_size
    for u in result.units:  # the rendered source sits beside its cubin, and the headers it included too
        assert u.source_path.read_text().startswith("// Rendered by lucegen")
        assert u.cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert (result.directory / "include" / "common.cuh").exists()


@pytest.mark.parametrize("model_name", ["qwen3.5-0.8b", "qwen3.5-27b"])
def test_the_attention_split_over_a_cluster_compiles_for_hopper(tmp_path, model_name):
    """tuning.prefill.attention_split (no shipped spec takes it: the H200's wgmma attention is faster) still renders,
    compiles and fits without spilling."""
    spec, model = load_spec("h200").with_prefill(attention_split=3), load_config(model_name)
    units = attention.units(spec, model)
    result = build(spec, model, units, root=tmp_path)
    assert "attention_prefill_split" in {k.name for k in result.kernels}
    assert all(k.spill_stores == 0 and k.spill_loads == 0 for k in result.kernels)


def test_the_model_shape_is_rendered_into_the_kernels(tmp_path):
    spec = load_spec("h200")
    a = build(spec, tiny_config(hidden_size=96), all_units(spec, tiny_config(hidden_size=96)), root=tmp_path)
    names = {k.name for k in a.kernels}
    assert "rmsnorm_1p_h96" in names and "gemv_bf16_k96" in names


def test_cache_hits_on_the_same_source_and_misses_on_another_arch(tmp_path):
    spec, model = load_spec("rtx3090"), tiny_config()
    first = build(spec, model, all_units(spec, model), root=tmp_path)
    again = build(spec, model, all_units(spec, model), root=tmp_path)
    assert not any(u.cached for u in first.units) and all(u.cached for u in again.units)
    assert [u.key for u in first.units] == [u.key for u in again.units]
    other = build(spec, model, all_units(spec, model), arch="sm_90", root=tmp_path)
    assert not any(u.cached for u in other.units)
    assert other.directory.name == model.name and other.directory.parent.name == "rtx3090-sm_90"
    assert not (set(u.key for u in other.units) & set(u.key for u in first.units))


def test_compile_error_names_the_rendered_file_and_line(tmp_path):
    src = '#include "common.cuh"\nextern "C" __global__ void k(float* y) {\n  y[0] = undefined_thing;\n}\n'
    path = tmp_path / "broken.cu"
    path.write_text(src)
    from lucegen.codegen.render import headers
    with pytest.raises(nvrtc.CompileError) as e:
        nvrtc.compile_cubin(src, "broken.cu", "sm_90", nvrtc.base_options("sm_90"), headers(), path)
    msg = str(e.value)
    assert f"{path}:3: y[0] = undefined_thing;" in msg and "undefined_thing" in msg


def test_resources_come_from_the_cubin_when_the_log_has_no_report(tmp_path):
    spec, model = load_spec("h200"), tiny_config()
    unit = all_units(spec, model)[0]
    result = build(spec, model, [unit], root=tmp_path)
    from_log = {k.name: k for k in result.kernels}
    from_cubin = nvrtc.resources("", result.units[0].cubin_path.read_bytes())
    assert set(from_cubin) == set(from_log)
    for name, r in from_cubin.items():
        assert r.registers == from_log[name].registers and r.stack_bytes == from_log[name].stack_bytes
        assert r.spill_stores is None  # a cubin does not record spills: reported as unknown, not as zero


def test_ptxas_report_is_parsed():
    log = ("ptxas info    : Compiling entry function 'foo' for 'sm_90'\n"
           "ptxas info    : Function properties for foo\n"
           "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 72 registers, used 1 barriers, 4096 bytes smem, 380 bytes cmem[0]\n")
    r = nvrtc.parse_ptxas(log)["foo"]
    assert (r.registers, r.stack_bytes, r.spill_stores, r.spill_loads, r.static_smem) == (72, 24, 8, 12, 4096)


def test_cli_build_prints_a_resource_table(tmp_path, capsys, monkeypatch):
    from lucegen import cli
    from lucegen.codegen import build as build_mod
    monkeypatch.setattr(build_mod, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(build_mod.build, "__defaults__", (None, tmp_path))
    assert cli.main(["build", "--spec", "rtx3090"]) == 0
    out = capsys.readouterr().out
    assert "gemv_bf16_k1024" in out and "co-resident" in out and "rtx3090" in out
    assert cli.main(["build", "--spec", str(tmp_path / "nope.yaml")]) == 2
