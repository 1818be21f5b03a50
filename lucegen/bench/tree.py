"""Tree verify and commit kernels, per layer: time per call on the real shapes for N = 1 (the decode step), 16 and
the spec's budget + 1 nodes (chains and bushy trees), against the time the bytes they must move take at the read
ceiling measured in the same run.

Bytes per call (the floor): DeltaNet verify reads the committed state once plus the nodes' in-projection rows and
writes their outputs; the commit (a path of L nodes) reads and writes the state; attention reads the committed
context's K/V once (bf16) plus the nodes' rows. Inputs are random; the state (1 MiB on Qwen3.5-0.8B) may sit in L2
across repeats, as one layer's state does between the verify and the commit of a round.

Records: tree_<kernel>_us with `limit` the floor in us, model "<model> N=<n> <shape>"; the decode step (the
1-node tree through decode_deltanet / decode_attention) as tree_decode_<kind>_us, model "<model> N=1".
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..codegen.build import build
from ..kernels import tree
from ..model.config import load_config
from ..runtime import DeviceArray, Stream, device_info
from ..spec import spec_for_current_device
from .gemv import measure_read_gbs
from .results import Recorder
from .timing import median_ms

MODELS = ("qwen3.5-0.8b", "qwen3.5-27b")
CONTEXT = 4096  # committed positions before the tree
BF16 = ml_dtypes.bfloat16


def _trees(max_nodes: int, rng) -> dict[str, list[int]]:
    out = {}
    for n in sorted({16, max_nodes}):
        out[f"N={n} chain"] = [-1] + list(range(n - 1))
        out[f"N={n} bushy"] = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, n)]
    return out


def run(recorder: Recorder | None = None) -> None:
    spec = spec_for_current_device()
    stream = Stream()
    read_gbs = measure_read_gbs(spec, stream)
    rec = recorder or Recorder(gpu=device_info().name)
    rec.record("read_gbs", "2 GiB streaming read", read_gbs, "GB/s", spec.chip.bandwidth_gbs)
    floor_us = lambda nbytes: nbytes / (read_gbs * 1e9) * 1e6
    rng = np.random.default_rng(0)
    for name in MODELS:
        cfg = load_config(name)
        units = tree.units(spec, cfg, [False])
        if not units:
            print(f"{name}: skipped ({tree.shape_problem(cfg, spec)})")
            continue
        k = tree.TreeKernels(build(spec, cfg, units).module(tree.unit_name(False)), cfg, spec)
        K, C, Hv = cfg.linear_conv_kernel_dim, cfg.conv_dim, cfg.linear_num_value_heads
        n_max = k.max_nodes
        rows_dn, rows_att = C + cfg.value_dim + 2 * Hv, cfg.q_proj_rows + 2 * cfg.kv_dim
        state_shape = (Hv, cfg.linear_value_head_dim, cfg.linear_key_head_dim)
        f32 = lambda shape: DeviceArray.from_numpy(rng.standard_normal(shape, dtype=np.float32) * 0.1)
        mixed, qkv = f32((n_max, rows_dn)), f32((n_max, rows_att))
        conv_w, a_log, dt_bias, ring, state = f32((C, K)), f32(Hv), f32(Hv), f32((K, C)), f32(state_shape)
        q_norm, k_norm = f32(cfg.head_dim), f32(cfg.head_dim)
        out_dn = DeviceArray.empty((n_max, cfg.value_dim), np.float32)
        out_att = DeviceArray.empty((n_max, cfg.num_attention_heads * cfg.head_dim), np.float32)
        kv_shape = (CONTEXT + n_max, cfg.num_key_value_heads, cfg.head_dim)
        bf16 = lambda shape: DeviceArray.from_numpy(rng.standard_normal(shape, dtype=np.float32).astype(BF16))
        keys, values = bf16(kv_shape), bf16(kv_shape)
        state_bytes, row_kv = 4 * int(np.prod(state_shape)), 2 * cfg.kv_dim
        decode = {  # the decode step: the 1-node tree, committed (one launch per layer kind)
            "decode_deltanet": (lambda s: k.decode_deltanet(mixed, conv_w, a_log, dt_bias, ring, state, out_dn,
                                                            CONTEXT, stream=s),
                                2 * state_bytes + 4 * (rows_dn + cfg.value_dim)),
            "decode_attention": (lambda s: k.decode_attention(qkv, q_norm, k_norm, keys, values, out_att, CONTEXT,
                                                              stream=s),
                                 (CONTEXT + 1) * 2 * row_kv + 4 * (rows_att + cfg.num_attention_heads * cfg.head_dim)),
        }
        for kernel, (fn, nbytes) in decode.items():
            us = median_ms(fn, stream, warmup_s=0.1) * 1e3
            rec.record(f"tree_{kernel}_us", f"{name} N=1", us, "us", floor_us(nbytes), nodes=1, context=CONTEXT)
        for label, parents in _trees(n_max, rng).items():
            n, t = len(parents), k.tree(parents)
            path = tree_path(parents, min(n, 8))
            length = k.set_path(t, path)
            model = f"{name} {label}"
            calls = {
                "deltanet_verify": (lambda s: k.deltanet(t, mixed, conv_w, a_log, dt_bias, ring, state, out_dn,
                                                         CONTEXT, stream=s),
                                    state_bytes + n * 4 * (rows_dn + cfg.value_dim)),
                "deltanet_commit": (lambda s: k.deltanet_commit(t, length, mixed, conv_w, a_log, dt_bias, ring,
                                                                state, out_dn, CONTEXT, stream=s),
                                    2 * state_bytes + length * 4 * (rows_dn + cfg.value_dim)),
                "attention": (lambda s: (k.attention_kv(t, qkv, k_norm, keys, values, CONTEXT, stream=s),
                                         k.attention(t, qkv, q_norm, keys, values, out_att, CONTEXT, stream=s)),
                              (CONTEXT + n) * 2 * row_kv + n * 4 * (rows_att + cfg.num_attention_heads * cfg.head_dim)),
                "kv_commit": (lambda s: k.kv_commit(length, keys, values, CONTEXT, stream=s), 2 * length * 2 * row_kv),
            }
            for kernel, (fn, nbytes) in calls.items():
                us = median_ms(fn, stream, warmup_s=0.1) * 1e3
                rec.record(f"tree_{kernel}_us", model, us, "us", floor_us(nbytes), nodes=n, path_nodes=length,
                           context=CONTEXT)
        for a in (mixed, qkv, conv_w, a_log, dt_bias, ring, state, q_norm, k_norm, out_dn, out_att, keys, values):
            a.free()
        k.free()


def tree_path(parents: list[int], length: int) -> list[int]:
    """A root-first path of up to `length` nodes: each step to the node's first child."""
    path = [0]
    while len(path) < length:
        kids = [c for c in range(1, len(parents)) if parents[c] == path[-1]]
        if not kids:
            break
        path.append(kids[0])
    return path
