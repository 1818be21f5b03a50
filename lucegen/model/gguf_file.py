"""GGUF files of llama.cpp's `qwen35` architecture: read lazily (memory-mapped), write (for test checkpoints).

Two views of a file:
- raw: per tensor the ggml type, the logical shape (numpy order, i.e. ggml's ne reversed) and the bytes as a
  uint8 view of the mapped file, [*shape[:-1], row_bytes] -- what the quantized kernels upload;
- canonical: dequantized to float32 and converted back to HF conventions (lucegen.model.weights).

llama.cpp's converter (convert_hf_to_gguf.py, Qwen3NextModel + _LinearAttentionVReorderBase) changes these
tensors on the way to GGUF, and `convert` applies or undoes exactly that:
- every RMSNorm weight except the DeltaNet output norm (linear_attn.norm) is stored as 1 + w;
- A_log is stored as ssm_a = -exp(A_log); dt_bias is renamed ssm_dt.bias; conv1d [C, 1, K] is squeezed to [C, K];
- when Hk != Hv, value heads go from HF's grouped order [k0v0 .. k0v(r-1), k1v0, ...] to tiled order
  [k0v0, k1v0, ..., k0v1, k1v1, ...] (value head j then uses key head j % Hk): the v rows of in_proj_qkv and the
  v channels of conv1d, the rows of in_proj_z, in_proj_b, in_proj_a, the entries of dt_bias and A_log, and the
  input columns of out_proj.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from tqdm import tqdm

from .config import FULL, LINEAR, ConfigError, ModelConfig
from .quants import GGMLType, QuantError, dequantize, ggml_type, quantize, row_bytes
from .weights import LazyWeights, WeightError, missing_error, weight_shapes

ARCH = "qwen35"
EOS_KEY = "tokenizer.ggml.eos_token_id"
MROPE_SECTIONS = [11, 11, 10, 0]

_GLOBAL = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
_NORMS_1P = {"norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight"}
_LAYER_RE = re.compile(r"(?:layers|blk)\.(\d+)\.(.+)")


# ---- names and conventions ---------------------------------------------------------------------------------
def split_name(name: str) -> tuple[int | None, str]:
    """(layer index, name inside the layer) of a canonical or GGUF name; (None, name) for global tensors."""
    m = _LAYER_RE.fullmatch(name)
    return (int(m[1]), m[2]) if m else (None, name)


def gguf_name(name: str) -> str:
    """The GGUF tensor name of a canonical (HF) name."""
    layer, leaf = split_name(name)
    return _GLOBAL[leaf] if layer is None else f"blk.{layer}.{_LAYER[leaf]}"


def gguf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The logical GGUF shape (numpy order) of a canonical tensor of HF shape `shape`."""
    return (shape[0], shape[2]) if name.endswith("conv1d.weight") else shape


def _retile(x: np.ndarray, axis: int, hk: int, r: int, hd: int, inverse: bool) -> np.ndarray:
    """Value heads (blocks of hd along `axis`) from grouped to tiled order, or back when inverse."""
    if r == 1:
        return x
    x = np.moveaxis(x, axis, 0)
    a, b = (r, hk) if inverse else (hk, r)
    x = x.reshape(a, b, hd, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(x, 0, axis)


def convert(cfg: ModelConfig, name: str, x: np.ndarray, to_gguf: bool) -> np.ndarray:
    """Apply (to_gguf) or undo llama.cpp's HF -> GGUF conventions for canonical tensor `name`; float32 out."""
    leaf = split_name(name)[1]
    x = np.asarray(x, np.float32)
    if leaf in _NORMS_1P:
        return x + np.float32(1) if to_gguf else x - np.float32(1)
    hk, dv, qk = cfg.linear_num_key_heads, cfg.linear_value_head_dim, 2 * cfg.key_dim
    r = cfg.linear_num_value_heads // hk

    def tile(a: np.ndarray, axis: int, hd: int) -> np.ndarray:
        return _retile(a, axis, hk, r, hd, inverse=not to_gguf)

    if leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        conv = leaf.startswith("linear_attn.conv1d")
        x = x[:, 0, :] if conv and to_gguf else x
        x = np.concatenate([x[:qk], tile(x[qk:], 0, dv)])
        return x[:, None, :] if conv and not to_gguf else x
    if leaf == "linear_attn.in_proj_z.weight":
        return tile(x, 0, dv)
    if leaf in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
        return tile(x, 0, 1)
    if leaf == "linear_attn.A_log":
        x = tile(x, 0, 1).astype(np.float64)
        return (-np.exp(x) if to_gguf else np.log(-x)).astype(np.float32)
    if leaf == "linear_attn.out_proj.weight":
        return tile(x, 1, dv)
    return x


# ---- metadata ----------------------------------------------------------------------------------------------
def _layer_types(n_layers: int, interval: int) -> tuple[str, ...]:
    """llama.cpp's qwen35 layout: full attention on every interval-th layer, Gated DeltaNet elsewhere."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))


def config_from_gguf_metadata(meta: Mapping[str, Any], vocab_size: int, tied: bool, source: str) -> ModelConfig:
    """ModelConfig from GGUF key/values (qwen35.*, general.name, the eos id), the vocab size (token_embd rows)
    and whether output.weight is absent (tied embeddings)."""
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{ARCH}.{key}", default)
        if value is None:
            raise ConfigError(f"{source}: missing GGUF metadata key {ARCH}.{key}")
        if isinstance(value, list):  # per-layer arrays (head_count_kv, feed_forward_length): one non-zero value
            values = {v for v in value if v}
            if len(values) != 1:
                raise ConfigError(f"{source}: {ARCH}.{key} = {value} varies per layer; lucegen needs one value")
            value = values.pop()
        return value

    def f32(key: str) -> float:  # the shortest decimal that round-trips the stored float32
        return float(str(np.float32(get(key))))

    n_layers = get("block_count") - get("nextn_predict_layers", 0)
    interval, head_dim, hv = get("full_attention_interval"), get("attention.key_length"), get("ssm.time_step_rank")
    cfg = ModelConfig(
        hidden_size=get("embedding_length"),
        num_hidden_layers=n_layers,
        intermediate_size=get("feed_forward_length"),
        vocab_size=vocab_size,
        num_attention_heads=get("attention.head_count"),
        num_key_value_heads=get("attention.head_count_kv"),
        head_dim=head_dim,
        linear_num_key_heads=get("ssm.group_count"),
        linear_num_value_heads=hv,
        linear_key_head_dim=get("ssm.state_size"),
        linear_value_head_dim=get("ssm.inner_size") // hv,
        linear_conv_kernel_dim=get("ssm.conv_kernel"),
        layer_types=_layer_types(n_layers, interval),
        rms_norm_eps=f32("attention.layer_norm_rms_epsilon"),
        rope_theta=f32("rope.freq_base"),
        partial_rotary_factor=get("rope.dimension_count") / head_dim,
        tie_word_embeddings=tied,
        eos_token_id=meta.get(EOS_KEY),
        max_position_embeddings=get("context_length"),
        name=meta.get("general.name") or Path(source).stem,
    )
    cfg.validate(source)
    return cfg


def add_config_metadata(w: GGUFWriter, cfg: ModelConfig) -> None:
    """Write the qwen35.* keys (and general.name, the eos id) that config_from_gguf_metadata reads back."""
    interval = cfg._interval()
    if cfg.layer_types != _layer_types(cfg.num_hidden_layers, interval):
        raise ConfigError(f"{cfg.name}: GGUF can only express full attention every n-th layer; layer_types "
                          f"{cfg.layer_types} are not of that form")
    w.add_name(cfg.name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.rotary_dim)
    w.add_rope_dimension_sections(MROPE_SECTIONS)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.value_dim)
    w.add_full_attention_interval(interval)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.eos_token_id is not None:
        w.add_eos_token_id(cfg.eos_token_id)


# ---- reading -----------------------------------------------------------------------------------------------
class _Reader(GGUFReader):
    """GGUFReader that names the tensor when the file is cut short (the stock reader fails in numpy.view)."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode("utf-8", "replace")
            try:
                t = GGMLType(int(raw_type[0]))
            except ValueError:
                raise WeightError(f"{self.path}: tensor {name!r} has unknown ggml type {int(raw_type[0])}") from None
            elems, nbytes = GGML_QUANT_SIZES[t]
            start = start_offs + int(offset[0])
            end = start + int(np.prod(dims, dtype=np.int64)) // elems * nbytes
            if end > len(self.data):
                raise WeightError(f"{self.path}: truncated: tensor {name!r} ({t.name}, bytes {start}..{end}) runs "
                                  f"past the end of the file ({len(self.data)} bytes)")
        super()._build_tensors(start_offs, fields)


def _shape(t) -> tuple[int, ...]:
    """The logical numpy-order shape of a reader tensor (ggml's ne reversed)."""
    return tuple(int(d) for d in reversed(t.shape))


class RawTensor(NamedTuple):
    name: str
    type: GGMLType
    shape: tuple[int, ...]  # logical, numpy order (ggml ne reversed)
    data: np.ndarray  # uint8 [*shape[:-1], row_bytes], a view of the mapped file


class GGUFCheckpoint(LazyWeights):
    """A qwen35 GGUF file: `config`, `raw(gguf_name)`, and the canonical weights as a lazy Mapping."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = _Reader(self.path)
        except WeightError:
            raise
        except (ValueError, IndexError, KeyError, OSError, OverflowError) as e:
            raise WeightError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        fields = self.reader.fields
        arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
        if arch != ARCH:
            raise WeightError(f"{self.path}: architecture {arch!r} is not supported (lucegen reads {ARCH!r})")
        self.tensors = {t.name: t for t in self.reader.tensors}
        if "token_embd.weight" not in self.tensors:
            raise missing_error(str(self.path), ["token_embd.weight"])
        meta = {k: f.contents() for k, f in fields.items() if k.startswith((ARCH + ".", "general.")) or k == EOS_KEY}
        config = config_from_gguf_metadata(meta, int(self.tensors["token_embd.weight"].shape[1]),
                                           "output.weight" not in self.tensors, str(self.path))
        super().__init__(config, str(self.path))
        self._check()

    def _check(self) -> None:
        expected = {gguf_name(n): gguf_shape(n, s) for n, s in self.shapes.items()}
        missing = [g for g in expected if g not in self.tensors]
        if missing:
            raise missing_error(str(self.path), missing)
        for g, t in self.tensors.items():
            layer = split_name(g)[0]
            if g not in expected:
                if layer is not None and layer >= self.config.num_hidden_layers:
                    continue  # MTP (nextn) layers appended after the text model's blocks
                raise WeightError(f"{self.path}: tensor {g!r} is not a weight of a qwen35 text model "
                                  f"with this metadata")
            try:
                ggml_type(t.tensor_type)
            except QuantError as e:
                raise WeightError(f"{self.path}: tensor {g!r}: {e}") from None
            if _shape(t) != expected[g]:
                raise WeightError(f"{self.path}: tensor {g!r} has shape {_shape(t)}, "
                                  f"but the metadata implies {expected[g]}")

    def raw(self, name: str) -> RawTensor:
        """Tensor `name` (a GGUF name) as stored."""
        t, shape = self.tensors[name], _shape(self.tensors[name])
        return RawTensor(name, ggml_type(t.tensor_type), shape, t.data.view(np.uint8).reshape(*shape[:-1], -1))

    def _read(self, name: str) -> np.ndarray:
        raw = self.raw(gguf_name(name))
        x = dequantize(raw.data, raw.type)
        if name.endswith("A_log") and not (x < 0).all():
            raise WeightError(f"{self.path}: tensor {raw.name!r} (= -exp(A_log)) holds values >= 0")
        return convert(self.config, name, x, to_gguf=False)


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


# ---- writing -----------------------------------------------------------------------------------------------
def write_gguf(path: str | Path, cfg: ModelConfig, weights: Mapping[str, np.ndarray],
               types: Mapping[str, GGMLType], metadata: Mapping[str, Any] | None = None,
               progress: bool = True) -> Path:
    """Write canonical `weights` of `cfg` as a qwen35 GGUF, tensor `name` stored as types[name].
    Extra metadata: str, int (uint32) or list-of-str values. Tensors are converted one at a time."""
    path = Path(path)
    w = GGUFWriter(path, ARCH)
    add_config_metadata(w, cfg)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_array(key, list(value))
    shapes = weight_shapes(cfg)
    for name, shape in shapes.items():
        gshape = gguf_shape(name, shape)
        nbytes = int(np.prod(gshape[:-1], dtype=np.int64)) * row_bytes(types[name], gshape[-1])
        w.add_tensor_info(gguf_name(name), gshape, np.dtype(np.float32), nbytes, raw_dtype=types[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name in tqdm(shapes, desc=f"writing {path.name}", unit="tensor", disable=not progress):
        w.write_tensor_data(quantize(convert(cfg, name, weights[name], to_gguf=True), types[name]))
    w.close()
    return path
