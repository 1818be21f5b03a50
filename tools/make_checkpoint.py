#!/usr/bin/env python3
"""Make a test checkpoint of any Qwen3.5-family config: random weights as an HF snapshot and/or a GGUF.

    python tools/make_checkpoint.py OUT_DIR [--config tiny|qwen3.5-0.8b|path/config.json] [--set key=value ...]
                                    [--seed 0] [--peaked] [--formats hf,gguf] [--mix q4_k_m] [--shard-mb 4096]
                                    [--no-tokenizer]

OUT_DIR becomes the HF snapshot (config.json, model.safetensors or shards + index, tokenizer files) and holds
<name>-<mix>.gguf. --set overrides config fields (JSON values), e.g. --set vocab_size=1024 hidden_size=256.
All weights are generated in memory first (about 2 bytes per parameter), so real sizes need the RAM for it.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lucegen.model.checkpoint import MIXES, make_checkpoint  # noqa: E402
from lucegen.model.config import ConfigError, load_config, tiny_config  # noqa: E402


def parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set {pair!r}: expected key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--config", default="tiny", help="tiny, a bundled model name, or a config.json / snapshot dir")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config fields")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peaked", action="store_true", help="scale embeddings and lm_head so greedy tokens are stable")
    ap.add_argument("--formats", default="hf,gguf", help="comma-separated: hf, gguf")
    ap.add_argument("--mix", default="q4_k_m", choices=sorted(MIXES), help="GGUF quant mix")
    ap.add_argument("--shard-mb", type=int, default=4096, help="largest safetensors shard (MiB)")
    ap.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer files")
    args = ap.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        if args.config == "tiny":
            cfg = tiny_config(**overrides)
        else:
            cfg = replace(load_config(args.config), **overrides)
            cfg.validate(args.config)
        paths = make_checkpoint(args.out_dir, cfg, seed=args.seed, peaked=args.peaked,
                                formats=tuple(args.formats.split(",")), mix=args.mix,
                                max_shard_bytes=args.shard_mb << 20, tokenizer=not args.no_tokenizer)
    except (ValueError, TypeError) as e:  # ConfigError, WeightError and QuantError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 1
    for fmt, path in paths.items():
        print(f"{fmt}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
