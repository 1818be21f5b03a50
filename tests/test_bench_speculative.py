"""`lucegen bench speculative` on the numpy backend with the tiny checkpoint: the oracle draft's acceptance profile
gives exactly the accepted length asked for, every speculative output equals the autoregressive one, and every
record carries the run's GPU, commit, date and command."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lucegen.bench import speculative
from lucegen.bench.results import Recorder
from lucegen.engine import SamplingParams, generate, load_model
from lucegen.model.config import tiny_config
from lucegen.spec_decode import Speculation, oracle_draft

TARGET = tiny_config()


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "cpu.jsonl"
    # 25 tokens: 24 after the first, whole rounds of 4 and of 6 tokens
    speculative.run(Recorder("CPU", out=out, command="test"), "tiny", "numpy", tokens=25, accept_lengths=(4, 6),
                    budgets=(1, 8), repeat=1)
    return {r["metric"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("mode", ["ddtree", "chain"])
@pytest.mark.parametrize("a", [4, 6])
def test_the_oracle_profile_gives_its_accepted_length_losslessly(records, mode, a):
    r = records[f"{mode}_tok_s_al{a}"]
    assert r["accepted_length"] == a and r["greedy_equal"] is True
    assert r["model"] == "numpy tiny" and r["unit"] == "tok/s" and r["value"] > 0
    # against the autoregressive run beside it: a target pass costing one decode step
    assert r["limit"] == pytest.approx(a * r["ar_tok_s"], rel=1e-3)
    assert r["speedup"] == pytest.approx(r["value"] / r["ar_tok_s"], rel=1e-2)


def test_budget_sweep_and_parts_are_recorded(records):
    for b in (1, 8):
        r = records[f"ddtree_tok_s_b{b}"]
        assert r["budget"] == b and r["greedy_equal"] is True and 1 <= r["accepted_length"] <= 24
    # budget 1: one node below the root, so at most one draft token a pass
    assert records["ddtree_tok_s_b1"]["accepted_length"] <= 2
    parts = {p: records[f"spec_{p}_ms"] for p in ("draft", "tree", "verify", "walk", "commit")}
    assert all(p["value"] > 0 and p["nodes"] == speculative.BUDGET + 1 for p in parts.values())
    assert parts["verify"]["limit"] == pytest.approx(records["decode_step_ms"]["value"], rel=1e-3)
    for r in records.values():
        assert r["gpu"] == "CPU" and r["command"] == "test" and r["commit"] and r["date"]


def test_oracle_run_accepts_run_tokens_each_round(checkpoint):
    """The profile hook on its own: a round accepts exactly `run` draft tokens, whatever the budget."""
    engine, tokenizer = load_model(checkpoint)
    ids, greedy = tokenizer.encode("Once upon a time"), SamplingParams(temperature=0)
    want = generate(engine, tokenizer, ids, 17, greedy, ignore_eos=True)
    for run, budget in ((3, 4), (3, 22), (1, 22)):
        engine.speculation = Speculation(oracle_draft(want.token_ids, len(ids), TARGET.vocab_size, run=run),
                                         depth=7, budget=budget)
        got = generate(engine, tokenizer, ids, 17, greedy, ignore_eos=True)
        assert got.token_ids == want.token_ids
        assert got.target_passes == 16 // (run + 1)  # 16 tokens after the first, run + 1 a pass


def test_random_weights_are_the_cuda_step_alone():
    from lucegen.bench.engines import open_engine
    for model, backend in (("random:qwen3.5-27b", "numpy"), ("random:qwen3.5-27b:q4_k_m:x", "cuda")):
        with pytest.raises(ValueError, match="random weights run on the cuda backend's layer-by-layer step"):
            open_engine(model, backend)


# ---- the GPU draft parts (lucegen/bench/draft_parts.py): what runs without a GPU ----------------------------------
def test_the_draft_parts_are_skipped_with_a_reason_on_the_numpy_backend(records, checkpoint, capsys):
    from lucegen.bench import draft_parts
    assert not any(m.startswith(("spec_draft_append", "spec_topk", "spec_round")) for m in records)
    engine, _ = load_model(checkpoint)
    assert "LayeredEngine" in draft_parts.skip_reason(engine)
    assert draft_parts.run(None, engine, "numpy tiny", [1, 2, 3], 4, {22: 1.0}, 1.0) is None
    assert "GPU draft parts skipped: the GPU draft runs beside the cuda backend's LayeredEngine" in \
        capsys.readouterr().out


def test_the_bundled_draft_config_fits_the_27b_only():
    from lucegen.bench import draft_parts
    from lucegen.model.config import load_config
    from lucegen.model.draft_config import DraftConfig
    assert draft_parts.config_problem(load_config("qwen3.5-27b")) is None
    problem = draft_parts.config_problem(TARGET)
    assert problem.startswith("qwen3.5-27b-dflash-draft on tiny") and "hidden_size" in problem
    shared = Path("/work/shared/models/qwen3.5-27b-dflash-draft.config.json")
    if shared.exists():  # the bundled copy is the shared config
        assert DraftConfig.from_json(shared) == DraftConfig.from_json(draft_parts.draft_config_path())


def test_round_arithmetic():
    from lucegen.bench import draft_parts as dp
    parts = {"draft_append": 0.1, "draft": 1.2, "topk": 0.05, "tree": 0.15, "verify": 6.0, "walk": 0.02,
             "commit": 0.48}
    assert dp.round_ms(parts) == pytest.approx(8.0)
    # accepted length 8: 7 accepted draft tokens and the bonus, 8 tokens a round of 8 ms = 1000 tok/s
    assert dp.round_tok_s(8.0, 8) == pytest.approx(1000.0)
    assert dp.limit_ms(4_387_000_000, 4387.0) == pytest.approx(1.0)  # 4.387 GB at 4387 GB/s: 1 ms


def test_the_derived_round_verifies_a_tree_that_holds_its_accepted_nodes():
    from lucegen.bench import draft_parts as dp
    measured = {2: 10.0, 4: 14.0, 8: 23.0, 16: 35.0, 64: 117.0}
    assert dp.ACCEPTED == 8
    assert dp.round_budget(64, measured) == 64  # the spec's budget holds 7 accepted nodes
    assert dp.round_budget(4, measured) == 8    # a tuned budget of 4 does not: the smallest that does
    assert dp.round_budget(4, {2: 1.0, 4: 2.0}) is None


def test_draft_bytes_on_the_27b_draft():
    from lucegen.bench import draft_parts as dp
    from lucegen.model.draft_config import DraftConfig
    cfg = DraftConfig.from_json(dp.draft_config_path())
    # per layer, bf16: [q | k | v] 6144 x 5120, o 5120 x 4096, [gate | up] 34816 x 5120, down 5120 x 17408
    layer = 2 * (6144 * 5120 + 5120 * 4096 + 34816 * 5120 + 5120 * 17408)
    assert dp.draft_forward_bytes(cfg, 0, 0) == 5 * layer == 3_198_156_800
    # plus the LM head, 16 embedding rows and K and V rows (fp32, 8 kv heads of 128) of every layer
    assert dp.draft_forward_bytes(cfg, 1000, 4096, 10) == 5 * layer + 1000 + 160 + 5 * 4096 * 2 * 1024 * 4
    # an append: fc (5120 x 25600) and every layer's [k | v] (2048 x 5120) in bf16, 8 feature rows in fp32
    assert dp.draft_append_bytes(cfg, 8) == 2 * (5120 * 25600 + 5 * 2048 * 5120) + 4 * 8 * 25600


def test_a_gemm_launch_reads_its_bf16_weight_rows():
    from lucegen.bench import draft_parts as dp
    x, w, y = object(), object(), object()  # tensor maps or arrays: not counted
    # the launch's arguments (x, w, y, M, N, K, ...): N x K bf16 weights, whatever M and the split's extras
    assert dp.gemm_weight_bytes((x, w, y, 16, 6144, 5120)) == 2 * 6144 * 5120
    assert dp.gemm_weight_bytes((x, w, y, 13, 5120, 17408, object(), object())) == 2 * 5120 * 17408
    assert dp.gemm_weight_bytes((x, w, y, True, 5)) == 0  # not a GEMM's arguments


def test_tiled_draft_weights_have_the_checkpoint_shapes():
    from lucegen.bench import draft_parts as dp
    from lucegen.model.draft_config import tiny_draft_config
    from lucegen.reference.dflash import draft_weight_shapes
    cfg = tiny_draft_config(TARGET, intermediate_size=200)
    w = dp.TiledDraftWeights(cfg, seed=3)
    assert set(w) == set(draft_weight_shapes(cfg)) and len(w) == len(draft_weight_shapes(cfg))
    for name, shape in draft_weight_shapes(cfg).items():
        a = w[name]
        assert a.shape == shape and a.dtype == np.float32 and np.isfinite(a).all()
        np.testing.assert_array_equal(a, w[name])  # the same on every access (the K/V rows are read twice)
    gate = w["layers.0.mlp.gate_proj.weight"]  # 200 rows: the 64-row tile 3 times and 8 rows of it
    np.testing.assert_array_equal(gate[64:128], gate[:64])
    np.testing.assert_array_equal(gate[192:], gate[:8])
