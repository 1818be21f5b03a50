#!/usr/bin/env python3
"""Write the HF golden fixtures that tests/test_reference_hf.py checks the numpy reference against.

tests/fixtures/hf_{tiny,ratio3}.npz hold the config (HF JSON), the weight seed and a digest of the weights,
the prompt (70 tokens: two DeltaNet chunks), a 16-token block and 8 greedy decode tokens, and HF's float32 logits:
prefill rows around the chunk boundary, every block row, every decode step, plus the last row of every hidden
state. The test regenerates the weights with random_weights(config, seed); the digest tells when that changed.

Run in an environment with torch and transformers 5.17 (see tools/hf_parity.py), e.g. /work/hfenv/bin/python.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_parity import BLOCK, get_config, hf_model, run_hf  # noqa: E402  (tools/ is sys.path[1] as a script)
from lucegen.reference.weights import random_weights, weights_digest  # noqa: E402

SEED, PROMPT_LEN, DECODE = 0, 70, 8
PREFILL_ROWS = np.array([0, 1, 31, 62, 63, 64, 65, PROMPT_LEN - 1])  # either side of the chunk boundary at 64
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


def main() -> int:
    import torch
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)
    for spec in ("tiny", "ratio3"):
        cfg = get_config(spec)
        weights = random_weights(cfg, SEED)
        rng = np.random.default_rng(SEED)
        prompt, block = rng.integers(0, cfg.vocab_size, PROMPT_LEN), rng.integers(0, cfg.vocab_size, BLOCK)
        hf = run_hf(hf_model(cfg, weights, "cpu"), prompt, block, DECODE)
        path = OUT / f"hf_{spec}.npz"
        np.savez_compressed(
            path,
            config=json.dumps(cfg.to_hf_dict()), seed=SEED, weights_sha256=weights_digest(weights),
            versions=f"torch {torch.__version__}, transformers {transformers.__version__}",
            prompt=prompt, block=block, decode_tokens=np.array(hf["decode_tokens"]),
            prefill_rows=PREFILL_ROWS, prefill_logits=hf["prefill"][PREFILL_ROWS],
            hidden_last=np.stack([h[-1] for h in hf["hidden"]]),
            block_logits=hf["block"], decode_logits=hf["decode"],
        )
        print(f"{path}: {path.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
