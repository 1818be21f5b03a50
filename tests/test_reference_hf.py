"""The reference against HF transformers' own float32 logits, stored by tools/make_hf_fixtures.py (no torch here).

Each fixture holds a config, a weight seed, the tokens, and HF's logits for a 70-token prefill (chunked DeltaNet
rule across a chunk boundary), a 16-token block on the cache (chunked rule from a state) and 8 decode steps
(recurrent rule). tools/hf_parity.py runs the same comparison live, on more and larger configs.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from lucegen.model.config import load_config
from lucegen.reference import State, decode_step, forward, random_weights, relative_error
from lucegen.reference.weights import weights_digest

FIXTURES = Path(__file__).parent / "fixtures"
# HF and the reference differ only in rounding (BLAS vs torch reductions, solve_triangular vs substitution):
# measured 1e-6 to 8e-6 relative; the tolerance is tools/hf_parity.py's float32 threshold.
RTOL = 1e-4


@pytest.mark.parametrize("name", ["hf_tiny", "hf_ratio3"])
def test_reference_matches_hf_fixture(name):
    path = FIXTURES / f"{name}.npz"
    if not path.exists():
        pytest.skip(f"{path} missing: run tools/make_hf_fixtures.py in an environment with transformers 5.17")
    f = np.load(path)
    cfg = load_config(json.loads(str(f["config"])))
    weights = random_weights(cfg, int(f["seed"]))
    assert weights_digest(weights) == str(f["weights_sha256"]), (
        "random_weights no longer reproduces the fixture's weights: regenerate with tools/make_hf_fixtures.py")

    state = State()
    out = forward(weights, cfg, f["prompt"], state, output_hidden_states=True)
    block = forward(weights, cfg, f["block"], state).logits
    decode = np.array([decode_step(weights, cfg, int(t), state) for t in f["decode_tokens"]])

    assert relative_error(out.logits[f["prefill_rows"]], f["prefill_logits"]) < RTOL
    for j, hf_hidden in enumerate(f["hidden_last"]):
        assert relative_error(out.hidden_states[j][-1], hf_hidden) < RTOL, f"hidden state {j}"
    assert relative_error(block, f["block_logits"]) < RTOL
    for i, hf_logits in enumerate(f["decode_logits"]):
        assert relative_error(decode[i], hf_logits) < RTOL, f"decode step {i}"
