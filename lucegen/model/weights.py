"""The canonical in-memory weight form, shared by the loaders, the checkpoint maker and the numpy reference.

A Mapping from HF text-model names with the "model.language_model." prefix stripped ("embed_tokens.weight",
"layers.3.self_attn.q_proj.weight", ...) to numpy arrays in HF conventions: zero-centred (1 + w) RMSNorm weights,
A_log, HF's grouped value-head order, conv1d as [conv_dim, 1, K]. "lm_head.weight" is present only when the
embeddings are untied; tied models use "embed_tokens.weight" for both. Dtypes are as stored (bf16 via ml_dtypes,
float16 or float32); GGUF weights come back dequantized to float32.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
from tqdm import tqdm

from .config import LINEAR, ModelConfig


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor: embeddings, layer by layer, final norm, lm_head (absent when tied)."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    shapes = {"embed_tokens.weight": (V, H)}
    for i, kind in enumerate(cfg.layer_types):
        if kind == LINEAR:
            mixer = {
                "linear_attn.in_proj_qkv.weight": (cfg.conv_dim, H),
                "linear_attn.in_proj_z.weight": (cfg.value_dim, H),
                "linear_attn.in_proj_b.weight": (Hv, H),
                "linear_attn.in_proj_a.weight": (Hv, H),
                "linear_attn.conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
                "linear_attn.dt_bias": (Hv,),
                "linear_attn.A_log": (Hv,),
                "linear_attn.norm.weight": (dv,),
                "linear_attn.out_proj.weight": (H, cfg.value_dim),
            }
        else:
            hd = cfg.head_dim
            mixer = {
                "self_attn.q_proj.weight": (cfg.q_proj_rows, H),
                "self_attn.k_proj.weight": (cfg.kv_dim, H),
                "self_attn.v_proj.weight": (cfg.kv_dim, H),
                "self_attn.o_proj.weight": (H, cfg.num_attention_heads * hd),
                "self_attn.q_norm.weight": (hd,),
                "self_attn.k_norm.weight": (hd,),
            }
        layer = {
            "input_layernorm.weight": (H,),
            **mixer,
            "post_attention_layernorm.weight": (H,),
            "mlp.gate_proj.weight": (I, H),
            "mlp.up_proj.weight": (I, H),
            "mlp.down_proj.weight": (H, I),
        }
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes["norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


class WeightError(ValueError):
    """A checkpoint that cannot be used: names the file and the tensor."""


def missing_error(source: str, missing: list[str]) -> WeightError:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return WeightError(f"{source}: missing tensor {missing[0]!r}{more}")


class LazyWeights(Mapping):
    """Canonical weights read on demand. Subclasses validate names, shapes and dtypes when opened and implement
    _read(name); nothing is cached, so each access reads (or computes) the tensor again."""

    def __init__(self, config: ModelConfig, source: str):
        self.config, self.source = config, source
        self.shapes = weight_shapes(config)

    def _read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shapes:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def load_all(self, progress: bool = True) -> dict[str, np.ndarray]:
        """Every tensor in memory, with a progress bar."""
        return {name: self[name] for name in tqdm(self.shapes, desc=f"loading {self.source}", unit="tensor",
                                                  disable=not progress)}


def open_weights(source, revision: str | None = None) -> LazyWeights:
    """A .gguf file, an HF snapshot directory or a hub model id, as lazily read canonical weights."""
    from .gguf_file import load_gguf  # the loaders build on this module
    from .hf import load_hf
    return load_gguf(source) if str(source).endswith(".gguf") else load_hf(source, revision)
