"""`lucegen bench prompts` on the numpy backend: the tiny checkpoint and a tiny random DFlash draft over the first
prompts of each set; chain and DDTree give the autoregressive tokens, the records carry the run's header fields."""
from __future__ import annotations

import json

import pytest

from lucegen.bench import prompts
from lucegen.bench.results import Recorder
from lucegen.cli import main
from lucegen.engine import SamplingParams, generate, load_model


@pytest.mark.parametrize("name", sorted(prompts.SETS))
def test_the_sets_load_with_chat_messages(name):
    rows = prompts.load_set(name)
    assert len(rows) == 10 and all(r["messages"][0]["role"] == "user" and r["max_tokens"] >= 512 for r in rows)


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_speculative_modes_match_ar_and_are_recorded(tmp_path, checkpoint, draft, mode, capsys):
    out = tmp_path / "r.jsonl"
    assert main(["bench", "prompts", "--set", "gsm8k", "--model", str(checkpoint), "--backend", "numpy",
                 "--draft", str(draft), "--mode", mode, "--budget", "5", "--limit", "2", "--tokens", "6",
                 "--results", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {r["metric"]: r for r in map(json.loads, out.read_text().splitlines())}
    ar, spec, accepted = (rows[f"gsm8k_{m}"] for m in ("ar_tok_s", f"{mode}_tok_s", f"{mode}_accepted_length"))
    assert spec["greedy_equal"] == 1.0 and spec["prompts"] == 2 and spec["budget"] == 5
    assert spec["tokens"] == ar["tokens"] == 2 * 5  # 6 tokens a prompt (no EOS in the tiny model), 5 decoded
    assert spec["accepted_length"] == accepted["value"] >= 1.0
    assert spec["limit"] == pytest.approx(spec["accepted_length"] * ar["value"], rel=1e-3)
    head = printed.splitlines()[:2]
    assert head[0].startswith("GPU CPU | commit ") and head[1] == f"$ {spec['command']}"
    assert all(r["gpu"] == "CPU" and r["model"] == f"numpy {checkpoint.name} gsm8k" for r in rows.values())


def test_ar_totals_are_the_generations(tmp_path, checkpoint):
    """The runner's totals are those of generate() on each prompt through the chat template."""
    totals = prompts.run(Recorder("CPU", out=tmp_path / "r.jsonl", command="test"), "humaneval", str(checkpoint),
                         "ar", limit=2, max_tokens=4)
    engine, tokenizer = load_model(checkpoint)
    tokens = 0
    for p in prompts.load_set("humaneval")[:2]:
        ids = tokenizer.encode(tokenizer.apply_chat_template(p["messages"]))
        tokens += generate(engine, tokenizer, ids, 4, SamplingParams(temperature=0)).completion_tokens - 1
    assert set(totals) == {"ar"} and totals["ar"].tokens == tokens and totals["ar"].passes == tokens


def test_bad_options_say_what(tmp_path, capsys, checkpoint, draft):
    base = ["bench", "prompts", "--model", str(checkpoint), "--backend", "numpy", "--results", str(tmp_path / "r")]
    assert main([*base, "--set", "math500", "--mode", "ddtree"]) == 2
    assert "--mode ddtree needs --draft" in capsys.readouterr().err
    assert main([*base, "--set", "math500", "--draft", str(draft)]) == 2
    assert "--mode ar takes no --draft" in capsys.readouterr().err
    assert main([*base[:2], "--backend", "numpy", "--set", "math500"]) == 2
    assert "--set and --model are required" in capsys.readouterr().err
