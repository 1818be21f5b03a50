"""`lucegen plan`: the device memory one sequence needs on a chip, item by item, and whether it fits.

    lucegen plan --spec rtx3090 --model model.gguf --draft draft/ --ctx 131072
    lucegen plan --spec rtx3090 --model qwen3.5-27b --mix q4_k_m --draft qwen3.5-27b-dflash-draft.config.json

Items (bytes; GiB in the table):
- target weights: a GGUF file's tensors (its text-model layers; MTP layers are not loaded), or a config quantized
  with lucegen's rendition of a llama.cpp mix (lucegen.model.checkpoint.gguf_types), as the GPU holds them (Q6_K's
  blocks in pairs, Q4_K's and Q6_K's matrices in whole tiles of 16 rows: kernels/qgemv.py's Format.matrix_bytes);
- draft weights: a DFlash draft's safetensors (their sizes, from the headers) or its config.json (bf16);
- KV cache: ctx positions x the full-attention layers x K and V x KV heads x a head_dim row in the KV format;
- DeltaNet state: per DeltaNet layer the fp32 recurrent state [Hv, dk, dv] and conv state [K-1, conv_dim];
- DDTree state at the spec's largest tree (tuning.ddtree.capacity), one of two ways to keep a verify lossless:
    persist: the fp32 recurrent state of every tree node in every DeltaNet layer (budget x layers x Hv x dk x dv
             x 4), written by the verify; commit copies the accepted node's;
    replay:  the node states of one layer at a time (the verify runs layer by layer) plus each node's state-update
             inputs (k, v, decay, beta) for every layer; commit recomputes the accepted path's states from the
             committed state with the same step, so they are the verify's bits;
  and, either way, every node's conv input column per DeltaNet layer (the K-1 committed columns before them);
- draft context: the ring of captured target features (bf16, DRAFT_WINDOW positions) and the draft's KV over it;
- activations: the widest row of every phase for max(budget + 1 verify rows, a PREFILL_CHUNK-token prefill chunk),
  the verify's logits and the draft's block of logits, fp32;
- CUDA context: what the driver takes for the context, module images and stacks (a reserve, --reserve-mib).
"""
from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .model import kvformats
from .model.config import ModelConfig, load_config
from .spec import KV_FORMATS, ChipSpec, load_spec

PREFILL_CHUNK = 512       # tokens per prefill chunk
DRAFT_WINDOW = 4096       # target positions the draft sees (lucebox's feature ring: min(ctx, 4096))
CONTEXT_RESERVE = 512 << 20
GIB = float(1 << 30)
TREE_STATES = ("auto", "persist", "replay")


class PlanError(ValueError):
    """Inputs a plan cannot be made from; the message names the file or the field."""


@dataclass(frozen=True)
class Item:
    name: str
    nbytes: int
    detail: str = ""


@dataclass(frozen=True)
class Draft:
    """What the plan needs of a DFlash draft: its weight bytes and the shapes of its context state."""
    source: str
    weight_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    target_layers: int  # captured target layers (fc's input is target_layers x hidden)
    hidden: int
    block_size: int


@dataclass
class Plan:
    spec: ChipSpec
    model: ModelConfig
    ctx: int
    kv_format: str
    tree_state: str
    items: list[Item]
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def capacity(self) -> int:
        return self.spec.chip.memory_bytes

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def table(self) -> str:
        rows = [(i.name, f"{i.nbytes / GIB:8.3f}", i.detail) for i in self.items]
        rows += [("total", f"{self.total / GIB:8.3f}", f"of {self.capacity / GIB:.3f} GiB on {self.spec.name}")]
        w = max(len(r[0]) for r in rows)
        lines = [f"{'item'.ljust(w)}  {'GiB':>8}  detail", f"{'-' * w}  {'-' * 8}  {'-' * 6}"]
        lines += [f"{n.ljust(w)}  {g}  {d}" for n, g, d in rows]
        return "\n".join(lines)


# ---- the target ------------------------------------------------------------------------------------------------
def _tensor_bytes(shape: tuple[int, ...], t) -> int:
    """Bytes on the GPU of a tensor of logical shape `shape` (rows of shape[-1] values) and ggml type t: a matrix in
    one of the quantized kernels' formats as they hold it (qgemv.Format.matrix_bytes: Q6_K's blocks in pairs, the
    tensor-core formats' rows in whole tiles), anything else as the file stores it."""
    from .kernels.qgemv import FORMATS
    from .model.quants import row_bytes
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    fmt = next((f for f in FORMATS.values() if f.ggml == t), None)
    if fmt is not None and len(shape) == 2 and shape[-1] % fmt.row_step == 0:
        return fmt.matrix_bytes(rows, shape[-1])
    return rows * row_bytes(t, shape[-1])


def target_from_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, int]]:
    """A GGUF file's config and its text-model tensor bytes on the GPU (_tensor_bytes) by ggml type name."""
    from .model.gguf_file import load_gguf, split_name
    ckpt = load_gguf(path)
    by_type: dict[str, int] = {}
    for name, t in ckpt.tensors.items():
        layer = split_name(name)[0]
        if layer is not None and layer >= ckpt.config.num_hidden_layers:
            continue  # MTP layers: not loaded
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: ggml's ne reversed
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + _tensor_bytes(shape, t.tensor_type)
    return ckpt.config, by_type


def target_from_config(model: ModelConfig, mix: str) -> dict[str, int]:
    """Tensor bytes on the GPU (_tensor_bytes) by ggml type name of `model` quantized with `mix`."""
    from .model.checkpoint import gguf_types
    from .model.gguf_file import gguf_shape
    from .model.weights import weight_shapes
    types, _ = gguf_types(model, mix)
    by_type: dict[str, int] = {}
    for name, shape in weight_shapes(model).items():
        t = types[name]
        by_type[t.name] = by_type.get(t.name, 0) + _tensor_bytes(gguf_shape(name, shape), t)
    return by_type


# ---- the draft -------------------------------------------------------------------------------------------------
def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def draft_from_config(cfg: dict, source: str) -> Draft:
    """A DFlash draft config.json: Qwen3-style layers, fc over the captured target layers, no embedding or LM head
    of its own; weights in bf16."""
    try:
        h, layers, nh = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
        nkv, hd, inter = cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
        targets = len(cfg["dflash_config"]["target_layer_ids"])
    except KeyError as e:
        raise PlanError(f"{source}: not a DFlash draft config (missing {e})") from None
    per_layer = 2 * h + nh * hd * h * 2 + 2 * nkv * hd * h + 2 * hd + 3 * h * inter
    params = targets * h * h + 2 * h + layers * per_layer  # fc, hidden_norm + norm, layers
    return Draft(source, 2 * params, layers, nkv, hd, targets, h, int(cfg.get("block_size", 16)))


def draft_from_safetensors(files: list[Path], cfg: dict | None, source: str) -> Draft:
    """Sizes from the headers; the context-state shapes from the tensors' shapes."""
    tensors = {}
    for f in files:
        tensors.update({k: v for k, v in _safetensors_header(f).items() if k != "__metadata__"})
    try:
        fc = tensors["fc.weight"]["shape"]
        kv_rows, h = tensors["layers.0.self_attn.k_proj.weight"]["shape"]
        hd = tensors["layers.0.self_attn.k_norm.weight"]["shape"][0]
    except KeyError as e:
        raise PlanError(f"{source}: not a DFlash draft checkpoint (no tensor {e})") from None
    layers = len({m[1] for k in tensors if (m := re.match(r"layers\.(\d+)\.", k))})
    nbytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in tensors.values())
    return Draft(source, nbytes, layers, kv_rows // hd, hd, fc[1] // fc[0], h, int((cfg or {}).get("block_size", 16)))


def load_draft(path: str | Path) -> Draft:
    """A draft from a .safetensors file, a folder of them (with or without config.json), or a config.json."""
    p = Path(path)
    if not p.exists():
        raise PlanError(f"{p}: no such draft file or folder")
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p] if p.suffix == ".safetensors" else []
    config = p / "config.json" if p.is_dir() else p if p.suffix == ".json" else None
    cfg = json.loads(config.read_text()) if config is not None and config.exists() else None
    if files:
        return draft_from_safetensors(files, cfg, str(p))
    if cfg is None:
        raise PlanError(f"{p}: neither safetensors nor a config.json")
    return draft_from_config(cfg, str(p))


# ---- sizes -----------------------------------------------------------------------------------------------------
def kv_cache_bytes(m: ModelConfig, fmt: str, ctx: int) -> int:
    return len(m.full_layers) * 2 * m.num_key_value_heads * kvformats.row_bytes(fmt, m.head_dim) * ctx


def recurrent_bytes(m: ModelConfig) -> int:
    """One DeltaNet layer's fp32 recurrent state [Hv, dk, dv]."""
    return m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim * 4


def deltanet_state_bytes(m: ModelConfig) -> int:
    return len(m.linear_layers) * (recurrent_bytes(m) + (m.linear_conv_kernel_dim - 1) * m.conv_dim * 4)


def tree_state_bytes(m: ModelConfig, budget: int, mode: str) -> int:
    layers = len(m.linear_layers)
    conv = layers * (m.linear_conv_kernel_dim - 1 + budget + 1) * m.conv_dim * 4
    if mode == "persist":
        return budget * layers * recurrent_bytes(m) + conv
    update_inputs = (m.key_dim + m.value_dim + 2 * m.linear_num_value_heads) * 4  # k, v, decay, beta per node
    return budget * recurrent_bytes(m) + (budget + 1) * layers * update_inputs + conv


def draft_context_bytes(d: Draft, ctx: int) -> int:
    window = min(ctx, DRAFT_WINDOW)
    ring = d.target_layers * d.hidden * window * 2
    kv = d.layers * 2 * d.kv_heads * d.head_dim * (window + d.block_size) * 2
    return ring + kv


def activation_bytes(m: ModelConfig, budget: int, draft: Draft | None) -> int:
    """fp32 rows: the residual and its norm, the widest mixer projection, gate and up, the mixer output."""
    mixer = max(m.q_proj_rows + 2 * m.kv_dim, m.conv_dim + m.value_dim + 2 * m.linear_num_value_heads)
    row = 2 * m.hidden_size + mixer + 2 * m.intermediate_size + max(m.value_dim, m.num_attention_heads * m.head_dim)
    logits = (budget + 1 + (draft.block_size if draft else 0)) * m.vocab_size
    return (max(budget + 1, PREFILL_CHUNK) * row + logits) * 4


# ---- the plan --------------------------------------------------------------------------------------------------
def make_plan(spec: ChipSpec, model: ModelConfig, weights_by_type: dict[str, int], draft: Draft | None, ctx: int,
              kv_format: str | None = None, tree_state: str = "auto", reserve: int = CONTEXT_RESERVE) -> Plan:
    fmt = kv_format or spec.tuning.kv_format
    if fmt not in KV_FORMATS:
        raise PlanError(f"KV format {fmt!r} is not one of {', '.join(KV_FORMATS)}")
    if fmt == "fp8" and spec.chip.cc < 89:
        raise PlanError(f"fp8 KV needs sm_89 or newer; {spec.name} is {spec.chip.arch}")
    if tree_state not in TREE_STATES:
        raise PlanError(f"tree state {tree_state!r} is not one of {', '.join(TREE_STATES)}")
    if not 0 < ctx <= model.max_position_embeddings:
        raise PlanError(f"context {ctx} is outside 1 .. {model.max_position_embeddings} (the model's limit)")
    budget = spec.tuning.ddtree.capacity  # what the engine allocates for (its largest tree)
    kinds = ", ".join(f"{t} {b / GIB:.2f}" for t, b in sorted(weights_by_type.items(), key=lambda kv: -kv[1]))
    m = model
    items = [Item("target weights", sum(weights_by_type.values()), f"{model.name}: {kinds} GiB")]
    if draft is not None:
        items.append(Item("draft weights", draft.weight_bytes, f"{draft.source}: {draft.layers} layers"))
    items.append(Item("KV cache", kv_cache_bytes(m, fmt, ctx),
                      f"{ctx} positions x {len(m.full_layers)} layers x K,V x {m.num_key_value_heads} heads x "
                      f"{m.head_dim} {fmt} ({kvformats.BYTES_PER_VALUE[fmt]:.4g} B/value)"))
    items.append(Item("DeltaNet state", deltanet_state_bytes(m),
                      f"{len(m.linear_layers)} layers x (recurrent {m.linear_num_value_heads}x{m.linear_key_head_dim}"
                      f"x{m.linear_value_head_dim} + conv {m.linear_conv_kernel_dim - 1}x{m.conv_dim}) fp32"))
    rest = [Item("activations", activation_bytes(m, budget, draft),
                 f"fp32 rows for max({budget + 1} verify rows, {PREFILL_CHUNK}-token prefill chunk) + logits"),
            Item("CUDA context", reserve, "driver context, module images, stacks (reserve)")]
    if draft is not None:
        rest.insert(0, Item("draft context", draft_context_bytes(draft, ctx),
                            f"feature ring {draft.target_layers}x{draft.hidden} bf16 + draft KV, "
                            f"{min(ctx, DRAFT_WINDOW)} positions"))
    notes = []

    def tree(mode: str) -> Item:
        detail = (f"budget {budget}: fp32 state of every node in all {len(m.linear_layers)} DeltaNet layers"
                  if mode == "persist" else
                  f"budget {budget}: one layer's node states + per-node update inputs; commit replays the path")
        return Item(f"DDTree state ({mode})", tree_state_bytes(m, budget, mode), detail + " + conv inputs")

    mode = tree_state
    if mode == "auto":
        persist = sum(i.nbytes for i in items + rest) + tree("persist").nbytes
        mode = "persist" if persist <= spec.chip.memory_bytes else "replay"
        if mode == "replay":
            notes.append(f"persisting every node's fp32 state would take {tree('persist').nbytes / GIB:.2f} GiB and "
                         f"{persist / GIB:.2f} GiB in all: over {spec.name}'s {spec.chip.memory_bytes / GIB:.2f} GiB "
                         f"by {(persist - spec.chip.memory_bytes) / GIB:.2f} GiB; the plan replays instead")
    items.append(tree(mode))
    return Plan(spec, model, ctx, fmt, mode, items + rest, notes)


def largest_context(make, limit: int) -> int:
    """The largest ctx <= limit with make(ctx).fits (0 when not even one position fits)."""
    if not make(1).fits:
        return 0
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if make(mid).fits else (lo, mid - 1)
    return lo


# ---- command line ----------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="device memory for one sequence on a chip: what fits, and a refusal if not")
    p.add_argument("--spec", default="h200", help="specs/<chip>.yaml or a bare chip name (default h200)")
    p.add_argument("--model", required=True, help="target: a .gguf file, or a bundled model name / config.json "
                                                  "with --mix")
    p.add_argument("--mix", default="q4_k_m", help="quant mix when --model is not a GGUF file (default q4_k_m)")
    p.add_argument("--draft", default=None, help="DFlash draft: safetensors file or folder, or its config.json")
    p.add_argument("--ctx", type=int, default=None, help="context in tokens (default: the spec's max_context)")
    p.add_argument("--kv", default=None, choices=KV_FORMATS, help="KV format (default: the spec's kv_format)")
    p.add_argument("--tree-state", default="auto", choices=TREE_STATES,
                   help="DDTree node states: persist, replay, or auto (persist when it fits)")
    p.add_argument("--reserve-mib", type=int, default=CONTEXT_RESERVE >> 20, help="CUDA context reserve (MiB)")
    p.set_defaults(fn=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from .model.weights import WeightError
    spec = load_spec(args.spec)
    try:
        if str(args.model).endswith(".gguf"):
            model, by_type = target_from_gguf(args.model)
        else:
            model = load_config(args.model)
            by_type = target_from_config(model, args.mix)
        draft = load_draft(args.draft) if args.draft else None
        ctx = args.ctx or spec.tuning.max_context

        def make(c: int, kv: str | None = args.kv) -> Plan:
            return make_plan(spec, model, by_type, draft, c, kv, args.tree_state, args.reserve_mib << 20)

        plan = make(ctx)
    except (PlanError, WeightError, kvformats.KVFormatError) as e:
        print(f"lucegen plan: {e}", file=sys.stderr)
        return 2
    tree = spec.tuning.ddtree
    trees = f", trees up to {tree.capacity}" if tree.capacity != tree.budget else ""
    print(f"lucegen plan: spec {spec.name} ({spec.chip.memory_bytes / GIB:.2f} GiB), model {model.name}, "
          f"context {ctx}, KV {plan.kv_format}, DDTree budget {tree.budget}{trees} ({plan.tree_state})\n")
    print(plan.table())
    for note in plan.notes:
        print(f"\nnote: {note}")
    print("\nKV formats at this context (the other items as above, the DDTree state chosen the same way):")
    for fmt in KV_FORMATS:
        if fmt == "fp8" and spec.chip.cc < 89:
            continue
        other = make(ctx, fmt)
        fit = "fits" if other.fits else f"over by {(other.total - other.capacity) / GIB:.2f} GiB"
        print(f"  {fmt:<6} {other.total / GIB:8.3f} GiB  {fit:<22} largest context that fits: "
              f"{largest_context(lambda c, f=fmt: make(c, f), model.max_position_embeddings)}")
    if plan.fits:
        print(f"\nfits: {(plan.capacity - plan.total) / GIB:.2f} GiB to spare")
        return 0
    print(f"\ndoes not fit: over by {(plan.total - plan.capacity) / GIB:.2f} GiB", file=sys.stderr)
    return 1
