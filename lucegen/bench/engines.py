"""Engines for the generation benchmarks (speculative, prompts): any backend of lucegen.engine.loader, by name.

`--model tiny` with no folder of that name makes the tiny test checkpoint (random peaked weights, its tokenizer) in
a temporary folder first, so the suites run on a CPU in seconds with nothing downloaded.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ..engine.loader import load_model, model_name
from ..model.checkpoint import make_checkpoint
from ..model.config import tiny_config


def bench_device(backend: str) -> str:
    """The `gpu` field of the records: the GPU's name, or "CPU" for the numpy backend."""
    if backend == "numpy":
        return "CPU"
    from ..runtime import device_info
    return device_info().name


def open_engine(model: str, backend: str = "numpy", **options):
    """(engine, tokenizer, name) for load_model(model, backend, **options); name is "<backend> <model>"."""
    name = f"{backend} {model_name(model)}"
    if model == "tiny" and not Path(model).exists():
        with tempfile.TemporaryDirectory(prefix="lucegen-tiny-") as folder:
            path = make_checkpoint(folder, tiny_config(), peaked=True, formats=("hf",), progress=False)["hf"]
            engine, tokenizer = load_model(path, backend, **options)  # weights and tokenizer are read here
        return engine, tokenizer, name
    engine, tokenizer = load_model(model, backend, **options)
    return engine, tokenizer, name
