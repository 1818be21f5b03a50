"""DraftConfig: the shape of a DFlash block-diffusion draft (z-lab `DFlashDraftModel`, algorithms.md §3.1, §3.4).

The draft is a small Qwen3-style decoder with no embedding or LM head of its own (it uses the target's). Its
config.json is a Qwen3 config plus `block_size` and `dflash_config: {target_layer_ids, mask_token_id}`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lucegen.model.config import ConfigError, ModelConfig, read_config_json


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    num_target_layers: int | None = None

    @property
    def fc_in(self) -> int:
        """Width of the fused target features: one target hidden state per id in target_layer_ids."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "<dict>") -> DraftConfig:
        def need(key: str, where: Mapping[str, Any] = cfg, section: str = "config") -> Any:
            if key not in where:
                raise ConfigError(f"{source}: missing field {key!r} in {section}")
            return where[key]

        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{source}: sliding-window draft layers are not supported by this reference")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if "rope_theta" not in rope and "rope_theta" not in cfg:
            raise ConfigError(f"{source}: missing field 'rope_theta' in config")
        dflash = need("dflash_config")
        n_target = cfg.get("num_target_layers")
        config = cls(
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(need("head_dim")),
            intermediate_size=int(need("intermediate_size")),
            block_size=int(need("block_size")),
            target_layer_ids=tuple(int(i) for i in need("target_layer_ids", dflash, "dflash_config")),
            mask_token_id=int(need("mask_token_id", dflash, "dflash_config")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta"))),
            num_target_layers=None if n_target is None else int(n_target),
        )
        config.validate(source)
        return config

    @classmethod
    def from_json(cls, path: str | Path) -> DraftConfig:
        path, data = read_config_json(path)
        return cls.from_hf_dict(data, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A z-lab style config.json that from_hf_dict reads back."""
        d = {"model_type": "qwen3", "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
             "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
             "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "block_size": self.block_size,
             "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
             "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id}}
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        return d

    def validate(self, source: str = "<draft config>") -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{source}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{source}: head_dim {self.head_dim} must be even (RoPE)")
        if self.block_size < 2:
            raise ConfigError(f"{source}: block_size {self.block_size} must be at least 2")
        if not self.target_layer_ids:
            raise ConfigError(f"{source}: dflash_config.target_layer_ids is empty")
        n = self.num_target_layers
        if min(self.target_layer_ids) < 0 or (n is not None and max(self.target_layer_ids) >= n):
            raise ConfigError(f"{source}: target_layer_ids {list(self.target_layer_ids)} out of range for "
                              f"num_target_layers {n}")

    def check_target(self, target: ModelConfig) -> None:
        """Raise ConfigError unless this draft can run on target (shared hidden size, embeddings, LM head)."""
        problems = []
        if target.hidden_size != self.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target's {target.hidden_size}")
        if max(self.target_layer_ids) >= target.num_hidden_layers:
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} exceed the target's "
                            f"{target.num_hidden_layers} layers")
        if self.num_target_layers not in (None, target.num_hidden_layers):
            problems.append(f"num_target_layers {self.num_target_layers} != target's {target.num_hidden_layers}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the target's vocab {target.vocab_size}")
        if problems:
            raise ConfigError("draft does not fit the target: " + "; ".join(problems))


def tiny_draft_config(target: ModelConfig, **overrides: Any) -> DraftConfig:
    """A small draft for a tiny target (lucegen.model.config.tiny_config), for tests. Override any field."""
    base = {
        "hidden_size": target.hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "block_size": 4,
        "target_layer_ids": (0, 1, target.num_hidden_layers - 2), "mask_token_id": target.vocab_size - 1,
        "rms_norm_eps": 1e-6, "rope_theta": 10_000_000.0, "num_target_layers": target.num_hidden_layers,
    }
    base.update(overrides)
    cfg = DraftConfig(**base)
    cfg.validate("tiny_draft_config")
    cfg.check_target(target)
    return cfg
