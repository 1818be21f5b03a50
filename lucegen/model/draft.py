"""DFlash draft directories: config.json (DraftConfig) + model.safetensors under the z-lab tensor names
(fc.weight, hidden_norm.weight, norm.weight, layers.{i}.*; no embedding or LM head: the draft uses the target's)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from lucegen.reference.dflash import draft_weight_shapes

from .config import ConfigError, ModelConfig
from .draft_config import DraftConfig
from .hf import check_tensor, open_safetensors
from .weights import WeightError, missing_error

WEIGHTS = "model.safetensors"


def load_draft(path: str | Path, target_cfg: ModelConfig) -> tuple[DraftConfig, dict[str, np.ndarray]]:
    """The draft's config and float32 weights, checked against its config and the target's (errors name the file
    and the tensor)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise WeightError(f"{path}: expected a DFlash draft directory holding config.json and {WEIGHTS}")
    cfg = DraftConfig.from_json(path / "config.json")
    try:
        cfg.check_target(target_cfg)
    except ConfigError as e:
        raise ConfigError(f"{path / 'config.json'}: {e}") from None
    file = path / WEIGHTS
    if not file.is_file():
        raise WeightError(f"{file}: no such file (the draft's weights)")
    handle, shapes = open_safetensors(file), draft_weight_shapes(cfg)
    for name in handle.keys():
        if name not in shapes:
            raise WeightError(f"{file}: tensor {name!r} is not a weight of this DFlash draft "
                              f"({cfg.num_hidden_layers} layers)")
        check_tensor(file, handle, name, shapes[name])
    missing = [name for name in shapes if name not in handle.keys()]
    if missing:
        raise missing_error(str(file), missing)
    return cfg, {name: handle.get_tensor(name).astype(np.float32) for name in shapes}


def write_draft(directory: str | Path, cfg: DraftConfig, weights: Mapping[str, np.ndarray]) -> Path:
    """A draft directory of `weights` in bf16 (config.json + model.safetensors), as load_draft reads it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    save_file({name: np.asarray(w).astype(ml_dtypes.bfloat16) for name, w in weights.items()},
              str(directory / WEIGHTS), metadata={"format": "pt"})
    return directory
