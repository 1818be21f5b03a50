"""bench/peers.py: a torch peer runs in a child process that imports torch first; its result comes back as JSON, a
failed child is tried once more, and a peer that cannot run gives None with the reason printed. Here torch is a
stand-in package written to tmp_path (its import failing on the first attempt where asked), and the peer functions
a module beside it."""
from __future__ import annotations

import importlib.util
import os
import textwrap
from pathlib import Path

import pytest

from lucegen.bench import peers

FAKE_TORCH = """
import os
if os.environ.get("FAKE_TORCH_FAIL_ONCE") and not os.path.exists(os.environ["FAKE_TORCH_FAIL_ONCE"]):
    open(os.environ["FAKE_TORCH_FAIL_ONCE"], "w").close()
    raise RuntimeError("expected ident but found ')' here: annotate(strtag) -> ()")
imported_first = "lucegen.runtime" not in __import__("sys").modules

class cuda:
    @staticmethod
    def is_available():
        return os.environ.get("FAKE_TORCH_NO_GPU") is None
"""

FAKE_PEERS = """
import torch

def echo(*args):
    return {"args": list(args), "torch_first": torch.imported_first}

def broken():
    raise ValueError("no such shape")
"""


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(textwrap.dedent(FAKE_TORCH))
    (tmp_path / "fake_peers.py").write_text(textwrap.dedent(FAKE_PEERS))
    monkeypatch.syspath_prepend(str(tmp_path))
    # the child finds the stand-ins first, and lucegen where this process found it
    lucegen_root = str(Path(peers.__file__).parents[2])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), lucegen_root, os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()
    assert importlib.util.find_spec("torch").origin.startswith(str(tmp_path))
    return tmp_path


def test_a_peer_runs_in_a_child_that_imported_torch_first(fake_torch):
    assert peers.peer("echo", 3, [1.5, "x"], module="fake_peers") == {"args": [3, [1.5, "x"]], "torch_first": True}


def test_a_failed_torch_import_is_tried_again_in_a_fresh_process(fake_torch, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_TORCH_FAIL_ONCE", str(fake_torch / "failed-once"))
    assert peers.peer("echo", 1, module="fake_peers") == {"args": [1], "torch_first": True}
    assert "attempt 1 failed (RuntimeError: expected ident but found ')'" in capsys.readouterr().out


def test_a_peer_that_cannot_run_gives_none_and_says_why(fake_torch, monkeypatch, capsys):
    assert peers.peer("broken", module="fake_peers") is None
    out = capsys.readouterr().out
    assert out.count("failed (ValueError: no such shape)") == peers.ATTEMPTS
    monkeypatch.setenv("FAKE_TORCH_NO_GPU", "1")
    assert peers.peer("echo", module="fake_peers") is None
    assert "torch sees no CUDA device" in capsys.readouterr().out


def test_without_torch_there_is_no_peer_and_no_child(monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(peers.subprocess, "run", lambda *a, **k: pytest.fail("a child was started"))
    assert peers.peer("matmul_tflops", 8, 8, 8) is None
