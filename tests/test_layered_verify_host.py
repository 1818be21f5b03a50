"""The layer-by-layer step's tree verifier (lucegen/engine/layered_verify.py) without a GPU: LayeredEngine on host
memory with every kernel launch replaced by its numpy reference (tests/host_layered.py). The step's decoding is
first held to the reference model (the emulation is the right one); then, on freshly drawn trees, prompts and
tokens: every node's logits from one verify forward equal decoding its ancestors and itself one by one, bit for
bit; a commit leaves the state of decoding the accepted path; greedy speculative generation with an oracle draft
gives plain greedy's tokens; and the verifier's input checks say what is wrong."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lucegen.engine.base import ContextOverflow
from lucegen.engine.layered import LayeredEngine
from lucegen.engine.sampling import Sampler, SamplingParams
from lucegen.kernels import argmax, sample, topk
from lucegen.model.config import tiny_config
from lucegen.reference import State, decode_step, random_weights, relative_error
from lucegen.spec import load_spec
from lucegen.spec_decode import Speculation, oracle_draft
from lucegen.spec_decode.tree import ancestry
from host_layered import after, assert_speculation_is_plain_decoding, layered_on_host, tree_case, trees

CFG = tiny_config()
SPEC = load_spec("h200")
# what the step multiplies: every matrix in bf16 (an HF checkpoint's Source); vectors fp32
WEIGHTS = {k: (v.astype(ml_dtypes.bfloat16).astype(np.float32) if v.ndim == 2 else v)
           for k, v in random_weights(CFG, seed=5).items()}
STEP_RTOL = 1e-2  # the bf16 K/V cache against the reference's fp32 one (tests/gpu/test_layered_gpu.py)



@pytest.fixture
def engine():
    """One engine for all of a test's examples (each starts from reset(); its graphs are replayed across them)."""
    with pytest.MonkeyPatch.context() as mp, layered_on_host(mp):
        e = LayeredEngine(WEIGHTS, CFG, spec=SPEC, max_context=128, chunk=4)
        yield e
        e.free()


def state_of(engine: LayeredEngine) -> dict:
    """The committed state, exactly (DeviceState.to_reference: the conv rings' last K-1 positions, the recurrent
    states, the K/V rows below the position)."""
    ref = engine.state.to_reference()
    return {"position": ref.position, **{f"{t}{i}": a.copy() for t in ("conv", "recurrent", "keys", "values")
                                         for i, a in getattr(ref, t).items()}}


def test_the_emulated_step_decodes_as_the_reference(engine):
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, 11)
    ref = State()
    expected = [decode_step(WEIGHTS, CFG, int(t), ref) for t in tokens]
    engine.reset()
    got = [*engine.run(tokens[:4])[0], *engine.run(tokens[4:6])[0], *(engine.decode(int(t)) for t in tokens[6:])]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert relative_error(g, e) < STEP_RTOL, f"position {i}"
    assert engine.step.graphs, "the steps ran as captured graphs"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parents=trees, prefix=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_a_verify_is_decoding_each_node_after_its_ancestors_bit_for_bit(engine, parents, prefix, seed):
    context, tokens = tree_case(engine, parents, prefix, seed)
    verifier = engine.verifier()
    logits = verifier.forward(tokens, parents)
    assert engine.position == prefix
    for n in range(len(parents)):
        np.testing.assert_array_equal(logits[n], after(engine, context, tokens[ancestry(parents, n)]),
                                      err_msg=f"node {n} of {list(parents)}")
    after(engine, context)
    np.testing.assert_array_equal(verifier.forward_argmax(tokens, parents), logits.argmax(axis=-1))  # greedy's pass
    rows = verifier.forward_rows(tokens, parents)  # a sampled round's pass
    assert len(rows) == len(parents)
    for n in np.random.default_rng(seed).permutation(len(parents)):
        np.testing.assert_array_equal(rows[n], logits[n], err_msg=f"node {n}")
    uniforms = np.random.default_rng(seed).random(len(parents))  # a sampled round's pass at a temperature alone
    np.testing.assert_array_equal(verifier.forward_drawn(tokens, parents, 0.7, uniforms),
                                  [sample.reference(row, 0.7, u, argmax.blocks(SPEC))
                                   for row, u in zip(logits, uniforms)])
    ids, values, rows = verifier.forward_top_k(tokens, parents, 6)  # and under top_k
    want_ids, want_values = topk.reference(logits, 6)
    np.testing.assert_array_equal(ids, want_ids)
    assert (np.abs(values - want_values) <= topk.logprob_tolerance(logits, want_values)).all()
    np.testing.assert_array_equal(rows[len(parents) - 1], logits[-1])
    ids, values, softmax, rows = verifier.forward_top_p(tokens, parents, 0.7, 6)  # and under top_p alone
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(values, np.take_along_axis(logits, want_ids, axis=1))
    for n, (zmax, total) in enumerate(softmax):
        assert (zmax, total) == sample.softmax_of(*sample.parts(logits[n], 0.7, argmax.blocks(SPEC)), 0.7)
    verifier.free()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parents=trees, prefix=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_a_commit_leaves_the_state_of_decoding_the_path(engine, parents, prefix, seed):
    rng = np.random.default_rng(seed)
    context = rng.integers(0, CFG.vocab_size, prefix)
    tokens = rng.integers(0, CFG.vocab_size, len(parents))
    path = ancestry(parents, int(rng.integers(0, len(parents))))
    nxt = int(rng.integers(0, CFG.vocab_size))
    after(engine, context)
    verifier = engine.verifier()
    verifier.forward(tokens, parents)
    verifier.commit(path)
    committed, logits = state_of(engine), engine.decode(nxt)
    after(engine, context, tokens[path])
    for name, a in state_of(engine).items():
        np.testing.assert_array_equal(committed[name], a, err_msg=name)
    np.testing.assert_array_equal(logits, engine.decode(nxt))
    verifier.free()


@pytest.mark.parametrize("chain", [False, True])
def test_greedy_speculative_generation_with_an_oracle_draft_is_plain_greedy(engine, chain):
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, CFG.vocab_size, 5)]
    assert_speculation_is_plain_decoding(engine, prompt, 24, depth=6, budget=12, chain=chain, seed=4)


SAMPLED = {"temperature": SamplingParams(temperature=0.7, seed=5),
           "top_k": SamplingParams(temperature=0.7, top_k=5, seed=6),
           "top_p": SamplingParams(temperature=0.7, top_p=0.9, seed=7)}


@pytest.mark.parametrize("law", SAMPLED)
def test_sampled_speculative_generation_draws_plain_samplings_tokens(engine, law):
    """Token for token from one seed: each round's draws (on the device, from the device's top_k + 1, or from the
    walked rows) take the uniforms plain decoding takes, on logits equal to its bit for bit."""
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, CFG.vocab_size, 5)]
    assert_speculation_is_plain_decoding(engine, prompt, 24, depth=6, budget=12, seed=4, params=SAMPLED[law])


def test_the_verifier_says_what_is_wrong(engine):
    after(engine, [1, 2, 3])
    v = engine.verifier()
    with pytest.raises(ValueError, match="commit\\(\\) before forward"):
        v.commit([0])
    with pytest.raises(ValueError, match="3 tokens but 2 parents"):
        v.forward([1, 2, 3], [-1, 0])
    with pytest.raises(ValueError, match="parents\\[2\\] = 2"):
        v.forward([1, 2, 3], [-1, 0, 2])
    with pytest.raises(ValueError, match="1 .. 65 tokens"):
        v.forward([1] * 66, [-1, *range(65)])
    with pytest.raises(ValueError, match="token ids"):
        v.forward([1, CFG.vocab_size], [-1, 0])
    with pytest.raises(ValueError, match="3 nodes but 2 uniforms"):
        v.forward_drawn([1, 2, 3], [-1, 0, 0], 0.7, [0.1, 0.2])
    v.forward([1, 2, 3], [-1, 0, 0])
    with pytest.raises(ValueError, match="not a child"):
        v.commit([0, 1, 2])
    engine.reset()
    engine.prefill(list(range(120)))
    with pytest.raises(ContextOverflow, match="exceed the context of 128"):
        v.forward([1] * 9, [-1, *range(8)])
    v.free()


def test_the_speculative_bench_times_the_verify_per_budget(engine, tmp_path):
    """lucegen.bench.speculative.verify on the emulated step: spec_verify_ms per budget whose tree fits, against
    the decode step; a budget past the spec's says it is skipped."""
    import json

    from lucegen.bench import speculative
    from lucegen.bench.results import Recorder
    out = tmp_path / "r.jsonl"
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, CFG.vocab_size, 6)]
    target = [int(t) for t in np.random.default_rng(4).integers(0, CFG.vocab_size, 20)]
    speculative.verify(Recorder("CPU", out=out, command="test"), engine, "emulated", prompt, target, (2, 8, 70), 1)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    step = next(r for r in rows if r["metric"] == "decode_step_ms")
    verify = {r["budget"]: r for r in rows if r["metric"] == "spec_verify_ms"}
    assert sorted(verify) == [2, 8] and engine.max_tree_nodes == 65  # budget 70: past h200's 64 + root
    for b, r in verify.items():
        assert r["nodes"] == b + 1 and r["verifier"] == "TreeVerifier" and r["limit"] == step["value"] > 0
    assert all(key[0] is engine.step for key in engine.step.graphs)  # the freed verifier dropped its graphs


def test_speculation_at_the_end_of_the_context_shrinks_the_tree_to_fit(engine):
    """A tree's nodes each hold a K/V row after the committed ones: near the end of the context the rounds take
    smaller budgets, and generation runs to the last position with plain greedy's tokens."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, CFG.vocab_size, 100)]
    n = engine.max_context - len(prompt)
    plain = [int(np.argmax(after(engine, prompt)))]
    while len(plain) < n:
        plain.append(int(np.argmax(engine.decode(plain[-1]))))
    engine.speculation = Speculation(oracle_draft(plain, len(prompt), CFG.vocab_size, seed=6), depth=6, budget=40)
    out, greedy = [int(np.argmax(after(engine, prompt)))], Sampler(SamplingParams(temperature=0))
    while len(out) < n:
        out += engine.speculate([*prompt, *out], n - len(out), greedy)
    assert out == plain and engine.position == engine.max_context - 1
