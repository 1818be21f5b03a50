"""The prefill driver on host memory: device arrays backed by numpy byte buffers and every kernel replaced by its
family's numpy reference, applied to exactly the arguments the kernel would get. Buffers keep the dtypes the
driver gives them (bf16 activations, KV), so this is also a numpy emulation of the GPU prefill's rounding points.
Used by tests/test_prefill_host.py (the driver without a GPU) and tests/gpu/test_prefill_gpu.py (the bf16 error a
correct kernel set has on a given case), which also share the state comparison below."""
from __future__ import annotations

import contextlib
import math
import re
from types import SimpleNamespace

import ml_dtypes
import numpy as np

import lucegen.engine.prefill as prefill_mod
from lucegen.kernels import attention, conv1d, gdn, gemm, rows
from lucegen.reference import State, relative_error
from lucegen.runtime.memory import DeviceArray

BF16 = ml_dtypes.bfloat16


class HostArray(DeviceArray):
    """A DeviceArray over a numpy byte buffer (views share it)."""

    def __init__(self, buf: np.ndarray, offset: int, shape, dtype):
        self.buf, self.offset = buf, offset
        super().__init__(id(buf) + offset, shape, dtype, owner=False)

    @property
    def a(self) -> np.ndarray:
        return self.buf[self.offset:self.offset + self.nbytes].view(self.dtype).reshape(self.shape)

    @classmethod
    def empty(cls, shape, dtype):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return cls(np.full(max(1, math.prod(shape) * np.dtype(dtype).itemsize), 0xFF, np.uint8), 0, shape, dtype)

    @classmethod
    def zeros(cls, shape, dtype):
        a = cls.empty(shape, dtype)
        a.buf[:] = 0
        return a

    @classmethod
    def from_numpy(cls, host):
        a = cls.empty(host.shape, host.dtype)
        a.copy_from(host)
        return a

    def view(self, shape, dtype=None, offset_bytes=0):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = np.dtype(dtype or self.dtype)
        assert offset_bytes + math.prod(shape) * dtype.itemsize <= self.nbytes, "view past the allocation"
        return HostArray(self.buf, self.offset + offset_bytes, shape, dtype)

    def copy_from(self, host, stream=None):
        host = np.ascontiguousarray(host)
        assert host.dtype == self.dtype and host.size == self.size
        self.a[...] = host.reshape(self.shape)

    def copy_to(self, other):
        assert other.nbytes == self.nbytes
        other.buf[other.offset:other.offset + other.nbytes] = self.buf[self.offset:self.offset + self.nbytes]

    def numpy(self):
        return self.a.copy()

    def free(self):
        pass

    def __del__(self):
        pass


def rows_of(arr: HostArray, n: int, width: int) -> np.ndarray:
    """The first n rows of width `width` of a (flat-indexed) buffer."""
    return arr.a.reshape(-1)[:n * width].reshape(n, width)


def store(dst: np.ndarray, value) -> None:
    dst[...] = np.asarray(value, np.float32).astype(dst.dtype).reshape(dst.shape)


# ---- the GEMM's split-K, block by block ------------------------------------------------------------------------

def gemm_kernel_config(name: str) -> tuple[int, int, str]:
    """(BM, BN, epilogue) of a GEMM kernel's name, gemm_[wg]<BM>x<BN>_<epilogue>."""
    shape, epilogue = re.fullmatch(r"gemm_(?:wg)?(\d+x\d+)_(\w+)", name).groups()
    bm, bn = map(int, shape.split("x"))
    return bm, bn, epilogue


def gemm_tiles(m: int, n: int, bm: int, bn: int) -> int:
    return math.ceil(m / bm) * math.ceil(n / bn)


def split_add(x, w, y, bm: int, bn: int, splits: int, partials: np.ndarray, counters: np.ndarray,
              blocks) -> None:
    """The split-K `add` kernel (gemm.cuh's split_k_add) block by block, the blocks b = split * tiles + tile running
    one after another in the order `blocks`: each stores its partial tile (the fp32 sum over its slice of K) in its
    slot of `partials` and counts itself in on its tile's counter; the one that brings the count to `splits` zeroes
    the counter and adds the tile's slots into y in slice order. y (fp32) is updated in place; x [M, K], w [N, K]."""
    (M, K), N = x.shape, w.shape[0]
    tiles_n = math.ceil(N / bn)
    tiles = gemm_tiles(M, N, bm, bn)
    part = [gemm.product(x[:, k0:k1], w[:, k0:k1]) for k0, k1 in gemm.slices(K, splits)]  # gemm.reference's
    slots = partials.reshape(-1)[:splits * tiles * bm * bn].reshape(splits, tiles, bm, bn)
    for b in blocks:
        s, t = divmod(int(b), tiles)
        rows, cols = slice(t // tiles_n * bm, t // tiles_n * bm + bm), slice(t % tiles_n * bn, t % tiles_n * bn + bn)
        tile = part[s][rows, cols]
        slots[s, t] = 0  # rows and columns past M and N: the kernel's zero-filled loads give zeros there
        slots[s, t, :tile.shape[0], :tile.shape[1]] = tile
        counters[t] += 1
        if counters[t] == splits:
            counters[t] = 0
            total = slots[0, t]
            for q in range(1, splits):
                total = total + slots[q, t]
            y[rows, cols] += total[:tile.shape[0], :tile.shape[1]]


def order_sensitive_gemm(m: int, n: int, k: int, splits: int, seed: int):
    """bf16 x [m, k], w [n, k] and fp32 y0 [m, n] whose split-K partials (K cut into `splits` slices, gemm.slices) are
    exact in fp32 whatever order a slice sums its products in (small integers, one power-of-two scale per slice), but
    of scales far enough apart that summing the partials in another order rounds differently: the kernel's result
    is then gemm.reference(..., splits) bit for bit, and only if it sums the slices in slice order."""
    rng = np.random.default_rng(seed)
    scale = np.ones(k, np.float32)
    for s, (k0, k1) in enumerate(gemm.slices(k, splits)):
        scale[k0:k1] = 2.0 ** (0, -21, -9, -30, 5, -14, -3, -25)[s % 8]
    x = (rng.integers(-4, 5, (m, k)) * scale).astype(np.float32).astype(BF16)
    w = rng.integers(-4, 5, (n, k)).astype(np.float32).astype(BF16)
    return x, w, (8 * rng.standard_normal((m, n))).astype(np.float32)


def run_gemm(name: str, grid, args, seed: int) -> None:
    """A launch of a kernels/gemm.py kernel (its arrays, not tensor maps: the mma method) by gemm.reference; a split-K
    `add` block by block in an order drawn from seed, as a GPU may finish them."""
    X, W, Y, M, N, K, *workspace = args
    bm, bn, epilogue = gemm_kernel_config(name)
    y = rows_of(Y, M, N // 2 if epilogue == "silu" else N)
    x, w = rows_of(X, M, K), W.a.reshape(N, K)
    if epilogue == gemm.SPLIT_ADD:
        blocks = np.random.default_rng(seed).permutation(grid[0])
        split_add(x, w, y, bm, bn, grid[0] // gemm_tiles(M, N, bm, bn), *(a.a for a in workspace), blocks)
    else:
        store(y, gemm.reference(x, w, epilogue, y.astype(np.float32)))


class HostKernel:
    """A kernel by name; its launch runs the family's numpy reference on the launch's arguments."""

    def __init__(self, module: HostModule, name: str):
        self.module, self.name = module, name

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        pass

    def __call__(self, grid, block, *args, smem=0, stream=None, cluster=1):
        c, name = self.module.cfg, self.name
        grid = (grid,) if isinstance(grid, int) else grid
        if name.startswith("gemm_"):
            run_gemm(name, grid, args, self.module.launches)
            self.module.launches += 1
        elif name.startswith("embed_h"):
            ids, table, x = args
            store(rows_of(x, grid[0], c.hidden_size), rows.embed_reference(table.a, ids.a[:grid[0]]))
        elif name.startswith("rmsnorm_f32_h"):
            x, w, y, eps = args
            H = c.hidden_size
            store(rows_of(y, grid[0], H), rows.rmsnorm_reference(rows_of(x, grid[0], H), w.a, eps))
        elif name == "gdn_chunk_prep":  # the front here; the scan below computes the whole rule from its outputs
            mixed, conv_w, a_log, dt_bias, ring, qkv, _, _, _, T, start = args
            ref_qkv, g, beta, new_ring = conv1d.reference(c, mixed.a[:T], conv_w.a, a_log.a, dt_bias.a, ring.a.copy(),
                                                          start)
            store(qkv.a[:T], ref_qkv)
            self.module.front = g, beta, new_ring
        elif name == "gdn_chunk_scan":  # and the new conv state, as the kernel's first slices write it
            qkv, _, _, _, state, o, _, ring, T, start = args
            g, beta, new_ring = self.module.front
            ref_o, ref_s = gdn.reference(c, qkv.a[:T], g, beta, state.a.copy() if start > 0 else None)
            store(o.a[:T], ref_o)
            store(state.a, ref_s)
            store(ring.a, new_ring)
        elif name == "gdn_gated_norm":
            o, mixed, w, y, eps, T = args
            hv, dv, C = c.linear_num_value_heads, c.linear_value_head_dim, c.conv_dim
            z = mixed.a[:T, C:C + c.value_dim].reshape(T, hv, dv)
            store(rows_of(y, T, hv * dv), gdn.gated_norm_reference(o.a[:T], z, w.a, eps))
        elif name == "attention_prep_tokens":
            qkv, q_norm, k_norm, _, q, k_cache, v_cache, eps, start = args
            T = grid[0]
            rq, rk, rv = attention.prep_reference(c, qkv.a[:T], q_norm.a, k_norm.a, start)
            store(q.a[:T], rq)
            store(k_cache.a[start:start + T], rk)
            store(v_cache.a[start:start + T], rv)
        elif name in ("attention_prefill_causal", "attention_prefill_split"):
            q, k_cache, v_cache, qkv, out, T, start = args
            tiles = math.ceil(T / attention.BM)  # a block per query tile, or a cluster of them sharing its keys
            assert grid[0] % tiles == 0 and (name == "attention_prefill_split") == (grid[0] > tiles)
            _, gate, _, _ = attention.split_qkv(c, qkv.a[:T])
            ref = attention.reference(c, q.a[:T], k_cache.a[:start + T], v_cache.a[:start + T], gate)
            store(rows_of(out, T, c.num_attention_heads * c.head_dim), ref)
        elif name.startswith("gemv_bf16_k"):
            W, x, y, N = args
            store(y.a[:N], W.a.reshape(N, -1).astype(np.float32) @ x.a.astype(np.float32))
        else:
            raise KeyError(f"no host stand-in for kernel {name}")


class HostModule:
    def __init__(self, cfg):
        self.cfg, self.front, self.launches = cfg, None, 0

    def kernel(self, name: str) -> HostKernel:
        return HostKernel(self, name)


class HostStream:
    """A stream on the host (the prefill's, the layered step's, the draft's): every launch has run when it returns."""

    def __init__(self, programmatic: bool = False):
        self.programmatic = programmatic

    def synchronize(self) -> None:
        pass

    def destroy(self) -> None:
        pass


@contextlib.contextmanager
def on_host(monkeypatch):
    """Inside: DeviceArray allocations are HostArrays and the prefill's build returns host modules."""
    with monkeypatch.context() as m:
        for name in ("empty", "zeros", "from_numpy"):
            m.setattr(DeviceArray, name, getattr(HostArray, name))

        def fake_build(spec, cfg, unit_list, root=None):
            return SimpleNamespace(units=[SimpleNamespace(unit=u) for u in unit_list],
                                   module=lambda name: HostModule(cfg))
        m.setattr(prefill_mod, "build", fake_build)
        m.setattr(prefill_mod, "Stream", HostStream)
        yield


def state_errors(dev_state, ref: State) -> dict[str, float]:
    """The relative error of every state table of every layer of a DeviceState against the reference's State."""
    got = dev_state.to_reference()
    assert got.position == ref.position
    out = {}
    for table in ("conv", "recurrent", "keys", "values"):
        mine, theirs = getattr(got, table), getattr(ref, table)
        assert mine.keys() == theirs.keys(), table
        for i in theirs:
            assert np.isfinite(mine[i]).all(), f"non-finite {table} of layer {i} (unwritten or NaN)"
            out[f"{table} of layer {i}"] = relative_error(mine[i], theirs[i])
    return out


def assert_state_close(dev_state, ref: State, rtol: float) -> None:
    for what, error in state_errors(dev_state, ref).items():
        assert error < rtol, f"{what}: {error:.2e}"
