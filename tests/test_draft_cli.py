"""Speculative decoding through `lucegen run --draft` and `lucegen serve --draft`, on the numpy backend and (where
there is a GPU) the cuda backend: a tiny target and a tiny random DFlash draft give the same greedy text (and the
same seeded samples) as no draft, and an always-right draft commits several tokens a round."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import openai
import pytest
from safetensors.numpy import load_file, save_file

from lucegen.cli import main
from lucegen.engine import SamplingParams, generate, load_model
from lucegen.engine.loader import LoadError
from lucegen.model.config import tiny_config
from lucegen.model.draft import load_draft, write_draft
from lucegen.model.draft_config import tiny_draft_config
from lucegen.reference.dflash import random_draft_weights
from lucegen.serve.app import create_app
from lucegen.spec_decode import Speculation, oracle_draft
from serving import running

TARGET = tiny_config()
DRAFT = tiny_draft_config(TARGET)


@pytest.fixture(params=["numpy", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request) -> str:
    return request.param


def run(capsys, *argv: str) -> tuple[str, str]:
    assert main(["run", "--prompt", "Tell me a story", "--max-tokens", "12", "--ignore-eos", *argv]) == 0
    return capsys.readouterr()


@pytest.mark.parametrize("options", [[], ["--budget", "3"], ["--chain"]])
def test_run_with_a_draft_prints_the_same_greedy_text(checkpoint, draft, capsys, options, backend):
    plain, _ = run(capsys, "--model", str(checkpoint), "--backend", backend)
    out, err = run(capsys, "--model", str(checkpoint), "--backend", backend, "--draft", str(draft), *options)
    assert out == plain and "output: 12 tokens" in err and "tokens per target pass" in err


def test_seeded_sampling_with_a_draft_draws_the_same_tokens(checkpoint, draft, backend):
    """The walk draws the target's token once per emitted token, from the same logits, with the same generator."""
    engine, tokenizer = load_model(checkpoint, backend)
    spec_engine, _ = load_model(checkpoint, backend, draft=draft, budget=6)
    ids = tokenizer.encode("Once upon")
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    want = generate(engine, tokenizer, ids, 14, sampling, ignore_eos=True)
    got = generate(spec_engine, tokenizer, ids, 14, sampling, ignore_eos=True)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert want.target_passes == 13 and 1 <= got.target_passes <= 13


def test_accepted_rounds_feed_the_same_loop(checkpoint, backend):
    """A draft that is always right (the oracle): several tokens per target pass, the same text, the same stops."""
    engine, tokenizer = load_model(checkpoint, backend)
    ids, greedy = tokenizer.encode("Tell me a story"), SamplingParams(temperature=0)
    want = generate(engine, tokenizer, ids, 14, greedy, ignore_eos=True)
    engine.speculation = Speculation(oracle_draft(want.token_ids, len(ids), TARGET.vocab_size), depth=3, budget=4)
    got = generate(engine, tokenizer, ids, 14, greedy, ignore_eos=True)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "length")
    assert got.target_passes == 4 and got.tokens_per_pass > 3
    stop = want.text[3:5]
    cut = generate(engine, tokenizer, ids, 14, greedy, [stop], ignore_eos=True)
    assert (cut.text, cut.finish_reason) == (want.text[:want.text.find(stop)], "stop")


def test_server_with_a_draft_answers_as_without(checkpoint, draft, backend):
    messages = [{"role": "user", "content": "Hello there!"}]
    answers = []
    for options in ({}, {"draft": draft}):
        engine, tokenizer = load_model(checkpoint, backend, **options)
        with running(create_app(engine, tokenizer, "tiny")) as port:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                   timeout=60)
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            answers.append((r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens))
    assert answers[0] == answers[1] and answers[0][0]


def test_write_and_load_draft_round_trip(draft):
    cfg, weights = load_draft(draft, TARGET)
    want = random_draft_weights(DRAFT, seed=3)
    assert cfg == DRAFT and weights.keys() == want.keys()
    np.testing.assert_allclose(weights["fc.weight"], want["fc.weight"], rtol=1e-2)


def broken(tmp_path, draft, *, drop: str | None = None, cut: str | None = None, **overrides):
    """A copy of the draft with a tensor dropped or cut short, or with config fields overridden (not checked
    against the target, unlike tiny_draft_config)."""
    out = tmp_path / "bad"
    if overrides:
        cfg = replace(DRAFT, **overrides)
        return write_draft(out, cfg, random_draft_weights(cfg))
    tensors = load_file(str(draft / "model.safetensors"))
    if drop:
        del tensors[drop]
    if cut:
        tensors[cut] = tensors[cut][:-1]
    write_draft(out, DRAFT, {})
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("case, message", [
    ({"drop": "layers.1.mlp.up_proj.weight"}, "model.safetensors: missing tensor 'layers.1.mlp.up_proj.weight'"),
    ({"cut": "fc.weight"}, "model.safetensors: tensor 'fc.weight' has shape (63, 192)"),
    ({"hidden_size": 32}, "config.json: draft does not fit the target: hidden_size 32 != target's 64"),
    ({"target_layer_ids": (0, 9), "num_target_layers": None}, "target_layer_ids [0, 9] exceed the target's 4 layers"),
])
def test_bad_drafts_are_clear_errors(checkpoint, draft, tmp_path, capsys, case, message):
    bad = broken(tmp_path, draft, **case)
    assert main(["run", "--model", str(checkpoint), "--prompt", "hi", "--draft", str(bad)]) == 2
    assert message in capsys.readouterr().err


def test_draft_option_errors(checkpoint, draft, tmp_path):
    with pytest.raises(ValueError, match="expected a DFlash draft directory"):
        load_model(checkpoint, draft=tmp_path / "nowhere")
    with pytest.raises(LoadError, match="--budget 0: must be at least 1"):
        load_model(checkpoint, draft=draft, budget=0)
