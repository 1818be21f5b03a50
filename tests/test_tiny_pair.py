"""The shipped default model (lucegen/models/tiny-pycode): a trained Qwen3.5-architecture target and its DFlash
draft. On held-out code prompts, chain and DDTree speculative decoding give exactly the autoregressive greedy
tokens, and the trained draft's tokens per target pass are well above 1 (a random draft, or one that reads the
target's features wrongly, stays near 1). Skipped until the trained files are in the checkout."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lucegen.cli import main
from lucegen.engine import SamplingParams, generate, load_model
from lucegen.engine.loader import DEFAULT_DRAFT, DEFAULT_MODEL_DIR, DEFAULT_TARGET
from lucegen.model.draft import load_draft, write_draft
from lucegen.reference.dflash import random_draft_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from pycode_corpus import held_out_prompts  # noqa: E402

TRAINED = (DEFAULT_TARGET / "model.safetensors").is_file() and (DEFAULT_DRAFT / "model.safetensors").is_file()
pytestmark = pytest.mark.skipif(not TRAINED, reason=f"the trained pair is not in {DEFAULT_MODEL_DIR} yet: "
                                "run tools/train_tiny_pair.py on a GPU and copy its output there")
GREEDY = SamplingParams(temperature=0)
PROMPTS, TOKENS = 3, 24
# Tokens per target pass that separate a draft reading the target's features from one that guesses: a random draft
# of the same shape stays below (1.00 .. 1.02 measured), the trained one stays above (on these prompts: chain 1.47,
# DDTree 2.0; tools/bench_tiny_pair.py on 6 prompts x 48 tokens: chain 1.53, DDTree 2.10).
GUESSING = 1.3


@pytest.fixture(scope="module")
def prompts():
    _, tokenizer = load_model(DEFAULT_TARGET)
    return [tokenizer.encode(p) for _, p in held_out_prompts(PROMPTS)]


def run_all(prompts, **draft_options):
    engine, tokenizer = load_model(DEFAULT_TARGET, **draft_options)
    return [generate(engine, tokenizer, ids, TOKENS, GREEDY, ignore_eos=True) for ids in prompts]


def tokens_per_pass(runs) -> float:
    return sum(g.completion_tokens - 1 for g in runs) / sum(g.target_passes for g in runs)


@pytest.fixture(scope="module")
def autoregressive(prompts):
    return [g.token_ids for g in run_all(prompts)]


@pytest.mark.parametrize("options", [{"chain": True, "budget": 15}, {"budget": 22}], ids=["chain", "ddtree"])
def test_trained_draft_is_lossless_and_accepts_more_than_one_token(prompts, autoregressive, options):
    runs = run_all(prompts, draft=DEFAULT_DRAFT, **options)
    assert [g.token_ids for g in runs] == autoregressive
    assert tokens_per_pass(runs) > GUESSING


@pytest.mark.slow
def test_a_random_draft_of_the_same_shape_accepts_far_less(prompts, autoregressive, tmp_path):
    """The floor the trained draft is measured against: same config, random weights."""
    cfg, _ = load_draft(DEFAULT_DRAFT, load_model(DEFAULT_TARGET)[0].config)
    random_draft = write_draft(tmp_path, cfg, random_draft_weights(cfg, seed=1))
    runs = run_all(prompts, draft=random_draft, budget=22)
    assert [g.token_ids for g in runs] == autoregressive
    assert tokens_per_pass(runs) < GUESSING


def test_the_pair_fits_16_mb():
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.rglob("*") if f.is_file())
    assert size <= 16_000_000


def test_lucegen_run_uses_the_pair_by_default(capsys):
    assert main(["run", "--prompt", "def main():\n", "--max-tokens", "8", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "output: 8 tokens" in err and out.strip()
