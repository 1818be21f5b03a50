#!/usr/bin/env python3
"""Train the tiny pair shipped as lucegen's default model: a Qwen3.5-architecture target and its DFlash draft.

    python3 tools/train_tiny_pair.py --out OUT [--minutes 5] [--device cuda|cpu]

Corpus: the CPython standard library's .py files of the Python running this (tools/pycode_corpus.py; a fixed set
is held out for evaluation), tokenized with the committed tokenizer (lucegen/models/tiny-pycode/target).
1. Target (--target-share of the time): HF transformers' Qwen3_5ForCausalLM of TARGET (8 layers, DeltaNet and
   gated attention 3:1, hidden 256, tied 2048-id embeddings), next-token loss, AdamW, cosine schedule over time.
2. Draft (the rest): a DFlash draft (block 16, 3 layers, features of target layers [1, 3, 5], evenly spaced as
   z-lab's build_target_layer_ids) trained with the block-diffusion objective on the frozen target: per sequence,
   random anchors a; block [x_a, mask x 15] at positions a..a+15 reads the fused target features of tokens < a
   (and its own block, unmasked) and predicts the target's greedy tokens at a+1..a+15 (given the data before
   each), cross-entropy weighted exp(-(k-1)/7) at depth k.
Writes OUT/target (config.json, model.safetensors, tokenizer files: lucegen's HF layout), OUT/draft
(lucegen.model.draft's layout), each every minute of its phase and at its end, and OUT/train_log.json. Last, on
the CPU, the saved bf16 files are loaded into lucegen's numpy reference and compared with the torch forwards.
Needs torch, transformers (>= 5.17, the Qwen3.5 code), numpy, safetensors, ml_dtypes; not lucegen.runtime.
"""
import torch  # first: importing it after cuda-python modules fails on some images

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch.nn.functional as F
from torch import nn

TOOLS = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS.parent), str(TOOLS)]
from lucegen.model.config import tiny_config  # noqa: E402
from lucegen.model.draft_config import DraftConfig  # noqa: E402
from pycode_corpus import SEPARATOR, corpus_files  # noqa: E402

TOKENIZER_DIR = TOOLS.parent / "lucegen" / "models" / "tiny-pycode" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB = 2048
SEPARATOR_ID = next(t["id"] for t in json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())["added_tokens"]
                    if t["content"] == SEPARATOR)
TARGET = tiny_config(
    name="tiny-pycode", hidden_size=256, num_hidden_layers=8, intermediate_size=512, vocab_size=VOCAB,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
    eos_token_id=SEPARATOR_ID)
BLOCK = 16
LOSS_DECAY = 7.0  # DFlash's gamma for block 16: depth k weighs exp(-(k - 1) / gamma)


def target_layer_ids(n_target: int, n_draft: int) -> list[int]:
    """z-lab build_target_layer_ids: n_draft layers evenly spaced from 1 to n_target - 3."""
    if n_draft == 1:
        return [n_target // 2]
    return [round(1 + i * (n_target - 4) / (n_draft - 1)) for i in range(n_draft)]


def draft_config(n_layers: int, mask_id: int) -> DraftConfig:
    cfg = DraftConfig(hidden_size=TARGET.hidden_size, num_hidden_layers=n_layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=384, block_size=BLOCK,
                      target_layer_ids=tuple(target_layer_ids(TARGET.num_hidden_layers, n_layers)),
                      mask_token_id=mask_id, rope_theta=TARGET.rope_theta,
                      num_target_layers=TARGET.num_hidden_layers)
    cfg.validate("train_tiny_pair")
    cfg.check_target(TARGET)
    return cfg


def log(msg: str, t0: float = time.perf_counter()) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


# ---- data ------------------------------------------------------------------------------------------------------
def tokenize(files: list[tuple[str, str]]) -> tuple[np.ndarray, dict[str, int]]:
    """All files, each followed by the separator, as one int32 array; and the special ids."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    encode_all = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    token_to_id = tok.token_to_id
    special = {"sep": token_to_id(SEPARATOR), "mask": token_to_id("<|mask|>")}
    ids = [i for seq in encode_all([text for _, text in files]) for i in (*seq, special["sep"])]
    return np.asarray(ids, np.int32), special


def batch(tokens: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, len(tokens) - length, (n,), generator=gen)
    return tokens[start[:, None] + torch.arange(length)]


def lr_at(progress: float, peak: float, warmup: float = 0.05) -> float:
    """Linear warm-up over the first `warmup` of the time, then cosine down to 10% of the peak."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


# ---- the DFlash draft in torch (the math of lucegen/reference/dflash.py, z-lab's tensor names) ---------------
class RMSNorm(nn.Module):
    """Qwen3RMSNorm: w * x_hat (the draft's norms; the target's are (1 + w) * x_hat)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def rope(x, pos, theta):
    """Full-head-dim NEOX RoPE of x [B, heads, T, hd] at positions pos [B, T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    ang = pos.float()[:, None, :, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, hd, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        self.cfg = cfg
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(H, cfg.num_attention_heads * hd, bias=False)
        a.k_proj = nn.Linear(H, cfg.num_key_value_heads * hd, bias=False)
        a.v_proj = nn.Linear(H, cfg.num_key_value_heads * hd, bias=False)
        a.o_proj = nn.Linear(cfg.num_attention_heads * hd, H, bias=False)
        a.q_norm, a.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)

    def forward(self, x, ctx, pos, mask):
        """x [B, Q, H] block stream; ctx [B, L, H] fused features; pos [B, L + Q]; mask [B, 1, Q, L + Q] bool."""
        c, a = self.cfg, self.self_attn
        B, Q, _ = x.shape
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = self.input_layernorm(x)
        kv_in = torch.cat([ctx, h], 1)
        q = a.q_norm(a.q_proj(h).view(B, Q, nh, hd)).transpose(1, 2)
        k = a.k_norm(a.k_proj(kv_in).view(B, -1, nkv, hd)).transpose(1, 2)
        v = a.v_proj(kv_in).view(B, -1, nkv, hd).transpose(1, 2)
        q, k = rope(q, pos[:, -Q:], c.rope_theta), rope(k, pos, c.rope_theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, Q, nh * hd))
        m, h = self.mlp, self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.fc_in, cfg.hidden_size, bias=False)
        self.hidden_norm, self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size,
                                                                                             cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, features, block_embeds, pos, mask):
        """Final-normed block hidden states [B, Q, H] (the target's LM head makes them logits)."""
        ctx = self.hidden_norm(self.fc(features))
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, pos, mask)
        return self.norm(x)


def features_of(hidden_states, layer_ids):
    """The fused input of the draft: target hidden states after layers layer_ids (HF hidden_states[i + 1])."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], -1)


def draft_batch(ids: torch.Tensor, predicted: torch.Tensor, n_blocks: int, mask_id: int, gen: torch.Generator):
    """Block ids, labels, positions and the attention mask of n_blocks random anchors in each sequence ids [B, L].
    predicted [B, L]: the target's greedy token for each position given the data before it (the labels)."""
    B, L = ids.shape
    dev = ids.device
    anchors = torch.stack([torch.randperm(L - BLOCK, generator=gen)[:n_blocks] + 1 for _ in range(B)]).to(dev)
    where = (anchors[:, :, None] + torch.arange(BLOCK, device=dev)).flatten(1)  # [B, nb * BLOCK] positions
    block = torch.gather(ids, 1, where).view(B, n_blocks, BLOCK)
    block[:, :, 1:] = mask_id
    labels = torch.gather(predicted, 1, where).view(B, n_blocks, BLOCK)[:, :, 1:]
    pos = torch.cat([torch.arange(L, device=dev).expand(B, L), where], 1)
    ctx_visible = torch.arange(L, device=dev)[None, None, :] < anchors.repeat_interleave(BLOCK, 1)[:, :, None]
    blk = torch.arange(n_blocks, device=dev).repeat_interleave(BLOCK)
    own_block = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
    mask = torch.cat([ctx_visible, own_block], 2)[:, None]
    return block.flatten(1), labels, pos, mask


def draft_loss(draft, target, ids, n_blocks, mask_id, gen):
    """The weighted block loss and, per block, the leading depths the draft's argmax gets right (greedy τ - 1).

    Labels are the target's greedy tokens along the data (what the target itself would say next at each position),
    the offline stand-in for DFlash's training on target-generated text: a block is accepted when it matches them."""
    with torch.no_grad():
        out_t = target(input_ids=ids, output_hidden_states=True, use_cache=False)
        feats = features_of(out_t.hidden_states, draft.cfg.target_layer_ids)
        predicted = torch.cat([ids[:, :1], out_t.logits[:, :-1].argmax(-1)], 1)
    block, labels, pos, mask = draft_batch(ids, predicted, n_blocks, mask_id, gen)
    embed = target.get_input_embeddings().weight
    out = draft(feats, F.embedding(block, embed), pos, mask)
    B = ids.shape[0]
    logits = (out.view(B, n_blocks, BLOCK, -1)[:, :, 1:] @ embed.T).float()
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    w = torch.exp(-torch.arange(BLOCK - 1, device=ids.device) / LOSS_DECAY)
    loss = (ce * w).sum(-1).mean() / w.sum()
    accepted = (logits.argmax(-1) == labels).int().cumprod(-1).sum(-1)
    return loss, accepted.float().mean()


# ---- training ---------------------------------------------------------------------------------------------------
def hf_target(device):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    text = {k: v for k, v in TARGET.to_hf_dict()["text_config"].items() if k not in ("model_type", "dtype")}
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text, attn_implementation="sdpa")).to(device)


def train(params, step_fn, seconds: float, lr: float, name: str, device, save, save_every: float = 60.0
          ) -> list[dict]:
    """AdamW on params until `seconds` pass; step_fn() -> (loss, metrics dict); save() writes the weights so far
    every save_every seconds (and at the end). Returns the logged points."""
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                   enabled=False)
    start, history, step, next_log, next_save = time.perf_counter(), [], 0, 0.0, save_every
    while (elapsed := time.perf_counter() - start) < seconds:
        for group in opt.param_groups:
            group["lr"] = lr_at(elapsed / seconds, lr)
        with autocast:
            loss, metrics = step_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if elapsed >= next_log or step == 1:
            point = {"step": step, "seconds": round(elapsed, 1), "loss": round(loss.item(), 4),
                     **{k: round(float(v), 4) for k, v in metrics.items()}}
            history.append(point)
            log(f"{name} " + " ".join(f"{k} {v}" for k, v in point.items()))
            next_log = elapsed + max(2.0, seconds / 30)
        if elapsed >= next_save:
            save()
            next_save = elapsed + save_every
    history.append({"step": step, "seconds": round(time.perf_counter() - start, 1), "loss": round(loss.item(), 4)})
    log(f"{name}: {step} steps in {history[-1]['seconds']} s")
    save()
    return history


@torch.no_grad()
def evaluate(fn, n: int) -> float:
    return float(np.mean([fn().item() for _ in range(n)]))


# ---- writing and checking ----------------------------------------------------------------------------------------
def canonical_target_weights(model) -> dict[str, np.ndarray]:
    """lucegen's canonical names (HF names without "model."; tied: no lm_head), float32."""
    return {name.removeprefix("model."): t.detach().float().cpu().numpy()
            for name, t in model.state_dict().items() if name != "lm_head.weight"}


def write_target(directory: Path, model) -> None:
    from lucegen.model.hf import write_hf
    write_hf(directory, TARGET, canonical_target_weights(model), tokenizer=False)
    for file in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / file, directory / file)


def write_draft_dir(directory: Path, draft) -> None:
    from lucegen.model.draft import write_draft
    write_draft(directory, draft.cfg, {k: t.detach().float().cpu().numpy() for k, t in draft.state_dict().items()})


def read_target(directory: Path) -> tuple[dict[str, np.ndarray], nn.Module]:
    """A saved target: its canonical float32 weights and the HF model holding them (float32, CPU)."""
    from lucegen.model.hf import load_hf
    weights = {k: np.asarray(v, np.float32) for k, v in load_hf(directory).items()}
    target = hf_target(torch.device("cpu")).float().eval()
    state = {f"model.{k}": torch.from_numpy(v) for k, v in weights.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    target.load_state_dict(state)
    return weights, target


def check_against_reference(out: Path, ids: np.ndarray) -> dict[str, float]:
    """Relative errors of lucegen's numpy reference against the torch forwards (float32, CPU), both on the saved
    bf16 weights: target logits over ids, and the draft's block logits after them."""
    from lucegen.model.draft import load_draft
    from lucegen.reference import forward, relative_error
    from lucegen.reference.dflash import context_features, draft_forward
    weights, target = read_target(out / "target")
    dcfg, dweights = load_draft(out / "draft", TARGET)
    ref = forward(weights, TARGET, ids, output_hidden_states=True)
    block = [int(ids[-1])] + [dcfg.mask_token_id] * (BLOCK - 1)
    ref_draft = draft_forward(dweights, weights, dcfg, TARGET, context_features(ref, dcfg.target_layer_ids[:]),
                              block)
    draft = Draft(dcfg).eval()
    draft.load_state_dict({k: torch.from_numpy(v) for k, v in dweights.items()})
    T = len(ids)
    with torch.no_grad():
        out_t = target(input_ids=torch.as_tensor(ids)[None].long(), output_hidden_states=True, use_cache=False)
        feats = features_of(out_t.hidden_states, dcfg.target_layer_ids)
        pos = torch.arange(T + BLOCK)[None]
        mask = torch.ones(1, 1, BLOCK, T + BLOCK, dtype=torch.bool)
        emb = target.get_input_embeddings().weight
        got = draft(feats, F.embedding(torch.tensor([block]), emb), pos, mask)[0] @ emb.T
    return {"target_logits_rel_err": relative_error(ref.logits, out_t.logits[0].numpy()),
            "draft_logits_rel_err": relative_error(ref_draft, got.numpy())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=5.0, help="training time, target and draft together")
    ap.add_argument("--target-share", type=float, default=0.6)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--draft-batch", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=24, help="anchors (draft blocks) per sequence")
    ap.add_argument("--draft-layers", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--target-from", type=Path, default=None, help="a target folder this script wrote: train "
                                                                      "only a draft for it")
    ap.add_argument("--max-files", type=int, default=None, help="train on the first N files (quick CPU tests)")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the reported numbers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    log(f"torch {torch.__version__} on {device}" + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda"
                                                    else ""))
    files = corpus_files()[:args.max_files]
    tokens, special = tokenize(files)
    held_out, _ = tokenize(corpus_files(held_out=True)[:args.max_files])
    log(f"corpus: {len(files)} training files, {len(tokens) / 1e6:.2f} M tokens; held out {len(held_out)} tokens")
    train_ids, val_ids = torch.from_numpy(tokens).long(), torch.from_numpy(held_out).long()
    seconds = args.minutes * 60
    report = {"target_config": TARGET.to_hf_dict(), "args": {k: str(v) for k, v in vars(args).items()},
              "corpus": {"python": sys.version.split()[0], "files": len(files), "tokens": len(tokens),
                         "held_out_tokens": len(held_out)}}

    def target_step(ids_source=train_ids):
        ids = batch(ids_source, args.batch, args.seq, gen).to(device)
        return target(input_ids=ids, labels=ids, use_cache=False).loss, {}

    if args.target_from:  # train only a draft, for a target trained before
        target = read_target(args.target_from)[1].to(device)
        write_target(args.out / "target", target)
        log(f"target: read from {args.target_from}; the draft gets all the time")
        args.target_share = 0.0
    else:
        target = hf_target(device)
        log(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.2f} M parameters")
        target.train()
        report["target_history"] = train(list(target.parameters()), target_step, seconds * args.target_share,
                                         args.lr, "target", device, lambda: write_target(args.out / "target", target))
    target.eval()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        report["target_val_loss"] = evaluate(lambda: target_step(val_ids)[0], args.eval_batches)
    log(f"target held-out loss {report['target_val_loss']:.4f}")
    for p in target.parameters():
        p.requires_grad_(False)

    dcfg = draft_config(args.draft_layers, special["mask"])
    draft = Draft(dcfg).to(device)
    for name, p in draft.named_parameters():  # N(0, 0.02) like HF's init; norms stay 1
        if p.ndim == 2:
            nn.init.normal_(p, std=0.02)
    log(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M parameters, target layers "
        f"{list(dcfg.target_layer_ids)}")

    def draft_step(ids_source=train_ids):
        ids = batch(ids_source, args.draft_batch, args.seq, gen).to(device)
        loss, accepted = draft_loss(draft, target, ids, args.blocks, dcfg.mask_token_id, gen)
        return loss, {"accepted": accepted}

    draft.train()
    report["draft_history"] = train(list(draft.parameters()), draft_step, seconds * (1 - args.target_share),
                                    args.draft_lr, "draft", device, lambda: write_draft_dir(args.out / "draft", draft))
    draft.eval()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        report["draft_val_accepted"] = evaluate(lambda: draft_step(val_ids)[1]["accepted"], args.eval_batches)
    log(f"draft held-out: {report['draft_val_accepted']:.2f} leading block tokens equal the target's greedy ones")

    report["reference_check"] = check_against_reference(args.out, held_out[:96])
    log(f"lucegen numpy reference vs torch on the saved weights: {report['reference_check']}")
    (args.out / "train_log.json").write_text(json.dumps(report, indent=1) + "\n")
    bad = {k: v for k, v in report["reference_check"].items() if v > 1e-3}
    if bad:
        print(f"error: the numpy reference disagrees with the torch forward: {bad}", file=sys.stderr)
        return 1
    log(f"done: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
