"""The DFlash draft reference: config, tensor names, the unmasked block attention over context features, and
lossless speculative decoding with it as the draft."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lucegen.model.config import ConfigError, tiny_config
from lucegen.model.draft_config import DraftConfig, tiny_draft_config
from lucegen.reference import forward, generate, random_weights
from lucegen.reference.dflash import (
    block_attention,
    context_features,
    dflash_draft_fn,
    draft_forward,
    draft_logprobs,
    draft_weight_shapes,
    random_draft_weights,
)
from lucegen.spec_decode import speculative_generate

DRAFT_JSON = Path(__file__).resolve().parents[1] / "lucegen" / "model" / "configs" / "drafts" / "qwen3.5-27b-dflash-draft.json"
TARGET = tiny_config()
TARGET_W = random_weights(TARGET, seed=1)
DRAFT = tiny_draft_config(TARGET)
DRAFT_W = random_draft_weights(DRAFT, seed=2)
PROMPT = [5, 17, 3, 99, 250]
FEATS = context_features(forward(TARGET_W, TARGET, PROMPT, output_hidden_states=True), DRAFT.target_layer_ids)
BLOCK = [42] + [DRAFT.mask_token_id] * (DRAFT.block_size - 1)


def run(feats=FEATS, block=BLOCK, positions=None):
    return draft_forward(DRAFT_W, TARGET_W, DRAFT, TARGET, feats, block, positions)


def real_config_dict() -> dict:
    return json.loads(DRAFT_JSON.read_text())


def test_config_from_zlab_json():
    cfg = DraftConfig.from_json(DRAFT_JSON)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (5120, 5, 32, 8)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.block_size, cfg.mask_token_id) == (128, 17408, 16, 248070)
    assert cfg.target_layer_ids == (1, 16, 31, 46, 61) and cfg.rope_theta == 1e7 and cfg.rms_norm_eps == 1e-6


@pytest.mark.parametrize("drop, message", [("hidden_size", "'hidden_size' in config"),
                                           ("dflash_config.mask_token_id", "'mask_token_id' in dflash_config"),
                                           ("rope_theta", "'rope_theta'"), ("block_size", "'block_size'")])
def test_config_missing_field(drop, message):
    d = real_config_dict()
    *outer, key = drop.split(".")
    del (d[outer[0]] if outer else d)[key]
    with pytest.raises(ConfigError, match=message):
        DraftConfig.from_hf_dict(d, source="draft.json")


def test_config_rejects_bad_values_and_mismatched_target():
    with pytest.raises(ConfigError, match="sliding-window"):
        DraftConfig.from_hf_dict({**real_config_dict(), "use_sliding_window": True})
    with pytest.raises(ConfigError, match="out of range"):
        DraftConfig.from_hf_dict({**real_config_dict(), "dflash_config": {"target_layer_ids": [1, 64],
                                                                           "mask_token_id": 0}})
    with pytest.raises(ConfigError, match="hidden_size 5120 != target's 64"):
        DraftConfig.from_json(DRAFT_JSON).check_target(TARGET)


def test_real_shapes_and_parameter_count():
    shapes = draft_weight_shapes(DraftConfig.from_json(DRAFT_JSON))
    assert shapes["fc.weight"] == (5120, 25600) and shapes["layers.4.self_attn.q_proj.weight"] == (4096, 5120)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (1024, 5120) and shapes["layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["layers.3.mlp.down_proj.weight"] == (5120, 17408) and "layers.5.mlp.up_proj.weight" not in shapes
    assert sum(int(np.prod(s)) for s in shapes.values()) == 1_730_213_120  # algorithms.md §3.4
    assert not any("embed" in n or "lm_head" in n for n in shapes)  # the target's are used


def test_random_weights_names_shapes_determinism():
    assert {n: w.shape for n, w in DRAFT_W.items()} == draft_weight_shapes(DRAFT)
    assert all(w.dtype == np.float32 for w in DRAFT_W.values())
    again = random_draft_weights(DRAFT, seed=2)
    assert all(np.array_equal(DRAFT_W[n], again[n]) for n in DRAFT_W)
    logits = run()
    assert logits.shape == (DRAFT.block_size, TARGET.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    np.testing.assert_array_equal(logits, run())


def test_context_features_are_hf_hidden_states():
    out = forward(TARGET_W, TARGET, PROMPT, output_hidden_states=True)
    assert FEATS.shape == (len(PROMPT), DRAFT.fc_in)
    H = TARGET.hidden_size
    for j, lid in enumerate(DRAFT.target_layer_ids):
        np.testing.assert_array_equal(FEATS[:, j * H:(j + 1) * H], out.hidden_states[lid + 1])
    with pytest.raises(ValueError, match="output_hidden_states"):
        context_features(forward(TARGET_W, TARGET, PROMPT), DRAFT.target_layer_ids)


def test_block_attention_is_unmasked_gqa():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 4, 8)), rng.normal(size=(7, 2, 8)), rng.normal(size=(7, 2, 8))
    got = block_attention(q, k, v, 0.5)
    for t in range(3):
        for head in range(4):
            s = k[:, head // 2] @ q[t, head] * 0.5
            w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(got[t, head], w @ v[:, head // 2], rtol=1e-12)


def test_every_block_position_sees_all_context_and_all_block_positions():
    base = run()
    for c in range(len(PROMPT)):  # one context token's features reach every block row
        feats = FEATS.copy()
        feats[c] += 1.0
        assert (np.abs(run(feats) - base).max(axis=1) > 1e-4).all(), c
    for b in range(DRAFT.block_size):  # one block token reaches every block row, earlier ones included
        block = list(BLOCK)
        block[b] = 7
        assert (np.abs(run(block=block) - base).max(axis=1) > 1e-4).all(), b


def test_draft_reads_the_context_features():
    other = context_features(forward(TARGET_W, TARGET, [9, 8, 7, 6, 5], output_hidden_states=True),
                             DRAFT.target_layer_ids)
    assert np.abs(run(other) - run()).max() > 1e-3


def test_positions_enter_only_relatively():
    """RoPE on q and k alike: shifting every position by a constant keeps the logits (up to rounding)."""
    n = len(PROMPT) + DRAFT.block_size
    np.testing.assert_allclose(run(positions=np.arange(n) + 100), run(), atol=2e-3)
    assert np.abs(run(positions=np.r_[np.arange(len(PROMPT)), np.arange(DRAFT.block_size) + 50]) - run()).max() > 1e-4


def test_draft_logprobs():
    lp = draft_logprobs(DRAFT_W, TARGET_W, DRAFT, TARGET, FEATS, 42)
    assert lp.shape == (DRAFT.block_size - 1, TARGET.vocab_size)
    np.testing.assert_allclose(np.exp(lp.astype(np.float64)).sum(axis=1), 1, rtol=1e-5)
    np.testing.assert_array_equal(np.argmax(lp, axis=1), np.argmax(run()[1:], axis=1))


@pytest.mark.parametrize("chain, budget", [(True, 3), (False, 6)])
def test_speculative_decoding_with_dflash_draft_is_lossless(chain, budget):
    draft_fn = dflash_draft_fn(DRAFT_W, TARGET_W, DRAFT, TARGET)
    ref = generate(TARGET_W, TARGET, PROMPT, 20)
    got = speculative_generate(TARGET_W, TARGET, PROMPT, 20, draft_fn, budget, depth=DRAFT.block_size - 1,
                               chain=chain)
    assert got == ref
    with pytest.raises(ValueError, match="at most block_size - 1"):
        draft_fn(PROMPT, DRAFT.block_size)


def test_the_draft_keeps_the_context_features_between_calls(monkeypatch):
    """A context that extends the last call's runs the target over the new tokens alone, one that does not starts
    again: either way the log-probs of a fresh run over the whole context (up to the rounding of the chunked rule)."""
    import lucegen.reference.dflash as dflash
    runs = []

    def counting(weights, cfg, ids, *args, **kwargs):
        runs.append(len(ids))
        return forward(weights, cfg, ids, *args, **kwargs)

    monkeypatch.setattr(dflash, "forward", counting)
    draft_fn, n = dflash_draft_fn(DRAFT_W, TARGET_W, DRAFT, TARGET), DRAFT.block_size - 1
    other = [int(t) for t in np.random.default_rng(7).integers(0, TARGET.vocab_size, 9)]
    p = PROMPT
    for ctx in (p, p + [7], p + [7, 300, 12], p[:3] + [8, 8], p[:3] + [8, 8, 1], other):
        out = forward(TARGET_W, TARGET, ctx[:-1], output_hidden_states=True)
        want = draft_logprobs(DRAFT_W, TARGET_W, DRAFT, TARGET, context_features(out, DRAFT.target_layer_ids), ctx[-1])
        np.testing.assert_allclose(draft_fn(ctx, n), want[:n], rtol=1e-4, atol=1e-4)
    # the target's tokens a call: the first 4, then the 1 and 2 new ones; the diverged context from its start, then
    # the 1 it grew by; a context of its own from its start
    assert runs == [4, 1, 2, 4, 1, 8]
