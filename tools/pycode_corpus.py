"""The corpus of the shipped tiny model pair: the CPython standard library's .py sources (PSF licence).

Shared by make_pycode_tokenizer.py (here), train_tiny_pair.py (on the GPU machine) and bench_tiny_pair.py (here):
the same sorted file list and the same held-out split on any machine, whatever Python version provides the files.
Held out (never trained on): files whose path, relative to the stdlib folder, has crc32 % HELD_OUT_MOD == 0.

Pure Python and numpy only (no torch, no lucegen imports), so the training script can import it before torch.
"""
from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path


HELD_OUT_MOD = 40
MAX_FILE_BYTES = 200_000  # a few generated tables (e.g. unicode data) are skipped: they are not code
SEPARATOR = "<|endoftext|>"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % HELD_OUT_MOD == 0


def corpus_files(held_out: bool = False, root: Path | None = None) -> list[tuple[str, str]]:
    """[(path relative to the stdlib folder, text)], sorted by path: the training files, or the held-out ones.
    site-packages is not the standard library and is skipped, as are files that are not UTF-8 or too large."""
    root = root or stdlib_dir()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or is_held_out(rel) != held_out:
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            out.append((rel, path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if not out:
        raise SystemExit(f"no {'held-out' if held_out else 'training'} .py files found under {root}")
    return out


def held_out_prompts(n: int, chars: int = 240) -> list[tuple[str, str]]:
    """[(file, prompt)] for the first n held-out files of at least 40 lines: whole lines from the middle of the
    file, at most `chars` characters (code the models never trained on, cut at the same place on any machine)."""
    out = []
    for rel, text in corpus_files(held_out=True):
        lines = text.splitlines(keepends=True)
        if len(lines) < 40:
            continue
        prompt = ""
        for line in lines[len(lines) // 2:]:
            if prompt and len(prompt) + len(line) > chars:
                break
            prompt += line
        out.append((rel, prompt[:chars]))
        if len(out) == n:
            break
    return out
