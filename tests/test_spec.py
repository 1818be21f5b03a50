"""Chip specs: every shipped spec loads; a bad spec is an error naming the file, the key and the reason."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lucegen.spec import SPECS_DIR, SpecError, all_specs, list_specs, load_spec, match_device

SHIPPED = ("rtx3090", "rtx4090", "rtx5090", "a100", "h100", "h200")


def test_every_chip_has_a_valid_spec():
    assert set(SHIPPED) <= set(list_specs())
    for spec in all_specs():
        mk = spec.tuning.megakernel
        for threads in (mk.threads, *(m.threads for m in mk.model_threads)):
            assert mk.blocks <= spec.max_coresident_blocks(threads)
        assert spec.chip.read_gbs > 0


def test_a_model_may_take_its_own_megakernel_threads(tmp_path):
    """tuning.megakernel.model_threads: the named model's megakernel takes its thread count, every other model the
    spec's."""
    path = _write(tmp_path, _set("tuning.megakernel.model_threads", [{"model": "qwen3.5-27b", "threads": 256}]))
    mk = load_spec(path).tuning.megakernel
    assert mk.threads_for("qwen3.5-27b") == 256 and mk.threads_for("qwen3.5-0.8b") == mk.threads != 256


def test_a_model_may_take_its_own_gemv_floor(tmp_path):
    """tuning.qgemv.model_min_blocks: the named model's GEMVs compile with its floor of blocks an SM (their kernel
    names say it), every other model's with the spec's."""
    from lucegen.kernels import qgemv
    path = _write(tmp_path, _set("tuning.qgemv", {"model_min_blocks": [{"model": "qwen3.5-27b", "min_blocks": 6}]}))
    spec = load_spec(path)
    q4k = qgemv.fmt_of("q4_k")
    assert spec.tuning.qgemv.min_blocks_for("qwen3.5-27b") == 6
    assert spec.tuning.qgemv.min_blocks_for("qwen3.5-0.8b") == spec.tuning.qgemv.min_blocks != 6
    assert qgemv.tunings(spec, q4k, 5120, "qwen3.5-27b")[0].name(q4k, 5120).endswith("_mb6")
    assert "_mb" not in qgemv.tunings(spec, q4k, 5120, "qwen3.5-0.8b")[0].name(q4k, 5120)


def test_registers_bound_the_blocks_an_sm_holds_by_whole_warp_groups():
    """64K registers an SM, given to warps 256 at a time and in groups of 4 warps: 17 warps of 96 registers fit one
    block (20 warps' worth), of 120 none (16 warps' worth: what ptxas's 96-register cap at 544 threads says);
    16 warps of 128 fit one, two blocks of 128 threads at 255 registers fit."""
    h200 = load_spec("h200")
    assert h200.max_coresident_blocks(544, 96) == h200.chip.sm_count
    assert h200.max_coresident_blocks(544, 120) == 0
    assert h200.max_coresident_blocks(512, 128) == h200.chip.sm_count
    assert h200.max_coresident_blocks(128, 255) == 2 * h200.chip.sm_count
    assert h200.max_coresident_blocks(384, 168) == h200.chip.sm_count


def test_bare_name_finds_the_spec():
    assert load_spec("h200").path == SPECS_DIR / "h200.yaml"


def test_h200_and_h100_are_told_apart_by_memory():
    assert match_device("sm_90", 132, 141 * 10**9).name == "h200"
    assert match_device("sm_90", 132, 80 * 2**30).name == "h100"
    assert match_device("sm_75", 40, 16 * 2**30) is None


def _write(tmp_path: Path, mutate) -> Path:
    data = yaml.safe_load((SPECS_DIR / "h200.yaml").read_text())
    mutate(data)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _set(path: str, value):
    def mutate(d):
        *parents, leaf = path.split(".")
        for k in parents:
            d = d[k]
        d[leaf] = value
    return mutate


def _delete(path: str):
    def mutate(d):
        *parents, leaf = path.split(".")
        for k in parents:
            d = d[k]
        del d[leaf]
    return mutate


@pytest.mark.parametrize("mutate, key, reason", [
    (_set("chip.warp_size", 32), "chip.warp_size", "unknown key"),
    (_set("tuning.megakernel.blocks", "many"), "tuning.megakernel.blocks", "expected an integer"),
    (_set("tuning.megakernel.blocks", 10_000), "tuning.megakernel.blocks", "cannot all be co-resident"),
    (_set("tuning.megakernel.threads", 100), "tuning.megakernel.threads", "multiple of 32"),
    (_set("tuning.megakernel.weight_prefetch_tiles", -1), "tuning.megakernel.weight_prefetch_tiles", ">= 0"),
    (_set("tuning.megakernel.barrier_tiles", -2), "tuning.megakernel.barrier_tiles", ">= 0"),
    (_set("tuning.megakernel.inflight_tiles", -1), "tuning.megakernel.inflight_tiles", ">= 0"),
    (_set("tuning.megakernel.model_threads", [{"model": "qwen3.5-27b", "threads": 100}]),
     "tuning.megakernel.model_threads[0].threads", "multiple of 32"),
    (_set("tuning.megakernel.model_threads", [{"model": "qwen3.5-27b"}]), "tuning.megakernel.model_threads[0].threads",
     "missing required key"),
    (_set("tuning.prefill.model_pdl", [{"model": "qwen3.5-0.8b", "pdl": "on"}]), "tuning.prefill.model_pdl[0].pdl",
     "expected true or false"),
    (_set("tuning.layered.row_threads", 100), "tuning.layered.row_threads", "multiple of 32"),
    (_set("chip.arch", "sm_42"), "chip.arch", "not supported by the installed NVRTC"),
    (_set("chip.arch", "ampere"), "chip.arch", "expected an arch"),
    (_set("tuning.kv_format", "int2"), "tuning.kv_format", "is not one of"),
    (_set("tuning.weight_formats", ["bf16", "iq1_s"]), "tuning.weight_formats[1]", "is not one of"),
    (_set("tuning.ddtree.budget", 0), "tuning.ddtree.budget", "between 1 and 1024"),
    (_set("tuning.ddtree.chain_seed", "yes"), "tuning.ddtree.chain_seed", "expected true or false"),
    (_set("tuning.ddtree.deltanet_slice", 24), "tuning.ddtree.deltanet_slice", "not 8, 16, 32 or 64"),
    (_set("chip.smem_per_block", 10**7), "chip.smem_per_block", "exceeds smem_per_sm"),
    (_set("chip.measured_read_gbs", 9000.0), "chip.measured_read_gbs", "datasheet"),
    (_delete("chip.sm_count"), "chip.sm_count", "missing required key"),
    (_set("tuning.gemv", [256]), "tuning.gemv", "expected a mapping"),
    (_set("tuning.gemv.method", "tma"), "tuning.gemv.method", "is not one of"),
    (_set("tuning.gemv.tile_bytes", 200_000), "tuning.gemv.tile_bytes", "fitting the"),
    (_set("tuning.prefill", {"chunk_tokens": 1000}), "tuning.prefill.chunk_tokens", "multiple of 64"),
    (_set("tuning.prefill", {"chunk_tokens": 1 << 20}), "tuning.prefill.chunk_tokens", "max_context"),
    (_set("tuning.prefill", {"gemm": "tcgen05"}), "tuning.prefill.gemm", "is not one of"),
    (_set("tuning.prefill", {"split_k": 0}), "tuning.prefill.split_k", "between 1 (no split) and 8"),
    (_set("tuning.qgemv", {"stages": 1}), "tuning.qgemv.stages", "0 (no ring) or between 2 and 8"),
    (_set("tuning.qgemv", {"gemm": "wmma"}), "tuning.qgemv.gemm", "is not one of"),
    (_set("tuning.qgemv", {"min_blocks": 9}), "tuning.qgemv.min_blocks", "between 1 and 8 (blocks of 256 threads"),
    (_set("tuning.qgemv", {"model_min_blocks": [{"model": "qwen3.5-27b", "min_blocks": 0}]}),
     "tuning.qgemv.model_min_blocks[0].min_blocks", "between 1 and 8"),
    (_set("tuning.qgemv", {"span": 9}), "tuning.qgemv.span", "between 1 and 8"),
    (_set("tuning.qgemv", {"gemm_m_tile": 3}), "tuning.qgemv.gemm_m_tile", "2, 4, 8 or 16"),
    (_set("tuning.qgemv", {"gemm_mma_from": 1}), "tuning.qgemv.gemm_mma_from", "between 2 and 65"),
    (_set("tuning.qgemv", {"format_mma_from": [{"format": "q6_k", "gemm_mma_from": 66}]}),
     "tuning.qgemv.format_mma_from[0].gemm_mma_from", "between 2 and 65"),
    (_set("tuning.qgemv", {"format_mma_from": [{"format": "q8_0", "gemm_mma_from": 4}]}),
     "tuning.qgemv.format_mma_from[0].format", "'q8_0': the int8 mma GEMM takes q4_k, q6_k"),
    (_set("tuning.qgemv", {"gemm": "dp4a", "quad_sums": True}), "tuning.qgemv.quad_sums", "serve the int8 mma GEMM"),
    (_set("tuning.qgemv", {"tensor_core_formats": ["q6_k"]}), "tuning.qgemv.tensor_core_formats",
     "q6_k: the tensor-core kernel takes q4_k"),
    (_set("tuning.ddtree", {"budget": 8, "max_budget": 6}), "tuning.ddtree.max_budget", "between the budget (8)"),
])
def test_bad_spec_names_file_key_and_reason(tmp_path, mutate, key, reason):
    path = _write(tmp_path, mutate)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    msg = str(e.value)
    assert str(path) in msg and f": {key}:" in msg and reason in msg, msg


def test_fp8_kv_needs_ada_or_newer(tmp_path):
    def mutate(d):
        d["chip"]["arch"] = "sm_86"
        d["tuning"]["gemv"]["method"] = "ldg"
        d["tuning"]["kv_format"] = "fp8"
    with pytest.raises(SpecError, match=r"tuning.kv_format: fp8 KV needs sm_89"):
        load_spec(_write(tmp_path, mutate))


def test_programmatic_launch_needs_hopper(tmp_path):
    def mutate(d):
        d["chip"]["arch"] = "sm_89"
        d["tuning"]["gemv"]["method"] = "ldg"
        d["tuning"]["prefill"]["gemm"] = "mma"
    with pytest.raises(SpecError, match=r"tuning.layered.pdl: programmatic dependent launch needs sm_90"):
        load_spec(_write(tmp_path, mutate))


def test_a_model_launched_programmatically_needs_hopper_too(tmp_path):
    """h200's tuning.prefill.model_pdl launches the 0.8B's prefill programmatically: on sm_89 the entry is the error."""
    def mutate(d):
        d["chip"]["arch"] = "sm_89"
        d["tuning"]["gemv"]["method"] = "ldg"
        d["tuning"]["prefill"]["gemm"] = "mma"
        d["tuning"]["layered"]["pdl"] = False
    with pytest.raises(SpecError, match=r"tuning.prefill.model_pdl\[0\].pdl: programmatic dependent launch needs"):
        load_spec(_write(tmp_path, mutate))


def test_a_model_may_launch_its_prefill_otherwise_than_the_spec(tmp_path):
    """tuning.prefill.model_pdl: the named model's prefill launches as its entry says, every other model's as pdl."""
    path = _write(tmp_path, _set("tuning.prefill.model_pdl", [{"model": "qwen3.5-27b", "pdl": True}]))
    prefill = load_spec(path).tuning.prefill
    assert not prefill.pdl and prefill.pdl_for("qwen3.5-27b") and not prefill.pdl_for("qwen3.5-0.8b")


def test_copy_engine_gemv_needs_hopper(tmp_path):
    with pytest.raises(SpecError, match=r"tuning.gemv.method: bulk copies need sm_90"):
        load_spec(_write(tmp_path, _set("chip.arch", "sm_89")))


def test_wgmma_prefill_gemm_needs_hopper(tmp_path):
    def mutate(d):
        d["chip"]["arch"] = "sm_100"
        d["tuning"]["prefill"] = {"gemm": "wgmma"}
    with pytest.raises(SpecError, match=r"tuning.prefill.gemm: wgmma is Hopper's .* this chip is sm_100"):
        load_spec(_write(tmp_path, mutate))
    assert load_spec("h200").with_prefill(gemm="wgmma").tuning.prefill.gemm == "wgmma"
    with pytest.raises(SpecError, match="tuning.prefill.gemm"):
        load_spec("rtx4090").with_prefill(gemm="wgmma")


def test_malformed_yaml_and_missing_file(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("chip: [unclosed\n")
    with pytest.raises(SpecError, match=r"broken.yaml: not valid YAML"):
        load_spec(p)
    with pytest.raises(SpecError, match=r"no such spec file"):
        load_spec(tmp_path / "absent.yaml")


def test_emulation_keeps_the_chip_but_changes_the_arch():
    spec = load_spec("rtx3090").with_arch("sm_90")
    assert spec.chip.arch == "sm_90" and spec.chip.sm_count == 82 and spec.tuning.kv_format == "tq3_0"
    with pytest.raises(SpecError, match="arch override"):
        load_spec("rtx3090").with_arch("sm_1")
    with pytest.raises(SpecError, match=r"emulated at sm_80: tuning.gemv.method: bulk copies need sm_90"):
        load_spec("h200").with_arch("sm_80")
