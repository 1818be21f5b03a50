#!/usr/bin/env python3
"""The numpy reference against HF transformers' Qwen3_5ForCausalLM, in float32.

Per config: random weights (lucegen.reference.random_weights) loaded into HF (eager attention, the torch
fallbacks of the DeltaNet ops), then per prompt length the three DeltaNet paths HF takes:
    prefill  T tokens, no cache           chunked rule from a zero state
    block    16 tokens on the cache       chunked rule from the cached state (a speculative verify block)
    decode   N greedy steps on the cache  recurrent rule
The reference is fed the same tokens (HF's greedy choices) and its logits, and the prefill hidden states, are
compared by relative error ||ref - hf|| / ||hf|| (decode: the worst step).

    hf_parity.py [CONFIG ...] [--prompt-lens 70 130] [--decode 32] [--device cpu|cuda] [--out DIR]

CONFIG is `tiny`, `ratio3` (3 value heads per key head, as 27B) or a path to an HF config.json. Needs torch and
transformers 5.17 and must NOT have flash-linear-attention or causal-conv1d installed (HF would use them).
Exit status 1 when any error exceeds --threshold.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lucegen.model.config import ModelConfig, load_config, tiny_config  # noqa: E402
from lucegen.reference import State, decode_step, forward, random_weights, relative_error  # noqa: E402

CONFIGS = {
    "tiny": lambda: tiny_config(),
    "ratio3": lambda: tiny_config(
        name="ratio3", hidden_size=96, num_hidden_layers=8, intermediate_size=192,
        num_attention_heads=6, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=32),
}
BLOCK = 16


def get_config(spec: str) -> ModelConfig:
    return CONFIGS[spec]() if spec in CONFIGS else load_config(spec)


def hf_model(cfg: ModelConfig, weights: dict[str, np.ndarray], device: str):
    """Qwen3_5ForCausalLM in float32 with eager attention, holding `weights`."""
    import torch
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    for package in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(package) is not None:
            sys.exit(f"{package} is importable: HF would run its kernels instead of the torch reference ops")
    torch.backends.cudnn.allow_tf32 = False  # the depthwise conv1d would otherwise run in TF32 on the GPU
    torch.backends.cuda.matmul.allow_tf32 = False
    text = {k: v for k, v in cfg.to_hf_dict()["text_config"].items() if k not in ("model_type", "dtype")}
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text, attn_implementation="eager")).float()
    state = {("lm_head.weight" if name == "lm_head.weight" else f"model.{name}"): torch.from_numpy(w)
             for name, w in weights.items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()


def run_hf(model, prompt: np.ndarray, block: np.ndarray, n_decode: int) -> dict:
    """HF logits for the prompt, the block and n_decode greedy steps, and the greedy tokens it chose."""
    import torch

    device = next(model.parameters()).device

    def step(ids, cache=None, **kw):
        ids = torch.as_tensor(np.asarray(ids))[None].to(device)
        return model(input_ids=ids, past_key_values=cache, use_cache=True, **kw)

    def to_numpy(batch):
        return batch[0].float().cpu().numpy()

    with torch.no_grad():
        out = step(prompt, output_hidden_states=True)
        cache = out.past_key_values
        block_logits = to_numpy(step(block, cache).logits)
        tokens, decode_logits, logits = [], [], block_logits[-1]
        for _ in range(n_decode):
            tokens.append(int(np.argmax(logits)))
            logits = to_numpy(step([tokens[-1]], cache).logits)[0]
            decode_logits.append(logits)
    return dict(prefill=to_numpy(out.logits), hidden=[to_numpy(h) for h in out.hidden_states], block=block_logits,
                decode=np.array(decode_logits), decode_tokens=tokens)


def run_reference(weights, cfg: ModelConfig, prompt, block, decode_tokens) -> dict:
    """The reference over the same tokens: prefill, block, then one decode step per token."""
    state = State()
    out = forward(weights, cfg, prompt, state, output_hidden_states=True)
    block_logits = forward(weights, cfg, block, state).logits
    decode = np.array([decode_step(weights, cfg, t, state) for t in decode_tokens])
    return dict(prefill=out.logits, hidden=out.hidden_states, block=block_logits, decode=decode)


def compare(ref: dict, hf: dict) -> dict:
    n = len(hf["decode_tokens"])
    return {
        "prefill": relative_error(ref["prefill"], hf["prefill"]),
        "hidden": max(relative_error(r, h) for r, h in zip(ref["hidden"], hf["hidden"], strict=True)),
        "block": relative_error(ref["block"], hf["block"]),
        "decode": max((relative_error(ref["decode"][i], hf["decode"][i]) for i in range(n)), default=0.0),
        # the reference's own greedy choice at every decode position (inputs are HF's tokens)
        "greedy_agree": bool(np.array_equal(ref["decode"][:-1].argmax(-1), hf["decode_tokens"][1:])),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", default=["tiny", "ratio3"])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[70, 130])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=float, default=1e-4, help="max relative error (float32)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--out", type=Path, help="write parity.json here")
    args = ap.parse_args(argv)

    import torch
    import transformers

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}, "
          f"threshold {args.threshold:g}")
    print(f"{'config':>10} {'T':>5} {'prefill':>9} {'hidden':>9} {'block':>9} {'decode':>9} {'greedy':>6} {'s':>6}")
    results = []
    for spec in args.configs:
        cfg = get_config(spec)
        weights = random_weights(cfg, args.seed)
        model = hf_model(cfg, weights, device)
        rng = np.random.default_rng(args.seed)
        for T in args.prompt_lens:
            t0 = time.time()
            prompt, block = rng.integers(0, cfg.vocab_size, T), rng.integers(0, cfg.vocab_size, BLOCK)
            hf = run_hf(model, prompt, block, args.decode)
            errs = compare(run_reference(weights, cfg, prompt, block, hf["decode_tokens"]), hf)
            ok = all(errs[k] <= args.threshold for k in ("prefill", "hidden", "block", "decode"))
            results.append(dict(config=cfg.name, spec=spec, prompt_len=T, block_len=BLOCK, decode_steps=args.decode,
                                **errs, ok=ok))
            print(f"{cfg.name:>10} {T:>5} {errs['prefill']:9.2e} {errs['hidden']:9.2e} {errs['block']:9.2e} "
                  f"{errs['decode']:9.2e} {str(errs['greedy_agree']):>6} {time.time() - t0:6.1f}"
                  + ("" if ok else "  FAIL"), flush=True)
        del model, weights
    passed = all(r["ok"] for r in results)
    print("PASS" if passed else "FAIL")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = dict(torch=torch.__version__, transformers=transformers.__version__, device=device,
                       seed=args.seed, threshold=args.threshold, passed=passed, results=results)
        (args.out / "parity.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
