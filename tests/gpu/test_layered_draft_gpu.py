"""The layer-by-layer step's target features (LayeredStep.capture_features) and its GPU DFlash draft
(lucegen/engine/layered_draft.py) on the GPU, on tests/gpu/test_layered_gpu.py's checkpoints (RATIO3_Q: the 27B's
head ratios at hidden 256, GGUF Q4_K_M-mix and HF bf16) and on the shipped tiny pair.

Features: a prefill chunk's rows and a tree verify's node rows against the reference's hidden states
(lucegen.reference.dflash.context_features, each token a decode step), layer block by layer block, with
test_layered_gpu.py's tolerances (STEP_RTOL for the bf16 K/V cache; a GGUF within 2.5 x the distance that activation
quantization alone makes, and STEP_RTOL at least); a verify's node rows also bit for bit against decoding the
node. The step's buffers, its features and the state are poisoned first (NaN), so a row a copy misses shows.

Speculation: load_model(gguf, backend="cuda", draft=...) drafts on the GPU draft and generates plain greedy's tokens
(80 a sequence, two sequences); on the HF checkpoint through the engine API, with plain decode steps between rounds,
plain greedy's 72 tokens, and every round's draft the reference draft's on the reference target's features (its
best token where the reference's margin is clear, log-probs within STEP_RTOL: tests/host_draft.py); the trained
tiny pair accepts more tokens a target pass than a guessing draft.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from lucegen.engine.generate import generate
from lucegen.engine.layered import LayeredEngine
from lucegen.engine.layered_draft import LayeredDraft
from lucegen.engine.loader import load_model
from lucegen.engine.sampling import SamplingParams
from lucegen.model.checkpoint import make_checkpoint
from lucegen.model.draft import write_draft
from lucegen.model.draft_config import tiny_draft_config
from lucegen.reference import State, relative_error
from lucegen.reference.dflash import context_features, random_draft_weights
from lucegen.reference.model import forward
from lucegen.runtime import synchronize
from lucegen.spec_decode.tree import ancestry

from gpu.test_layered_gpu import TREE, poison
from host_draft import STEP_RTOL, assert_gpu_draft_speculation, assert_the_trained_pair_accepts
from host_layered import RATIO3_Q, after, checkpoint, unquantized

pytestmark = pytest.mark.gpu
LAYERS = (1, 3, RATIO3_Q.num_hidden_layers - 1)  # DeltaNet, attention, the last (its feature: the final norm's output)
DRAFT = tiny_draft_config(RATIO3_Q, block_size=8, target_layer_ids=LAYERS)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return checkpoint(tmp_path_factory, "gguf", peaked=False)


def engine_with_features(weights, chunk: int = 16) -> LayeredEngine:
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256, chunk=chunk)
    engine.step.capture_features(LAYERS)
    poison(engine)
    poison_features(engine)
    return engine


def poison_features(engine: LayeredEngine) -> None:
    engine.step.features.fill_bytes(0xFF)
    synchronize()  # the memset ran on the legacy stream, which the step's stream does not wait for


def features(engine: LayeredEngine, n: int) -> np.ndarray:
    """The first n feature rows of the step's last forward."""
    return engine.step.features.numpy()[:n].copy()


def reference_features(weights, sequence) -> np.ndarray:
    """[len(sequence), len(LAYERS) x hidden]: each token's features from a reference decode step."""
    state = State()
    return np.concatenate([context_features(forward(weights, RATIO3_Q, [int(t)], state, output_hidden_states=True),
                                            LAYERS) for t in sequence])


def check_rows(got: np.ndarray, ref, rows_of) -> None:
    """got [n, features] against rows_of(weights) (the reference's rows on those weights), row by row and layer
    block by block: within STEP_RTOL of the plain reference's (unquantized(ref)), or for a GGUF (ref with
    ActivationQuantized matrices) within 2.5 x the distance that quantizing the activations alone makes."""
    H = RATIO3_Q.hidden_size
    want, emulated = rows_of(unquantized(ref)), rows_of(ref)
    assert np.isfinite(got).all(), "non-finite features (a row or block not written)"
    for i in range(len(got)):
        for j, layer in enumerate(LAYERS):
            block = slice(j * H, (j + 1) * H)
            bound = max(STEP_RTOL, 2.5 * relative_error(emulated[i, block], want[i, block]))
            err = relative_error(got[i, block], want[i, block])
            assert err < bound, f"row {i}, layer {layer}: relative error {err:.2e}, bound {bound:.2e}"


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_prefill_chunk_features_match_the_reference(gguf, tmp_path_factory, fmt):
    """A chunk of 16 tokens at position 0, then one of 5 at 16."""
    weights, ref = gguf if fmt == "gguf" else checkpoint(tmp_path_factory, "hf", peaked=False)
    engine = engine_with_features(weights)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, RATIO3_Q.vocab_size, 21)]
    engine.reset()
    engine.run(tokens[:16])
    first = features(engine, 16)
    engine.run(tokens[16:])
    got = np.concatenate([first, features(engine, 5)])
    check_rows(got, ref, lambda weights: reference_features(weights, tokens))
    engine.free()


def test_tree_verify_node_features_are_their_decode_steps_and_match_the_reference(gguf):
    weights, ref = gguf
    engine = engine_with_features(weights, chunk=8)
    rng = np.random.default_rng(8)
    context = [int(t) for t in rng.integers(0, RATIO3_Q.vocab_size, 13)]
    tokens = rng.integers(0, RATIO3_Q.vocab_size, len(TREE))
    after(engine, context)
    verifier = engine.verifier()
    poison_features(engine)
    verifier.forward(tokens, TREE)
    got = features(engine, len(TREE))
    paths = [[*context, *tokens[ancestry(TREE, n)]] for n in range(len(TREE))]
    check_rows(got, ref, lambda weights: np.stack([reference_features(weights, p)[-1] for p in paths]))
    for n in range(len(TREE)):
        poison_features(engine)
        after(engine, context, tokens[ancestry(TREE, n)])
        np.testing.assert_array_equal(got[n], features(engine, 1)[0], err_msg=f"node {n}")
    verifier.free()
    engine.free()


def test_load_model_speculates_on_the_gpu_draft_as_plain_greedy(tmp_path):
    """`lucegen run --backend cuda --model x.gguf --draft d`: the layer-by-layer step with the GPU draft; two
    sequences of 80 tokens, each generate() with the draft giving the tokens of the one without."""
    paths = make_checkpoint(tmp_path / "target", RATIO3_Q, seed=5, peaked=True, progress=False)  # HF (tokenizer) + GGUF
    draft = write_draft(tmp_path / "draft", DRAFT, random_draft_weights(DRAFT, seed=4))
    engine, tokenizer = load_model(paths["gguf"], backend="cuda", draft=draft)
    assert isinstance(engine, LayeredEngine) and isinstance(engine.draft, LayeredDraft)
    assert engine.speculation.draft_fn is engine.draft
    speculation, greedy = engine.speculation, SamplingParams(temperature=0.0)
    for text in ("def add(a, b):", "Once upon a time"):
        ids = tokenizer.encode(text)
        engine.speculation = None
        plain = generate(engine, tokenizer, ids, 80, greedy, ignore_eos=True)
        engine.speculation = speculation
        got = generate(engine, tokenizer, ids, 80, greedy, ignore_eos=True)
        assert got.token_ids == plain.token_ids and len(got.token_ids) == 80
    engine.free()


def test_gpu_draft_rounds_are_plain_greedy_and_the_reference_drafts(tmp_path_factory):
    """The HF checkpoint (no activation quantization: features within STEP_RTOL of the reference's), trees of the
    spec's budget, 72 tokens after each of two prompts."""
    weights, ref = checkpoint(tmp_path_factory, "hf", peaked=False)
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256, chunk=8)
    draft_weights = {k: (v.astype(ml_dtypes.bfloat16).astype(np.float32) if v.ndim == 2 else v)
                     for k, v in random_draft_weights(DRAFT, seed=6).items()}  # the device's bf16 matrices
    rng = np.random.default_rng(10)
    prompts = [[int(t) for t in rng.integers(0, RATIO3_Q.vocab_size, 9)] for _ in range(2)]
    assert_gpu_draft_speculation(engine, DRAFT, draft_weights, ref, prompts, 72)
    engine.free()


def test_the_trained_pair_accepts_with_the_gpu_draft():
    assert_the_trained_pair_accepts(lambda weights, cfg: LayeredEngine(weights, cfg, max_context=512))
