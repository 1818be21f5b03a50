"""Load a Qwen3.5-family text model from an HF snapshot (config.json + safetensors), lazily.

Accepts the official multimodal layout ("model.language_model.*", "lm_head.weight") and the flat
Qwen3_5ForCausalLM layout ("model.*"); mtp.* and model.visual.* are ignored. Every file header is checked when
the snapshot is opened (names, shapes against the config, dtypes); tensor data is read on access.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from safetensors import safe_open
from safetensors.numpy import save_file

from .config import ModelConfig
from .weights import LazyWeights, WeightError, missing_error, weight_shapes

INDEX = "model.safetensors.index.json"
SNAPSHOT_FILES = ["config.json", "generation_config.json", "*.safetensors", INDEX, "tokenizer*", "vocab.json",
                  "merges.txt", "special_tokens_map.json", "chat_template*"]
DTYPES = ("BF16", "F16", "F32")
IGNORED_PREFIXES = ("mtp.", "model.visual.")
PREFIXES = ("model.language_model.", "model.")
HF_PREFIX = PREFIXES[0]  # what write_hf stores under, as the official snapshots do
DEFAULT_SHARD_BYTES = 4 << 30


def canonical_name(stored: str) -> str | None:
    """The canonical name of a stored tensor name; None for tensors a text model ignores."""
    if stored.startswith(IGNORED_PREFIXES):
        return None
    for prefix in PREFIXES:
        if stored.startswith(prefix):
            return stored[len(prefix):]
    return stored


def resolve_snapshot(path_or_id: str | Path, revision: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """A local snapshot directory: the path itself, or the hub snapshot of a model id (downloaded if needed)."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise WeightError(f"{path}: expected a snapshot directory holding config.json and *.safetensors")
        return path
    try:
        return Path(snapshot_download(str(path_or_id), revision=revision, cache_dir=cache_dir,
                                      allow_patterns=SNAPSHOT_FILES))
    except (HfHubHTTPError, HFValidationError, OSError) as e:
        raise WeightError(
            f"{path_or_id}: not a local directory, and the model could not be fetched from the Hugging Face hub "
            f"(no network, or the id is not in the local cache): {type(e).__name__}: {e}") from None


def open_safetensors(file: Path):
    """A safe_open handle (numpy) of file, or a WeightError naming it."""
    try:
        return safe_open(file, framework="np")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on bad files
        raise WeightError(f"{file}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def check_tensor(file: Path, handle, stored: str, shape: tuple[int, ...]) -> None:
    """Raise a WeightError naming file and tensor unless the stored tensor has this shape and a float dtype."""
    info = handle.get_slice(stored)
    got, dtype = tuple(info.get_shape()), info.get_dtype()
    if got != shape:
        raise WeightError(f"{file}: tensor {stored!r} has shape {got}, but config.json implies {shape}")
    if dtype not in DTYPES:
        raise WeightError(f"{file}: tensor {stored!r} has dtype {dtype}; supported: {', '.join(DTYPES)}")


class HFCheckpoint(LazyWeights):
    """Canonical weights of an HF snapshot directory; `dir` is the directory, `config` its ModelConfig."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        super().__init__(ModelConfig.from_json(self.dir / "config.json"), str(self.dir))
        self._handles, self._where = {}, {}  # file -> safe_open handle; canonical name -> (file, stored name)
        for file in self._files():
            handle = self._handles[file] = open_safetensors(file)
            for stored in handle.keys():
                self._add(file, handle, stored)
        missing = [n for n in self.shapes if n not in self._where]
        if missing:
            raise missing_error(str(self.dir), missing)

    def _files(self) -> list[Path]:
        index = self.dir / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
            files = {}
            for stored, shard in weight_map.items():
                files.setdefault(shard, stored)
            for shard, stored in files.items():
                if not (self.dir / shard).is_file():
                    raise WeightError(f"{self.dir / shard}: shard listed in {INDEX} is missing "
                                      f"(holds tensor {stored!r})")
            return [self.dir / shard for shard in files]
        single = self.dir / "model.safetensors"
        if not single.is_file():
            raise WeightError(f"{self.dir}: neither model.safetensors nor {INDEX} found")
        return [single]

    def _add(self, file: Path, handle, stored: str) -> None:
        name = canonical_name(stored)
        if name is None or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return
        if name not in self.shapes:
            raise WeightError(f"{file}: tensor {stored!r} is not a weight of this Qwen3.5 text model "
                              f"({self.config.num_hidden_layers} layers, layer_types from config.json)")
        if name in self._where:
            raise WeightError(f"{file}: tensor {stored!r} duplicates one in {self._where[name][0]}")
        check_tensor(file, handle, stored, self.shapes[name])
        self._where[name] = (file, stored)

    def _read(self, name: str) -> np.ndarray:
        file, stored = self._where[name]
        return self._handles[file].get_tensor(stored)


def load_hf(path_or_id: str | Path, revision: str | None = None, cache_dir: str | Path | None = None) -> HFCheckpoint:
    """Open an HF snapshot (a local directory or a hub model id) as lazily read canonical weights."""
    return HFCheckpoint(resolve_snapshot(path_or_id, revision, cache_dir))


def write_hf(directory: str | Path, cfg: ModelConfig, weights: Mapping[str, np.ndarray],
             max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: bool = True) -> Path:
    """An HF snapshot of canonical `weights` in bf16: config.json, model.safetensors or shards + index, and the
    tokenizer files (lucegen.model.tokenizer) unless tokenizer=False."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    shards, size = [[]], 0
    for name, shape in weight_shapes(cfg).items():
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file, names in zip(files, shards):
        tensors = {(name if name == "lm_head.weight" else HF_PREFIX + name):
                   np.asarray(weights[name]).astype(ml_dtypes.bfloat16) for name in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        total = sum(2 * int(np.prod(s)) for s in weight_shapes(cfg).values())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    if tokenizer:
        from .tokenizer import write_tokenizer_files  # here: `tokenizers` is needed only for these files
        write_tokenizer_files(directory, cfg.vocab_size)
    return directory
