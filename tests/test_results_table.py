"""tools/results_table.py: the newest row of each metric and model in the table; the three plots from whatever the
file holds (with matplotlib), and the table alone without it."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("results_table", Path(__file__).parents[1] / "tools/results_table.py")
results_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_table)


def row(metric, model, value, unit="tok/s", limit=None, **extra):
    return {"metric": metric, "model": model, "value": value, "unit": unit, "gpu": "CPU", "commit": "abc",
            "date": "2026-11-29T18:00:00Z", "command": "lucegen bench x", **({"limit": limit} if limit else {}),
            **extra}


@pytest.fixture
def results(tmp_path):
    rows = [row("ar_tok_s", "numpy tiny", 100.0), row("ar_tok_s", "numpy tiny", 120.0),  # the second is newer
            *(row(f"{m}_tok_s_al{a}", "numpy tiny", 50.0 * a, limit=120.0 * a, accepted_length=a)
              for m in ("ddtree", "chain") for a in (4, 8)),
            *(row(f"ddtree_tok_s_b{b}", "numpy tiny", 300.0 / b, accepted_length=2 + b / 8) for b in (2, 8, 32)),
            row("gemv_bw_frac", "bf16 248320x1024", 0.97, "fraction", 1.0)]
    path = tmp_path / "cpu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_table_keeps_the_newest_row(results):
    lines = results_table.table(results).splitlines()
    ar = [line for line in lines if line.startswith("| ar_tok_s ")]
    assert len(ar) == 1 and "| 120 |" in ar[0]
    assert any(line.startswith("| ddtree_tok_s_al8 | numpy tiny | lucegen | 400 | tok/s | 960 | 41.7% |")
               for line in lines)


def test_a_variants_rows_are_a_curve_of_their_own(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [*(row(f"chain_tok_s_al{a}", "m", 10.0 * a) for a in (4, 8)),
            *(row(f"chain_tok_s_al{a}", "m", 9.0 * a, path="a variant") for a in (4, 8))]
    assert [results_table.series(r) for r in rows[1:3]] == ["m", "m (a variant)"]
    fig, ax = plt.subplots()
    assert results_table.plot_speculative(rows, ax)
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    plt.close(fig)
    assert lines == {"chain, m": [40.0, 80.0], "chain, m (a variant)": [36.0, 72.0]}


def test_page_with_plots(results, tmp_path):
    pytest.importorskip("matplotlib")
    text = results_table.page([results], tmp_path)
    for view in ("speculative", "bandwidth", "budget"):
        png = tmp_path / f"cpu-{view}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"![cpu-{view}](cpu-{view}.png)" in text


def test_page_skips_a_plot_without_its_data(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "gpu.jsonl"
    path.write_text(json.dumps(row("gemv_bw_frac", "bf16 8x8", 0.5, "fraction", 1.0)) + "\n")
    text = results_table.page([path], tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["gpu-bandwidth.png"] and "gpu-budget" not in text


def test_page_without_matplotlib_still_has_the_table(results, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    text = results_table.page([results], tmp_path)
    assert "| ddtree_tok_s_al8 |" in text and "pip install -e '.[plots]'" in text
    assert not list(tmp_path.glob("*.png"))
