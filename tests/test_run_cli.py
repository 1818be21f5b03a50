"""`lucegen run`: the streamed text is the reference's greedy output, speeds go to stderr, errors are clear."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from lucegen import reference
from lucegen.cli import main
from lucegen.model.tokenizer import Tokenizer
from lucegen.model.weights import open_weights
from lucegen.runtime import gpu_available


def reference_text(checkpoint, prompt: str, max_tokens: int) -> tuple[str, int]:
    tok = Tokenizer.from_dir(checkpoint)
    weights = open_weights(checkpoint)
    ids = tok.encode(prompt)
    out = reference.generate({k: np.asarray(v, np.float32) for k, v in weights.items()}, weights.config, ids,
                             max_tokens, eos_token_id=tok.eos_token_ids[0])
    return tok.decode(out, skip_special_tokens=True), len(ids)


@pytest.mark.parametrize("chat", [False, True])
def test_run_prints_the_greedy_text_and_the_speeds(checkpoint, capsys, chat):
    prompt = "Tell me a story"
    if chat:
        text = Tokenizer.from_dir(checkpoint).apply_chat_template([{"role": "user", "content": prompt}])
    want, n_prompt = reference_text(checkpoint, text if chat else prompt, 16)
    argv = ["run", "--model", str(checkpoint), "--prompt", prompt, "--max-tokens", "16"] + (["--chat"] if chat else [])
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == want + "\n"
    assert f"prompt: {n_prompt} tokens" in err and err.count("tok/s") == 2 and "finish: " in err


def test_run_stop_string(checkpoint, capsys):
    want, _ = reference_text(checkpoint, "abc", 16)
    assert len(want) >= 5, "the fixture's greedy text is too short to cut"
    stop = want[3:5]
    assert main(["run", "--model", str(checkpoint), "--prompt", "abc", "--max-tokens", "16", "--stop", stop]) == 0
    out, err = capsys.readouterr()
    assert out == want[:want.find(stop)] + "\n" and "finish: stop" in err


def test_run_streams(checkpoint):
    """Text reaches stdout while the generation is still going (3000 tokens take seconds here)."""
    proc = subprocess.Popen([sys.executable, "-m", "lucegen.cli", "run", "--model", str(checkpoint), "--prompt", "a",
                             "--max-tokens", "3000", "--ignore-eos", "--temperature", "1", "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.read(1)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "5000"], "max_tokens can be at most"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--draft", "d"], "d: expected a DFlash draft directory"),
])
def test_run_errors(checkpoint, capsys, args, message):
    assert main(["run", "--model", str(checkpoint), "--prompt", "hi", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: this checks the message where there is none")
def test_run_cuda_without_a_gpu_is_a_clear_error(checkpoint, capsys):
    assert main(["run", "--model", str(checkpoint), "--prompt", "hi", "--backend", "cuda"]) == 2
    assert "the cuda backend needs an NVIDIA GPU" in capsys.readouterr().err


def test_run_missing_model(tmp_path, capsys):
    assert main(["run", "--model", str(tmp_path / "none.gguf"), "--prompt", "hi"]) == 2
    assert "none.gguf" in capsys.readouterr().err
