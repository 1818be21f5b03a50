"""Open a model for generation: an HF snapshot folder, a .gguf file or a hub id -> (engine, tokenizer).

Backends are registered by name in BACKENDS: a function (weights, max_context, spec) -> Engine, where `weights`
is the lazily read checkpoint (lucegen.model.weights.LazyWeights, with .config; a GGUF one also has .raw() for the
quantized bytes) and `spec` the chip spec name or path given with --spec (None when not given). None marks a
backend that is planned but not written yet. The cuda backend runs the decode megakernel where it holds the model
(bf16) and the layer-by-layer step (engine/layered.py) otherwise, e.g. for a GGUF file. A DFlash draft (--draft)
runs on the GPU beside the layer-by-layer step, from the target features the step captures
(lucegen/engine/layered_draft.py), its trees verified in one forward of the step (lucegen/engine/layered_verify.py);
on the numpy backend and beside the megakernel it runs on the numpy reference, reading the target's features from a
numpy forward of the context (a host copy of the target's weights on the cuda backend), the megakernel's trees
verified node by node through its decode step (lucegen/spec_decode/device.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ..model.draft import load_draft
from ..model.tokenizer import Tokenizer
from ..model.weights import LazyWeights, open_weights
from ..spec import DDTreeTuning, load_spec
from .base import Engine


# The default model: a tiny Qwen3.5-architecture target and its DFlash draft trained on Python code
# (tools/train_tiny_pair.py; how and on what: lucegen/models/tiny-pycode/README.md).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "tiny-pycode"
DEFAULT_TARGET = DEFAULT_MODEL_DIR / "target"
DEFAULT_DRAFT = DEFAULT_MODEL_DIR / "draft"


class LoadError(ValueError):
    """A model that cannot be opened with the options given."""


def default_model() -> Path:
    """The default model's target folder; a LoadError when its weights are not in this checkout yet."""
    if not (DEFAULT_TARGET / "model.safetensors").is_file():
        raise LoadError(f"the default model's weights are not in {DEFAULT_TARGET}: train them with "
                        "tools/train_tiny_pair.py, or give --model")
    return DEFAULT_TARGET


def _numpy(weights: LazyWeights, max_context: int | None, spec: str | None) -> Engine:
    if spec is not None:
        raise LoadError(f"--spec {spec}: a chip spec selects the cuda backend's kernels; the numpy backend has none")
    from .numpy_backend import NumpyEngine
    return NumpyEngine(weights, weights.config, max_context)


def _cuda(weights: LazyWeights, max_context: int | None, spec: str | None) -> Engine:
    """The decode megakernel for a bf16 (HF) checkpoint it can hold on this chip; else (a GGUF file, or a model
    whose rows exceed the megakernel's shared memory) the layer-by-layer step, weights used as loaded."""
    from ..kernels import megakernel
    from ..model.gguf_file import GGUFCheckpoint
    from ..runtime import NoDriverError, init
    from ..spec import spec_for_current_device
    try:
        init()
    except NoDriverError as e:
        raise LoadError(f"the cuda backend needs an NVIDIA GPU: {e}") from None
    chip = load_spec(spec) if spec else spec_for_current_device()
    if not isinstance(weights, GGUFCheckpoint) and megakernel.units(chip, weights.config):
        from .decode import DecodeEngine
        return DecodeEngine(weights, weights.config, chip, max_context)
    from .layered import LayeredEngine
    try:
        return LayeredEngine(weights, weights.config, chip, max_context)
    except ValueError as e:
        raise LoadError(f"{weights.source}: {e}") from None


BACKENDS: dict[str, Callable[[LazyWeights, int | None, str | None], Engine] | None] = {
    "numpy": _numpy,
    "cuda": _cuda,
}


def load_model(model: str | Path, backend: str = "numpy", *, max_context: int | None = None,
               spec: str | None = None, draft: str | Path | None = None, budget: int | None = None,
               chain: bool = False, tokenizer: str | Path | None = None) -> tuple[Engine, Tokenizer]:
    """The engine and tokenizer of `model`. The tokenizer comes from `tokenizer` (a folder), else the snapshot
    folder, else (for a .gguf) the folder the file is in. `draft`: a DFlash draft directory for speculative
    decoding, with trees of `budget` nodes (default: the spec's DDTree budget, else 22) or, with `chain`, the
    draft's top-1 chain."""
    if backend not in BACKENDS:
        raise LoadError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    if BACKENDS[backend] is None:
        available = ", ".join(name for name, make in BACKENDS.items() if make)
        raise LoadError(f"the {backend} backend is not available yet (available: {available})")
    if budget is not None and budget < 1:
        raise LoadError(f"--budget {budget}: must be at least 1")
    weights = open_weights(model)
    folder = tokenizer or (Path(model).parent if str(model).endswith(".gguf") else weights.dir)
    engine = BACKENDS[backend](weights, max_context, spec)
    if draft is not None:
        from ..spec_decode.decode import Speculation  # here: spec_decode imports the engine's sampler
        draft_cfg, draft_weights = load_draft(draft, weights.config)
        budget = budget or (load_spec(spec).tuning.ddtree.budget if spec else DDTreeTuning.budget)
        try:
            draft_fn = _draft_fn(engine, backend, weights, draft_cfg, draft_weights)
        except ValueError as e:  # a draft shape the GPU draft's kernels do not take on this chip
            raise LoadError(f"{draft}: {e}") from None
        engine.speculation = Speculation(draft_fn, draft_cfg.block_size - 1, budget, chain)
    return engine, Tokenizer.from_dir(folder)


def _draft_fn(engine: Engine, backend: str, weights: LazyWeights, draft_cfg, draft_weights):
    """The DFlash draft_fn: on the GPU for an engine that has one (LayeredEngine.gpu_draft), else the numpy
    reference's, which runs the target over the context each round (on a host copy of its weights on the cuda
    backend)."""
    if hasattr(engine, "gpu_draft"):
        return engine.gpu_draft(draft_cfg, draft_weights)
    from ..reference.dflash import dflash_draft_fn
    target = engine.weights if backend == "numpy" else {
        name: np.asarray(w, np.float32) for name, w in weights.load_all(progress=False).items()}
    return dflash_draft_fn(draft_weights, target, draft_cfg, weights.config)


def model_name(model: str | Path) -> str:
    """The name a model is served under by default: its folder's (or .gguf file's) name, or the hub id."""
    path = Path(model).expanduser()
    if path.exists() and path.resolve() == DEFAULT_TARGET:
        return DEFAULT_MODEL_DIR.name
    if path.exists():
        return path.resolve().stem if path.suffix == ".gguf" else path.resolve().name
    return str(model)
