"""The layer-by-layer step on a GGUF checkpoint (quantized matrices of two formats, fused projections, llama.cpp's
tiled value-head order), emulated on the host (tests/host_layered.py: every launch runs its kernel's numpy
stand-in). The row kernels write the quantized activations (XBlocks) the projections read (layered.cuh's
quantize_row), so each projection must multiply the XBlocks of its own input row made after that row's last
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
