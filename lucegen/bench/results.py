"""One JSON object per measurement, appended to results/<gpu>.jsonl."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent.parent / "results"


def commit() -> str:
    """The commit measured: $LUCEGEN_COMMIT (set when the tree was copied without .git), else git's HEAD."""
    if os.environ.get("LUCEGEN_COMMIT"):
        return os.environ["LUCEGEN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=RESULTS_DIR.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "").replace("geforce", "")).strip("-")


@dataclass
class Recorder:
    gpu: str
    out: Path | None = None
    command: str = field(default_factory=lambda: "lucegen " + shlex.join(sys.argv[1:]))
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    commit: str = field(default_factory=commit)

    def __post_init__(self):
        self.out = self.out or RESULTS_DIR / f"{gpu_slug(self.gpu)}.jsonl"
        print(f"GPU {self.gpu} | commit {self.commit} | {self.date}\n$ {self.command}")

    def record(self, metric: str, model: str, value: float, unit: str, limit: float | None = None, **extra) -> dict:
        row = {"metric": metric, "model": model, "value": round(float(value), 6), "unit": unit, "gpu": self.gpu,
               "commit": self.commit, "date": self.date, "command": self.command}
        if limit is not None:
            row["limit"] = round(float(limit), 6)
        row.update(extra)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        ratio = f"  (limit {limit:.4g} {unit}: {value / limit:.1%})" if limit else ""
        print(f"  {metric:<28} {model:<22} {value:>12.4g} {unit}{ratio}")
        return row
