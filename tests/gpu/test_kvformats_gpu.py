"""KV-cache rows on the GPU as attention reads them (templates/kv.cuh, quant.cuh) against the numpy reference
(lucegen.model.kvformats), bit for bit, on freshly drawn rows. Outputs are poisoned (all bits set: NaN)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lucegen.codegen.build import build
from lucegen.kernels import kv, qgemv
from lucegen.model import kvformats
from lucegen.model.config import tiny_config
from lucegen.runtime import DeviceArray
from lucegen.spec import spec_for_current_device

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def readers(tmp_path_factory):
    spec = spec_for_current_device()
    module = build(spec, tiny_config(), kv.units(spec), root=tmp_path_factory.mktemp("kv")).module("kv_read")
    return {f: kv.reader(module, spec, f) for f in kv.DECODERS}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(sorted(kv.DECODERS)), n=st.integers(1, 2000), head_dim=st.sampled_from([128, 256]),
       log_scale=st.floats(-3, 3), seed=st.integers(0, 2**32 - 1))
def test_kv_rows_read_back_bit_for_bit(readers, fmt, n, head_dim, log_scale, seed):
    x = (10.0 ** log_scale * np.random.default_rng(seed).standard_normal((n, head_dim))).astype(np.float32)
    raw = kvformats.encode(x, fmt)
    out = DeviceArray.empty(n * head_dim + 64, np.float32)
    out.fill_bytes(0xFF)
    readers[fmt](qgemv.device_bytes(raw), out, n, head_dim)
    host = out.numpy()
    assert (host[n * head_dim:].view(np.uint32) == 0xFFFFFFFF).all(), "the kernel wrote past its output"
    np.testing.assert_array_equal(host[:n * head_dim].reshape(n, head_dim).view(np.uint32),
                                  kv.reference(raw, fmt).view(np.uint32))
