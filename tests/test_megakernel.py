"""The decode megakernel without a GPU: it renders and compiles for every spec and model shape, and the weights are
packed where its rendered constants say they are."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from lucegen.codegen.build import build
from lucegen.codegen.render import TEMPLATES_DIR, render
from lucegen.kernels import all_units, megakernel
from lucegen.kernels.megakernel import BF16, F32, Layout, LayoutError, pack_layer_tensor, reference_weights
from lucegen.model.config import LINEAR, load_config, tiny_config
from lucegen.reference import random_weights
from lucegen.reference.ops import rope_cos_sin
from lucegen.spec import list_specs, load_spec

# the shapes of the test configs: tiny (Hv = 2 Hk), and one with 3 value heads per key head and one kv head (as 27B)
RATIO3 = dict(name="ratio3", hidden_size=96, num_hidden_layers=8, intermediate_size=192, num_attention_heads=6,
              num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
              linear_key_head_dim=32, linear_value_head_dim=32)
CONFIGS = {"tiny": tiny_config(), "ratio3": tiny_config(**RATIO3)}


@pytest.mark.parametrize("spec_name", list_specs())
@pytest.mark.parametrize("config", [*sorted(CONFIGS), "qwen3.5-0.8b"])  # 0.8B: its narrow GEMVs split K over warps
def test_compiles_without_spills_for_every_spec(tmp_path, spec_name, config):
    spec, cfg = load_spec(spec_name), CONFIGS.get(config) or load_config(config)
    (unit,) = megakernel.units(spec, cfg)
    kernels = build(spec, cfg, [unit], root=tmp_path).kernels
    assert sorted(k.name for k in kernels) == sorted((megakernel.KERNEL, megakernel.SAMPLED_KERNEL))
    for k in kernels:  # greedy and sampled
        assert k.cooperative
        assert k.spill_stores == 0 and k.spill_loads == 0, \
            f"{spec_name}/{config}/{k.name}: {k.spill_stores} bytes spilled"
        # a cooperative launch needs every block resident at once
        assert k.coresident_blocks >= spec.tuning.megakernel.blocks
        assert k.dynamic_smem <= spec.chip.smem_per_block


def test_phase_kinds_are_the_kernels():
    """skip_mask bits and the phase tests name phases by PHASE_KINDS: the order of the kernel's PhaseKind enum."""
    header = (TEMPLATES_DIR / "mk_decode.cuh").read_text()
    enum = re.search(r"enum PhaseKind \{([^}]*)\}", header).group(1)
    assert tuple(n.strip().lower() for n in enum.split(",")) == megakernel.PHASE_KINDS


def test_lucegen_build_includes_it():
    spec, cfg = load_spec("h200"), load_config("qwen3.5-0.8b")
    assert "megakernel" in [u.name for u in all_units(spec, cfg)]


def test_the_model_and_the_spec_are_rendered_into_it():
    spec = load_spec("h200")
    a = render(Layout(tiny_config(), spec).unit(), "")
    b = render(Layout(tiny_config(hidden_size=96, vocab_size=700), load_spec("rtx3090")).unit(), "")
    assert "HIDDEN = 64" in a and "VOCAB = 512" in a and "BLOCKS = 132" in a
    assert "HIDDEN = 96" in b and "VOCAB = 700" in b and "BLOCKS = 82" in b
    kinds = ", ".join(str(int(t != LINEAR)) for t in tiny_config().layer_types)
    assert f"LAYER_KIND[4] = {{{kinds}}}" in a


def test_a_model_too_wide_for_the_chip_gets_no_unit_and_says_why():
    spec, cfg = load_spec("rtx3090"), load_config("qwen3.5-27b")
    assert megakernel.units(spec, cfg) == []
    with pytest.raises(LayoutError, match="shared memory"):
        Layout(cfg, spec)


def test_layout_places_every_tensor_aligned_and_apart():
    lay = Layout(load_config("qwen3.5-0.8b"), load_spec("h200"))
    spans = [(lay.embed.offset, lay.embed.nbytes), (lay.final_norm.offset, lay.final_norm.nbytes)]
    for layer in range(lay.cfg.num_hidden_layers):
        spans += [(t.offset, t.nbytes) for t in lay.layer_tensors(layer).values()]
    spans.sort()
    assert all(off % 256 == 0 for off, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), "tensors overlap"
    assert spans[-1][0] + spans[-1][1] <= lay.arena_bytes
    assert lay.lm_head == lay.embed  # tied: the LM head reads the embeddings


def test_bytes_per_token_of_qwen35_08b():
    """research/algorithms.md 2.3: 752,393,024 parameters read per token, 1.505 GB in bf16 (the vectors, kept in
    fp32, add a little)."""
    lay = Layout(load_config("qwen3.5-0.8b"), load_spec("h200"))
    assert lay.weight_bytes_per_token() == pytest.approx(1.505e9, rel=2e-3)


def test_shared_memory_holds_the_ring_and_the_work_areas():
    for name in list_specs():
        spec = load_spec(name)
        lay = Layout(load_config("qwen3.5-0.8b"), spec)
        assert lay.slots >= 2 and lay.slot_bytes % 128 == 0
        assert lay.slot_bytes >= 2 * 2 * lay.cfg.intermediate_size  # the widest row, twice
        assert lay.smem_bytes <= spec.chip.smem_per_block
        assert lay.work_bytes >= 4 * lay.cfg.intermediate_size


@pytest.mark.parametrize("spec_name", list_specs())
@pytest.mark.parametrize("model_name", ["qwen3.5-0.8b", "qwen3.5-27b", *CONFIGS])
def test_every_weight_tile_is_a_legal_bulk_copy(spec_name, model_name):
    """Each block streams its rows of every matrix in tiles: a 16-byte aligned source, a whole number of 16-byte
    words, no more than a slot, inside the arena (the bulk copy engine's rules; cp.async's are weaker)."""
    spec = load_spec(spec_name)
    cfg = CONFIGS.get(model_name) or load_config(model_name)
    if not megakernel.units(spec, cfg):
        pytest.skip(f"no megakernel for {model_name} on {spec_name}")
    lay = Layout(cfg, spec)
    matrices = [("lm_head", lay.lm_head)] + [(n, t) for i in range(cfg.num_hidden_layers)
                                             for n, t in lay.layer_tensors(i).items() if t.dtype == BF16]
    for name, t in matrices:
        n, k = t.shape
        pair = 2 if name == "gate_up" else 1  # a block takes whole (gate, up) row pairs
        rows, tile_rows = lay.tiling(k)
        assert tile_rows >= rows >= pair and tile_rows % rows == 0 and tile_rows * 2 * k <= lay.slot_bytes
        for b in range(lay.blocks):
            r0, r1 = (pair * r for r in lay.block_rows(n // pair, b))
            for row in range(r0, r1, tile_rows):
                src, size = t.offset + row * k * 2, min(tile_rows, r1 - row) * k * 2
                assert src % 16 == 0 and size % 16 == 0 and 0 < size <= lay.slot_bytes
                assert src + size <= lay.arena_bytes


@pytest.fixture(scope="module")
def tiny_weights():
    cfg = tiny_config()
    return cfg, random_weights(cfg, seed=3)


def test_packing_follows_the_reference_names(tiny_weights):
    cfg, w = tiny_weights
    lin, full = cfg.linear_layers[0], cfg.full_layers[0]
    gu = pack_layer_tensor(w, cfg, lin, "gate_up")
    np.testing.assert_array_equal(gu[0::2], w[f"layers.{lin}.mlp.gate_proj.weight"])
    np.testing.assert_array_equal(gu[1::2], w[f"layers.{lin}.mlp.up_proj.weight"])
    p = f"layers.{lin}.linear_attn."
    rows = pack_layer_tensor(w, cfg, lin, "in")
    C, V, Hv = cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads
    np.testing.assert_array_equal(rows[:C], w[p + "in_proj_qkv.weight"])
    np.testing.assert_array_equal(rows[C:C + V], w[p + "in_proj_z.weight"])
    np.testing.assert_array_equal(rows[C + V:C + V + Hv], w[p + "in_proj_b.weight"])
    np.testing.assert_array_equal(rows[C + V + Hv:], w[p + "in_proj_a.weight"])
    np.testing.assert_array_equal(pack_layer_tensor(w, cfg, lin, "conv"), w[p + "conv1d.weight"][:, 0, :])
    q = f"layers.{full}.self_attn."
    rows = pack_layer_tensor(w, cfg, full, "in")
    np.testing.assert_array_equal(rows, np.concatenate([w[q + "q_proj.weight"], w[q + "k_proj.weight"],
                                                        w[q + "v_proj.weight"]]))


def test_the_arena_holds_each_tensor_at_its_rendered_offset(tiny_weights):
    cfg, w = tiny_weights
    lay = Layout(cfg, load_spec("h200"))
    arena = np.zeros(lay.arena_bytes, np.uint8)
    for t, a in lay.packed(w):
        assert a.dtype == t.dtype and a.shape == t.shape
        arena[t.offset:t.offset + t.nbytes] = a.reshape(-1).view(np.uint8)
    read = lambda off, shape, dtype: arena[off:off + int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype)

    layer = cfg.full_layers[0]
    base = lay.layer_offsets[layer]
    q_norm = read(base + lay.full["q_norm"].offset, (cfg.head_dim,), F32)
    np.testing.assert_array_equal(q_norm, w[f"layers.{layer}.self_attn.q_norm.weight"])
    down = read(base + lay.full["down"].offset, (cfg.hidden_size, cfg.intermediate_size), BF16)
    np.testing.assert_array_equal(down.reshape(cfg.hidden_size, -1),
                                  w[f"layers.{layer}.mlp.down_proj.weight"].astype(ml_dtypes.bfloat16))
    embed = read(lay.embed.offset, lay.embed.shape, BF16).reshape(lay.embed.shape)
    np.testing.assert_array_equal(embed, w["embed_tokens.weight"].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(read(lay.final_norm.offset, (cfg.hidden_size,), F32), w["norm.weight"])
    params = lay.params()
    assert params["linear"]["A_LOG"] == lay.linear["a_log"].offset and params["final_norm"] == lay.final_norm.offset


def test_reference_weights_are_what_the_kernel_reads(tiny_weights):
    cfg, w = tiny_weights
    ref = reference_weights(w)
    m = "layers.0.linear_attn.in_proj_qkv.weight"
    np.testing.assert_array_equal(ref[m], w[m].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not np.array_equal(ref[m], w[m])  # the matrices are rounded to bf16 ...
    np.testing.assert_array_equal(ref["layers.0.linear_attn.A_log"], w["layers.0.linear_attn.A_log"])  # ... vectors not
    assert all(a.dtype == np.float32 for a in ref.values())


@pytest.mark.parametrize("config", ["qwen3.5-0.8b", "tiny"])
def test_rendered_rope_frequencies_give_the_reference_angles(config):
    cfg = load_config(config) if config != "tiny" else tiny_config()
    params = Layout(cfg, load_spec("h200")).params()
    inv_freq = np.array([float.fromhex(v.removesuffix("f")) for v in params["inv_freq"]], np.float32)
    positions = np.array([0, 1, 2047, 2048, 32767, 262143])
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    angles = positions.astype(np.float32)[:, None] * inv_freq  # the kernel's fp32 product
    np.testing.assert_array_equal(np.cos(angles), cos[:, :cfg.rotary_dim // 2])
    np.testing.assert_array_equal(np.sin(angles), sin[:, :cfg.rotary_dim // 2])


@pytest.mark.parametrize("spec_name", list_specs())
@pytest.mark.parametrize("model_name", ["qwen3.5-0.8b", "qwen3.5-27b", *CONFIGS])
def test_k_split_keeps_the_consumers_busy_and_fits_its_partials(spec_name, model_name):
    """ring_gemv cuts the K of a narrow GEMV's row groups into k_split(k) slices: every slice has a chunk per lane,
    a split never makes more units than the block's consumer warps for the matrix it was chosen for, and the
    partial sums of every matrix of that width fit the shared area (unit u writes floats u*rows .. u*rows+rows-1)."""
    spec = load_spec(spec_name)
    cfg = CONFIGS.get(model_name) or load_config(model_name)
    if not megakernel.units(spec, cfg):
        pytest.skip(f"no megakernel for {model_name} on {spec_name}")
    lay = Layout(cfg, spec)
    for k, counts in lay.block_row_counts().items():
        split, rows = lay.k_split(k), lay.tiling(k)[0]
        assert split >= 1 and (split == 1 or k // 8 // split >= 32)
        if split > 1:
            assert -(-min(counts) // rows) * split <= lay.warps - 1
            assert all(-(-n // rows) * split * rows <= lay.partial_floats for n in counts)
    if model_name == "qwen3.5-0.8b" and spec_name == "h200":  # 8 rows of the out- and down-projections a block,
        assert lay.k_split(cfg.intermediate_size) == 8 and lay.k_split(cfg.value_dim) == 8  # 16 consumer warps
