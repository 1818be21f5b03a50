"""The tree verify kernels without a GPU: the DeltaNet schedule restores every node's parent state within
floor(log2 N) stack levels, the numpy references equal the reference model's per-node decode steps (and the numpy
tree_forward's node states), commits equal sequential decoding, and the unit compiles for every spec."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lucegen.codegen.build import build
from lucegen.kernels import all_units, tree
from lucegen.kernels.conv1d import ring_to_state, state_to_ring
from lucegen.model.config import load_config, tiny_config
from lucegen.reference import State, decode_step, prefill, random_weights, relative_error
from lucegen.reference.attention import gated_attention
from lucegen.reference.deltanet import gated_deltanet
from lucegen.reference.model import sub_weights
from lucegen.reference.ops import rms_norm, rms_norm_gated
from lucegen.spec import list_specs, load_spec
from lucegen.spec_decode import tree_forward

CFG = tiny_config()
# tiny (Hv = 2 Hk, 2 query heads per kv head), and 3 value heads per key head with one kv head (as 27B)
RATIO3 = tiny_config(name="ratio3", hidden_size=96, num_hidden_layers=4, intermediate_size=192, num_attention_heads=6,
                     num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
                     linear_key_head_dim=32, linear_value_head_dim=32)
MODELS = {cfg.name: (cfg, random_weights(cfg, seed=3)) for cfg in (CFG, RATIO3)}


@st.composite
def trees(draw, max_nodes: int = 65):
    """parents of a topologically ordered tree: chains, bushes and everything between."""
    n = draw(st.integers(1, max_nodes))
    kind = draw(st.sampled_from(["chain", "star", "random"]))
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [draw(st.integers(max(0, i - draw(st.integers(1, i))), i - 1)) for i in range(1, n)]


def chain(n):
    return [-1] + list(range(n - 1))


# ---- schedule ---------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(trees())
def test_schedule_restores_each_parent_state_within_log2_levels(parents):
    codes, used = tree.schedule(parents)
    regs, stack, seen = -1, {}, []  # regs: the node whose state the registers hold (-1: the committed state)
    for code in codes.tolist():
        node, restore, save = code & 0xFFFF, (code >> 16 & 0xFF) - 1, (code >> 24 & 0x7F) - 1
        held = regs if restore < 0 else stack[restore]
        assert held == parents[node], f"node {node} would start from node {held}'s state"
        regs = node
        if save >= 0:
            stack[save] = node
        seen.append(node)
    assert sorted(seen) == list(range(len(parents)))
    assert used <= tree.stack_levels(len(parents)) and all(level < used for level in stack)
    if parents == chain(len(parents)):
        assert used == 0 and codes.tolist() == list(range(len(parents)))


def test_bad_trees_and_paths_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"parents\[0\] must be -1"):
        tree.depths([0, 0])
    with pytest.raises(ValueError, match=r"parents\[2\] = 2"):
        tree.depths([-1, 0, 2])
    with pytest.raises(ValueError, match="start at the root"):
        tree.check_path([-1, 0, 0], [1])
    with pytest.raises(ValueError, match=r"path\[1\] = 2 is not a child"):
        tree.check_path([-1, 0, 1], [0, 2])


# ---- references against the reference model ----------------------------------------------------------------------
def committed(cfg, weights, n_prompt: int) -> State:
    state = State()
    if n_prompt:
        prefill(weights, cfg, list(range(7, 7 + n_prompt)), state)
    return state


def lin_mixed(weights, x):
    p = sub_weights(weights, "layers.0.linear_attn.")
    w = np.concatenate([p[n] for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                       "in_proj_a.weight")])
    return x @ w.T, p


@pytest.mark.parametrize("model", sorted(MODELS))
@settings(max_examples=12, deadline=None)
@given(trees(max_nodes=12), st.sampled_from([0, 1, 5]), st.integers(0, 2**31 - 1))
def test_deltanet_reference_is_the_per_node_decode_step(model, parents, n_prompt, seed):
    """Layer 0 (DeltaNet) sees the embeddings: the reference's node states equal tree_forward's, and its outputs
    through the gated norm and out-projection equal gated_deltanet run as a decode step after the parent."""
    cfg, weights = MODELS[model]
    rng = np.random.default_rng(seed)
    state, tokens = committed(cfg, weights, n_prompt), rng.integers(0, cfg.vocab_size, len(parents)).tolist()
    x = rms_norm(weights["embed_tokens.weight"][tokens], weights["layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
    mixed, p = lin_mixed(weights, x)
    K, C = cfg.linear_conv_kernel_dim, cfg.conv_dim
    ring = state_to_ring(state.conv[0], n_prompt) if n_prompt else np.zeros((K, C), np.float32)
    shape = (cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim)
    rec = state.recurrent[0].transpose(0, 2, 1).copy() if n_prompt else np.full(shape, np.nan, np.float32)
    out, convs, recs = tree.deltanet_reference(cfg, mixed, p["conv1d.weight"][:, 0], p["A_log"], p["dt_bias"], ring,
                                               rec, parents, n_prompt)

    _, nodes = tree_forward(weights, cfg, state, tokens, parents)
    z = mixed[:, C:C + cfg.value_dim].reshape(len(parents), cfg.linear_num_value_heads, -1)
    for n, par in enumerate(parents):
        assert relative_error(convs[n], nodes[n].conv[0]) < 1e-6
        assert relative_error(recs[n].transpose(0, 2, 1), nodes[n].recurrent[0]) < 1e-5
        conv0 = (convs[par] if par >= 0 else state.conv.get(0))
        rec0 = (recs[par].transpose(0, 2, 1) if par >= 0 else state.recurrent.get(0))
        if rec0 is None:  # the sequence's first token: the model runs its chunked rule from zeros
            continue
        y, _, _ = gated_deltanet(p, cfg, x[n:n + 1], conv0, rec0)
        gated = rms_norm_gated(out[n].reshape(1, cfg.linear_num_value_heads, -1), z[n:n + 1], p["norm.weight"],
                               cfg.rms_norm_eps).reshape(1, -1)
        o = gated @ p["out_proj.weight"].T
        # fp32 sums in another order: the error is relative to the magnitudes the out-projection adds (an output
        # that cancels to near zero, as hypothesis finds, has no digits of its own to compare)
        magnitudes = np.abs(gated) @ np.abs(p["out_proj.weight"]).T
        assert np.linalg.norm(o - y) / np.linalg.norm(magnitudes) < 1e-5


@pytest.mark.parametrize("model", sorted(MODELS))
@settings(max_examples=12, deadline=None)
@given(trees(max_nodes=12), st.sampled_from([0, 1, 6]), st.integers(0, 2**31 - 1))
def test_attention_reference_is_the_per_node_decode_step(model, parents, n_prompt, seed):
    """Node by node, gated_attention over the committed cache plus the ancestors' rows (what the model's decode step
    at that position sees) gives the reference's K/V rows and, through o_proj, its outputs."""
    cfg, weights = MODELS[model]
    full = cfg.full_layers[0]
    rng = np.random.default_rng(seed)
    state = committed(cfg, weights, n_prompt)
    p = sub_weights(weights, f"layers.{full}.self_attn.")
    x = rng.normal(size=(len(parents), cfg.hidden_size)).astype(np.float32)
    qkv = x @ np.concatenate([p["q_proj.weight"], p["k_proj.weight"], p["v_proj.weight"]]).T
    empty = np.zeros((0, cfg.num_key_value_heads, cfg.head_dim), np.float32)
    keys, values = state.keys.get(full, empty), state.values.get(full, empty)
    k, v = tree.attention_kv_reference(cfg, qkv, p["k_norm.weight"], parents, n_prompt)
    out = tree.attention_reference(cfg, qkv, p["q_norm.weight"], np.concatenate([keys, k]),
                                   np.concatenate([values, v]), parents, n_prompt)
    depth = tree.depths(parents)
    for n in range(len(parents)):
        line, a = [], parents[n]
        while a >= 0:
            line.append(a)
            a = parents[a]
        line = line[::-1]
        y, kk, vv = gated_attention(p, cfg, x[n:n + 1], n_prompt + int(depth[n]),
                                    np.concatenate([keys, k[line]]), np.concatenate([values, v[line]]))
        assert relative_error(kk[-1], k[n]) < 1e-6 and relative_error(vv[-1], v[n]) < 1e-6
        assert relative_error(out[n:n + 1] @ p["o_proj.weight"].T, y) < 1e-5


@pytest.mark.parametrize("model", sorted(MODELS))
@settings(max_examples=10, deadline=None)
@given(trees(max_nodes=12), st.sampled_from([1, 3, 9]), st.integers(0, 2**31 - 1))
def test_commit_references_are_sequential_decoding(model, parents, n_prompt, seed):
    """Committing a root-to-node path leaves layer 0's ring and state as decoding the path's tokens one by one, and
    moves node rows to consecutive positions."""
    cfg, weights = MODELS[model]
    rng = np.random.default_rng(seed)
    node = int(rng.integers(len(parents)))
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    path = path[::-1]
    tree.check_path(parents, path)
    state, tokens = committed(cfg, weights, n_prompt), rng.integers(0, cfg.vocab_size, len(parents)).tolist()
    x = rms_norm(weights["embed_tokens.weight"][tokens], weights["layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
    mixed, p = lin_mixed(weights, x)
    ring, rec = state_to_ring(state.conv[0], n_prompt), state.recurrent[0].transpose(0, 2, 1).copy()
    _, _, recs = tree.deltanet_reference(cfg, mixed, p["conv1d.weight"][:, 0], p["A_log"], p["dt_bias"], ring, rec,
                                         parents, n_prompt)
    new_ring, new_rec = tree.deltanet_commit_reference(mixed, ring, rec, recs, path, n_prompt)
    seq = state.copy()
    for n in path:
        decode_step(weights, cfg, tokens[n], seq)
    assert relative_error(ring_to_state(new_ring, n_prompt + len(path)), seq.conv[0]) < 1e-6
    assert relative_error(new_rec.transpose(0, 2, 1), seq.recurrent[0]) < 1e-5

    cache = rng.normal(size=(n_prompt + len(parents) + 2, 2, 4)).astype(np.float32)
    moved = tree.kv_commit_reference(cache, path, n_prompt)
    assert np.array_equal(moved[:n_prompt], cache[:n_prompt])
    for i, n in enumerate(path):
        assert np.array_equal(moved[n_prompt + i], cache[n_prompt + n])


# ---- the unit ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec_name", list_specs())
@pytest.mark.parametrize("model,tiled", [("tiny", False), ("qwen3.5-0.8b", False), ("qwen3.5-0.8b", True),
                                         ("qwen3.5-27b", True)])
def test_compiles_without_spills_for_every_spec(tmp_path, spec_name, model, tiled):
    """HF's grouped value-head order and llama.cpp's tiled one (a GGUF checkpoint, the layer-by-layer step's)."""
    spec, cfg = load_spec(spec_name), CFG if model == "tiny" else load_config(model)
    (unit,) = tree.units(spec, cfg, [tiled])
    assert unit.name == ("tree_tiled" if tiled else "tree") and unit.params["tiled"] is tiled
    kernels = build(spec, cfg, [unit], root=tmp_path).kernels
    assert [k.name for k in kernels] == ["tree_deltanet", "tree_attention_kv", "tree_attention", "tree_kv_commit"]
    for k in kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{spec_name}/{model}/{k.name} spills"
        assert k.dynamic_smem + k.static_smem <= spec.chip.smem_per_block and k.coresident_blocks > 0


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "tq3_0"])
def test_compiles_without_spills_for_each_kv_row_format(tmp_path, fmt):
    """The tree attention with a quantized KV cache (tuning.kv_format; the specs name q8_0 and tq3_0 on some chips,
    none q4_0) on the 27B's tiled unit."""
    import dataclasses
    base, cfg = load_spec("h200"), load_config("qwen3.5-27b")
    spec = dataclasses.replace(base, tuning=dataclasses.replace(base.tuning, kv_format=fmt))
    (unit,) = tree.units(spec, cfg, [True])
    assert unit.params["kv_format"] == fmt
    for k in build(spec, cfg, [unit], root=tmp_path).kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{fmt}/{k.name} spills"


def test_the_kv_formats_the_tree_attention_does_not_read_fall_back_to_bf16_rows():
    import dataclasses
    big, tiny = load_config("qwen3.5-27b"), tiny_config()  # head_dim 256 and 32
    assert tree.kv_rows(load_spec("rtx4090"), big) == "q8_0" and tree.kv_rows(load_spec("rtx3090"), big) == "tq3_0"
    assert tree.kv_rows(load_spec("rtx3090"), tiny) == "bf16"  # tq3_0 rows are groups of 128 values
    base = load_spec("rtx4090")
    fp8 = dataclasses.replace(base, tuning=dataclasses.replace(base.tuning, kv_format="fp8"))
    assert tree.kv_rows(fp8, big) == "bf16"


def test_lucegen_build_includes_it_and_a_model_it_cannot_take_says_why():
    spec = load_spec("h200")
    assert {"tree", "tree_tiled"} <= {u.name for u in all_units(spec, load_config("qwen3.5-0.8b"))}
    wide = tiny_config(num_attention_heads=32, num_key_value_heads=2)  # 16 query heads per kv head
    assert tree.units(spec, wide) == []
    assert "16 query heads per kv head" in tree.shape_problem(wide, spec)
