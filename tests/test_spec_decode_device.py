"""The GPU engines' node-by-node tree verify (lucegen/spec_decode/device.py) without a GPU: a DeviceState on host
memory (tests/host_kernels.py) and an engine whose decode step is the numpy reference's on that state. Every
node's logits must equal decoding its ancestors and itself one by one after the committed sequence, bit for bit,
and a commit must leave exactly the state of decoding the accepted path one token at a time."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import lucegen.spec_decode.device as device
from lucegen.engine.state import DeviceState
from lucegen.model.config import tiny_config
from lucegen.reference import decode_step, random_weights
from lucegen.spec_decode.device import NodeVerifier, depth_first, depths
from lucegen.spec_decode.tree import ancestry
from host_kernels import on_host

CFG = tiny_config()
WEIGHTS = random_weights(CFG, seed=5)


class HostEngine:
    """decode(token) at state.position: the reference's decode step on the state as the GPU holds it."""

    def __init__(self, max_context: int):
        self.config, self.state = CFG, DeviceState(CFG, max_context)

    def decode(self, token: int) -> np.ndarray:
        ref = self.state.to_reference()
        logits = decode_step(WEIGHTS, CFG, int(token), ref)
        self.state.load_reference(ref)
        return logits


def snapshot(state: DeviceState) -> dict:
    ref = state.to_reference()
    return {"position": ref.position, **{f"{t}{i}": a.copy() for t in ("conv", "recurrent", "keys", "values")
                                         for i, a in getattr(ref, t).items()}}


trees = st.integers(1, 12).flatmap(lambda n: st.tuples(*[st.just(-1)] + [st.integers(0, i - 1) for i in range(1, n)]))


def test_depth_first_visits_each_subtree_whole():
    parents = [-1, 0, 0, 1, 3, 2, 1]
    assert depth_first(parents) == [0, 1, 3, 4, 6, 2, 5]
    assert depths(parents) == [0, 1, 1, 2, 3, 2, 2]


@settings(max_examples=15, deadline=None)
@given(parents=trees, prefix=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_node_by_node_verify_is_sequential_decoding(parents, prefix, seed):
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, CFG.vocab_size, len(parents))]
    context = [int(t) for t in rng.integers(0, CFG.vocab_size, prefix)]
    with pytest.MonkeyPatch.context() as mp, on_host(mp):
        mp.setattr(device, "synchronize", lambda: None)
        engine = HostEngine(64)
        for t in context:
            engine.decode(t)
        committed = snapshot(engine.state)
        verifier = NodeVerifier(engine)
        logits = verifier.forward(tokens, parents)
        for n in range(len(parents)):  # n after its ancestors, one by one from the committed state
            fresh = HostEngine(64)
            for t in context:
                fresh.decode(t)
            for a in ancestry(parents, n):
                expected = fresh.decode(tokens[a])
            np.testing.assert_array_equal(logits[n], expected)
        path = ancestry(parents, max(range(len(parents)), key=lambda n: depths(parents)[n]))
        path = path[:1 + rng.integers(len(path))]
        verifier.commit(path)
        fresh = HostEngine(64)
        for t in [*context, *(tokens[a] for a in path)]:
            fresh.decode(t)
        got, want = snapshot(engine.state), snapshot(fresh.state)
        assert got.keys() == want.keys() and committed["position"] == prefix
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
