#!/usr/bin/env python3
"""HF transformers' float32 Qwen3_5ForCausalLM (eager attention, torch DeltaNet ops: tools/hf_parity.py's hf_model)
on one prompt, in a process of its own: the last token's logits.

    hf_logits.py CONFIG_JSON WEIGHTS IDS_TXT OUT [--device cuda|cpu]

CONFIG_JSON  an HF config.json (ModelConfig.to_hf_dict())
WEIGHTS      a .safetensors file: the model's weights by HF name without the "model." prefix (as lucegen.reference
             holds them), float32 (not .npz: numpy failed to read back a 3 GB npz of the 0.8B's weights there)
IDS_TXT      the prompt's token ids, as whitespace-separated integers
OUT          written: a .safetensors file holding "logits", float32 [vocab], the logits of the prompt's last token
             (no .npy/.npz on either side: the GPU image's numpy fails to parse the headers of the files it wrote)

tests/gpu/test_prefill_gpu.py runs this so that torch is never imported into the pytest process (there, importing
torch 2.11 fails while it registers its own custom ops). Needs torch and transformers, and not flash-linear-attention
or causal-conv1d (hf_model refuses to run with them).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_parity import hf_model

from lucegen.model.config import load_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path)
    ap.add_argument("weights", type=Path)
    ap.add_argument("ids", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)

    import torch

    cfg = load_config(args.config)
    weights = load_file(str(args.weights))
    ids = np.array(args.ids.read_text().split(), np.int64)
    model = hf_model(cfg, weights, args.device)
    del weights
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids)[None].to(args.device)).logits[0, -1]
    save_file({"logits": logits.float().cpu().numpy()}, str(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
