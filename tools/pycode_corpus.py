"""The corpus of the shipped tiny model pair: the CPython standard library's .py sources (PSF licence).

Shared by make_pycode_tokenizer.py (here), train_tiny_pair.py (on the GPU machine) and bench_tiny_pair.py (here):
the same sorted file list and the same held-out split on any machine, whatever Python version provides the files.
Held out (never trained on): files whose path, relative to the stdlib folder, has crc32 % HELD_OUT_MOD == 0.

Pure Python and numpy only (no torch, no lucegen imports), so the training script can import it before torch.
"""
from __future__ import annotations

import re
import sysconfig
import unicodedata
import zlib
from functools import lru_cache
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


# ---- a pure-Python encoder for the byte-level BPE tokenizer.json (used where `tokenizers` is not installed) ----
# Qwen3.5's split pattern (lucegen.model.tokenizer.QWEN3_5_PAT_STR) in `re` syntax: \p{L} -> [^\W\d_],
# \p{N} -> \d. Identical on ASCII text; the stdlib sources are almost all ASCII (checked against `tokenizers` by
# make_pycode_tokenizer.py --check-encoder). Any split still gives ids that decode back to the text.
_LETTERS = r"[^\W\d_]"
_SPLIT = re.compile(
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|(?:_|[^\r\n\w])?""" + _LETTERS + r"""+|\d| ?(?:_|[^\s\w])+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


class PurePythonBPE:
    """encode(text) -> ids of a byte-level BPE tokenizer.json (NFC, the split above, merges by rank); special
    tokens are not parsed out of the text (the corpus separator is added as an id by the caller)."""

    def __init__(self, tokenizer_json: dict):
        model = tokenizer_json["model"]
        self.vocab = model["vocab"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.special = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
        self.byte_chars = _bytes_to_unicode()

    def token_to_id(self, token: str) -> int:
        return self.special[token] if token in self.special else self.vocab[token]

    @lru_cache(maxsize=1 << 20)
    def _word(self, word: str) -> tuple[int, ...]:
        parts = ["".join(self.byte_chars[b] for b in ch.encode()) for ch in word]
        parts = [c for p in parts for c in p]  # one symbol per byte
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return tuple(self.vocab[p] for p in parts)

    def encode(self, text: str) -> list[int]:
        text = unicodedata.normalize("NFC", text)
        return [i for word in _SPLIT.findall(text) for i in self._word(word)]


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
