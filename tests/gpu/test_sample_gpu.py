"""The device draw (templates/sample.cuh, one launch for a row or many) against the host's law on fresh rows: the
token Sampler.draw takes for the same uniform (filtered_probs at the temperature, the first token whose running sum
passes u), wherever u is not within rounding of a boundary between two tokens. The output is poisoned before
every launch."""
from __future__ import annotations

import numpy as np
import pytest

from lucegen.codegen.build import build
from lucegen.kernels import argmax, sample
from lucegen.model.config import load_config
from lucegen.runtime import DeviceArray
from lucegen.spec import spec_for_current_device
from test_sample import host_token

pytestmark = pytest.mark.gpu
MARGIN = 1e-12  # closer to a boundary than this, rounding picks the side


@pytest.fixture(scope="module")
def kernel():
    spec = spec_for_current_device()
    cfg = load_config("qwen3.5-0.8b")
    op = sample.Sample(build(spec, cfg, sample.units(spec, cfg)).module("sample"), spec)
    yield op, argmax.blocks(spec)
    op.free()


@pytest.mark.parametrize("n", [248_320, 8_192, 1_000, 5])  # the vocabulary, ..., fewer tokens than blocks
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_a_draw_is_the_hosts_token_for_the_same_uniform(kernel, n, temperature):
    op, blocks = kernel
    rng = np.random.default_rng([n, int(temperature * 10)])
    checked = 0
    for scale in (1.0, 4.0):
        logits = (rng.standard_normal(n) * scale).astype(np.float32)
        row = DeviceArray.from_numpy(logits)
        for u in [0.0, float(np.nextafter(1.0, 0.0)), *rng.random(40)]:
            op.out.fill_bytes(0xFF)
            op(row, temperature, u)
            token = int(op.out.numpy()[0])
            want, margin = host_token(logits, temperature, u)
            assert token == sample.reference(logits, temperature, u, blocks) or margin <= MARGIN
            if margin > MARGIN:
                assert token == want, f"u {u}: drew {token}, the host {want}"
                checked += 1
        row.free()
    assert checked >= 60
    assert not op.ticket.numpy().any()  # left at zero for the next launch


@pytest.mark.parametrize("rows,n", [(23, 248_320), (65, 1_000)])
def test_rows_are_drawn_each_with_its_own_uniform(kernel, rows, n):
    """One launch over the rows of a tree verify's logits (a uniform a row): each row's token is the host's."""
    op, blocks = kernel
    rng = np.random.default_rng([rows, n])
    logits = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    uniforms = rng.random(rows)
    v = DeviceArray.from_numpy(logits)
    op.reserve(rows)
    op.out.fill_bytes(0xFF)
    op(v, 0.8, uniforms)
    drawn = op.out.numpy()[:rows]
    for r in range(rows):
        want, margin = host_token(logits[r], 0.8, uniforms[r])
        assert drawn[r] == want or margin <= MARGIN, f"row {r}: drew {drawn[r]}, the host {want}"
    assert not op.ticket.numpy().any()
    v.free()
