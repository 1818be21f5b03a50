"""tools/ab.py, the A/B tools' driver: one process per tree with that tree first on PYTHONPATH, the trees
alternating round after round, each child's last JSON line its result; a failed child stops the run and says which
tree; and each A/B tool's child side answers --help (its arguments parse) without a GPU, as do the kernel-boundary
and pipe-rate tools (whose kernels compile here)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).parents[1] / "tools"
spec = importlib.util.spec_from_file_location("ab", TOOLS / "ab.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)

# a child that reports which tree its PYTHONPATH starts with, its arguments, and fails in a tree named "broken"
CHILD = '''
import json, os, sys
tree = os.environ["PYTHONPATH"].split(os.pathsep)[0]
print("some output first")
if os.path.basename(tree) == "broken":
    sys.exit("the measurement broke")
print(json.dumps({"tree": os.path.basename(tree), "args": sys.argv[1:]}))
'''


@pytest.fixture
def child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return script


def test_trees_alternate_round_after_round_each_on_its_pythonpath(tmp_path, child, capsys):
    trees = [str(tmp_path / "a"), str(tmp_path / "b")]
    runs = ab.alternate(str(child), trees, rounds=3, args=["--x", "1"])
    assert list(runs) == trees
    for tree in trees:
        assert [r["tree"] for r in runs[tree]] == [Path(tree).name] * 3
        assert all(r["args"] == ["--child", "--x", "1"] for r in runs[tree])
    printed = [json.loads(line)["tree"] for line in capsys.readouterr().out.splitlines()]
    assert printed == ["a", "b"] * 3


def test_a_tree_at_a_spec_file_runs_that_tree_with_the_spec_passed_on(tmp_path, child):
    tree = str(tmp_path / "a")
    runs = ab.alternate(str(child), [tree, f"{tree}@/specs/variant.yaml"], rounds=1, args=["--x", "1"])
    assert runs[tree][0] == {"tree": "a", "args": ["--child", "--x", "1"]}
    assert runs[f"{tree}@/specs/variant.yaml"][0] == {"tree": "a", "args": ["--child", "--x", "1", "--spec",
                                                                               "/specs/variant.yaml"]}


def test_a_failed_child_stops_the_run_and_names_its_tree(tmp_path, child):
    with pytest.raises(RuntimeError, match=r"broken: the measurement failed \(exit 1\)[\s\S]*the measurement broke"):
        ab.alternate(str(child), [str(tmp_path / "a"), str(tmp_path / "broken")], rounds=2, args=[])


def test_the_tools_get_none_and_the_failure_on_stderr(tmp_path, child, capsys):
    assert ab.alternate_or_report(str(child), [str(tmp_path / "broken")], rounds=1, args=[]) is None
    assert "broken: the measurement failed" in capsys.readouterr().err


@pytest.mark.parametrize("tool", ["prefill_ab.py", "decode_ab.py", "layered_ab.py"])
def test_each_ab_tool_parses_its_arguments_without_a_gpu(tool):
    out = subprocess.run([sys.executable, str(TOOLS / tool), "--help"], capture_output=True, text=True, check=True)
    assert "--trees" in out.stdout and "--rounds" in out.stdout


def test_the_kernel_boundary_tool_parses_its_arguments_without_a_gpu():
    out = subprocess.run([sys.executable, str(TOOLS / "kernel_boundary.py"), "--help"], capture_output=True,
                         text=True, check=True)
    assert "--launches" in out.stdout


def test_the_pipe_rates_tool_parses_its_arguments_and_its_kernels_compile_without_a_gpu():
    out = subprocess.run([sys.executable, str(TOOLS / "pipe_rates.py"), "--help"], capture_output=True, text=True,
                         check=True)
    assert "--warps" in out.stdout
    spec = importlib.util.spec_from_file_location("pipe_rates", TOOLS / "pipe_rates.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.compile_source("sm_90")  # every kind's kernel, mma.sync's int8 shape included
