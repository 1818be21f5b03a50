"""The cuda backend behind `lucegen run`: a checkpoint on disk, loaded and generated through the decode megakernel,
gives the reference's greedy tokens."""
from __future__ import annotations

import pytest

from lucegen import reference
from lucegen.engine.generate import generate
from lucegen.engine.loader import load_model
from lucegen.engine.sampling import SamplingParams
from lucegen.model.checkpoint import make_checkpoint
from lucegen.model.config import tiny_config
from lucegen.model.weights import open_weights

pytestmark = pytest.mark.gpu


def test_cuda_backend_generates_the_reference_greedy_tokens(tmp_path):
    cfg = tiny_config(vocab_size=512)
    make_checkpoint(tmp_path, cfg, seed=3, peaked=True, formats=("hf",), progress=False)
    engine, tokenizer = load_model(tmp_path, backend="cuda")
    prompt = tokenizer.encode("def add(a, b):")
    out = generate(engine, tokenizer, prompt, 24, SamplingParams(temperature=0.0), ignore_eos=True)
    weights = {k: v.astype("float32") for k, v in open_weights(tmp_path).load_all(progress=False).items()}
    expected = reference.generate(weights, cfg, prompt, 24)
    assert list(out.token_ids) == expected
