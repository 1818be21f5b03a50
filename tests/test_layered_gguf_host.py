"""The layer-by-layer step on a GGUF checkpoint (quantized matrices of two formats, fused projections, llama.cpp's
tiled value-head order), emulated on the host (tests/host_layered.py: every launch runs its kernel's numpy
stand-in). The row kernels write the quantized activations (XBlocks) the projections read (quant.cuh's
quantize_xblock_lanes), so each projection must multiply the XBlocks of its own input row made after that row's last
change: the step must give, bit for bit, what it gives when every projection quantizes its input itself (qquant_x
before each GEMV, the way it ran before), and stay near the numpy reference whose quantized matrices quantize their
activations the same way (host_layered.ActivationQuantized), position by position within the GPU test's bound
(tests/gpu/test_layered_gpu.py: 2.5 x the distance that activation quantization alone makes, STEP_RTOL at least).
A stale or foreign row's XBlocks, or a head order mixed up, is off by O(0.1 .. 1)."""
from __future__ import annotations

import numpy as np
import pytest

import lucegen.engine.layered as layered_mod
from lucegen.engine.layered import LayeredEngine
from lucegen.kernels import argmax, sample, topk
from lucegen.reference import State, decode_step, relative_error
from lucegen.spec import load_spec

from host_layered import RATIO3_Q, checkpoint, layered_on_host, unquantized

STEP_RTOL = 1e-2


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return checkpoint(tmp_path_factory, "gguf", peaked=False)


def emulated_logits(weights, tokens, fused: bool) -> np.ndarray:
    """Logits of a 4-token step then single steps; fused=False: no XBlocks from the row kernels."""
    with pytest.MonkeyPatch.context() as mp, layered_on_host(mp):
        if not fused:
            mp.setattr(layered_mod.LayeredStep, "quantized", lambda self, k: False)
        engine = LayeredEngine(weights, RATIO3_Q, spec=load_spec("h200"), max_context=64, chunk=4)
        assert (engine.step.hq is not None) == fused
        out = [engine.run(tokens[:4])[0], *(engine.run(tokens[i:i + 1])[0] for i in range(4, len(tokens)))]
        engine.free()
    return np.concatenate(out)


def reference_logits(ref, tokens) -> np.ndarray:
    state = State()
    return np.stack([decode_step(ref, RATIO3_Q, int(t), state) for t in tokens])


def test_the_row_kernels_xblocks_are_what_each_projection_would_quantize(gguf):
    weights, ref = gguf
    tokens = np.random.default_rng(7).integers(0, RATIO3_Q.vocab_size, 10)
    fused = emulated_logits(weights, tokens, fused=True)
    np.testing.assert_array_equal(fused, emulated_logits(weights, tokens, fused=False))
    emulated, plain = reference_logits(ref, tokens), reference_logits(unquantized(ref), tokens)
    for i in range(len(tokens)):
        bound = max(STEP_RTOL, 2.5 * relative_error(emulated[i], plain[i]))
        err = relative_error(fused[i], plain[i])
        assert err < bound, f"position {i}: relative error {err:.2e}, bound {bound:.2e}"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "tq3_0"])
def test_the_step_keeps_its_kv_cache_in_the_specs_format(gguf, fmt):
    """tuning.kv_format q8_0 / q4_0 / tq3_0: the cache holds the format's rows (bytes), and the step decodes as the reference
    whose attention reads its K/V through the same format (kvformats.codec), within the bound above, and nearer
    to it than to the reference whose cache keeps its fp32 rows."""
    import dataclasses
    from lucegen.model import kvformats
    weights, ref = gguf
    base = load_spec("h200")
    spec = dataclasses.replace(base, tuning=dataclasses.replace(base.tuning, kv_format=fmt))
    tokens = np.random.default_rng(11).integers(0, RATIO3_Q.vocab_size, 10)
    with pytest.MonkeyPatch.context() as mp, layered_on_host(mp):
        engine = LayeredEngine(weights, RATIO3_Q, spec=spec, max_context=64, chunk=4)
        i = RATIO3_Q.full_layers[0]
        assert engine.state.kv_format == fmt and engine.state.keys[i].dtype == np.uint8
        assert engine.state.keys[i].shape[-1] == kvformats.row_bytes(fmt, RATIO3_Q.head_dim)
        got = np.concatenate([engine.run(tokens[:4])[0], *(engine.run(tokens[j:j + 1])[0] for j in range(4, 10))])
        engine.free()
    state = State(kv_codec=kvformats.codec(fmt))
    want = np.stack([decode_step(ref, RATIO3_Q, int(t), state) for t in tokens])
    plain = reference_logits(unquantized(ref), tokens)
    for j in range(len(tokens)):
        bound = max(STEP_RTOL, 2.5 * relative_error(want[j], plain[j]))
        err = relative_error(got[j], want[j])
        assert err < bound, f"{fmt}, position {j}: relative error {err:.2e}, bound {bound:.2e}"
    unformatted = reference_logits(ref, tokens)  # the reference's cache keeps its fp32 rows
    assert relative_error(got, want) < relative_error(got, unformatted)


def test_a_kv_format_the_step_does_not_read_yet_says_so_and_keeps_bf16_rows(gguf):
    import dataclasses
    weights, _ = gguf
    base = load_spec("h200")
    spec = dataclasses.replace(base, tuning=dataclasses.replace(base.tuning, kv_format="fp8"))
    with pytest.MonkeyPatch.context() as mp, layered_on_host(mp):
        with pytest.warns(UserWarning, match="fp8 is not read by the layer-by-layer step's attention for ratio3q"):
            engine = LayeredEngine(weights, RATIO3_Q, spec=spec, max_context=16, chunk=4)
        assert engine.state.kv_format == "bf16"
        engine.free()


def test_a_sampled_step_draws_its_token_and_its_top_k_from_its_own_logits(gguf):
    weights, _ = gguf
    spec = load_spec("h200")
    with pytest.MonkeyPatch.context() as mp, layered_on_host(mp):
        engine = LayeredEngine(weights, RATIO3_Q, spec=spec, max_context=64, chunk=4)
        for temperature, u in [(0.7, 0.1), (1.0, 0.5), (1.5, 0.93)]:
            engine.reset()
            engine.prefill([3, 1, 4])
            logits = engine.decode(1)
            engine.reset()
            engine.prefill([3, 1, 4])
            token = engine.decode_sample(1, temperature, u)
            assert engine.position == 4
            assert token == sample.reference(logits, temperature, u, argmax.blocks(spec))
        engine.reset()
        engine.prefill([3, 1, 4])
        ids, values = engine.decode_top_k(1, 21)
        assert engine.position == 4
        want_ids, want_values = topk.reference(logits, 21)
        np.testing.assert_array_equal(ids, want_ids[0])
        np.testing.assert_array_equal(values, want_values[0])
        np.testing.assert_array_equal(engine.step_logits(), logits)
        engine.free()
