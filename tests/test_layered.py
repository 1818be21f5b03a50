"""The layer-by-layer step's host side (no GPU): its kernel units (row kernels, tree kernels in both value-head
orders, quantized projections) render and compile for every spec on the 27B and on a scaled-down config with the
27B's head ratios, the value-head reordering of an HF checkpoint's small tensors
matches llama.cpp's (gguf_file.convert), fused projections, random quantized rows, and a GGUF file read as stored."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lucegen.codegen.build import build
from lucegen.engine.layered_weights import GGUFSource, Source, fuse, random_rows, tiled
from lucegen.kernels import layered, qgemv, tree
from lucegen.model.checkpoint import make_checkpoint
from lucegen.model.config import load_config, tiny_config
from lucegen.model.gguf_file import convert, gguf_name, load_gguf
from lucegen.model.quants import GGMLType, dequantize, quantize
from lucegen.model.weights import weight_shapes
from lucegen.spec import list_specs, load_spec

RATIO3_Q = tiny_config(name="ratio3q", hidden_size=256, num_hidden_layers=8, intermediate_size=512,
                       num_attention_heads=6, num_key_value_heads=1, head_dim=128, linear_num_key_heads=2,
                       linear_num_value_heads=6, linear_key_head_dim=128, linear_value_head_dim=128)


@pytest.mark.parametrize("spec_name", list_specs())
@pytest.mark.parametrize("model", ["qwen3.5-27b", "ratio3q"])
def test_the_step_kernels_compile_for_every_spec(tmp_path, spec_name, model):
    """The layered units (a GGUF's Q4_K embedding, an HF checkpoint's bf16 one), the mixers (the tree kernels in
    llama.cpp's tiled value-head order and HF's grouped one) and the qgemv units of the model's Q4_K_M mix."""
    spec = load_spec(spec_name)
    cfg = load_config(model) if model != "ratio3q" else RATIO3_Q
    assert layered.shape_problem(spec, cfg) is None and tree.shape_problem(cfg, spec) is None
    mixers = tree.units(spec, cfg)
    assert [(u.name, u.params["tiled"]) for u in mixers] == [("tree", False), ("tree_tiled", True)]
    units = [*layered.units(spec, cfg, ["q4_k", "bf16"]), *mixers, *qgemv.units(spec, cfg, qgemv.mix_pairs(cfg))]
    result = build(spec, cfg, units, root=tmp_path)
    assert {k.name for k in result.kernels} == {k.name for u in units for k in u.kernels}
    for k in result.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"
        assert k.coresident_blocks >= 1, f"{k.name} cannot run on {spec_name}"


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_tiled_is_llama_cpps_value_head_order(seed):
    """tiled() of every DeltaNet tensor equals gguf_file.convert's HF -> GGUF conversion up to the conventions
    convert changes besides the order (A_log stored as -exp, conv1d squeezed)."""
    cfg = RATIO3_Q
    rng = np.random.default_rng(seed)
    for name, shape in weight_shapes(cfg).items():
        if not name.startswith("layers.0."):
            continue
        x = rng.standard_normal(shape).astype(np.float32)
        got, gguf = tiled(cfg, name, x), convert(cfg, name, x, to_gguf=True)
        if name.endswith("A_log"):
            np.testing.assert_allclose(-np.exp(got.astype(np.float64)), gguf, rtol=1e-6)
        elif "norm" in name and "linear_attn" not in name:
            np.testing.assert_array_equal(got, x)  # not reordered; convert stores 1 + w
        else:
            np.testing.assert_array_equal(got, gguf)


def test_fuse_joins_runs_of_one_format():
    a, b, c = (np.full((n, 144), v, np.uint8) for n, v in ((3, 1), (2, 2), (4, 3)))
    q6 = np.full((5, 210), 9, np.uint8)
    runs, n, k = fuse([("q4_k", a), ("q4_k", b), ("q6_k", q6), ("q4_k", c)])
    assert (n, k) == (14, 256)
    assert [(f, r.shape[0], col) for f, r, col in runs] == [("q4_k", 5, 0), ("q6_k", 5, 5), ("q4_k", 4, 10)]
    np.testing.assert_array_equal(runs[0][1], np.concatenate([a, b]))
    with pytest.raises(ValueError, match="row widths"):
        fuse([("q4_k", a), ("q8_0", np.zeros((1, 34), np.uint8))])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "bf16"])
def test_random_rows_decode_to_finite_values(fmt):
    rows = random_rows(fmt, 40, 512, np.random.default_rng(0), {})
    f = qgemv.fmt_of(fmt)
    assert rows.shape == (40, f.gguf_row_bytes(512)) and rows.dtype == np.uint8
    w = dequantize(rows, f.ggml)
    assert np.isfinite(w).all() and w.std() > 0


def test_a_gguf_is_read_as_stored_and_its_small_tensors_tiled(tmp_path):
    cfg = tiny_config(name="r3", linear_num_key_heads=2, linear_num_value_heads=6, hidden_size=256,
                      intermediate_size=512, linear_key_head_dim=16, linear_value_head_dim=16)
    ck = load_gguf(make_checkpoint(tmp_path, cfg, seed=1, formats=("gguf",), progress=False)["gguf"])
    src = GGUFSource(ck)
    for name in ("layers.0.linear_attn.in_proj_qkv.weight", "layers.3.mlp.down_proj.weight", "lm_head.weight"):
        fmt, rows = src.matrix(name)
        raw = ck.raw(gguf_name(name))
        assert fmt == qgemv.fmt_of(raw.type).name
        np.testing.assert_array_equal(rows, raw.data)
    for name in ("layers.0.linear_attn.A_log", "layers.0.linear_attn.dt_bias", "layers.0.linear_attn.conv1d.weight"):
        np.testing.assert_array_equal(src.vector(name), tiled(cfg, name, np.asarray(ck[name], np.float32)))
    np.testing.assert_array_equal(src.vector("layers.0.input_layernorm.weight"), ck["layers.0.input_layernorm.weight"])


def test_a_float_matrix_in_a_gguf_is_a_clear_error(tmp_path):
    cfg = tiny_config(name="f16", hidden_size=48, intermediate_size=96)  # rows of 48: F16 fallback
    ck = load_gguf(make_checkpoint(tmp_path, cfg, seed=1, formats=("gguf",), progress=False)["gguf"])
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight is F16.*quantized or bf16"):
        GGUFSource(ck).matrix("layers.0.linear_attn.in_proj_qkv.weight")


def test_an_hf_checkpoint_is_bf16_rows_in_hf_order():
    rng = np.random.default_rng(0)
    w = {"m": rng.standard_normal((4, 64)).astype(np.float32), "layers.0.linear_attn.dt_bias": np.arange(4.0)}
    src = Source(w, tiny_config())
    fmt, rows = src.matrix("m")
    assert fmt == "bf16"
    np.testing.assert_array_equal(rows, quantize(w["m"], GGMLType.BF16))
    np.testing.assert_array_equal(src.vector("layers.0.linear_attn.dt_bias"), np.arange(4.0, dtype=np.float32))


def test_the_bench_limit_counts_kv_rows_and_deltanet_states():
    from lucegen.bench.decode_gguf import state_bytes_per_token
    cfg = load_config("qwen3.5-27b")
    assert state_bytes_per_token(cfg, 0) == 48 * 48 * 128 * 128 * 4 * 2  # 48 DeltaNet layers' states, read + written
    assert state_bytes_per_token(cfg, 1000) - state_bytes_per_token(cfg, 0) == 16 * 1000 * 4 * 256 * 2 * 2
    # Q8_0 rows: 8 blocks of 34 bytes a head of 256
    assert state_bytes_per_token(cfg, 1000, "q8_0") - state_bytes_per_token(cfg, 0) == 16 * 1000 * 4 * 8 * 34 * 2


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_a_deltanet_layer_in_gguf_order_with_tiled_key_heads_is_the_hf_layer(seed):
    """What the kernels compute under LIN_TILED (value head j reads key head j % Hk: mk_deltanet.cuh
    deltanet_key_head), from a GGUF's matrices (llama.cpp's order) and the small tensors as GGUFSource gives them
    (tiled), equals the reference's DeltaNet layer on HF weights: the order convention is consistent end to end."""
    from lucegen.reference.deltanet import causal_conv1d, chunk_gated_delta_rule, gated_deltanet
    from lucegen.reference.ops import rms_norm_gated, sigmoid, silu, softplus
    from lucegen.reference.weights import random_weights
    from lucegen.reference.compare import relative_error
    cfg = tiny_config(linear_num_key_heads=2, linear_num_value_heads=6)
    pre = "layers.0.linear_attn."
    w = random_weights(cfg, seed % 1000)
    rng = np.random.default_rng(seed)
    T, Hk, Hv, dk, dv = 9, 2, 6, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    expected, _, _ = gated_deltanet({n[len(pre):]: a for n, a in w.items() if n.startswith(pre)}, cfg, x)

    mat = lambda n: convert(cfg, pre + n, w[pre + n], to_gguf=True)  # as the GGUF file holds it
    vec = lambda n: tiled(cfg, pre + n, np.asarray(w[pre + n], np.float32))  # as GGUFSource gives it
    conv_state = np.zeros((cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), np.float32)
    mixed, _ = causal_conv1d(x @ mat("in_proj_qkv.weight").T, vec("conv1d.weight"), conv_state)
    q, k, v = np.split(silu(mixed), [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    q = np.tile(q.reshape(T, Hk, dk), (1, Hv // Hk, 1))  # value head j <- key head j % Hk
    k = np.tile(k.reshape(T, Hk, dk), (1, Hv // Hk, 1))
    beta = sigmoid(x @ mat("in_proj_b.weight").T)
    g = -np.exp(vec("A_log")) * softplus(x @ mat("in_proj_a.weight").T + vec("dt_bias"))
    o, _ = chunk_gated_delta_rule(q, k, v.reshape(T, Hv, dv), g, beta, None)
    o = rms_norm_gated(o, (x @ mat("in_proj_z.weight").T).reshape(T, Hv, dv), vec("norm.weight"), cfg.rms_norm_eps)
    got = o.reshape(T, -1) @ mat("out_proj.weight").T
    assert relative_error(got, expected) < 1e-5
