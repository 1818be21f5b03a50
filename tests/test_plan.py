"""lucegen plan: each item's arithmetic on small cases worked out here independently, the inputs it reads (GGUF,
safetensors, configs), and the verdict: the 27B Q4_K_M target, its bf16 DFlash draft and 128K of context fit an
RTX 3090 with the spec's KV format, and q8_0 KV would not."""
from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from lucegen import cli, plan
from lucegen.model.config import load_config, tiny_config
from lucegen.model.quants import GGMLType
from lucegen.model.weights import weight_shapes
from lucegen.spec import load_spec

# z-lab/Qwen3.5-27B-DFlash (shared/models/qwen3.5-27b-dflash-draft.config.json): 1.73B parameters
DRAFT_27B = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120,
             "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 17408, "vocab_size": 248320, "block_size": 16,
             "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61], "mask_token_id": 248070}}
SMALL_DRAFT = {**DRAFT_27B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "block_size": 8,
               "dflash_config": {"target_layer_ids": [0, 2, 3]}}


def small_draft_tensors() -> dict[str, np.ndarray]:
    """The DFlash tensor names (shared/models/README.md) at SMALL_DRAFT's shapes, bf16."""
    h, nh, nkv, hd, inter = 64, 4, 2, 16, 96
    t = {"fc.weight": (h, 3 * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(2):
        t.update({f"layers.{i}.input_layernorm.weight": (h,), f"layers.{i}.post_attention_layernorm.weight": (h,),
                  f"layers.{i}.self_attn.q_proj.weight": (nh * hd, h), f"layers.{i}.self_attn.k_proj.weight": (nkv * hd, h),
                  f"layers.{i}.self_attn.v_proj.weight": (nkv * hd, h), f"layers.{i}.self_attn.o_proj.weight": (h, nh * hd),
                  f"layers.{i}.self_attn.q_norm.weight": (hd,), f"layers.{i}.self_attn.k_norm.weight": (hd,),
                  f"layers.{i}.mlp.gate_proj.weight": (inter, h), f"layers.{i}.mlp.up_proj.weight": (inter, h),
                  f"layers.{i}.mlp.down_proj.weight": (h, inter)})
    return {k: np.zeros(s, ml_dtypes.bfloat16) for k, s in t.items()}


def test_the_dflash_draft_config_is_1_73b_bf16_parameters():
    d = plan.draft_from_config(DRAFT_27B, "draft")
    assert d.weight_bytes == 2 * 1_730_213_120  # 3.46 GB, as z-lab publishes it
    assert (d.layers, d.kv_heads, d.head_dim, d.target_layers, d.hidden, d.block_size) == (5, 8, 128, 5, 5120, 16)


def test_a_draft_from_safetensors_matches_its_config(tmp_path):
    tensors = small_draft_tensors()
    save_file(dict(list(tensors.items())[:10]), str(tmp_path / "model-1.safetensors"))
    save_file(dict(list(tensors.items())[10:]), str(tmp_path / "model-2.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(SMALL_DRAFT))
    from_files = plan.load_draft(tmp_path)
    assert from_files.weight_bytes == sum(t.nbytes for t in tensors.values())
    assert dataclasses.replace(from_files, source="x") == plan.draft_from_config(SMALL_DRAFT, "x")
    with pytest.raises(plan.PlanError, match="no such draft"):
        plan.load_draft(tmp_path / "absent")


def test_items_of_a_small_model_worked_out_by_hand():
    # tiny: hidden 64, 4 layers (3 DeltaNet + 1 attention), 2 KV heads x head_dim 128, Hk 2 / Hv 4 heads of 16,
    # conv_dim 2*32 + 64 = 128, intermediate 128, vocab 512
    m = tiny_config(head_dim=128)
    draft = plan.draft_from_config(SMALL_DRAFT, "draft")
    spec = load_spec("rtx3090")  # budget 22
    p = plan.make_plan(spec, m, {"Q8_0": 1000, "F32": 24}, draft, ctx=1000, kv_format="q8_0", tree_state="persist",
                       reserve=1 << 20)
    got = {i.name: i.nbytes for i in p.items}
    assert got["target weights"] == 1024
    assert got["KV cache"] == 1000 * 1 * 2 * 2 * (128 // 32 * 34)      # ctx x layers x K,V x heads x row bytes
    assert got["DeltaNet state"] == 3 * (4 * 16 * 16 * 4 + 3 * 128 * 4)
    assert got["DDTree state (persist)"] == 22 * 3 * 4 * 16 * 16 * 4 + 3 * (3 + 23) * 128 * 4
    window = 1000  # < DRAFT_WINDOW
    assert got["draft context"] == 3 * 64 * window * 2 + 2 * 2 * 2 * 16 * (window + 8) * 2
    row = 2 * 64 + max(2 * 4 * 128 + 2 * 256, 128 + 64 + 2 * 4) + 2 * 128 + max(64, 4 * 128)
    assert got["activations"] == (512 * row + (23 + 8) * 512) * 4
    assert got["CUDA context"] == 1 << 20 and p.total == sum(got.values())
    replay = plan.make_plan(spec, m, {"Q8_0": 1000}, draft, 1000, "q8_0", "replay").items
    tree = next(i.nbytes for i in replay if i.name == "DDTree state (replay)")
    assert tree == 22 * 4 * 16 * 16 * 4 + 23 * 3 * (32 + 64 + 2 * 4) * 4 + 3 * (3 + 23) * 128 * 4


def test_kv_bytes_per_format_at_128k_for_the_27b():
    m = load_config("qwen3.5-27b")  # 16 attention layers x K,V x 4 heads x 256 = 32768 values per position
    per_value = {"bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32, "tq3_0": 14 / 32, "fp8": 1}
    for fmt, b in per_value.items():
        assert plan.kv_cache_bytes(m, fmt, 131072) == round(131072 * 32768 * b)
    # the DDTree's fp32 state per node in all 48 DeltaNet layers: 3 GiB at the 3090's budget of 22
    assert plan.tree_state_bytes(m, 22, "persist") - plan.tree_state_bytes(m, 0, "persist") \
        == 22 * 48 * 48 * 128 * 128 * 4 + 22 * 48 * 10240 * 4


def test_target_bytes_from_a_gguf_equal_the_mix_arithmetic(tmp_path):
    from lucegen.model.checkpoint import make_checkpoint
    cfg = tiny_config(hidden_size=256, intermediate_size=512)
    path = make_checkpoint(tmp_path, cfg, formats=("gguf",), mix="q8_0", progress=False)["gguf"]
    model, by_type = plan.target_from_gguf(path)
    assert model.hidden_size == 256 and by_type == plan.target_from_config(cfg, "q8_0")
    # q8_0: every matrix 34 bytes per 32 values; vectors and the conv taps float32
    sizes = {n: int(np.prod(s)) for n, s in weight_shapes(cfg).items()}
    vec = sum(v for n, v in sizes.items() if len(weight_shapes(cfg)[n]) != 2)
    assert by_type == {"Q8_0": (sum(sizes.values()) - vec) * 34 // 32, "F32": vec * 4}


def cli_plan(capsys, *args) -> tuple[int, str]:
    rc = cli.main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_weight_bytes_are_what_the_gpu_holds_worked_out_by_hand():
    # Q6_K, 3 rows of 768 values: 3 x 3 x 210 bytes in the file; on the GPU 2 pairs of 432 bytes a row, in a whole tile
    # of 16 rows
    assert plan._tensor_bytes((3, 768), GGMLType.Q6_K) == 16 * 2 * 432
    assert plan._tensor_bytes((32, 512), GGMLType.Q4_K) == 32 * 2 * 144  # Q4_K: whole tiles already
    assert plan._tensor_bytes((3, 64), GGMLType.Q8_0) == 3 * 2 * 34    # plain rows, as stored
    assert plan._tensor_bytes((5120,), GGMLType.F32) == 5120 * 4        # a vector, as stored


def test_128k_fits_a_3090_beside_the_27b_and_its_draft_and_q8_0_kv_would_not(tmp_path, capsys):
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps(DRAFT_27B))
    args = ["--spec", "rtx3090", "--model", "qwen3.5-27b", "--mix", "q4_k_m", "--draft", str(draft), "--ctx", "131072"]
    rc, out = cli_plan(capsys, *args)
    assert rc == 0 and "KV tq3_0" in out and "fits:" in out and "total" in out
    assert "persisting every node's fp32 state would take 3.14 GiB" in out  # and so the plan replays
    rc, out = cli_plan(capsys, *args, "--kv", "q8_0")
    assert rc == 1 and "does not fit: over by 0.22 GiB" in out


def test_the_h200_persists_node_states_and_refusals_are_named(tmp_path, capsys):
    rc, out = cli_plan(capsys, "--spec", "h200", "--model", "qwen3.5-27b", "--ctx", "262144")
    assert rc == 0 and "DDTree state (persist)" in out
    rc, out = cli_plan(capsys, "--spec", "h200", "--model", "qwen3.5-27b", "--ctx", "300000")
    assert rc == 2 and "outside 1 .. 262144" in out
    rc, out = cli_plan(capsys, "--spec", "rtx3090", "--model", "qwen3.5-27b", "--kv", "fp8")
    assert rc == 2 and "fp8 KV needs sm_89" in out
    rc, out = cli_plan(capsys, "--spec", "rtx3090", "--model", "qwen3.5-27b", "--draft", str(tmp_path / "x"))
    assert rc == 2 and "no such draft" in out
    rc, out = cli_plan(capsys, "--spec", "rtx3090", "--model", "qwen3.5-0.8b", "--mix", "bf16", "--ctx", "4096")
    assert rc == 0  # a small model fits, with no draft
