"""The tree verify and commit kernels on the GPU: each against its numpy reference on fresh inputs (outputs
poisoned, state a kernel must not read poisoned), for N = 1, 7, 22 and 64 nodes (capped at the spec's budget + 1),
chains, stars and random bushy trees; and losslessness: verify and commit give bit for bit what 1-node trees (the
decode step) give token by token along the accepted path.

Tolerances (relative error ||out - ref|| / ||ref||):
  DeltaNet outputs and states  2e-4  (fp32 with fast exp/rsqrt: the decode megakernel's one-step bound 2e-5,
                                      times ~sqrt(64) for a chain of 64 dependent steps)
  K/V rows                     4e-3  (bf16 rows: a rounding flip where the fp32 values differ in the last ulps)
  attention outputs            1e-5  (the reference reads the cache the kernel left; fp32 softmax in another
                                      order)
"""
from __future__ import annotations

from functools import cache

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lucegen.codegen.build import build
from lucegen.kernels import qgemv, tree
from lucegen.kernels.gdn import gated_norm_reference
from lucegen.model.config import load_config, tiny_config
from lucegen.reference import relative_error
from lucegen.runtime import DeviceArray, synchronize
from lucegen.spec import spec_for_current_device

import xblocks

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DN_RTOL, KV_RTOL, ATT_RTOL, NORM_RTOL = 2e-4, 4e-3, 1e-5, 1e-6
MODELS = {"tiny": tiny_config, "0.8b": lambda: load_config("qwen3.5-0.8b"), "27b": lambda: load_config("qwen3.5-27b"),
          # 8 query heads a kv head: the tree attention's warps take 4 heads each, two warps a position
          "tiny-g8": lambda: tiny_config(num_attention_heads=8, num_key_value_heads=1)}
SIZES = [1, 7, 22, 64]
KINDS = ["chain", "star", "bushy"]
STARTS = st.sampled_from([0, 1, 2, 3, 50, 700])


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out).astype(np.float32)
    assert np.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    return relative_error(out, ref)


def dev(a: np.ndarray) -> DeviceArray:
    return DeviceArray.from_numpy(np.ascontiguousarray(a))


def poisoned(shape, dtype) -> DeviceArray:
    a = DeviceArray.empty(shape, dtype)
    a.fill_bytes(0xFF)
    return a


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    spec, root = spec_for_current_device(), tmp_path_factory.mktemp("build")

    @cache
    def get(name: str) -> tree.TreeKernels:
        cfg = MODELS[name]()
        (unit,) = tree.units(spec, cfg, [False])
        return tree.TreeKernels(build(spec, cfg, [unit], root=root).module(unit.name), cfg, spec)
    return get


def make_tree(kind: str, n: int, rng) -> list[int]:
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]


def deepest_path(parents, rng) -> list[int]:
    node = int(rng.integers(len(parents)))
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


# ---- Gated DeltaNet ----------------------------------------------------------------------------------------------
def deltanet_inputs(cfg, n, start, rng):
    K, C, Hv = cfg.linear_conv_kernel_dim, cfg.conv_dim, cfg.linear_num_value_heads
    rows = C + cfg.value_dim + 2 * Hv
    ring = rng.standard_normal((K, C), dtype=np.float32)
    for p in range(start - K, 0):  # slots of positions before the sequence: never read
        ring[p % K] = np.nan
    state = (rng.standard_normal((Hv, cfg.linear_value_head_dim, cfg.linear_key_head_dim), dtype=np.float32) * 0.1
             if start > 0 else np.full((Hv, cfg.linear_value_head_dim, cfg.linear_key_head_dim), np.nan, np.float32))
    return dict(mixed=rng.standard_normal((n, rows), dtype=np.float32),
                conv_w=(rng.standard_normal((C, K), dtype=np.float32) / np.sqrt(K)).astype(np.float32),
                a_log=rng.uniform(0, np.log(16), Hv).astype(np.float32),
                dt_bias=rng.uniform(-1, 1, Hv).astype(np.float32), ring=ring, state=state)


def run_deltanet(k: tree.TreeKernels, x, parents, start, path=None, norm_w=None):
    """(out, ring, state) after a verify (and, with a path, its commit) on device copies of x's ring and state;
    with norm_w, then (normed, its XBlocks) of the verify too (poisoned past the nodes' rows)."""
    t = k.tree(parents)
    d = {name: dev(a) for name, a in x.items()}
    n, VD = len(parents), k.cfg.value_dim
    out = poisoned((n, VD), np.float32)
    normed, normed_q = poisoned((n, VD), np.float32), poisoned(qgemv.xblock_bytes(n, VD) + 64, np.uint8)
    norm = None if norm_w is None else (dev(norm_w), normed, normed_q)
    k.deltanet(t, d["mixed"], d["conv_w"], d["a_log"], d["dt_bias"], d["ring"], d["state"], out, start, norm=norm)
    if path is not None:
        length = k.set_path(t, path)
        k.deltanet_commit(t, length, d["mixed"], d["conv_w"], d["a_log"], d["dt_bias"], d["ring"], d["state"], out,
                          start)
    synchronize()
    if norm_w is not None:
        return out.numpy(), d["ring"].numpy(), d["state"].numpy(), normed.numpy(), normed_q.numpy()
    return out.numpy(), d["ring"].numpy(), d["state"].numpy()


def norm_inputs(cfg, rng) -> np.ndarray:
    return rng.standard_normal(cfg.linear_value_head_dim, np.float32) * np.float32(0.1) + np.float32(1)


def assert_normed(cfg, out, mixed, w, normed, normed_q) -> None:
    """normed is the gated RMSNorm of out (gate z from mixed) and normed_q its XBlocks in the layout of its rows, bit
    for bit, nothing else written (xblocks.assert_xblocks_of)."""
    n, hv, dv, C, VD = len(out), cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.conv_dim, cfg.value_dim
    want = gated_norm_reference(out.reshape(n, hv, dv), mixed[:n, C:C + VD].reshape(n, hv, dv), w,
                                cfg.rms_norm_eps).reshape(n, VD)
    assert rel_err(normed, want) < NORM_RTOL
    assert_xblocks_of(normed_q, normed)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
@SETTINGS
@given(start=STARTS, seed=st.integers(0, 2**32 - 1))
def test_deltanet_verify_matches_reference(kernels, model, kind, n, start, seed):
    k = kernels(model)
    n = min(n, k.max_nodes)
    rng = np.random.default_rng(seed)
    parents, x = make_tree(kind, n, rng), deltanet_inputs(k.cfg, n, start, rng)
    w = norm_inputs(k.cfg, rng)
    out, ring, state, normed, normed_q = run_deltanet(k, x, parents, start, norm_w=w)
    ref, _, _ = tree.deltanet_reference(k.cfg, x["mixed"], x["conv_w"], x["a_log"], x["dt_bias"],
                                        np.nan_to_num(x["ring"]), x["state"], parents, start)
    assert rel_err(out, ref) < DN_RTOL
    assert_normed(k.cfg, out, x["mixed"], w, normed, normed_q)
    # verify leaves the committed state alone
    assert np.array_equal(ring, x["ring"], equal_nan=True) and np.array_equal(state, x["state"], equal_nan=True)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
@SETTINGS
@given(start=STARTS, seed=st.integers(0, 2**32 - 1))
def test_deltanet_commit_is_sequential_decode(kernels, model, kind, n, start, seed):
    """The committed ring and state match the reference, and equal bit for bit what decoding the path's tokens
    one by one (1-node trees, committed) leaves; so do the path nodes' verify outputs."""
    k = kernels(model)
    n = min(n, k.max_nodes)
    rng = np.random.default_rng(seed)
    parents, x = make_tree(kind, n, rng), deltanet_inputs(k.cfg, n, start, rng)
    path = deepest_path(parents, rng)
    out, _, _ = run_deltanet(k, x, parents, start)
    _, ring, state = run_deltanet(k, x, parents, start, path)
    _, _, recs = tree.deltanet_reference(k.cfg, x["mixed"], x["conv_w"], x["a_log"], x["dt_bias"],
                                         np.nan_to_num(x["ring"]), x["state"], parents, start)
    ref_ring, ref_state = tree.deltanet_commit_reference(x["mixed"], x["ring"], x["state"], recs, path, start)
    live = [(start + len(path) - 1 - d) % ring.shape[0] for d in range(min(ring.shape[0], start + len(path)))]
    assert rel_err(ring[live], ref_ring[live]) < DN_RTOL and rel_err(state, ref_state) < DN_RTOL

    d = {name: dev(a) for name, a in x.items()}
    o = poisoned((1, k.cfg.value_dim), np.float32)
    w = norm_inputs(k.cfg, rng)
    for i, node in enumerate(path):  # the decode step, token by token, with the gated norm
        step = dev(x["mixed"][node:node + 1])
        normed = poisoned((1, k.cfg.value_dim), np.float32)
        normed_q = poisoned(qgemv.xblock_bytes(1, k.cfg.value_dim) + 64, np.uint8)
        k.decode_deltanet(step, d["conv_w"], d["a_log"], d["dt_bias"], d["ring"], d["state"], o, start + i,
                          norm=(dev(w), normed, normed_q))
        synchronize()
        assert np.array_equal(o.numpy()[0], out[node]), f"node {node}: verify output differs from its decode step"
        assert_normed(k.cfg, o.numpy(), x["mixed"][node:node + 1], w, normed.numpy(), normed_q.numpy())
    assert np.array_equal(ring[live], d["ring"].numpy()[live]) and np.array_equal(state, d["state"].numpy())


# ---- attention ---------------------------------------------------------------------------------------------------
def attention_inputs(cfg, n, start, rng):
    rows = cfg.q_proj_rows + 2 * cfg.kv_dim
    shape = (start + n, cfg.num_key_value_heads, cfg.head_dim)
    return dict(qkv=rng.standard_normal((n, rows), dtype=np.float32),
                q_norm=rng.uniform(-0.5, 0.5, cfg.head_dim).astype(np.float32),
                k_norm=rng.uniform(-0.5, 0.5, cfg.head_dim).astype(np.float32),
                keys=rng.standard_normal(shape, dtype=np.float32).astype(BF16),
                values=rng.standard_normal(shape, dtype=np.float32).astype(BF16))


def run_attention(k: tree.TreeKernels, x, parents, start, path=None):
    """(out, keys, values, out's XBlocks or None) after attention_kv + attention (and, with a path, kv_commit)."""
    t = k.tree(parents)
    d = {name: dev(a) for name, a in x.items()}
    for buf in (d["keys"], d["values"]):  # node rows: written by attention_kv before anything reads them
        buf.view((len(parents), k.cfg.kv_dim), BF16, start * k.cfg.kv_dim * 2).fill_bytes(0xFF)
    width = k.cfg.num_attention_heads * k.cfg.head_dim
    out = poisoned((len(parents), width), np.float32)
    out_q = poisoned(qgemv.xblock_bytes(len(parents), width) + 64, np.uint8) \
        if tree.xblocks_in_merge(k.cfg) else None
    k.attention_kv(t, d["qkv"], d["k_norm"], d["keys"], d["values"], start)
    k.attention(t, d["qkv"], d["q_norm"], d["keys"], d["values"], out, start, out_q=out_q)
    if path is not None:
        k.kv_commit(k.set_path(t, path), d["keys"], d["values"], start)
    synchronize()
    return out.numpy(), d["keys"].numpy(), d["values"].numpy(), None if out_q is None else out_q.numpy()


def assert_xblocks_of(got: np.ndarray | None, rows: np.ndarray) -> None:
    """got (where given) holds the XBlocks of rows and nothing else (xblocks.assert_xblocks_of)."""
    if got is not None:
        xblocks.assert_xblocks_of(got, rows)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
@SETTINGS
@given(start=STARTS, seed=st.integers(0, 2**32 - 1))
def test_attention_matches_reference(kernels, model, kind, n, start, seed):
    k = kernels(model)
    n = min(n, k.max_nodes)
    rng = np.random.default_rng(seed)
    parents, x = make_tree(kind, n, rng), attention_inputs(k.cfg, n, start, rng)
    out, keys, values, out_q = run_attention(k, x, parents, start)
    assert_xblocks_of(out_q, out)
    rk, rv = tree.attention_kv_reference(k.cfg, x["qkv"], x["k_norm"], parents, start)
    assert rel_err(keys[start:], rk) < KV_RTOL and rel_err(values[start:], rv) < KV_RTOL
    assert np.array_equal(keys[:start], x["keys"][:start]) and np.array_equal(values[:start], x["values"][:start])
    ref = tree.attention_reference(k.cfg, x["qkv"], x["q_norm"], keys.astype(np.float32), values.astype(np.float32),
                                   parents, start)  # over the rows the kernel wrote, checked above
    assert rel_err(out, ref) < ATT_RTOL


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
@SETTINGS
@given(start=STARTS, seed=st.integers(0, 2**32 - 1))
def test_attention_commit_is_sequential_decode(kernels, model, kind, n, start, seed):
    """The accepted rows land at start .. in path order, and the verify outputs of the path's nodes equal bit for
    bit the decode step's (1-node trees) after the committed path prefix."""
    k = kernels(model)
    n = min(n, k.max_nodes)
    rng = np.random.default_rng(seed)
    parents, x = make_tree(kind, n, rng), attention_inputs(k.cfg, n, start, rng)
    path = deepest_path(parents, rng)
    out, keys, values, _ = run_attention(k, x, parents, start, path)
    _, node_keys, node_values, _ = run_attention(k, x, parents, start)
    for got, nodes in ((keys, node_keys), (values, node_values)):
        assert np.array_equal(got[:start + len(path)],
                              tree.kv_commit_reference(nodes, path, start)[:start + len(path)])
    d = {name: dev(a) for name, a in x.items()}
    o = poisoned((1, k.cfg.num_attention_heads * k.cfg.head_dim), np.float32)
    for buf in (d["keys"], d["values"]):
        buf.view((len(parents), k.cfg.kv_dim), BF16, start * k.cfg.kv_dim * 2).fill_bytes(0xFF)
    for i, node in enumerate(path):  # the decode step, token by token
        k.decode_attention(dev(x["qkv"][node:node + 1]), d["q_norm"], d["k_norm"], d["keys"], d["values"], o,
                           start + i)
        synchronize()
        assert np.array_equal(o.numpy()[0], out[node]), f"node {node}: verify output differs from its decode step"
    assert np.array_equal(d["keys"].numpy()[:start + len(path)], keys[:start + len(path)])
    assert np.array_equal(d["values"].numpy()[:start + len(path)], values[:start + len(path)])


# ---- quantized KV rows (tuning.kv_format q8_0 / q4_0 / tq3_0) --------------------------------------------------------
@pytest.fixture(scope="module")
def kv_kernels(tmp_path_factory):
    """kernels(model, fmt): the tree kernels of a spec whose tuning.kv_format is fmt."""
    import dataclasses
    base, root = spec_for_current_device(), tmp_path_factory.mktemp("build-kv")

    @cache
    def get(name: str, fmt: str) -> tree.TreeKernels:
        spec = dataclasses.replace(base, tuning=dataclasses.replace(base.tuning, kv_format=fmt))
        cfg = MODELS[name]()
        (unit,) = tree.units(spec, cfg, [False])
        return tree.TreeKernels(build(spec, cfg, [unit], root=root / fmt).module(unit.name), cfg, spec)
    return get


@pytest.mark.parametrize("fmt, model", [("q8_0", "tiny"), ("q8_0", "27b"), ("q4_0", "tiny"), ("q4_0", "27b"),
                                        ("tq3_0", "0.8b"), ("tq3_0", "27b")])  # tq3_0: head_dim a multiple of 128
@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(start=STARTS, seed=st.integers(0, 2**32 - 1))
def test_attention_reads_and_writes_quantized_kv_rows(kv_kernels, fmt, model, kind, start, seed):
    """The node rows written in the format are as near the exact K/V as the format allows (within 1.5 x what
    kvformats.encode's own rows miss them by, + 1e-3), the rows before them untouched; the outputs are the
    reference's over the rows as the format decodes them; a commit moves the rows' bytes; the decode step writes
    and reads its row as the verify did, bit for bit."""
    from lucegen.model import kvformats
    k = kv_kernels(model, fmt)
    rng = np.random.default_rng(seed)
    n = min(SIZES[2], k.max_nodes)
    parents, x = make_tree(kind, n, rng), attention_inputs(k.cfg, n, start, rng)
    for name in ("keys", "values"):
        x[name] = kvformats.encode(x[name].astype(np.float32), fmt)
    t = k.tree(parents)
    d = {name: dev(a) for name, a in x.items()}
    for buf in (d["keys"], d["values"]):
        buf.view(n * buf.nbytes // (start + n), np.uint8, start * buf.nbytes // (start + n)).fill_bytes(0xFF)
    width = k.cfg.num_attention_heads * k.cfg.head_dim
    out = poisoned((n, width), np.float32)
    k.attention_kv(t, d["qkv"], d["k_norm"], d["keys"], d["values"], start)
    k.attention(t, d["qkv"], d["q_norm"], d["keys"], d["values"], out, start)
    synchronize()
    keys, values = d["keys"].numpy(), d["values"].numpy()
    assert np.array_equal(keys[:start], x["keys"][:start]) and np.array_equal(values[:start], x["values"][:start])
    rk, rv = tree.attention_kv_reference(k.cfg, x["qkv"], x["k_norm"], parents, start)
    for got, exact in ((keys[start:], rk), (values[start:], rv)):
        own = rel_err(kvformats.codec(fmt)(exact), exact)
        assert rel_err(kvformats.decode(got, fmt), exact) < 1.5 * own + 1e-3
    ref = tree.attention_reference(k.cfg, x["qkv"], x["q_norm"], kvformats.decode(keys, fmt),
                                   kvformats.decode(values, fmt), parents, start)
    assert rel_err(out.numpy(), ref) < ATT_RTOL

    path = deepest_path(parents, rng)
    k.kv_commit(k.set_path(t, path), d["keys"], d["values"], start)
    synchronize()
    for got, nodes in ((d["keys"].numpy(), keys), (d["values"].numpy(), values)):
        assert np.array_equal(got[:start + len(path)], tree.kv_commit_reference(nodes, path, start)[:start + len(path)])
    node = path[-1]
    o = poisoned((1, width), np.float32)
    e = {name: dev(a) for name, a in x.items()}
    for i, m in enumerate(path):  # the decode step along the path: its rows and outputs are the verify's
        k.decode_attention(dev(x["qkv"][m:m + 1]), e["q_norm"], e["k_norm"], e["keys"], e["values"], o, start + i)
    synchronize()
    assert np.array_equal(o.numpy()[0], out.numpy()[node])
    assert np.array_equal(e["keys"].numpy()[:start + len(path)], d["keys"].numpy()[:start + len(path)])
