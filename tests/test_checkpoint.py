"""The test-checkpoint maker: llama.cpp's Q4_K_M type rule, fallbacks, end-to-end files, the CLI tool."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader

from lucegen.model.checkpoint import gguf_types, make_checkpoint
from lucegen.model.config import load_config, tiny_config
from lucegen.model.gguf_file import gguf_name, load_gguf
from lucegen.model.hf import load_hf
from lucegen.model.quants import block_shape
from lucegen.model.tokenizer import Tokenizer
from lucegen.model.weights import weight_shapes
from lucegen.reference import generate
from lucegen.reference.weights import random_weights

TOOL = Path(__file__).resolve().parents[1] / "tools" / "make_checkpoint.py"


def layer_of(gguf: str) -> int:
    return int(gguf.split(".")[1])


def expected_q4_k_m(cfg, name: str, shape) -> T:
    """The rule as llama.cpp states it, written out independently of lucegen.model.checkpoint."""
    g, n = gguf_name(name), cfg.num_hidden_layers
    if len(shape) != 2:
        return T.F32
    if g == "output.weight" or (g == "token_embd.weight" and cfg.tie_word_embeddings):
        return T.Q6_K
    if g.split(".")[-2] in ("attn_v", "attn_qkv", "ffn_down"):
        i = layer_of(g)
        if i < n / 8 or i >= 7 * n / 8 or (i - n // 8) % 3 == 2:
            return T.Q6_K
    return T.Q4_K


@pytest.mark.parametrize("n_layers", [8, 16, 24, 64])
@pytest.mark.parametrize("tied", [False, True])
def test_q4_k_m_rule(n_layers, tied):
    cfg = tiny_config(num_hidden_layers=n_layers, hidden_size=256, intermediate_size=512, head_dim=64,
                      linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=tied)
    types, fallbacks = gguf_types(cfg, "q4_k_m")
    assert not fallbacks
    assert types == {name: expected_q4_k_m(cfg, name, shape) for name, shape in weight_shapes(cfg).items()}
    promoted = {layer_of(gguf_name(n)) for n, t in types.items() if t == T.Q6_K and n.startswith("layers.")}
    assert 0 in promoted and n_layers - 1 in promoted and len(promoted) < n_layers


@pytest.mark.parametrize("hidden, expect", [(64, T.Q8_0), (48, T.F16)])
def test_fallbacks_are_taken_and_recorded(tmp_path, hidden, expect):
    cfg = tiny_config(hidden_size=hidden)
    types, fallbacks = gguf_types(cfg, "q4_k_m")
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 2:  # no row is a multiple of 256; rows of `hidden` values are (not) a multiple of 32
            want = expect if shape[1] == hidden else T.Q8_0
            assert types[name] == want and f"{gguf_name(name)}:" in " ".join(fallbacks), name
    path = make_checkpoint(tmp_path, cfg, formats=("gguf",), progress=False)["gguf"]
    assert GGUFReader(path).fields["lucegen.quant_fallbacks"].contents() == fallbacks
    ckpt = load_gguf(path)
    assert {ckpt.raw(gguf_name(n)).type for n in types} == set(types.values())


@pytest.mark.parametrize("source", ["qwen3.5-0.8b", "qwen3.5-27b"])
def test_real_configs_shapes_only(source):
    """No 1.5 GB files: the mix and sizes of the real configs, from their shapes."""
    cfg = load_config(source)
    shapes = weight_shapes(cfg)
    assert sum(int(np.prod(s)) for s in shapes.values()) == cfg.n_params()
    types, fallbacks = gguf_types(cfg, "q4_k_m")
    assert not fallbacks
    assert types == {name: expected_q4_k_m(cfg, name, shape) for name, shape in shapes.items()}
    nbytes = sum(int(np.prod(s)) // block_shape(types[n])[0] * block_shape(types[n])[1] for n, s in shapes.items())
    assert 4.5 < 8 * nbytes / cfg.n_params() < 6.5625  # between Q4_K's and Q6_K's bits per weight
    if source == "qwen3.5-27b":  # lucebox's Qwen3.5-27B Q4_K_M GGUF is "~16 GB" (research/lucebox.md)
        assert abs(nbytes / 1e9 - 16) < 1.6


def test_make_checkpoint_end_to_end(tmp_path):
    cfg = tiny_config(name="e2e", eos_token_id=2)
    paths = make_checkpoint(tmp_path / "a", cfg, seed=3, peaked=True, progress=False)
    truth = random_weights(cfg, 3, dtype=ml_dtypes.bfloat16, peaked=True)
    hf = load_hf(paths["hf"])
    assert dataclasses.replace(hf.config, name=cfg.name) == cfg
    for name, w in truth.items():
        np.testing.assert_array_equal(hf[name].view(np.uint16), w.view(np.uint16), err_msg=name)
    gg = load_gguf(paths["gguf"])
    assert paths["gguf"].parent == paths["hf"] and gg.config == cfg
    tok = Tokenizer.from_dir(paths["hf"])
    assert 256 < tok.vocab_size <= cfg.vocab_size

    def digest(directory):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}

    again = make_checkpoint(tmp_path / "b", cfg, seed=3, peaked=True, progress=False)
    other = make_checkpoint(tmp_path / "c", cfg, seed=4, peaked=True, formats=("hf",), tokenizer=False,
                            progress=False)
    assert digest(again["hf"]) == digest(paths["hf"])
    assert digest(other["hf"])["model.safetensors"] != digest(paths["hf"])["model.safetensors"]


def test_peaked_greedy_tokens_survive_q4_k_m(tmp_path):
    """The reference decodes the same greedy tokens from the Q4_K_M GGUF as from the bf16 HF snapshot."""
    cfg = tiny_config(name="kq", hidden_size=256, intermediate_size=512, head_dim=64, linear_key_head_dim=64,
                      linear_value_head_dim=64)
    paths = make_checkpoint(tmp_path, cfg, seed=5, peaked=True, tokenizer=False, progress=False)
    hf = {k: np.asarray(v, np.float32) for k, v in load_hf(paths["hf"]).load_all(progress=False).items()}
    gguf = load_gguf(paths["gguf"]).load_all(progress=False)
    tokens = generate(hf, cfg, [1, 2, 3, 4, 5], 24)
    assert len(set(tokens)) > 8  # an untied peaked model walks through the vocabulary
    assert generate(gguf, cfg, [1, 2, 3, 4, 5], 24) == tokens


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown quant mix 'q3_k'"):
        make_checkpoint("/nonexistent", tiny_config(), mix="q3_k")
    with pytest.raises(ValueError, match="unknown checkpoint formats"):
        make_checkpoint("/nonexistent", tiny_config(), formats=("onnx",))


def test_tool(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_checkpoint", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "ck"
    assert tool.main([str(out), "--set", "vocab_size=300", "name=\"cli\"", "--mix", "q8_0", "--no-tokenizer"]) == 0
    assert load_hf(out).config.vocab_size == 300 and not (out / "tokenizer.json").exists()
    assert load_gguf(out / "cli-q8_0.gguf").raw("blk.0.ffn_up.weight").type == T.Q8_0
    assert tool.main([str(out), "--set", "bogus=1"]) == 1
    assert "bogus" in capsys.readouterr().err
