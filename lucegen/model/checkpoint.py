"""Test checkpoints of any ModelConfig: deterministic random weights written as an HF snapshot and as a GGUF.

The weights are lucegen.reference.random_weights (the reference's generator) rounded to bf16; that bf16 mapping
is the truth both files are made from. The HF snapshot holds config.json, model.safetensors (or shards with an
index) in bf16 under "model.language_model.*", and the tokenizer files (lucegen.model.tokenizer); the GGUF holds
the same weights with llama.cpp's conventions applied (gguf_file.convert) in a llama.cpp-like quant mix.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_VERSION, LlamaFileType

from lucegen.reference.weights import random_weights

from .config import ModelConfig
from .gguf_file import gguf_name, split_name, write_gguf
from .hf import DEFAULT_SHARD_BYTES, write_hf
from .quants import GGMLType, block_shape
from .weights import weight_shapes

# mix -> (base type of matrices, llama.cpp's general.file_type); *_k_m mixes follow llama.cpp's Q4_K_M / Q5_K_M.
MIXES = {
    "q4_k_m": (GGMLType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k_m": (GGMLType.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "q6_k": (GGMLType.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "q8_0": (GGMLType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "bf16": (GGMLType.BF16, LlamaFileType.MOSTLY_BF16),
    "f16": (GGMLType.F16, LlamaFileType.MOSTLY_F16),
    "f32": (GGMLType.F32, LlamaFileType.ALL_F32),
}


def _mix(mix: str) -> tuple[GGMLType, LlamaFileType]:
    if mix not in MIXES:
        raise ValueError(f"unknown quant mix {mix!r} (known: {', '.join(MIXES)})")
    return MIXES[mix]


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's layers that get more bits in *_K_M mixes: the first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_types(cfg: ModelConfig, mix: str = "q4_k_m") -> tuple[dict[str, GGMLType], list[str]]:
    """The ggml type of every canonical tensor under `mix`, and the fallbacks taken as "gguf_name:WANTED->USED".

    Vectors and conv1d stay F32 (llama.cpp never quantizes them). In q4_k_m / q5_k_m, output.weight (or a tied
    token_embd) is Q6_K, and attn_v / attn_qkv / ffn_down are Q6_K on use_more_bits layers (llama.cpp counts
    attn_v-like tensors with one counter; qwen35 has exactly one per layer, so the counter is the layer index);
    every other matrix gets the base type (in the other mixes, every matrix; llama.cpp would still promote
    output.weight). A matrix whose rows are not a multiple of the type's block falls back
    to Q8_0, else F16 (llama.cpp would take Q5_0 for Q4_K; lucegen has no Q5_0 kernels)."""
    base, _ = _mix(mix)
    k_mix = mix.endswith("_k_m")
    types, fallbacks = {}, []
    for name, shape in weight_shapes(cfg).items():
        g = gguf_name(name)
        t = base
        if len(shape) != 2:
            t = GGMLType.F32
        elif k_mix and (g == "output.weight" or (g == "token_embd.weight" and cfg.tie_word_embeddings)):
            t = GGMLType.Q6_K
        elif k_mix and g.endswith(("attn_v.weight", "attn_qkv.weight", "ffn_down.weight")) \
                and use_more_bits(split_name(g)[0], cfg.num_hidden_layers):
            t = GGMLType.Q6_K
        if shape[-1] % block_shape(t)[0]:
            used = GGMLType.Q8_0 if shape[-1] % block_shape(GGMLType.Q8_0)[0] == 0 else GGMLType.F16
            fallbacks.append(f"{g}:{t.name}->{used.name}")
            t = used
        types[name] = t
    return types, fallbacks


def write_gguf_checkpoint(path: str | Path, cfg: ModelConfig, weights: Mapping[str, np.ndarray],
                          mix: str = "q4_k_m", progress: bool = True) -> Path:
    """A qwen35 GGUF of `weights` in quant mix `mix`; fallbacks are listed under lucegen.quant_fallbacks."""
    types, fallbacks = gguf_types(cfg, mix)
    metadata = {"general.file_type": int(_mix(mix)[1]), "general.quantization_version": GGML_QUANT_VERSION}
    if fallbacks:
        metadata["lucegen.quant_fallbacks"] = fallbacks
    return write_gguf(path, cfg, weights, types, metadata, progress)


def make_checkpoint(directory: str | Path, cfg: ModelConfig, *, seed: int = 0, peaked: bool = False,
                    formats: tuple[str, ...] = ("hf", "gguf"), mix: str = "q4_k_m",
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: bool = True,
                    progress: bool = True) -> dict[str, Path]:
    """Random bf16 weights of `cfg` (seeded; `peaked` makes greedy tokens stable) written into `directory`:
    "hf" as the snapshot itself, "gguf" as <directory>/<cfg.name>-<mix>.gguf. Returns format -> path."""
    unknown = set(formats) - {"hf", "gguf"}
    if unknown:
        raise ValueError(f"unknown checkpoint formats {sorted(unknown)} (known: hf, gguf)")
    _mix(mix)  # fail before the slow part
    directory = Path(directory)
    weights = random_weights(cfg, seed, dtype=ml_dtypes.bfloat16, peaked=peaked)
    out = {}
    if "hf" in formats:
        out["hf"] = write_hf(directory, cfg, weights, max_shard_bytes, tokenizer)
    if "gguf" in formats:
        directory.mkdir(parents=True, exist_ok=True)
        out["gguf"] = write_gguf_checkpoint(directory / f"{cfg.name}-{mix}.gguf", cfg, weights, mix, progress)
    return out
