#!/usr/bin/env python3
"""Train the tiny pair's tokenizer: a byte-level BPE of VOCAB ids on the stdlib training files (pycode_corpus).

    python3 tools/make_pycode_tokenizer.py [--out lucegen/models/tiny-pycode/target]

256 byte tokens, merges up to VOCAB - 6, then the 5 Qwen special tokens the chat template needs
(lucegen.model.tokenizer.TEST_SPECIAL_TOKENS) and MASK_TOKEN, the DFlash draft's mask id (the last id). Writes
tokenizer.json + tokenizer_config.json. Deterministic for a given corpus and `tokenizers` version; it is run once
here and its files are committed, so the GPU machine only reads them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lucegen.model.tokenizer import byte_level_tokenizer, tokenizer_config  # noqa: E402
from pycode_corpus import corpus_files  # noqa: E402
from tokenizers import AddedToken  # noqa: E402

VOCAB = 2048
MASK_TOKEN = "<|mask|>"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "lucegen" / "models" / "tiny-pycode" / "target"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    start = time.perf_counter()
    files = corpus_files()
    backend = byte_level_tokenizer(VOCAB - 1, "\n".join(text for _, text in files))
    backend.add_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])
    assert backend.get_vocab_size() == VOCAB and backend.token_to_id(MASK_TOKEN) == VOCAB - 1
    args.out.mkdir(parents=True, exist_ok=True)
    backend.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(backend), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    n_tokens = sum(len(e.ids) for e in backend.encode_batch([t for _, t in files]))
    n_bytes = sum(len(t.encode()) for _, t in files)
    print(f"{args.out}: {VOCAB} ids from {len(files)} files ({n_bytes / 1e6:.1f} MB -> {n_tokens / 1e6:.2f} M "
          f"tokens, {n_bytes / n_tokens:.2f} bytes per token) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
