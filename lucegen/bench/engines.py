"""Engines for the generation benchmarks (speculative, prompts): any backend of lucegen.engine.loader, by name.

`--model tiny` with no folder of that name makes the tiny test checkpoint (random peaked weights, its tokenizer) in
a temporary folder first, so the suites run on a CPU in seconds with nothing downloaded.

`--model random:<config>[:<mix>]` (cuda backend), e.g. random:qwen3.5-27b:q4_k_m: the layer-by-layer step on
random quantized weights of the real shapes (layered_weights.RandomSource, no file: a real 27B GGUF through the numpy
quantizer would take hours; speed does not depend on the values) with a byte-level tokenizer of the config's
vocabulary size; the context is RANDOM_CONTEXT tokens.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ..engine.loader import load_model, model_name
from ..model.checkpoint import make_checkpoint
from ..model.config import load_config, tiny_config
from ..model.tokenizer import write_tokenizer_files

RANDOM_CONTEXT = 4096


def bench_device(backend: str) -> str:
    """The `gpu` field of the records: the GPU's name, or "CPU" for the numpy backend."""
    if backend == "numpy":
        return "CPU"
    from ..runtime import device_info
    return device_info().name


def open_engine(model: str, backend: str = "numpy", **options):
    """(engine, tokenizer, name) for load_model(model, backend, **options); name is "<backend> <model>"."""
    name = f"{backend} {model_name(model)}"
    if model.startswith("random:"):
        return (*random_engine(model, backend, **options), name)
    if model == "tiny" and not Path(model).exists():
        with tempfile.TemporaryDirectory(prefix="lucegen-tiny-") as folder:
            path = make_checkpoint(folder, tiny_config(), peaked=True, formats=("hf",), progress=False)["hf"]
            engine, tokenizer = load_model(path, backend, **options)  # weights and tokenizer are read here
        return engine, tokenizer, name
    engine, tokenizer = load_model(model, backend, **options)
    return engine, tokenizer, name


def random_engine(model: str, backend: str, draft=None, **options):
    """(engine, tokenizer) for "random:<config>[:<mix>]": see the module's docstring."""
    _, config, *mix = model.split(":")
    if backend != "cuda" or draft is not None or len(mix) > 1:
        raise ValueError(f"{model}: random weights run on the cuda backend's layer-by-layer step, without a draft "
                         f"(random:<config>[:<mix>], mix default q4_k_m)")
    from ..engine.layered import LayeredEngine
    from ..engine.layered_weights import RandomSource
    cfg = load_config(config)
    engine = LayeredEngine(RandomSource(cfg, mix[0] if mix else "q4_k_m"), cfg, max_context=RANDOM_CONTEXT)
    with tempfile.TemporaryDirectory(prefix="lucegen-random-") as folder:
        tokenizer = write_tokenizer_files(folder, cfg.vocab_size)
    return engine, tokenizer
