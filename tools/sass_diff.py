"""Whether two source trees compile to the same machine code, cubin by cubin: a change to the templates checked
without a GPU (a refactor that compiles to the same instructions behaves the same; one that does not needs its GPU
tests). Each tree (a directory, or a git revision, unpacked by `git archive` into a temporary directory) builds the
spec for each model in a process of its own, with its own lucegen, templates and build folder; each pair of cubins
is disassembled with nvdisasm (PyPI's nvidia-cuda-nvdisasm, or a CUDA toolkit's on PATH) and compared:

    identical     the same SASS text
    renamed       the same instructions in the same order, up to a renaming of registers and predicates (each
                  name replaced by the order of its first use, so the data flow is the same)
    reordered     the same multiset of instructions (names dropped), some in another order: not a proof, read the
                  disassembly
    differs       instructions added or removed: the counts are printed

    python3 tools/sass_diff.py BASE [TREE] [--spec specs/h200.yaml] [--model qwen3.5-0.8b qwen3.5-27b]

TREE defaults to the working tree (.). Exits 0 if every cubin is identical or renamed, else 1.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")       # the offset nvdisasm prints before an instruction
REGISTER = re.compile(r"\b(U?R|U?P)([0-9]+)\b")  # general, uniform and predicate registers (RZ, URZ, PT stay)


def nvdisasm() -> str:
    found = shutil.which("nvdisasm") or next(iter(glob.glob(
        str(Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "*" / "bin" / "nvdisasm"))), None)
    if found is None:
        sys.exit("sass_diff: no nvdisasm (pip install nvidia-cuda-nvdisasm, or put a CUDA toolkit's bin on PATH)")
    return found


def instructions(sass: str) -> list[str]:
    """The instruction lines of nvdisasm -c output, without their offsets, whitespace collapsed."""
    return [" ".join(ADDRESS.sub("", line).split()) for line in sass.splitlines() if ADDRESS.search(line)]


def canonical(lines: list[str]) -> list[str]:
    """lines with each register (of each kind) named by the order of its first use."""
    names: dict[str, str] = {}
    used: collections.Counter = collections.Counter()

    def rename(m: re.Match) -> str:
        if m.group(0) not in names:
            names[m.group(0)] = f"{m.group(1)}{used[m.group(1)]}'"
            used[m.group(1)] += 1
        return names[m.group(0)]
    return [REGISTER.sub(rename, line) for line in lines]


def compare(a: str, b: str) -> str:
    """identical / renamed / reordered / 'differs: +x -y' (instructions only in b, only in a), as the module says."""
    ia, ib = instructions(a), instructions(b)
    if ia == ib:
        return "identical"
    if canonical(ia) == canonical(ib):
        return "renamed"
    ca, cb = (collections.Counter(REGISTER.sub(r"\1", i) for i in x) for x in (ia, ib))
    if ca == cb:
        return "reordered"
    return f"differs: +{sum((cb - ca).values())} -{sum((ca - cb).values())}"


def unpack(tree: str, scratch: Path) -> Path:
    """A directory as it is; else a git revision of this repository unpacked into scratch."""
    if Path(tree).is_dir():
        return Path(tree).resolve()
    out = scratch / re.sub(r"[^\w.-]", "_", tree)
    out.mkdir()
    archive = subprocess.run(["git", "archive", tree], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def build(tree: Path, spec: str, model: str) -> Path:
    """The folder of the tree's cubins for spec and model (built in a process with the tree's lucegen)."""
    proc = subprocess.run([sys.executable, "-m", "lucegen.cli", "build", "--spec", spec, "--model", model],
                          cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        sys.exit(f"sass_diff: building {model} in {tree} failed\n{proc.stderr[-2000:]}")
    return tree / "build" / Path(spec).stem / model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="a directory or a git revision")
    ap.add_argument("tree", nargs="?", default=".", help="a directory or a git revision (default: .)")
    ap.add_argument("--spec", default="specs/h200.yaml", help="relative to each tree")
    ap.add_argument("--model", nargs="+", default=["qwen3.5-0.8b", "qwen3.5-27b"])
    args = ap.parse_args()
    tool, bad = nvdisasm(), 0
    with tempfile.TemporaryDirectory() as scratch:
        base, tree = unpack(args.base, Path(scratch)), unpack(args.tree, Path(scratch))
        for model in args.model:
            a, b = build(base, args.spec, model), build(tree, args.spec, model)
            for name in sorted({p.name for p in a.glob("*.cubin")} | {p.name for p in b.glob("*.cubin")}):
                if not (a / name).exists() or not (b / name).exists():
                    verdict = f"only in {args.tree if (b / name).exists() else args.base}"
                else:
                    sass = [subprocess.run([tool, "-c", str(d / name)], capture_output=True, text=True,
                                           check=True).stdout for d in (a, b)]
                    verdict = compare(*sass)
                bad += verdict not in ("identical", "renamed")
                print(f"{model}/{name}: {verdict}", flush=True)
    print(f"{bad} cubin(s) not the same code up to register names" if bad else "every cubin the same code")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
