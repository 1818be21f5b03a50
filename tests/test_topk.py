"""Top-k per position (lucegen/kernels/topk.py, templates/topk.cuh) without a GPU: the numpy reference against a
brute-force stable sort, a block-by-block numpy emulation of the kernel's algorithm (the threshold of the group
maxima, the bound on the gathered entries, the bitonic merges in the lanes' layout, the per-row tickets) against the
same sort, the launcher driven through that emulation on host memory, the spec's tuning checks, and NVRTC builds.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from host_kernels import HostArray
from lucegen.codegen.build import build
from lucegen.kernels import FAMILIES, all_units, topk
from lucegen.model.config import tiny_config
from lucegen.runtime.memory import DeviceArray
from lucegen.spec import SPECS_DIR, SpecError, list_specs, load_spec, validate
from lucegen.spec_decode.tree import TopK, build_tree

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# (threads, slice, max_k) the emulation runs: GROUP_THREADS 1, 2 and 4, KMAX / 32 = 1, 2 and 4 entries a lane
TUNINGS = [(64, 256, 32), (256, 1024, 64), (256, 512, 32), (256, 1024, 128), (128, 256, 64)]
NONE = 0x80000000  # the composite of topk_none(): key 0, id 0x7fffffff


def brute(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable sort of each row and the float64 log-sum-exp summed exactly (math.fsum)."""
    ids = np.argsort(-x, axis=1, kind="stable")[:, :k]
    lp = []
    with np.errstate(invalid="ignore"):  # rows of -inf or NaN: NaN values, as from the kernel
        for row, i in zip(x.astype(np.float64), ids):
            peak = row.max()
            lp.append(row[i] - (peak + math.log(math.fsum(np.exp(row - peak)))))
    return ids, np.array(lp)


def draw_rows(rng: np.random.Generator, kind: str, n: int, vocab: int) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal((n, vocab)) * rng.uniform(0.1, 20)).astype(np.float32)
    if kind == "ties":  # a few distinct values: long runs of exact ties, -0.0 and +0.0 among them
        return rng.choice(np.array([-1.0, -0.0, 0.0, 1.0, 2.0], np.float32), size=(n, vocab))
    if kind == "constant":
        return np.full((n, vocab), rng.standard_normal(), np.float32)
    if kind == "ramp":  # the best at one end of the row: every slice but one holds none of the top k
        r = np.arange(vocab, dtype=np.float32) * np.float32(rng.choice([-1.0, 1.0]))
        return np.broadcast_to(r, (n, vocab)).copy()
    if kind == "comb":  # period 128 (a block's group stride): the case the bound on gathered entries is for
        return np.broadcast_to((np.arange(vocab) % 128 == 5).astype(np.float32), (n, vocab)).copy()
    if kind == "special":  # -inf, +-0 and NaN among normal values (NaN ranks last, as numpy sorts it)
        x = rng.standard_normal((n, vocab)).astype(np.float32)
        for v in (-np.inf, -0.0, 0.0, np.nan):
            x[rng.random((n, vocab)) < 0.05] = v
        return x
    raise ValueError(kind)


KINDS = ["normal", "ties", "constant", "ramp", "comb", "special"]


# ---- the reference --------------------------------------------------------------------------------------------

@SETTINGS
@given(n=st.integers(1, 5), vocab=st.integers(1, 3000), kfrac=st.floats(0, 1), kind=st.sampled_from(KINDS[:5]),
       seed=st.integers(0, 2**32 - 1))
def test_reference_is_the_stable_sort_and_the_exact_log_softmax(n, vocab, kfrac, kind, seed):
    x = draw_rows(np.random.default_rng(seed), kind, n, vocab)
    k = 1 + round(kfrac * (min(vocab, 128) - 1))
    ids, lp = topk.reference(x, k)
    want_ids, want_lp = brute(x, k)
    assert ids.dtype == np.int32 and lp.dtype == np.float32 and ids.shape == lp.shape == (n, k)
    np.testing.assert_array_equal(ids, want_ids)
    # float64 throughout, then one rounding to fp32: half an ulp of the result (plus float64's ~1e-16 of lse)
    np.testing.assert_allclose(lp, want_lp, rtol=2.0**-24, atol=1e-12)


def test_reference_takes_a_row_and_rejects_a_bad_k():
    ids, lp = topk.reference(np.array([1.0, 3.0, 3.0, 2.0], np.float32), 3)
    assert ids.tolist() == [[1, 2, 3]]
    lse = math.log(sum(math.exp(v) for v in (1, 3, 3, 2)))
    np.testing.assert_allclose(lp, [[3 - lse, 3 - lse, 2 - lse]], rtol=1e-7)
    for k in (0, 5):
        with pytest.raises(ValueError, match="between 1 and"):
            topk.reference(np.zeros(4, np.float32), k)


def test_the_tolerance_is_larger_than_an_fp32_computation_misses_by():
    """An fp32 log-softmax (numpy's, in another summation order than the kernel's) is well inside the bound."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 248320)) * 8).astype(np.float32)
    ids, ref = topk.reference(x, 64)
    m = x.max(axis=1, keepdims=True)
    f32 = np.take_along_axis(x, ids, 1) - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True, dtype=np.float32)))
    tol = topk.logprob_tolerance(x, ref)
    assert (np.abs(f32 - ref) < tol / 4).all() and (tol < 1e-4).all()


# ---- a numpy emulation of templates/topk.cuh ------------------------------------------------------------------

def keys_of(x: np.ndarray) -> np.ndarray:
    """topk_key: fp32 -> an unsigned key in the same order, -0 as +0, NaN as 0."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).copy()
    u[u == 0x80000000] = 0
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    k = np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)
    k[nan] = 0
    return k


def value_of(key: np.ndarray) -> np.ndarray:
    """topk_value."""
    key = np.asarray(key, np.uint32)
    return np.where(key & 0x80000000, key & 0x7FFFFFFF, ~key).astype(np.uint32).view(np.float32)


def composite(key, ident) -> np.ndarray:
    """An entry as one integer ordered as topk_better: the larger key first, then the lower id."""
    return (np.asarray(key, np.uint64) << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - np.asarray(ident, np.uint64))


def split(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (c >> np.uint64(32)).astype(np.uint32), (np.uint64(0xFFFFFFFF) - (c & np.uint64(0xFFFFFFFF))).astype(np.uint32)


class Shape:
    def __init__(self, threads: int, slice_: int, max_k: int):
        self.threads, self.slice, self.max_k = threads, slice_, max_k
        self.per, self.warps, self.e = slice_ // threads, threads // 32, max_k // 32
        self.groups = min(2 * max_k, threads)
        self.group_threads = threads // self.groups
        self.cap = max_k * (slice_ // self.groups)


def block_stage(s: Shape, x_row: np.ndarray, vocab: int, k: int, block: int, gathered: list | None = None):
    """Block `block` of a row: its list of max_k composites (best first, then none) and its (m, s)."""
    base = block * s.slice
    n = min(s.slice, vocab - base)
    key = np.zeros(s.slice, np.uint32)
    key[:n] = keys_of(x_row[base:base + n])
    kt = key.reshape(s.per, s.threads)                  # kt[j, t]: position j * threads + t
    j = np.argmax(kt, axis=0)                           # the first of equal keys: the lowest position
    t = np.arange(s.threads)
    mine = composite(kt[j, t], j * s.threads + t)
    gmax = mine.reshape(s.groups, s.group_threads).max(axis=1)
    ge = (gmax[None, :] >= gmax[:, None]).sum(axis=1)
    assert (ge == k).sum() == 1, "exactly one group maximum has k group maxima >= it"
    L = gmax[ge == k][0]
    every = composite(key, np.arange(s.slice))
    cand = every[every >= L]
    assert k <= cand.size <= s.cap, f"{cand.size} entries >= L, {s.cap} places"
    if gathered is not None:
        gathered.append(cand.size)
    best = np.sort(cand)[::-1][:k]                      # rank = the number of better gathered entries
    bk, bi = split(best)
    lst = np.full(s.max_k, NONE, np.uint64)
    lst[:k] = np.where(bi < n, composite(bk, base + bi.astype(np.uint64)), np.uint64(NONE))
    valid = x_row[base:base + n]
    m = value_of(key.max())
    s_ = np.float32(0) if m == -np.inf else np.exp(valid.astype(np.float64) - m).sum()
    return lst, (m, s_)


def bitonic_sort(v: np.ndarray) -> np.ndarray:
    """topk_bitonic_sort on v [E, 32] (entry i = v[i // 32, i % 32]): in-lane strides, then the shuffles."""
    v = v.copy()
    E = v.shape[0]
    s = E // 2
    while s >= 1:
        for e in range(E):
            if e & s == 0:
                a, b = v[e].copy(), v[e | s].copy()
                v[e], v[e | s] = np.maximum(a, b), np.minimum(a, b)
        s //= 2
    lane = np.arange(32)
    for s in (16, 8, 4, 2, 1):
        o = v[:, lane ^ s]
        take = ((lane & s) == 0)[None, :] == (o > v)
        v = np.where(take, o, v)
    return v


def merge_list(s: Shape, r: np.ndarray, lst: np.ndarray) -> np.ndarray:
    """topk_merge_list: lane l, entry e takes list[max_k - 1 - (32 e + l)] if better, then sorts."""
    a = lst[::-1].reshape(s.e, 32)
    return bitonic_sort(np.maximum(r, a))


def merge_stage(s: Shape, lists: np.ndarray) -> np.ndarray:
    """The last block's top-k of the row's lists [blocks, max_k]: per warp, then pairwise over the warps."""
    B = lists.shape[0]
    r = [lists[w].reshape(s.e, 32).copy() if w < B else np.full((s.e, 32), NONE, np.uint64) for w in range(s.warps)]
    for w in range(s.warps):
        for b in range(w + s.warps, B, s.warps):
            r[w] = merge_list(s, r[w], lists[b])
    step = 1
    while step < s.warps:
        for w in range(0, s.warps, 2 * step):
            if w + step < s.warps:
                r[w] = merge_list(s, r[w], r[w + step].reshape(-1))
        step *= 2
    return r[0].reshape(-1)


def emulate(s: Shape, x: np.ndarray, k: int, order: np.random.Generator | None = None, gathered=None):
    """ids [n, k], logprobs [n, k] as the kernel computes them (the log-sum-exp here in float64), the blocks of
    every row finishing in a random order."""
    n, vocab = x.shape
    B = math.ceil(vocab / s.slice)
    ids, lps = np.empty((n, k), np.int32), np.empty((n, k), np.float32)
    for row in range(n):
        lists = np.empty((B, s.max_k), np.uint64)
        stats = [None] * B
        ticket = 0
        for b in (order.permutation(B) if order is not None else range(B)):
            lists[b], stats[b] = block_stage(s, x[row], vocab, k, b, gathered)
            ticket += 1
            if ticket == B:  # the last block
                M = float(value_of(keys_of(np.array([m for m, _ in stats], np.float32)).max()))  # NaN: key 0
                S = sum(0.0 if m == -np.inf else sb * math.exp(m - M) for m, sb in stats)
                lse = M + math.log(S) if S > 0 else (-math.inf if S == 0 else math.nan)
                top = merge_stage(s, lists)[:k]
                tk, ti = split(top)
                ids[row] = ti.astype(np.int64)
                with np.errstate(invalid="ignore"):
                    lps[row] = value_of(tk).astype(np.float64) - lse
    return ids, lps


def test_key_order_is_the_float_order():
    x = np.array([-np.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, np.inf], np.float32)
    k = keys_of(x)
    assert (np.diff(k.astype(np.int64)[[0, 1, 2, 3, 5, 6, 7, 8, 9]]) > 0).all() and k[4] == k[5]
    assert keys_of(np.array([np.nan, -np.nan], np.float32)).tolist() == [0, 0] and k[0] > 0
    np.testing.assert_array_equal(value_of(k[[0, 1, 2, 3, 5, 6, 7, 8, 9]]), x[[0, 1, 2, 3, 5, 6, 7, 8, 9]])
    assert np.isnan(value_of(np.uint32(0)))


@SETTINGS
@given(tuning=st.sampled_from(TUNINGS), n=st.integers(1, 3), vocab=st.integers(1, 4000), kfrac=st.floats(0, 1),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
def test_emulated_kernel_is_the_stable_sort(tuning, n, vocab, kfrac, kind, seed):
    s = Shape(*tuning)
    rng = np.random.default_rng(seed)
    x = draw_rows(rng, kind, n, vocab)
    k = 1 + round(kfrac * (min(vocab, s.max_k) - 1))
    ids, lp = emulate(s, x, k, order=rng)
    want_ids, want_lp = brute(x, k)
    np.testing.assert_array_equal(ids, want_ids)
    if kind != "special":  # NaN rows have a NaN log-sum-exp, in the kernel as in numpy
        np.testing.assert_allclose(lp, want_lp, rtol=1e-6, atol=1e-6)


def test_emulated_kernel_at_the_real_shape():
    """The default tuning on a 248,320 vocabulary: 31 blocks a row (the last one partial), k = 1 and k = max_k."""
    s = Shape(256, 8192, 64)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 248320)) * 4).astype(np.float32)
    x[1, 248320 - 3] = 100.0  # the best in the last, partial slice
    gathered = []
    for k in (1, 64):
        ids, lp = emulate(s, x, k, order=rng, gathered=gathered)
        want_ids, want_lp = brute(x, k)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(lp, want_lp, rtol=1e-6, atol=1e-6)
    # on random logits the gathered entries are a few per wanted one, far below the bound
    assert max(gathered) < 4 * 64 and s.cap == 4096


@pytest.mark.parametrize("k", [1, 17, 64])
def test_gathered_entries_stay_within_the_bound_on_bad_rows(k):
    s = Shape(256, 8192, 64)
    for kind in ("constant", "comb", "ties", "ramp"):
        gathered = []
        x = draw_rows(np.random.default_rng(1), kind, 1, 3 * 8192 + 5)
        ids, _ = emulate(s, x, k, gathered=gathered)
        np.testing.assert_array_equal(ids, brute(x, k)[0])
        assert max(gathered) <= s.cap
        if kind == "constant":  # the first element of each of the first k groups and the one between them
            assert max(gathered) == s.group_threads * (k - 1) + 1


def test_bitonic_merge_of_two_sorted_lists_keeps_their_top():
    rng = np.random.default_rng(3)
    for e in (1, 2, 4):
        s = Shape(256, 1024, 32 * e)
        for _ in range(50):
            a, b = (np.sort(rng.integers(0, 1000, 32 * e).astype(np.uint64))[::-1] for _ in range(2))
            got = merge_list(s, a.reshape(e, 32), b).reshape(-1)
            np.testing.assert_array_equal(got, np.sort(np.concatenate([a, b]))[::-1][:32 * e])


# ---- the launcher, on host memory through the emulation ---------------------------------------------------------

class EmulatedKernel:
    """A topk_f32 'kernel' on HostArrays: checks the launch's grid and arguments and runs the emulation, block by
    block on the launcher's own workspace (lists, stats, tickets)."""

    def __init__(self, shape: Shape):
        self.s, self.launches = shape, []

    def __call__(self, grid, block, logits, vocab, k, lists, stats, tickets, ids, logprobs, values, stream=None):
        s = self.s
        blocks, n = grid
        assert block == s.threads and blocks == math.ceil(vocab / s.slice)
        assert lists.size >= n * blocks * s.max_k * 2 and stats.size >= n * blocks * 2 and tickets.size >= n
        assert (tickets.a[:n] == 0).all(), "tickets are left at zero"
        x = logits.a.reshape(-1)[:n * vocab].reshape(n, vocab)
        got_ids, got_lp = emulate(s, x, k)
        ids.a.reshape(-1)[:] = got_ids.reshape(-1)
        logprobs.a.reshape(-1)[:] = got_lp.reshape(-1)
        if not isinstance(values, tuple):  # (0, c_void_p): none asked for
            values.a.reshape(-1)[:] = np.take_along_axis(x, got_ids, axis=1).reshape(-1)
        self.launches.append((grid, k))


class EmulatedModule:
    def __init__(self, shape: Shape):
        self.k = EmulatedKernel(shape)

    def kernel(self, name):
        assert name == "topk_f32"
        return self.k


@pytest.fixture
def on_host(monkeypatch):
    for name in ("empty", "zeros", "from_numpy"):
        monkeypatch.setattr(DeviceArray, name, getattr(HostArray, name))


def small_spec(threads=256, slice_=1024, max_k=64):
    spec = load_spec("h200")
    t = dataclasses.replace(spec.tuning.topk, threads=threads, slice=slice_, max_k=max_k)
    return validate(dataclasses.replace(spec, tuning=dataclasses.replace(spec.tuning, topk=t)), "test")


def test_launcher_on_host(on_host):
    spec = small_spec()
    op = topk.TopKKernel(EmulatedModule(Shape(256, 1024, 64)), spec, rows=2, vocab=1000)
    rng = np.random.default_rng(5)
    for n, vocab, k in [(1, 1000, 1), (3, 5000, 64), (2, 1024, 10), (16, 3001, 33)]:  # grows past the reserve
        x = rng.standard_normal((n, vocab)).astype(np.float32)
        ids, lp = op(DeviceArray.from_numpy(x), n, vocab, k)
        assert ids.shape == lp.shape == (n, k) and ids.dtype == np.int32 and lp.dtype == np.float32
        ref_ids, ref_lp = topk.reference(x, k)
        np.testing.assert_array_equal(ids.numpy(), ref_ids)
        np.testing.assert_allclose(lp.numpy(), ref_lp, atol=topk.logprob_tolerance(x, ref_lp).max())
        top = topk.device_topk(op, DeviceArray.from_numpy(x), n, vocab, k, None)
        assert isinstance(top, TopK) and top.ids.dtype == np.int64
        np.testing.assert_array_equal(top.ids, ref_ids)
        ids, lp, values = op.best(DeviceArray.from_numpy(x), n, vocab, k)  # with the logits themselves
        np.testing.assert_array_equal(ids.numpy(), ref_ids)
        np.testing.assert_array_equal(values.numpy(), np.take_along_axis(x, ref_ids, axis=1))
    # the caller's own outputs, and k above max_k clamped by device_topk (DDTree reads K from the TopK's width)
    x = rng.standard_normal((2, 3000)).astype(np.float32)
    own_ids, own_lp = HostArray.empty((2, 5), np.int32), HostArray.empty((2, 5), np.float32)
    got = op(DeviceArray.from_numpy(x), 2, 3000, 5, ids=own_ids, logprobs=own_lp)
    assert got[0] is own_ids and got[1] is own_lp
    np.testing.assert_array_equal(own_ids.numpy(), topk.reference(x, 5)[0])
    top = topk.device_topk(op, DeviceArray.from_numpy(x), 2, 3000, 100, None)
    assert top.ids.shape == (2, 64)
    tree = build_tree(top, 100, root=7)  # a DDTree from it: at most 64 tokens a depth
    assert len(tree.tokens) == 101 and set(tree.tokens[1:]) <= set(top.ids.reshape(-1).tolist())


def test_launcher_rejects_bad_calls(on_host):
    op = topk.TopKKernel(EmulatedModule(Shape(256, 1024, 64)), small_spec(), rows=1, vocab=100)
    x = DeviceArray.from_numpy(np.zeros((2, 100), np.float32))
    for n, vocab, k, match in [(2, 100, 0, "between 1"), (2, 100, 65, "max_k"), (1, 10, 11, "vocab"),
                               (3, 100, 1, "do not hold"), (0, 100, 1, "at least one")]:
        with pytest.raises(ValueError, match=match):
            op(x, n, vocab, k)
    with pytest.raises(ValueError, match="expected 2"):
        op(x, 1, 100, 2, ids=HostArray.empty(3, np.int32))
    with pytest.raises(ValueError, match="values .* expected 2"):
        op(x, 1, 100, 2, values=HostArray.empty(3, np.float32))
    with pytest.raises(ValueError, match="do not hold"):
        op(DeviceArray.from_numpy(np.zeros(200, np.float64)), 1, 100, 1)


# ---- spec and builds ------------------------------------------------------------------------------------------

def test_the_family_is_registered_and_a_spec_without_a_topk_section_gets_the_defaults(tmp_path):
    from lucegen.spec import TopKTuning
    assert topk in FAMILIES
    data = yaml.safe_load((SPECS_DIR / "h200.yaml").read_text())
    data["tuning"].pop("topk", None)
    p = tmp_path / "plain.yaml"
    p.write_text(yaml.safe_dump(data))
    assert load_spec(p).tuning.topk == TopKTuning() == TopKTuning(threads=256, slice=8192, max_k=64)


@pytest.mark.parametrize("topk_tuning, key, reason", [
    ({"threads": 384}, "tuning.topk.threads", "power of two"),
    ({"threads": 32}, "tuning.topk.threads", "power of two"),
    ({"max_k": 48}, "tuning.topk.max_k", "32, 64 or 128"),
    ({"threads": 64, "slice": 4096, "max_k": 128}, "tuning.topk.max_k", "at most threads"),
    ({"slice": 1000}, "tuning.topk.slice", "times threads"),
    ({"slice": 256 * 65}, "tuning.topk.slice", "times threads"),
    ({"slice": 16384}, "tuning.topk.slice", "static shared memory"),
    ({"width": 3}, "tuning.topk.width", "unknown key"),
])
def test_bad_topk_tuning_names_the_key(tmp_path, topk_tuning, key, reason):
    data = yaml.safe_load((SPECS_DIR / "h200.yaml").read_text())
    data["tuning"]["topk"] = topk_tuning
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert f": {key}:" in str(e.value) and reason in str(e.value), str(e.value)


def test_shared_memory_formula_matches_the_build(tmp_path):
    from lucegen.spec import topk_shared_bytes
    for th, sl, mk in [(256, 8192, 64), (256, 8192, 128), (64, 1024, 32)]:
        spec = small_spec(th, sl, mk)
        (kernel,) = build(spec, tiny_config(), topk.units(spec, tiny_config()), root=tmp_path).kernels
        assert kernel.static_smem == topk_shared_bytes(th, sl, mk)


@pytest.mark.parametrize("spec_name", list_specs())
def test_topk_compiles_for_every_spec_and_max_k(tmp_path, spec_name):
    base = load_spec(spec_name)
    assert [u.name for u in all_units(base, tiny_config()) if u.name == "topk"] == ["topk"]
    for max_k in (32, 64, 128):
        t = dataclasses.replace(base.tuning.topk, max_k=max_k)
        spec = validate(dataclasses.replace(base, tuning=dataclasses.replace(base.tuning, topk=t)), spec_name)
        result = build(spec, tiny_config(), topk.units(spec, tiny_config()), root=tmp_path)
        (kernel,) = result.kernels
        assert kernel.name == "topk_f32" and kernel.coresident_blocks >= 1
        assert kernel.spill_stores == 0 and kernel.spill_loads == 0, f"spills on {spec_name} at max_k {max_k}"
        src = result.units[0].source_path.read_text()
        assert f"topk_f32<256, 8192, {max_k}>" in src
