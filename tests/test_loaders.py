"""HF snapshot and GGUF loaders: round trips, llama.cpp's conventions, and clear errors on bad files."""
from __future__ import annotations

import dataclasses
import json

import huggingface_hub.constants
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants
from safetensors.numpy import load_file, save_file

from lucegen.model.checkpoint import gguf_types, write_gguf_checkpoint, write_hf
from lucegen.model.config import tiny_config
from lucegen.model.gguf_file import (GGUFCheckpoint, add_config_metadata, config_from_gguf_metadata, convert,
                                     gguf_name, load_gguf)
from lucegen.model.hf import HFCheckpoint, load_hf
from lucegen.model.weights import WeightError, open_weights, weight_shapes
from lucegen.reference.weights import random_weights
from test_quants import REL_ERROR

CFG = tiny_config()  # 2 key heads, 4 value heads: value heads are retiled in GGUF
RATIO3 = tiny_config(name="ratio3", hidden_size=96, num_hidden_layers=8, intermediate_size=192, num_attention_heads=6,
                     num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
                     linear_key_head_dim=32, linear_value_head_dim=32)
# Every matrix row a multiple of 256, so the K-quants apply.
KQ = tiny_config(name="kq", hidden_size=256, intermediate_size=512, head_dim=64, linear_key_head_dim=64,
                 linear_value_head_dim=64)
NORMS_1P = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def bf16_weights(cfg, seed=0):
    return random_weights(cfg, seed, dtype=ml_dtypes.bfloat16)


def bits(a):
    return np.asarray(a).view(np.uint16 if np.asarray(a).itemsize == 2 else np.uint32)


# ---- HF ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [CFG, tiny_config(tie_word_embeddings=True)], ids=["untied", "tied"])
@pytest.mark.parametrize("shard_bytes", [1 << 30, 40_000], ids=["single", "sharded"])
def test_hf_round_trip_is_exact(tmp_path, cfg, shard_bytes):
    weights = bf16_weights(cfg)
    write_hf(tmp_path, cfg, weights, max_shard_bytes=shard_bytes, tokenizer=False)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes < 1 << 30)
    ckpt = load_hf(tmp_path)
    assert dataclasses.replace(ckpt.config, name=cfg.name) == cfg
    assert list(ckpt) == list(weights)
    for name, w in ckpt.load_all(progress=False).items():
        assert w.dtype == ml_dtypes.bfloat16 and w.shape == weights[name].shape
        np.testing.assert_array_equal(bits(w), bits(weights[name]), err_msg=name)


def test_hf_index_lists_every_tensor(tmp_path):
    write_hf(tmp_path, CFG, bf16_weights(CFG), max_shard_bytes=40_000, tokenizer=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    stored = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(tmp_path / f).items()}
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in stored.values())
    assert all(index["weight_map"][k] != index["weight_map"]["model.language_model.embed_tokens.weight"]
               for k in ("lm_head.weight", "model.language_model.norm.weight"))


def test_hf_flat_names_and_ignored_tensors(tmp_path):
    """Qwen3_5ForCausalLM names (model.*), a tied model that still stores lm_head, plus mtp.* and model.visual.*."""
    cfg = tiny_config(tie_word_embeddings=True)
    weights = bf16_weights(cfg)
    extra = {"lm_head.weight": weights["embed_tokens.weight"], "mtp.fc.weight": np.ones((4, 4), np.float32),
             "model.visual.blocks.0.attn.qkv.weight": np.ones((3, 3), np.float32)}
    save_file({**{f"model.{k}": v for k, v in weights.items()}, **extra}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    ckpt = load_hf(tmp_path)
    assert set(ckpt) == set(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(bits(ckpt[name]), bits(w))


@pytest.fixture
def hf_dir(tmp_path):
    write_hf(tmp_path, CFG, bf16_weights(CFG), tokenizer=False)
    return tmp_path


def rewrite(path, edit):
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_hf_truncated_file_names_the_file(hf_dir):
    path = hf_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(WeightError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf(hf_dir)


def test_hf_missing_shard_names_shard_and_tensor(tmp_path):
    write_hf(tmp_path, CFG, bf16_weights(CFG), max_shard_bytes=40_000, tokenizer=False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    name, shard = next((k, v) for k, v in index.items() if v.startswith("model-00002"))
    (tmp_path / shard).unlink()
    with pytest.raises(WeightError, match=rf"{shard}: shard listed in .* is missing \(holds tensor '{name}'\)"):
        load_hf(tmp_path)


def test_hf_shape_mismatch_names_file_and_tensor(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["text_config"]["intermediate_size"] = 96
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"model\.safetensors: tensor 'model\.language_model\.layers\.0\.mlp\.down_"
                                          r"proj\.weight' has shape \(64, 128\), but config.json implies \(64, 96\)"):
        load_hf(hf_dir)


def test_hf_bad_dtype_names_tensor(hf_dir):
    name = "model.language_model.layers.1.mlp.up_proj.weight"

    def to_int8(tensors):
        tensors[name] = tensors[name].astype(np.float32).astype(np.int8)

    rewrite(hf_dir / "model.safetensors", to_int8)
    with pytest.raises(WeightError, match=rf"tensor '{name}' has dtype I8; supported: BF16, F16, F32"):
        load_hf(hf_dir)


def test_hf_missing_and_unexpected_tensors(hf_dir):
    rewrite(hf_dir / "model.safetensors", lambda t: t.pop("model.language_model.layers.2.linear_attn.A_log"))
    with pytest.raises(WeightError, match=r"missing tensor 'layers\.2\.linear_attn\.A_log'"):
        load_hf(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["text_config"].update(num_hidden_layers=3, layer_types=cfg["text_config"]["layer_types"][:3])
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"tensor 'model\.language_model\.layers\.3\.[a-z_.]+' is not a weight"):
        load_hf(hf_dir)


def test_hf_model_id_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "cache"
    with pytest.raises(WeightError, match="not a local directory.*hub.*LocalEntryNotFoundError"):
        load_hf("lucegen-test/not-cached", cache_dir=cache)
    # a snapshot already in the hub cache loads without network
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--lucegen-test--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    write_hf(repo / "snapshots" / revision, CFG, bf16_weights(CFG), tokenizer=False)
    ckpt = load_hf("lucegen-test/tiny", cache_dir=cache)
    assert ckpt.dir == repo / "snapshots" / revision and len(ckpt.load_all(progress=False)) == len(ckpt.shapes)


# ---- GGUF ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [CFG, RATIO3, tiny_config(tie_word_embeddings=True, eos_token_id=7),
                                 tiny_config(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=333)])
def test_gguf_config_round_trip(tmp_path, cfg):
    path = write_gguf_checkpoint(tmp_path / "m.gguf", cfg, bf16_weights(cfg), mix="f32", progress=False)
    assert load_gguf(path).config == cfg


@pytest.mark.parametrize("source", ["qwen3.5-0.8b", "qwen3.5-27b", "qwen3.6-27b"])
def test_gguf_metadata_of_real_configs(tmp_path, source):
    from lucegen.model.config import load_config
    cfg = load_config(source)
    w = GGUFWriter(tmp_path / "meta.gguf", "qwen35")
    add_config_metadata(w, cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    meta = {k: f.contents() for k, f in GGUFReader(tmp_path / "meta.gguf").fields.items()}
    assert meta["qwen35.rope.dimension_count"] == 64 and meta["qwen35.ssm.inner_size"] == cfg.value_dim
    assert config_from_gguf_metadata(meta, cfg.vocab_size, cfg.tie_word_embeddings, source) == cfg


@pytest.mark.parametrize("cfg", [CFG, RATIO3], ids=["r2", "r3"])
def test_gguf_f32_round_trip(tmp_path, cfg):
    """Permutations and the squeeze are exact; 1 + w and -exp(A_log) round back within one float32 ulp."""
    weights = bf16_weights(cfg)
    got = load_gguf(write_gguf_checkpoint(tmp_path / "m.gguf", cfg, weights, mix="f32", progress=False))
    for name, w in weights.items():
        want, have = np.asarray(w, np.float32), got[name]
        assert have.dtype == np.float32 and have.shape == want.shape, name
        if name.endswith(NORMS_1P + ("A_log",)) or name == "norm.weight":
            assert np.all(np.abs(have - want) <= 2.0 ** -23 * (1 + np.abs(want))), name
        else:
            np.testing.assert_array_equal(have, want, err_msg=name)


@pytest.mark.parametrize("cfg", [CFG, RATIO3], ids=["r2", "r3"])
def test_gguf_tensors_follow_llama_cpp_conventions(tmp_path, cfg):
    """The stored tensors, element by element, as llama.cpp's converter writes them (written out with loops)."""
    weights = {k: np.asarray(v, np.float32) for k, v in bf16_weights(cfg).items()}
    ckpt = load_gguf(write_gguf_checkpoint(tmp_path / "m.gguf", cfg, weights, mix="f32", progress=False))

    def stored(name):
        raw = ckpt.raw(name)
        return gguf_quants.dequantize(raw.data, raw.type)

    hk, hv, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    r, qk = hv // hk, 2 * cfg.key_dim
    assert list(ckpt.reader.tensors[0].shape) == [cfg.hidden_size, cfg.vocab_size]  # ggml ne: fastest first
    np.testing.assert_array_equal(stored("output_norm.weight"), weights["norm.weight"] + np.float32(1))
    for i in cfg.full_layers:
        np.testing.assert_array_equal(stored(f"blk.{i}.attn_q_norm.weight"),
                                      weights[f"layers.{i}.self_attn.q_norm.weight"] + np.float32(1))
        np.testing.assert_array_equal(stored(f"blk.{i}.attn_q.weight"), weights[f"layers.{i}.self_attn.q_proj.weight"])
    for i in cfg.linear_layers:
        w = {k.split("linear_attn.")[1]: v for k, v in weights.items() if k.startswith(f"layers.{i}.linear_attn.")}
        g = {n: stored(f"blk.{i}.{n}") for n in ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight",
                                                  "ssm_alpha.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                                                  "ssm_norm.weight", "ssm_out.weight")}
        np.testing.assert_array_equal(stored(f"blk.{i}.attn_norm.weight"),
                                      weights[f"layers.{i}.input_layernorm.weight"] + np.float32(1))
        np.testing.assert_array_equal(g["ssm_norm.weight"], w["norm.weight"])  # the DeltaNet norm keeps plain w
        assert list(ckpt.reader.tensors[[t.name for t in ckpt.reader.tensors].index(f"blk.{i}.ssm_conv1d.weight")]
                    .shape) == [cfg.linear_conv_kernel_dim, cfg.conv_dim]
        np.testing.assert_array_equal(g["attn_qkv.weight"][:qk], w["in_proj_qkv.weight"][:qk])
        np.testing.assert_array_equal(g["ssm_conv1d.weight"][:qk], w["conv1d.weight"][:qk, 0])
        for head in range(hv):  # grouped head k*r + j sits at tiled position j*hk + k
            t = (head % r) * hk + head // r
            src, dst = slice(head * dv, (head + 1) * dv), slice(t * dv, (t + 1) * dv)
            np.testing.assert_array_equal(g["attn_qkv.weight"][qk:][dst], w["in_proj_qkv.weight"][qk:][src])
            np.testing.assert_array_equal(g["ssm_conv1d.weight"][qk:][dst], w["conv1d.weight"][qk:, 0][src])
            np.testing.assert_array_equal(g["attn_gate.weight"][dst], w["in_proj_z.weight"][src])
            np.testing.assert_array_equal(g["ssm_out.weight"][:, dst], w["out_proj.weight"][:, src])
            np.testing.assert_array_equal(g["ssm_beta.weight"][t], w["in_proj_b.weight"][head])
            np.testing.assert_array_equal(g["ssm_alpha.weight"][t], w["in_proj_a.weight"][head])
            assert g["ssm_dt.bias"][t] == w["dt_bias"][head]
            assert g["ssm_a"][t] == np.float32(-np.exp(np.float64(w["A_log"][head])))


def test_open_weights_picks_the_loader(tmp_path):
    weights = bf16_weights(CFG)
    write_hf(tmp_path, CFG, weights, tokenizer=False)
    gguf = write_gguf_checkpoint(tmp_path / "m.gguf", CFG, weights, mix="f32", progress=False)
    assert isinstance(open_weights(tmp_path), HFCheckpoint) and isinstance(open_weights(gguf), GGUFCheckpoint)


@pytest.mark.parametrize("cfg", [KQ, dataclasses.replace(KQ, tie_word_embeddings=True)], ids=["untied", "tied"])
@pytest.mark.parametrize("mix", ["q4_k_m", "q5_k_m"])
def test_gguf_quantized_round_trip(tmp_path, cfg, mix):
    weights = bf16_weights(cfg)
    ckpt = load_gguf(write_gguf_checkpoint(tmp_path / "m.gguf", cfg, weights, mix=mix, progress=False))
    types, fallbacks = gguf_types(cfg, mix)
    assert not fallbacks and GGUFReader(ckpt.path).fields.get("lucegen.quant_fallbacks") is None
    for name, w in weights.items():
        raw = ckpt.raw(gguf_name(name))
        assert raw.type == types[name] and raw.data.dtype == np.uint8
        assert np.shares_memory(raw.data, ckpt.reader.data)  # a view of the mapped file, not a copy
        have = ckpt[name]
        expect = convert(cfg, name, gguf_quants.dequantize(raw.data, raw.type), to_gguf=False)
        np.testing.assert_array_equal(have, expect, err_msg=name)  # gguf's dequantizer, our conventions
        want = np.asarray(w, np.float32)
        if raw.type != T.F32:
            assert np.linalg.norm(have - want) / np.linalg.norm(want) <= REL_ERROR["normal"][raw.type], name


# ---- GGUF errors ---------------------------------------------------------------------------------------------
def write_custom(path, cfg, *, arch="qwen35", drop=(), replace=None, extra=None, metadata=None):
    """A GGUF written tensor by tensor (F32 unless `replace` gives (bytes, type)), for broken-file tests."""
    w = GGUFWriter(path, arch)
    add_config_metadata(w, cfg)
    for key, value in (metadata or {}).items():
        w.add_uint32(key, value)
    for name, x in bf16_weights(cfg).items():
        g = gguf_name(name)
        if g in drop:
            continue
        if g in (replace or {}):
            data, t = replace[g]
            w.add_tensor(g, data, raw_dtype=t)
        else:
            w.add_tensor(g, convert(cfg, name, x, to_gguf=True))
    for g, x in (extra or {}).items():
        w.add_tensor(g, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_mtp_layers_are_skipped(tmp_path):
    path = write_custom(tmp_path / "m.gguf", CFG, metadata={"qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1},
                        extra={"blk.4.nextn.eh_proj.weight": np.ones((64, 128), np.float32)})
    ckpt = load_gguf(path)
    assert ckpt.config == CFG and len(ckpt.load_all(progress=False)) == len(weight_shapes(CFG))


def test_gguf_wrong_architecture(tmp_path):
    with pytest.raises(WeightError, match=r"m\.gguf: architecture 'qwen3' is not supported"):
        load_gguf(write_custom(tmp_path / "m.gguf", CFG, arch="qwen3"))


def test_gguf_unsupported_type_names_tensor(tmp_path):
    raw = np.zeros((KQ.intermediate_size, 66), np.uint8)  # one IQ2_XXS block (66 bytes) per 256-value row
    path = write_custom(tmp_path / "m.gguf", KQ, replace={"blk.1.ffn_up.weight": (raw, T.IQ2_XXS)})
    with pytest.raises(WeightError, match=r"tensor 'blk\.1\.ffn_up\.weight': ggml type IQ2_XXS is not supported"):
        load_gguf(path)


def test_gguf_missing_unexpected_and_misshapen_tensors(tmp_path):
    with pytest.raises(WeightError, match=r"m\.gguf: missing tensor 'blk\.2\.ssm_a'"):
        load_gguf(write_custom(tmp_path / "m.gguf", CFG, drop={"blk.2.ssm_a"}))
    with pytest.raises(WeightError, match=r"tensor 'blk\.0\.attn_q\.weight' is not a weight"):
        load_gguf(write_custom(tmp_path / "n.gguf", CFG, extra={"blk.0.attn_q.weight": np.ones((4, 64), np.float32)}))
    bad = np.ones((CFG.intermediate_size, CFG.hidden_size), np.float32)
    with pytest.raises(WeightError, match=r"tensor 'blk\.0\.ffn_down\.weight' has shape \(128, 64\), but the metadata "
                                          r"implies \(64, 128\)"):
        load_gguf(write_custom(tmp_path / "o.gguf", CFG, replace={"blk.0.ffn_down.weight": (bad, T.F32)}))


def test_gguf_truncated_file_names_tensor(tmp_path):
    path = write_gguf_checkpoint(tmp_path / "m.gguf", CFG, bf16_weights(CFG), mix="q4_k_m", progress=False)
    last = GGUFReader(path).tensors[-1]
    path.write_bytes(path.read_bytes()[:last.data_offset + 10])
    with pytest.raises(WeightError, match=rf"m\.gguf: truncated: tensor '{last.name}' \({last.tensor_type.name}, "
                                          r"bytes \d+\.\.\d+\) runs past the end of the file"):
        load_gguf(path)


@pytest.mark.parametrize("content", [b"", b"GGUF" + bytes(range(40)), b"not a gguf file at all"])
def test_gguf_unreadable_file(tmp_path, content):
    (tmp_path / "m.gguf").write_bytes(content)
    with pytest.raises(WeightError, match=r"m\.gguf: not a readable GGUF file"):
        load_gguf(tmp_path / "m.gguf")
