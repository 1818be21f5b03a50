"""`lucegen tune` on the numpy backend with the tiny checkpoint: the spec file gets the best budget on its one budget
line (every other byte kept), the file is restored when the result does not validate, an output that differs from
plain decoding fails the command, and bad options exit 2 with a one-line message."""
from __future__ import annotations

import shutil

import pytest

from lucegen import spec as spec_module
from lucegen.bench.speculative import Paired
from lucegen.cli import main
from lucegen.engine.generate import Generation
from lucegen.engine.numpy_backend import NumpyEngine
from lucegen.spec import SPECS_DIR, SpecError, load_spec
from lucegen.tune import Measurement, TuneError, best, summed, sweep, tune, with_budget

FAST = ["--backend", "numpy", "--model", "tiny", "--tokens", "9", "--prompts", "2"]


@pytest.fixture
def h200(tmp_path):
    """A copy of the real H200 spec."""
    return shutil.copy(SPECS_DIR / "h200.yaml", tmp_path / "h200.yaml")


def fake(tok_s: dict[int, float], differs: dict[int, tuple[int, ...]] | None = None):
    """A measure function reading tok/s (and differing prompts) from tables."""
    def measure(budget: int) -> Measurement:
        return Measurement(budget, tok_s[budget], 100.0, 1.0 + budget / 10, (differs or {}).get(budget, ()))
    return measure


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    assert len(a) == len(b)
    return [(x, y) for x, y in zip(a, b) if x != y]


def test_the_rewrite_changes_the_budget_line_alone(h200):
    before = h200.read_text()
    after = with_budget(before, 8, "measured here")
    line = next(line for line in before.splitlines(keepends=True) if line.startswith("    budget:"))
    assert changed_lines(before, after) == [(line, "    budget: 8  # measured here\n")]


def test_the_rewrite_finds_tuning_ddtree_budget_by_indentation_and_keeps_line_endings():
    text = ("# budget: 1 in a comment\r\nchip:\r\n  budget: 2\r\ntuning:\r\n  other:\r\n    budget: 3\r\n"
            "  ddtree:  # the tree\r\n\r\n    # budget: 4 commented out\r\n    budget:   5   # old note\r\n"
            "    chain_seed: true\r\n")
    after = with_budget(text, 12, "new note")
    assert changed_lines(text, after) == [("    budget:   5   # old note\r\n", "    budget: 12  # new note\r\n")]
    with pytest.raises(TuneError, match="no `budget:` lines under tuning.ddtree"):
        with_budget("tuning:\n  ddtree:\n    chain_seed: true\n", 8, "x")
    with pytest.raises(TuneError, match="2 `budget:` lines under tuning.ddtree"):
        with_budget("tuning:\n  ddtree:\n    budget: 4\n    budget: 8\n", 8, "x")


def test_the_best_budget_is_the_one_of_highest_tok_s(capsys):
    results = sweep([2, 4, 8, 16], fake({2: 10.0, 4: 30.0, 8: 20.0, 16: 30.0}))
    assert [m.budget for m in results] == [2, 4, 8, 16]
    assert best(results).budget == 4  # a tie goes to the smaller budget
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["budget", "nodes", "accepted"] and table[2].split()[:2] == ["4", "5"]


def test_write_puts_the_best_budget_into_the_spec_and_it_loads(h200, capsys):
    before = h200.read_text()
    assert tune(str(h200), "tiny", "numpy", budgets=[2, 4, 8], write=True,
                measure=fake({2: 10.0, 4: 5.0, 8: 40.0})) == 0
    (old, new), = changed_lines(before, h200.read_text())
    assert old.startswith("    budget: ") and new.startswith("    budget: 8  # lucegen tune ")
    assert "40.0 tok/s" in new and "on CPU" in new and "oracle draft" in new
    spec = load_spec(h200)
    assert spec.tuning.ddtree.budget == 8
    assert spec.to_dict()["chip"] == load_spec("h200").to_dict()["chip"]
    assert "best budget: 8" in capsys.readouterr().out


def test_a_bare_spec_name_is_the_file_in_specs(h200, monkeypatch):
    monkeypatch.setattr(spec_module, "SPECS_DIR", h200.parent)
    assert tune("h200", "tiny", "numpy", budgets=[2, 4], write=True, measure=fake({2: 1.0, 4: 2.0})) == 0
    assert load_spec(h200).tuning.ddtree.budget == 4


def test_a_budget_that_does_not_validate_leaves_the_file_as_it_was(h200, capsys):
    before = h200.read_bytes()
    with pytest.raises(SpecError, match=r"tuning.ddtree.budget: 2000 must be between 1 and 1024.*restored"):
        tune(str(h200), "tiny", "numpy", budgets=[8, 2000], write=True, measure=fake({8: 1.0, 2000: 9.0}))
    assert h200.read_bytes() == before


def test_an_output_unlike_plain_decoding_fails_and_writes_nothing(h200, capsys):
    before = h200.read_bytes()
    assert tune(str(h200), "tiny", "numpy", budgets=[2, 4], write=True,
                measure=fake({2: 1.0, 4: 2.0}, differs={4: (1,)})) == 1
    out, err = capsys.readouterr()
    assert "NO: prompt 1" in out and "at budget 4: speculative decoding must be lossless" in err
    assert h200.read_bytes() == before


def test_a_lossy_engine_is_caught_by_the_real_measurement(h200, monkeypatch, capsys):
    """Speculative rounds that change their last token: the comparison with plain decoding must see it."""
    speculate = NumpyEngine.speculate

    def lossy(self, context_ids, max_new, sampler):
        new = speculate(self, context_ids, max_new, sampler)
        return [*new[:-1], (new[-1] + 1) % self.config.vocab_size]
    monkeypatch.setattr(NumpyEngine, "speculate", lossy)
    before = h200.read_bytes()
    assert main(["tune", "--spec", str(h200), "--budgets", "4", "--write", *FAST]) == 1
    out, err = capsys.readouterr()
    assert "NO: prompt 0, 1" in out and "must be lossless" in err
    assert h200.read_bytes() == before


def test_tok_s_and_accepted_length_are_summed_over_the_prompts():
    def g(tokens: int, seconds: float, passes: int, ids=None) -> Generation:
        return Generation("", ids or list(range(tokens)), "length", 3, 0.1, seconds, passes)
    runs = [Paired([g(11, 0.5, 10)], [g(11, 0.25, 4)]),             # 10 steps: ar 20 tok/s, 40 with the draft
            Paired([g(31, 1.5, 30)], [g(31, 1.0, 6, [7] * 31)])]    # 30 steps: ar 20 tok/s, 30; output differs
    m = summed(8, runs)
    assert m.tok_s == pytest.approx(40 / 1.25) and m.ar_tok_s == pytest.approx(20.0)
    assert m.accepted_length == pytest.approx(4.0) and m.differs == (1,) and m.nodes == 9


@pytest.mark.parametrize("args, message", [
    (["--spec", "no-such-chip"], "no-such-chip: no such spec file"),
    (["--budgets", "0", "4"], "--budgets 0 4: each budget must be at least 1"),
    (["--tokens", "1"], "--tokens 1: at least 2"),
    (["--prompts", "0"], "--prompts 0: between 1 and"),
    (["--model", "{tmp}/missing"], "missing/config.json: no such config file"),
    (["--draft", "{tmp}/missing"], "missing/config.json: no such config file"),
    (["--backend", "tpu"], "unknown backend 'tpu'"),
])
def test_bad_options_exit_2_with_one_line(h200, tmp_path, capsys, args, message):
    (tmp_path / "missing").mkdir()
    before = h200.read_bytes()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["tune", "--spec", str(h200), *FAST, "--budgets", "2", *args, "--write"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lucegen tune: ") and message in err and err.count("\n") == 1
    assert h200.read_bytes() == before


def test_no_fitting_budget_exits_2(h200, monkeypatch, capsys):
    monkeypatch.setattr(NumpyEngine, "max_tree_nodes", 5, raising=False)
    assert main(["tune", "--spec", str(h200), *FAST, "--budgets", "8", "16", "--write"]) == 2
    err = capsys.readouterr().err
    assert "no budget of 8 16 fits" in err and "at most 5 nodes" in err


def test_lucegen_tune_end_to_end_with_the_oracle(h200, capsys):
    before = h200.read_text()
    assert main(["tune", "--spec", str(h200), *FAST, "--budgets", "2", "8", "--write"]) == 0
    out = capsys.readouterr().out
    assert "draft: oracle, right with probability 0.8" in out
    rows = {int(line.split()[0]): line.split() for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert sorted(rows) == [2, 8] and all(r[-1] == "yes" for r in rows.values())
    assert all(1.0 <= float(r[2]) <= 8.0 for r in rows.values())  # accepted length: 8 tokens after the first
    chosen = max(rows, key=lambda b: float(rows[b][3]))
    assert f"best budget: {chosen} " in out
    (_, new), = changed_lines(before, h200.read_text())
    assert new.startswith(f"    budget: {chosen}  # lucegen tune ") and "(numpy tiny, oracle draft" in new
    assert load_spec(h200).tuning.ddtree.budget == chosen


def test_lucegen_tune_with_a_dflash_draft(checkpoint, draft, h200, capsys):
    budget = load_spec(h200).tuning.ddtree.budget
    assert main(["tune", "--spec", str(h200), "--backend", "numpy", "--model", str(checkpoint), "--draft",
                 str(draft), "--budgets", "1", "4", "--tokens", "6", "--prompts", "1"]) == 0
    out = capsys.readouterr().out
    assert f"draft: DFlash {draft}" in out and "oracle" not in out
    assert [line.split()[-1] for line in out.splitlines() if line.strip()[:1].isdigit()] == ["yes", "yes"]
    assert load_spec(h200).tuning.ddtree.budget == budget  # no --write
