"""ModelConfig: the shape of a Qwen3.5-family text model, from an HF config.json or from GGUF metadata.

One dataclass serves every size of the family (0.8B, 27B, Qwen3.6-27B, the tiny test configs). The kernels are
rendered from it, so nothing about a model's shape is written by hand anywhere else.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

LINEAR = "linear_attention"
FULL = "full_attention"

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
SUPPORTED_ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5TextForCausalLM",
)


class ConfigError(ValueError):
    """A model config that cannot be used: names the source and the field."""


def read_config_json(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(the file, its JSON) for a config.json or the folder holding one; a clear ConfigError otherwise."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return path, json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None
    max_position_embeddings: int = 262_144
    name: str = "qwen3.5"
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        """Hk * dk: width of the DeltaNet q and k projections."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        """Hv * dv: width of the DeltaNet v, z and output."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: [q | k | v]."""
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_proj_rows(self) -> int:
        """q_proj output: per head [query (head_dim) | gate (head_dim)]."""
        return 2 * self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def n_params(self) -> int:
        """Text-model parameters (embedding counted once when tied)."""
        H, I = self.hidden_size, self.intermediate_size
        n = self.vocab_size * H * (1 if self.tie_word_embeddings else 2) + H  # embed, lm_head, final norm
        for t in self.layer_types:
            n += 2 * H + 3 * H * I  # two norms + MLP
            if t == LINEAR:
                Hv = self.linear_num_value_heads
                n += self.conv_dim * H + self.value_dim * H + 2 * Hv * H  # qkv, z, b, a
                n += self.conv_dim * self.linear_conv_kernel_dim + 2 * Hv + self.linear_value_head_dim
                n += H * self.value_dim
            else:
                n += self.q_proj_rows * H + 2 * self.kv_dim * H + H * self.num_attention_heads * self.head_dim
                n += 2 * self.head_dim
        return n

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d["layer_types"] = list(self.layer_types)
        return d

    # ---- constructors --------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "<dict>") -> "ModelConfig":
        """Build from an HF config dict: the text model nested under `text_config`, or flat."""
        top = dict(cfg)
        archs = top.get("architectures") or []
        model_type = top.get("model_type")
        if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not a Qwen3.5-family text model "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(f"{source}: architectures {archs} are not supported (expected one of {SUPPORTED_ARCHITECTURES})")
        text = dict(top.get("text_config") or top)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})

        def need(key: str, where: Mapping[str, Any] = text) -> Any:
            if key not in where:
                raise ConfigError(f"{source}: missing field {key!r} in {'text_config' if 'text_config' in top else 'config'}")
            return where[key]

        n_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(need("full_attention_interval"))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
        prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        config = cls(
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers,
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(need("head_dim")),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            layer_types=tuple(layer_types),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(prf),
            tie_word_embeddings=bool(tie),
            eos_token_id=None if eos is None else int(eos),
            max_position_embeddings=int(text.get("max_position_embeddings", 262_144)),
            name=str(top.get("_name_or_path") or text.get("_name_or_path") or "qwen3.5"),
        )
        config.validate(source)
        return config

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path, data = read_config_json(path)
        cfg = cls.from_hf_dict(data, source=str(path))
        if cfg.name == "qwen3.5":
            cfg = replace(cfg, name=path.parent.name if path.name == "config.json" else path.name.removesuffix(".json").removesuffix(".config"))
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF config.json (text model nested under text_config, as the real files are)."""
        text = {
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": False,
            "attn_output_gate": True,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "full_attention_interval": self._interval(),
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "mamba_ssm_dtype": "float32",
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": self.eos_token_id,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            "dtype": "bfloat16",
        }
        return {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }

    def _interval(self) -> int:
        full = self.full_layers
        return (full[0] + 1) if full else self.num_hidden_layers + 1

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self, source: str = "<config>") -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"{source}: {msg}")

        for name in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
        if len(self.layer_types) != self.num_hidden_layers:
            bad(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            bad(f"layer_types holds unsupported layer kinds {unknown} (supported: {LINEAR}, {FULL})")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of linear_num_key_heads {self.linear_num_key_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            bad(f"rotary dim {self.rotary_dim} (head_dim x partial_rotary_factor) must be even and <= head_dim")


BUNDLED_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_MODEL = "qwen3.5-0.8b"


def bundled_models() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def load_config(source: str | Path | Mapping[str, Any] | None = None) -> ModelConfig:
    """A config from a dict, a bundled model name (default qwen3.5-0.8b), a config.json, a checkpoint folder or
    a GGUF file."""
    if isinstance(source, Mapping):
        return ModelConfig.from_hf_dict(source)
    source = DEFAULT_MODEL if source is None else source
    path = Path(source)
    if not path.exists() and (BUNDLED_DIR / f"{source}.json").exists():
        path = BUNDLED_DIR / f"{source}.json"
    if not path.exists():
        raise ConfigError(f"{source}: no such file or folder, and not a bundled model ({', '.join(bundled_models())})")
    if path.suffix == ".gguf":
        from .gguf_file import load_gguf
        return load_gguf(path).config
    return ModelConfig.from_json(path)


def tiny_config(**overrides: Any) -> ModelConfig:
    """A small config with the real structure (3:1 DeltaNet:attention), for tests. Override any field."""
    base = dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
        tie_word_embeddings=False, eos_token_id=None, max_position_embeddings=4096, name="tiny",
    )
    base.update(overrides)
    if "layer_types" not in overrides:
        base["layer_types"] = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(base["num_hidden_layers"]))
    cfg = ModelConfig(**base)
    cfg.validate("tiny_config")
    return cfg
