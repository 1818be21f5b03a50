"""`lucegen bench speculative` on the numpy backend with the tiny checkpoint: the oracle draft's acceptance profile
gives exactly the accepted length asked for, every speculative output equals the autoregressive one, and every
record carries the run's GPU, commit, date and command."""
from __future__ import annotations

import json

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
