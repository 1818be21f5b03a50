"""The GPU DFlash draft of the layer-by-layer step (lucegen/engine/layered_draft.py, LayeredStep.capture_features)
without a GPU: LayeredEngine, its GpuDraft and the top-K on host memory, every kernel launch replaced by its
family's numpy reference (tests/host_draft.py).

Checked: the step's captured features against the reference's hidden states (prefill chunks) and, bit for bit,
a verify's node rows against decoding the node; which rows reach the draft on each commit; the draft's context
after prefill, verify commits of branching paths and decode steps against the reference draft on the features of
the committed sequence; losing and regaining the context; speculative generation (the engine API, load_model and
generate(), plain decode steps between rounds) giving plain greedy's tokens, the rounds drafting as the reference
draft; and the trained tiny pair accepting more tokens a pass than a guessing draft."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lucegen.engine import generate, load_model, loader
from lucegen.engine.layered import LayeredEngine
from lucegen.engine.layered_draft import LayeredDraft, runs
from lucegen.engine.sampling import SamplingParams
from lucegen.kernels import topk
from lucegen.model.config import tiny_config
from lucegen.model.draft import load_draft
from lucegen.model.draft_config import DraftConfig, tiny_draft_config
from lucegen.reference import State, random_weights, relative_error
from lucegen.reference.dflash import context_features, draft_forward, random_draft_weights
from lucegen.reference.model import forward
from lucegen.spec import load_spec
from lucegen.spec_decode.tree import ancestry
from host_draft import (STEP_RTOL, assert_gpu_draft_speculation, assert_the_trained_pair_accepts,
                        layered_draft_on_host)
from host_layered import after, bf16_activations, bf16_rounded, tree_case, trees

CFG = tiny_config()
SPEC = load_spec("h200").with_prefill(gemm="mma")  # the draft's GEMMs pass arrays, not TMA descriptors, to the host
# the last layer among them: its feature is the final norm's output (HF's last hidden state)
DRAFT = tiny_draft_config(CFG, target_layer_ids=(0, 2, CFG.num_hidden_layers - 1))


WEIGHTS = bf16_rounded(random_weights(CFG, seed=5))
DRAFT_WEIGHTS = bf16_rounded(random_draft_weights(DRAFT, seed=2))
DRAFT_RTOL = 1e-5  # the emulated GpuDraft against draft_forward on the same features (tests/test_draft_gpu_host.py)
BRANCHING = [-1, 0, 1, 0, 3, 4, 2]  # the path [0, 3, 4, 5] skips rows 1 and 2: a gathered append


@pytest.fixture
def engine():
    """A host engine with the GPU draft attached (one for all of a test's examples)."""
    with pytest.MonkeyPatch.context() as mp, layered_draft_on_host(mp, DRAFT):
        e = LayeredEngine(WEIGHTS, CFG, spec=SPEC, max_context=128, chunk=4)
        e.gpu_draft(DRAFT, DRAFT_WEIGHTS)
        yield e
        e.free()


def features(engine: LayeredEngine, n: int) -> np.ndarray:
    """The first n feature rows of the step's last forward."""
    return engine.step.features.numpy()[:n].copy()


def reference_features(tokens) -> np.ndarray:
    out = forward(WEIGHTS, CFG, [int(t) for t in tokens], State(), output_hidden_states=True)
    return context_features(out, DRAFT.target_layer_ids)


def committed_features(engine: LayeredEngine, sequence) -> np.ndarray:
    """The features of `sequence` as the step makes them decoding it token by token from an empty state (what
    the draft must hold after any mix of chunks, verifies and decode steps that committed it: an M-token step is
    M decode steps bit for bit, a verify's node its decode step)."""
    engine.reset()
    rows = []
    for t in sequence:
        engine.run([int(t)])
        rows.append(features(engine, 1)[0])
    return np.stack(rows)


class Recorder:
    """A step follower that records what it is given."""

    def __init__(self):
        self.calls = []

    def follow(self, rows, position):
        self.calls.append((list(rows), position))


def test_runs_of_consecutive_rows():
    assert runs([]) == []
    assert runs([3]) == [(3, 1)]
    assert runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 2), (9, 1)]
    assert runs(range(4)) == [(0, 4)]


def test_prefill_chunk_features_are_the_reference_hidden_states(engine):
    """Chunks at positions 0 and 4: every layer's block (the last layer's is the final norm's output) within the
    bf16 K/V cache's distance of the reference's."""
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, 8)
    engine.reset()
    engine.run(tokens[:4])
    first = features(engine, 4)
    engine.run(tokens[4:])
    got, want = np.concatenate([first, features(engine, 4)]), reference_features(tokens)
    H = CFG.hidden_size
    for j, layer in enumerate(DRAFT.target_layer_ids):
        err = relative_error(got[:, j * H:(j + 1) * H], want[:, j * H:(j + 1) * H])
        assert err < STEP_RTOL, f"layer {layer}: relative error {err:.2e}"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parents=trees, prefix=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_a_verify_node_row_is_its_decode_steps_features_bit_for_bit(engine, parents, prefix, seed):
    context, tokens = tree_case(engine, parents, prefix, seed)
    verifier = engine.verifier()
    verifier.forward(tokens, parents)
    got = features(engine, len(parents))
    for n in range(len(parents)):
        after(engine, context, tokens[ancestry(parents, n)])
        np.testing.assert_array_equal(got[n], features(engine, 1)[0], err_msg=f"node {n} of {list(parents)}")
    verifier.free()


def test_the_follower_gets_the_rows_of_committed_tokens(engine):
    """Prefill chunks, a decode step and a verify's commit, each at the position its tokens take."""
    draft, recorder = engine.step.follower, Recorder()
    engine.step.follower = recorder
    engine.reset()
    engine.prefill(list(range(10)))
    engine.decode(3)
    verifier = engine.verifier()
    verifier.forward([1, 2, 3, 4, 5, 6, 7], BRANCHING)
    verifier.commit([0, 3, 4, 5])
    assert recorder.calls == [([0, 1, 2, 3], 0), ([0, 1, 2, 3], 4), ([0, 1], 8), ([0], 10), ([0, 3, 4, 5], 11)]
    assert engine.position == 15
    verifier.free()
    engine.step.follower = draft


def test_the_draft_holds_the_committed_sequence(engine):
    """After a prefill, a verify commit of a branching path (its rows gathered) and a decode step, the draft's
    logits are the reference draft's on the committed sequence's features, and its TopK the top-K of them."""
    draft: LayeredDraft = engine.draft
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, CFG.vocab_size, 6)
    tokens = rng.integers(0, CFG.vocab_size, len(BRANCHING))
    path, nxt, root = [0, 3, 4, 5], int(rng.integers(CFG.vocab_size)), int(rng.integers(CFG.vocab_size))
    engine.reset()
    engine.prefill([int(t) for t in prompt])
    verifier = engine.verifier()
    verifier.forward(tokens, BRANCHING)
    verifier.commit(path)
    engine.decode(nxt)
    sequence = [*prompt, *tokens[path], nxt]
    assert draft.draft.length == engine.position == len(sequence)
    n = DRAFT.block_size - 1
    top = draft([*sequence, root], n)
    logits = draft.draft.logits.numpy()[:n]
    want = draft_forward(bf16_activations(DRAFT_WEIGHTS), WEIGHTS, DRAFT, CFG, committed_features(engine, sequence),
                         [root] + [DRAFT.mask_token_id] * n)[1:]
    assert relative_error(logits, want) < DRAFT_RTOL
    ids, lps = topk.reference(logits, draft.k)
    assert draft.k == min(SPEC.tuning.ddtree.capacity, SPEC.tuning.topk.max_k, CFG.vocab_size)
    np.testing.assert_array_equal(top.ids, ids)
    np.testing.assert_array_equal(top.logprobs, lps)
    verifier.free()


def test_a_moved_position_loses_the_context_until_a_new_sequence(engine):
    draft: LayeredDraft = engine.draft
    engine.reset()
    engine.prefill([1, 2, 3, 4, 5])
    assert draft([1, 2, 3, 4, 5, 6], 2).ids.shape == (2, draft.k)
    assert draft([1, 2, 3, 4, 5, 6], 0).ids.shape == (0, draft.k)
    with pytest.raises(ValueError, match="5 committed tokens and the root"):
        draft([1, 2, 3], 2)
    with pytest.raises(ValueError, match="at most block_size - 1"):
        draft([1, 2, 3, 4, 5, 6], DRAFT.block_size)
    engine.state.position -= 2  # as a benchmark does to repeat a step
    engine.decode(7)
    engine.decode(8)  # back at the draft's length, but not its tokens
    with pytest.raises(RuntimeError, match="holds no features"):
        draft([1, 2, 3, 7, 8, 9], 2)
    engine.reset()
    with pytest.raises(RuntimeError, match="holds no features"):
        draft([9], 2)
    engine.prefill([1, 2, 3])
    assert draft([1, 2, 3, 4], 2).ids.shape == (2, draft.k)


def test_speculation_with_the_gpu_draft_is_plain_greedy_and_drafts_as_the_reference(engine):
    """Two sequences of 40 tokens, plain decode steps between some rounds (host_draft.assert_gpu_draft_speculation)."""
    prompts = [[int(t) for t in np.random.default_rng(seed).integers(0, CFG.vocab_size, 5)] for seed in (2, 3)]
    assert_gpu_draft_speculation(engine, DRAFT, DRAFT_WEIGHTS, WEIGHTS, prompts, 40, budget=12)


def test_load_model_with_a_draft_uses_the_gpu_draft(checkpoint, draft, monkeypatch):
    """load_model(backend="cuda", draft=...) on a LayeredEngine: its speculation drafts on the GPU draft, and
    generate() gives the tokens it gives without the draft, across sequences and after a plain one."""
    with layered_draft_on_host(monkeypatch, load_draft(draft, CFG)[0]):
        monkeypatch.setitem(loader.BACKENDS, "cuda", lambda weights, max_context, spec: LayeredEngine(
            weights, weights.config, SPEC, max_context=256, chunk=8))
        engine, tokenizer = load_model(checkpoint, "cuda", draft=draft, budget=6)
        assert isinstance(engine.speculation.draft_fn, LayeredDraft) and engine.speculation.draft_fn is engine.draft
        speculation = engine.speculation
        for text in ("Once upon a time", "def add(a, b):"):
            ids = tokenizer.encode(text)
            engine.speculation = None
            plain = generate(engine, tokenizer, ids, 20, SamplingParams(temperature=0), ignore_eos=True)
            engine.speculation = speculation
            got = generate(engine, tokenizer, ids, 20, SamplingParams(temperature=0), ignore_eos=True)
            assert got.token_ids == plain.token_ids
        engine.free()


def test_the_trained_pair_accepts_with_the_gpu_draft(monkeypatch):
    with layered_draft_on_host(monkeypatch, DraftConfig.from_json(loader.DEFAULT_DRAFT / "config.json")):
        assert_the_trained_pair_accepts(lambda weights, cfg: LayeredEngine(weights, cfg, SPEC, max_context=512))
