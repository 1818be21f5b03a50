"""The layer-by-layer step (lucegen/engine/layered.py) on the GPU against the numpy reference, on a scaled-down
Qwen3.5 with the 27B's head ratios and head dims (3 DeltaNet value heads per key head, 6 query heads per kv head,
128-wide heads) read from GGUF Q4_K_M-mix and bf16 HF checkpoints written by lucegen.model.checkpoint; its row
kernels against their numpy references; and its tree verifier (lucegen/engine/layered_verify.py) against the step
itself, bit for bit: a node's logits are decoding it after its ancestors, a commit is decoding the accepted path
(the step decodes with the same tree kernels, so any difference is a bug, not rounding).

The reference runs on the checkpoint's own values (the GGUF dequantized; HF bf16 as float32), so weights are no
source of error. Outputs and the state are poisoned (all bits set: NaN) before the runs, so an element a kernel
fails to write, or state it must not read, shows.

Tolerance of whole steps (relative error of the logits): STEP_RTOL = 1e-2, the decode megakernel's for its ratio3
model (tests/gpu/test_megakernel_gpu.py): the step runs the megakernel's mixers with the same bf16 KV cache, a
deliberate departure from the fp32 reference (a numpy run that rounds its cache to bf16 moved ratio3's logits by
up to 3.3e-3); everything else is fp32 except the other deliberate one: the quantized formats' GEMVs multiply
activations quantized to 8 bits per 32 values (lucegen/kernels/qgemv.py), which moves this model's logits by
several percent (5.8% at worst over the GGUF test's 84 positions), and unlike fp32 rounding it does not shrink when
the inputs nearly agree: a last-bit difference in x can move one 8-bit value by a whole step. So the GGUF run is
held, position by position, to 2.5 times (E2E margin of the prefill tests) the distance between the fp32
reference and a reference that quantizes the activations of those matrices exactly as the kernels do
(qgemv.quantize_x: ActivationQuantized below), and to STEP_RTOL at least. Measured on the H200 before this bound:
6.2% against the fp32 reference where the emulation moves it by 5.8%, 2.7% against the emulation itself. A wrong
index, position, head order or state is off by O(0.1..1).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lucegen.engine.layered import LayeredEngine
from lucegen.engine.sampling import SamplingParams
from lucegen.kernels import layered, qgemv, topk
from lucegen.model.checkpoint import make_checkpoint
from lucegen.model.config import tiny_config
from lucegen.model.gguf_file import load_gguf
from lucegen.reference import State, decode_step, generate, relative_error
from lucegen.spec import TENSOR_CORE_FORMATS, spec_for_current_device
from lucegen.spec_decode.tree import ancestry

from xblocks import assert_xblocks_of
from test_sample import host_token
from host_layered import RATIO3_Q, after, assert_speculation_is_plain_decoding, checkpoint, unquantized

pytestmark = pytest.mark.gpu
STEP_RTOL = 1e-2
ROW_RTOL = 1e-6

@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return checkpoint(tmp_path_factory, "gguf", peaked=False)


def poison(engine: LayeredEngine) -> None:
    st, step = engine.state, engine.step
    for table in (st.conv, st.recurrent, st.keys, st.values):
        for a in table.values():
            a.fill_bytes(0xFF)
    for a in (step.x, step.h, step.y, step.proj, step.mix_out, step.normed, step.act, step.logits,
              step.tokens, step.hq, step.normedq, step.actq):
        if a is not None:
            a.fill_bytes(0xFF)


def run_chunks(engine: LayeredEngine, tokens, m: int) -> np.ndarray:
    """Logits of every token, stepping m tokens at a time."""
    return np.concatenate([engine.run(tokens[i:i + m])[0] for i in range(0, len(tokens), m)])


def reference_logits(weights, tokens) -> np.ndarray:
    state = State()
    return np.stack([decode_step(weights, RATIO3_Q, int(t), state) for t in tokens])


def check(engine: LayeredEngine, ref_weights, tokens, m: int) -> None:
    poison(engine)
    engine.reset()
    out = run_chunks(engine, tokens, m)
    ref = reference_logits(ref_weights, tokens)
    errs = [relative_error(out[i], ref[i]) for i in range(len(tokens))]
    worst = int(np.argmax(errs))
    assert errs[worst] < STEP_RTOL, f"position {worst}: relative error {errs[worst]:.2e} (m = {m})"
    assert engine.position == len(tokens)


def test_gguf_steps_match_the_reference_over_a_prompt_and_64_steps_past_it(gguf):
    """A 20-token prompt in steps of 16 and 4 tokens, then 64 single steps (positions 20 .. 83)."""
    weights, ref = gguf
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256, chunk=16)
    tokens = np.random.default_rng(1).integers(0, RATIO3_Q.vocab_size, 84)
    poison(engine)
    prompt = engine.run(tokens[:16])[0], engine.run(tokens[16:20])[0]
    steps = [engine.run(tokens[i:i + 1])[0] for i in range(20, 84)]
    out = np.concatenate([*prompt, *steps])
    expected = reference_logits(unquantized(ref), tokens)
    emulated = reference_logits(ref, tokens)
    for i in range(len(tokens)):
        bound = max(STEP_RTOL, 2.5 * relative_error(emulated[i], expected[i]))
        err = relative_error(out[i], expected[i])
        assert err < bound, f"position {i}: relative error {err:.2e}, bound {bound:.2e}"


def test_an_m_token_step_equals_m_single_steps(gguf):
    """Bit for bit: the GEMM row is the GEMV of that row, the mixers run token by token, the rest is per row."""
    weights, _ = gguf
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256, chunk=8)
    tokens = np.random.default_rng(2).integers(0, RATIO3_Q.vocab_size, 24)
    poison(engine)
    engine.reset()
    many = run_chunks(engine, tokens, 8)
    many_tokens = engine.step.tokens.view(8).numpy()
    poison(engine)
    engine.reset()
    single = run_chunks(engine, tokens, 1)
    np.testing.assert_array_equal(many, single)
    np.testing.assert_array_equal(many_tokens, single[-8:].argmax(-1))


def test_greedy_tokens_equal_the_reference_on_a_peaked_gguf(tmp_path_factory):
    weights, ref = checkpoint(tmp_path_factory, "gguf", peaked=True)
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, RATIO3_Q.vocab_size, 7)]
    poison(engine)
    engine.reset()
    out, logits = [], engine.prefill(prompt)
    for _ in range(24):
        out.append(int(np.argmax(logits)))
        logits = engine.decode(out[-1])
    assert out == generate(ref, RATIO3_Q, prompt, 24)


def after_a_prompt(engine: LayeredEngine, tokens, step) -> list:
    """step(i, token) for each token after the first 4, one after another from the state of a 4-token prefill (the
    state poisoned first): a device step and decode's, each from the same state."""
    poison(engine)
    engine.reset()
    engine.prefill(tokens[:4])
    out = [step(i, t) for i, t in enumerate(tokens[4:])]
    assert engine.position == len(tokens)
    return out


def test_decode_argmax_is_the_argmax_of_decodes_logits(gguf):
    """decode_argmax (greedy generation's step: the device argmax, no logits to the host) takes decode's step: the
    same token as numpy's argmax of decode's logits, and the same state after it, step after step."""
    weights, _ = gguf
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256)
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, RATIO3_Q.vocab_size, 24)]
    want = after_a_prompt(engine, tokens, lambda i, t: int(np.argmax(engine.decode(t))))
    assert after_a_prompt(engine, tokens, lambda i, t: engine.decode_argmax(t)) == want


def test_decode_sample_draws_from_decodes_logits(gguf):
    """decode_sample (a sampled step at a temperature: the device draw, no logits to the host) takes decode's step:
    the host's draw from decode's logits with the same uniform, and the same state after it, step after step."""
    weights, _ = gguf
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256)
    rng = np.random.default_rng(6)
    tokens = [int(t) for t in rng.integers(0, RATIO3_Q.vocab_size, 24)]
    u = rng.random(len(tokens))
    want = after_a_prompt(engine, tokens, lambda i, t: host_token(engine.decode(t), 0.8, u[i]))
    drawn = after_a_prompt(engine, tokens, lambda i, t: engine.decode_sample(t, 0.8, u[i]))
    for i, (token, (host, margin)) in enumerate(zip(drawn, want)):
        assert token == host or margin <= 1e-12, f"step {i}: drew {token}, the host {host}"


def test_decode_top_k_is_the_top_k_of_decodes_logits(gguf):
    """decode_top_k (a top_k law's step: the k + 1 best from the device) takes decode's step: topk's reference on
    decode's logits (the same ids; log-softmax values within its tolerance), the step's logits left for a tie,
    and the same state after it, step after step."""
    weights, _ = gguf
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256)
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, RATIO3_Q.vocab_size, 16)]
    rows = after_a_prompt(engine, tokens, lambda i, t: engine.decode(t))
    tops = after_a_prompt(engine, tokens, lambda i, t: (*engine.decode_top_k(t, 21), engine.step_logits()))
    for row, (ids, values, logits) in zip(rows, tops):
        want_ids, want_values = topk.reference(row, 21)
        np.testing.assert_array_equal(ids, want_ids[0])
        assert (np.abs(values - want_values[0]) <= topk.logprob_tolerance(row, want_values)[0]).all()
        np.testing.assert_array_equal(logits, row)


def test_decode_top_p_is_the_best_and_softmax_of_decodes_logits(gguf):
    """decode_top_p (a top_p law's step) takes decode's step: its k best are topk's reference on decode's logits,
    with those logits, and its softmax is the row's at the temperature (fp64, within rounding)."""
    weights, _ = gguf
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256)
    tokens = [int(t) for t in np.random.default_rng(8).integers(0, RATIO3_Q.vocab_size, 12)]
    rows = after_a_prompt(engine, tokens, lambda i, t: engine.decode(t))
    tops = after_a_prompt(engine, tokens, lambda i, t: (*engine.decode_top_p(t, 0.6, 64), engine.step_logits()))
    for row, (ids, values, zmax, total, logits) in zip(rows, tops):
        want_ids = topk.reference(row, 64)[0][0]
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(values, row[want_ids])
        z = row.astype(np.float64) / 0.6
        assert zmax == pytest.approx(z.max(), rel=1e-15)
        assert total == pytest.approx(np.exp(z - z.max()).sum(), rel=1e-13)
        np.testing.assert_array_equal(logits, row)


def test_an_hf_bf16_checkpoint_runs_through_the_same_step(tmp_path_factory):
    """HF's grouped value-head order and bf16 matrices (qgemv's bf16 format)."""
    weights, ref = checkpoint(tmp_path_factory, "hf", peaked=False)
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256, chunk=4)
    check(engine, ref, np.random.default_rng(4).integers(0, RATIO3_Q.vocab_size, 40), 4)


# ---- row kernels ------------------------------------------------------------------------------------------------
def poisoned_bytes(n: int):
    return poisoned(n, np.uint8)


def poisoned(shape, dtype=np.float32):
    """A device array with every bit set (fp32: NaN)."""
    from lucegen.runtime import DeviceArray
    a = DeviceArray.empty(shape, dtype)
    a.fill_bytes(0xFF)
    return a


# rows wider than one block's part, none a whole number of parts (add + RMSNorm: 512 values a block at 256 threads;
# SiLU x up: 1024), every width whole XBlocks
WIDE_ROWS = tiny_config(name="wide-rows", hidden_size=2592, intermediate_size=4128)


def test_row_kernels_split_over_blocks_match_their_references(tmp_path):
    from lucegen.codegen.build import build
    from lucegen.runtime import DeviceArray
    from lucegen.spec import spec_for_current_device
    cfg, m, spec = WIDE_ROWS, 3, spec_for_current_device()
    module = build(spec, cfg, layered.units(spec, cfg, ["bf16"]), root=tmp_path).module(layered.unit_name("bf16"))
    k = layered.LayerKernels(module, spec, cfg)
    assert k.add_norm_blocks > 1 and k.silu_blocks > 1
    rng = np.random.default_rng(7)
    H, I = cfg.hidden_size, cfg.intermediate_size
    xq = poisoned_bytes(qgemv.xblock_bytes(m, I) + 64)
    x, y = rng.standard_normal((m, H), np.float32), rng.standard_normal((m, H), np.float32)
    w = rng.standard_normal(H, np.float32) * np.float32(0.1)
    dx, dy, dw = DeviceArray.from_numpy(x), DeviceArray.from_numpy(y), DeviceArray.from_numpy(w)
    dsum, dh = poisoned((m, H)), poisoned((m, H))
    k.add_rmsnorm(dx, dy, dw, dsum, dh, m, xq=xq)
    x1, h1 = layered.add_rmsnorm_reference(x, y, w, cfg.rms_norm_eps)
    assert relative_error(dsum.numpy(), x1) < ROW_RTOL and relative_error(dh.numpy(), h1) < ROW_RTOL
    assert_xblocks_of(xq.numpy(), dh.numpy())
    with pytest.raises(ValueError, match="another buffer"):
        k.add_rmsnorm(dx, dy, dw, dx, dh, m)
    gu = rng.standard_normal((m, 2 * I), np.float32)
    dact = poisoned((m, I))
    xq.fill_bytes(0xFF)
    k.silu_mul(DeviceArray.from_numpy(gu), dact, m, xq=xq)
    assert relative_error(dact.numpy(), layered.silu_mul_reference(gu)) < ROW_RTOL
    assert_xblocks_of(xq.numpy(), dact.numpy())


def test_row_kernels_match_their_references(gguf):
    from lucegen.runtime import DeviceArray
    weights, _ = gguf
    engine = LayeredEngine(weights, RATIO3_Q, max_context=64)
    k, cfg, m = engine.step.kernels, RATIO3_Q, 5
    rng = np.random.default_rng(6)
    H, I = cfg.hidden_size, cfg.intermediate_size
    x, y = rng.standard_normal((m, H), np.float32), rng.standard_normal((m, H), np.float32)
    w = rng.standard_normal(H, np.float32) * np.float32(0.1)
    dx, dy, dw = DeviceArray.from_numpy(x), DeviceArray.from_numpy(y), DeviceArray.from_numpy(w)
    dh, dsum = DeviceArray.empty((m, H), np.float32), DeviceArray.empty((m, H), np.float32)
    dh.fill_bytes(0xFF)
    dsum.fill_bytes(0xFF)
    xq = poisoned_bytes(qgemv.xblock_bytes(m, I) + 64)
    k.add_rmsnorm(dx, dy, dw, dsum, dh, m, xq=xq)
    x1, h1 = layered.add_rmsnorm_reference(x, y, w, cfg.rms_norm_eps)
    assert relative_error(dsum.numpy(), x1) < ROW_RTOL and relative_error(dh.numpy(), h1) < ROW_RTOL
    np.testing.assert_array_equal(dx.numpy(), x)  # read only: the sum went to x_out
    assert_xblocks_of(xq.numpy(), dh.numpy())  # the fused activation quantization: qquant_x's bytes, no more
    dh.fill_bytes(0xFF)
    dsum.fill_bytes(0xFF)
    k.add_rmsnorm(dx, None, dw, dsum, dh, m)  # no add (the first layer)
    x0, h0 = layered.add_rmsnorm_reference(x, None, w, cfg.rms_norm_eps)
    assert relative_error(dsum.numpy(), x0) < ROW_RTOL and relative_error(dh.numpy(), h0) < ROW_RTOL
    gu = rng.standard_normal((m, 2 * I), np.float32)
    dgu, dact = DeviceArray.from_numpy(gu), DeviceArray.empty((m, I), np.float32)
    dact.fill_bytes(0xFF)
    xq.fill_bytes(0xFF)
    k.silu_mul(dgu, dact, m, xq=xq)
    assert relative_error(dact.numpy(), layered.silu_mul_reference(gu)) < ROW_RTOL
    assert_xblocks_of(xq.numpy(), dact.numpy())
    src, dst = rng.standard_normal((m, 7), np.float32), rng.standard_normal((m, 20), np.float32)
    dsrc, ddst = DeviceArray.from_numpy(src), DeviceArray.from_numpy(dst)
    k.place(dsrc, ddst, 7, 20, 9, m)
    np.testing.assert_array_equal(ddst.numpy(), layered.place_reference(src, dst, 9))
    ids = rng.integers(0, cfg.vocab_size, m)
    io = DeviceArray.from_numpy(np.concatenate([[0], ids]).astype(np.int32))
    dx.fill_bytes(0xFF)
    k.embed(engine.weights.embed.parts[0].w, io, dx, m)
    from lucegen.model.quants import dequantize
    raw = weights.raw("token_embd.weight")
    np.testing.assert_array_equal(dx.numpy(), dequantize(raw.data[ids], raw.type))


def test_the_cuda_backend_runs_a_gguf_through_the_step(tmp_path):
    """`lucegen run --backend cuda --model x.gguf`: load_model picks the layer-by-layer step for a GGUF file and
    generates the reference's greedy tokens."""
    from lucegen.engine.generate import generate as generate_text
    from lucegen.engine.loader import load_model
    paths = make_checkpoint(tmp_path, RATIO3_Q, seed=5, peaked=True, progress=False)  # HF (tokenizer) + GGUF
    engine, tokenizer = load_model(paths["gguf"], backend="cuda")
    assert isinstance(engine, LayeredEngine)
    prompt = tokenizer.encode("def add(a, b):")
    out = generate_text(engine, tokenizer, prompt, 24, SamplingParams(temperature=0.0), ignore_eos=True)
    ref = {k: np.asarray(v, np.float32) for k, v in load_gguf(paths["gguf"]).load_all(progress=False).items()}
    assert list(out.token_ids) == generate(ref, RATIO3_Q, prompt, 24)


# ---- tree verify in one forward (lucegen/engine/layered_verify.py) ----------------------------------------------
# a root with three children, branches of several depths, a chain of four, a leaf at depth one
TREE = [-1, 0, 0, 1, 1, 3, 2, 6, 7, 0, 4, 5]


def random_tree(n: int, seed: int) -> list[int]:
    """n nodes, each a child of a random earlier one, deeper ones favoured (trees as DDTree grows them)."""
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]


def state_bytes(engine: LayeredEngine) -> dict:
    """The committed state, exactly (DeviceState.to_reference: the conv rings' last K-1 positions, the recurrent
    states, the K/V rows below the position)."""
    ref = engine.state.to_reference()
    return {"position": ref.position, **{f"{t}{i}": a.copy() for t in ("conv", "recurrent", "keys", "values")
                                         for i, a in getattr(ref, t).items()}}


@pytest.mark.parametrize("fmt,tree_name", [("gguf", "branches"), ("gguf", "full"), ("hf", "branches")])
def test_a_tree_verify_is_decoding_each_node_after_its_ancestors_bit_for_bit(gguf, tmp_path_factory, fmt, tree_name):
    """Every node's logits from one forward over the tree equal those of decoding its ancestors and itself one
    by one after the committed prompt; "full": a tree of the spec's whole DDTree budget + the root. A GGUF runs the
    tree kernels in llama.cpp's tiled value-head order, an HF checkpoint in HF's grouped one."""
    weights, _ = gguf if fmt == "gguf" else checkpoint(tmp_path_factory, "hf", peaked=False)
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256, chunk=8)
    assert engine.weights.tiled == (fmt == "gguf")
    parents = TREE if tree_name == "branches" else random_tree(engine.step.tree.max_nodes, 7)
    rng = np.random.default_rng(8)
    context = rng.integers(0, RATIO3_Q.vocab_size, 21)
    tokens = rng.integers(0, RATIO3_Q.vocab_size, len(parents))
    poison(engine)
    after(engine, context)
    verifier = engine.verifier()
    logits = verifier.forward(tokens, parents)
    assert engine.position == len(context)  # a verify commits nothing
    assert logits.shape == (len(parents), RATIO3_Q.vocab_size)
    for n in range(len(parents)):
        expected = after(engine, context, tokens[ancestry(parents, n)])
        np.testing.assert_array_equal(logits[n], expected, err_msg=f"node {n} (parents {parents})")
    after(engine, context)  # the committed context again
    rows = verifier.forward_rows(tokens, parents)  # a sampled round's pass: the rows copied one by one
    for n in rng.permutation(len(parents)):
        np.testing.assert_array_equal(rows[n], logits[n], err_msg=f"node {n} (parents {parents})")
    verifier.step.sample.out.fill_bytes(0xFF)  # a temperature's pass: every node drawn on the device, its own uniform
    uniforms = rng.random(len(parents))
    drawn = verifier.forward_drawn(tokens, parents, 0.8, uniforms)
    for n, u in enumerate(uniforms):
        want, margin = host_token(logits[n], 0.8, u)
        assert drawn[n] == want or margin <= 1e-12, f"node {n}: drew {drawn[n]}, the host {want}"
    ids, values, rows = verifier.forward_top_k(tokens, parents, 21)  # top_k's pass: each node's k + 1 best
    want_ids, want_values = topk.reference(logits, 21)
    np.testing.assert_array_equal(ids, want_ids)
    assert (np.abs(values - want_values) <= topk.logprob_tolerance(logits, want_values)).all()
    np.testing.assert_array_equal(rows[len(parents) - 1], logits[-1])
    ids, values, softmax, rows = verifier.forward_top_p(tokens, parents, 0.8, 21)  # top_p's: the best, the softmax
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(values, np.take_along_axis(logits, want_ids, axis=1))
    for n, (zmax, total) in enumerate(softmax):
        z = logits[n].astype(np.float64) / 0.8
        assert zmax == pytest.approx(z.max(), rel=1e-15)
        assert total == pytest.approx(np.exp(z - z.max()).sum(), rel=1e-13)


@pytest.mark.parametrize("path", [[0], [0, 1, 3, 5, 11], [0, 2, 6, 7, 8], [0, 9]])
def test_a_commit_leaves_the_state_of_decoding_the_path(gguf, path):
    """Bit for bit: the DeltaNet states and rings, the K/V rows, the position; and the next decode step."""
    weights, _ = gguf
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256, chunk=8)
    rng = np.random.default_rng(9)
    context = rng.integers(0, RATIO3_Q.vocab_size, 13)
    tokens = rng.integers(0, RATIO3_Q.vocab_size, len(TREE))
    nxt = int(rng.integers(0, RATIO3_Q.vocab_size))
    poison(engine)
    after(engine, context)
    verifier = engine.verifier()
    verifier.forward(tokens, TREE)
    verifier.commit(path)
    assert engine.position == len(context) + len(path)
    committed, logits = state_bytes(engine), engine.decode(nxt)
    poison(engine)
    after(engine, context, tokens[path])
    sequential = state_bytes(engine)
    for name, a in sequential.items():
        np.testing.assert_array_equal(committed[name], a, err_msg=name)
    np.testing.assert_array_equal(logits, engine.decode(nxt))


@pytest.mark.parametrize("budget,chain", [(4, False), (64, False), (16, True)])
def test_greedy_speculative_generation_with_an_oracle_draft_is_plain_greedy(tmp_path_factory, budget, chain):
    """LayeredEngine.speculate (the tree verifier) with a noisy oracle draft: the tokens of plain greedy decoding,
    in fewer target passes than tokens."""
    weights, _ = checkpoint(tmp_path_factory, "gguf", peaked=True)
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256)
    prompt = [int(t) for t in np.random.default_rng(10).integers(0, RATIO3_Q.vocab_size, 9)]
    assert_speculation_is_plain_decoding(engine, prompt, 48, depth=7, chain=chain, seed=3,
                                       budget=min(budget, engine.spec.tuning.ddtree.budget))


SAMPLED = {"temperature": SamplingParams(temperature=0.7, seed=5),
           "top_k": SamplingParams(temperature=0.7, top_k=20, seed=6),
           "top_p": SamplingParams(temperature=0.7, top_p=0.9, seed=7)}


@pytest.mark.parametrize("law", SAMPLED)
def test_sampled_speculative_generation_draws_plain_samplings_tokens(tmp_path_factory, law):
    """The generation loop with speculation draws plain sampling's tokens from one seed, token for token: each
    round's draws (every node on the device with its depth's uniform, from the device's top_k + 1 best, or from the
    walked rows on the host) take the uniforms plain decoding takes, on logits equal to its bit for bit."""
    weights, _ = checkpoint(tmp_path_factory, "gguf", peaked=True)
    engine = LayeredEngine(weights, RATIO3_Q, max_context=256)
    prompt = [int(t) for t in np.random.default_rng(11).integers(0, RATIO3_Q.vocab_size, 9)]
    assert_speculation_is_plain_decoding(engine, prompt, 48, depth=7, seed=3, params=SAMPLED[law],
                                         budget=engine.spec.tuning.ddtree.budget)


def test_with_q4_k_on_tensor_cores_a_verify_is_decoding_and_speculation_is_plain_greedy(tmp_path_factory):
    """tuning.qgemv.tensor_core_formats on: those formats' rows (Q4_K's) go through kernels/qgemm_tc.py at every M,
    one batch-invariant kernel for the decode GEMV and the verify GEMM, the others' (Q6_K's) through kernels/qgemv.py.
    A tree verify's logits equal decoding each node after its ancestors bit for bit, and speculation gives plain
    greedy decoding's tokens."""
    spec = spec_for_current_device()
    qgemv_tc = dataclasses.replace(spec.tuning.qgemv, tensor_core_formats=TENSOR_CORE_FORMATS)
    spec = dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, qgemv=qgemv_tc))
    weights, _ = checkpoint(tmp_path_factory, "gguf", peaked=True)
    engine = LayeredEngine(weights, RATIO3_Q, spec, max_context=256, chunk=8)
    assert {f for f, _ in engine.weights.pairs()} >= set(TENSOR_CORE_FORMATS)
    rng = np.random.default_rng(12)
    context = rng.integers(0, RATIO3_Q.vocab_size, 11)
    tokens = rng.integers(0, RATIO3_Q.vocab_size, len(TREE))
    poison(engine)
    after(engine, context)
    logits = engine.verifier().forward(tokens, TREE)
    for n in range(len(TREE)):
        np.testing.assert_array_equal(logits[n], after(engine, context, tokens[ancestry(TREE, n)]), err_msg=f"node {n}")
    prompt = [int(t) for t in rng.integers(0, RATIO3_Q.vocab_size, 9)]
    assert_speculation_is_plain_decoding(engine, prompt, 40, depth=7, chain=False, seed=4,
                                       budget=spec.tuning.ddtree.budget)
