#!/usr/bin/env python3
"""Render results/<gpu>.jsonl as a markdown table (the newest measurement of each metric and model), with plots.

    python3 tools/results_table.py [results/h200.jsonl ...]   > prints the table; --write updates results/README.md

With --write and matplotlib installed (pip install -e '.[plots]'), PNG plots are written beside the page, each from
whatever the file holds, and linked under its table:

    <gpu>-speculative.png   tok/s against accepted length: DDTree and chain with the oracle draft, the
                            autoregressive rate, the limit (accepted length x autoregressive), the prompt sets
    <gpu>-bandwidth.png     the fraction of the read ceiling each kernel reaches (GEMVs at M = 1, the decode
                            megakernel and each of its phases)
    <gpu>-budget.png        the DDTree budget sweep: tok/s and accepted length against the tree budget

Without matplotlib the page still gets its tables, and says how to add the plots.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACCEPT = re.compile(r"^(ddtree|chain)_tok_s_al(\d+)$")
BUDGET = re.compile(r"^ddtree_tok_s_b(\d+)$")
PROMPT_SET = re.compile(r"^(\w+)_(chain|ddtree)_tok_s$")


def run_by(r: dict) -> str:
    """Who or what produced a row: a peer, a path through lucegen, a kernel variant (bench prefill's GEMM method
    and split-K), or lucegen as configured by its spec."""
    by = r.get("peer") or r.get("path")
    if isinstance(by, str):  # (rows before path_nodes carried a tree path's length as an int "path")
        return by
    if r.get("gemm"):
        return f"lucegen, {r['gemm']} GEMMs" + (f", split-K {r['split_k']}" if r.get("split_k", 1) > 1 else "")
    return "lucegen"


def latest(path: Path) -> list[dict]:
    """The newest row of each (metric, model, run by)."""
    rows: dict[tuple[str, str, str], dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["metric"], r["model"], run_by(r))] = r  # later lines are newer
    return list(rows.values())


def table(path: Path) -> str:
    out = [f"### {path.stem}", "",
           "| metric | model | run by | value | unit | limit | of limit | commit | date |",
           "|---|---|---|---:|---|---:|---:|---|---|"]
    for r in latest(path):
        limit = r.get("limit")
        ratio = f"{r['value'] / limit:.1%}" if limit else ""
        who = run_by(r)
        out.append(f"| {r['metric']} | {r['model']} | {who} | {r['value']:.4g} | {r['unit']} | "
                   f"{'' if limit is None else f'{limit:.4g}'} | {ratio} | {r['commit']} | {r['date'][:10]} |")
    return "\n".join(out)


# ---- plots: each returns False when the rows hold nothing for it ----------------------------------------------------

def series(r: dict) -> str:
    """The curve a row belongs to: its model, and who ran it where that is not lucegen as its spec configures it."""
    by = run_by(r)
    return r["model"] if by == "lucegen" else f"{r['model']} ({by})"


def plot_speculative(rows: list[dict], ax) -> bool:
    by_model: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in rows:
        m = ACCEPT.match(r["metric"])
        if m:
            by_model.setdefault(series(r), {}).setdefault(m[1], []).append(
                (r.get("accepted_length", int(m[2])), r["value"]))
    sets = [r for r in rows if PROMPT_SET.match(r["metric"]) and "accepted_length" in r]
    if not by_model and not sets:
        return False
    for model, modes in sorted(by_model.items()):
        for mode, points in sorted(modes.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=f"{mode}, {model}")
    lengths = [p[0] for modes in by_model.values() for points in modes.values() for p in points]
    for r in rows:
        if r["metric"] == "ar_tok_s" and run_by(r) == "lucegen" and r["model"] in by_model:
            ax.axhline(r["value"], linestyle="--", color="black", linewidth=0.8, label=f"autoregressive, {r['model']}")
            span = [1.0, max(lengths)]
            ax.plot(span, [x * r["value"] for x in span], ":", color="gray",
                    label=f"limit: accepted length x autoregressive, {r['model']}")
    for r in sets:
        ax.plot(r["accepted_length"], r["value"], "s", label=f"{r['metric'].removesuffix('_tok_s')}, {r['model']}")
    ax.set(xlabel="accepted length (tokens per target pass)", ylabel="tok/s", yscale="log",
           title="Speculative decoding: tok/s against accepted length")
    return True


def plot_bandwidth(rows: list[dict], ax) -> bool:
    gemv = [r for r in rows if r["metric"].endswith("_bw_frac") and r["unit"] == "fraction"]
    bars = [(f"{r['metric'].removesuffix('_bw_frac')} {r['model']}", r["value"])
            for r in gemv if " M=" not in r["model"] or r["model"].endswith(" M=1")]
    reads = [r for r in rows if r["metric"] == "tg128_tok_s" and r.get("read_gbs")]
    if reads:  # the decode megakernel's phases, each against the read ceiling of the decode run
        read = reads[-1]["read_gbs"]
        bars += [(f"decode phase {r['metric'].removeprefix('phase_us_')}", r["gbs"] / read)
                 for r in rows if r["metric"].startswith("phase_us_") and r.get("bytes_per_token") and r.get("gbs")]
    if not bars:
        return False
    ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1])
    ax.axvline(1.0, color="gray", linestyle=":")
    ax.set(xlabel="fraction of the measured read ceiling", title="Bandwidth efficiency per kernel")
    ax.tick_params(axis="y", labelsize=7)
    return True


def plot_budget(rows: list[dict], ax) -> bool:
    by_model: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:
        m = BUDGET.match(r["metric"])
        if m:
            by_model.setdefault(series(r), []).append((int(m[1]), r["value"], r.get("accepted_length", 0.0)))
    if not by_model:
        return False
    twin = ax.twinx()
    for model, points in sorted(by_model.items()):
        points.sort()
        budgets = [p[0] for p in points]
        ax.plot(budgets, [p[1] for p in points], "o-", label=f"tok/s, {model}")
        twin.plot(budgets, [p[2] for p in points], "s--", color="gray", label=f"accepted length, {model}")
    ax.set(xlabel="DDTree budget (tree nodes per target pass)", ylabel="tok/s", xscale="log",
           title="DDTree budget sweep")
    ticks = sorted({p[0] for points in by_model.values() for p in points})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    twin.set_ylabel("accepted length")
    twin.legend(loc="lower right", fontsize=7)
    return True


PLOTS = {"speculative": plot_speculative, "bandwidth": plot_bandwidth, "budget": plot_budget}


def plots(path: Path, out_dir: Path) -> list[Path] | None:
    """Write the plots of one results file into out_dir; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, written = latest(path), []
    for view, draw in PLOTS.items():
        fig, ax = plt.subplots(figsize=(9, 5.5))
        if draw(rows, ax):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper left")
            fig.tight_layout()
            written.append(out_dir / f"{path.stem}-{view}.png")
            fig.savefig(written[-1], dpi=110, metadata={"Software": None})
        plt.close(fig)
    return written


def page(files: list[Path], out_dir: Path) -> str:
    parts = ["# Results", "", "Generated by `python3 tools/results_table.py --write` from the JSONL files beside it "
             "(one JSON object per measurement; the newest of each metric and model is shown).", ""]
    for f in files:
        parts += [table(f), ""]
        images = plots(f, out_dir)
        if images is None:
            parts += ["(Plots: install matplotlib, `pip install -e '.[plots]'`, and run the command again.)", ""]
        parts += [f"![{p.stem}]({p.name})" for p in images or []] + ([""] if images else [])
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--write", action="store_true", help="write results/README.md and the plots beside it")
    args = ap.parse_args()
    files = args.files or sorted((ROOT / "results").glob("*.jsonl"))
    if args.write:
        (ROOT / "results" / "README.md").write_text(page(files, ROOT / "results"))
    print("\n\n".join(table(f) for f in files))


if __name__ == "__main__":
    main()
