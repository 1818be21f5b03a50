"""Where a kernel's machine code goes: its SASS bytes attributed to the source lines that inlined them, as a tree
from the kernel's body down (the cubins carry -lineinfo; nvdisasm -gi prints each instruction's inlining chain).
A persistent kernel walks most of its code every step, so its size against the SM's instruction caches is a cost
(a warp waits on an instruction fetch after each jump to code the caches no longer hold):

    python3 tools/sass_size.py build/h200/qwen3.5-0.8b/megakernel.cubin --kernel mk_decode [--depth 3] [--top 8]

Prints the kernel's size, then per call site (depth 1 = the kernel body's lines, 2 = the lines of the function it
calls, ...) its bytes and share, the largest `--top` children under each.
"""
from __future__ import annotations

import argparse
import collections
import functools
import re
import subprocess
import sys
from pathlib import Path

from sass_diff import ADDRESS, nvdisasm

FRAME = re.compile(r'"([^"]+)", line (\d+)')
SASS_BYTES = 16  # every sm_70+ instruction


def chains(sass: str, kernel: str) -> list[tuple[str, ...]]:
    """Per instruction of `kernel`, its inlining chain outermost first ((path, line) frames)."""
    out, chain, in_group, inside = [], (), False, False
    for line in sass.splitlines():
        if line.startswith(".text.") or line.lstrip().startswith(".section"):
            inside = line == f".text.{kernel}:"  # (its subroutines follow it inside its section)
            continue
        if not inside:
            continue
        frames = FRAME.findall(line) if line.lstrip().startswith("//##") else []
        if frames:
            if not in_group:
                chain, in_group = [], True
            for frame in frames:
                if not chain or chain[-1] != frame:
                    chain.append(frame)
            continue
        if ADDRESS.search(line):
            in_group = False
            out.append(tuple(reversed(chain)))
    return out


def call_site_sizes(instrs: list[tuple], depth: int) -> collections.Counter:
    """{chain prefix of length 1 .. depth: its instructions}: every call site counts all the code inlined under it."""
    return collections.Counter(c[:d] for c in instrs for d in range(1, min(depth, len(c)) + 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cubin")
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    sass = subprocess.run([nvdisasm(), "-gi", a.cubin], capture_output=True, text=True, check=True).stdout
    instrs = chains(sass, a.kernel)
    if not instrs:
        sys.exit(f"sass_size: no kernel {a.kernel} in {a.cubin}")
    total = len(instrs) * SASS_BYTES
    print(f"{a.kernel}: {len(instrs)} instructions, {total / 1024:.1f} KB")
    sizes = call_site_sizes(instrs, a.depth)

    @functools.cache
    def source(path: str) -> list[str]:  # where it was compiled, else beside the cubin (a build folder)
        folder = Path(a.cubin).parent
        found = next((p for p in (Path(path), folder / Path(path).name, folder / "include" / Path(path).name)
                      if p.is_file()), None)
        return found.read_text().splitlines() if found else []

    def name(frame: tuple[str, str]) -> str:
        path, n = frame
        text = source(path)[int(n) - 1].strip() if int(n) <= len(source(path)) else ""
        return f"{Path(path).name}:{n}  {text[:72]}"

    def show(prefix: tuple) -> None:
        children = [(k, n) for k, n in sizes.items() if len(k) == len(prefix) + 1 and k[:len(prefix)] == prefix]
        for key, n in sorted(children, key=lambda kv: -kv[1])[:a.top]:
            b = n * SASS_BYTES
            print(f"{'  ' * len(prefix)}{b / 1024:7.1f} KB {100 * b / total:5.1f}%  {name(key[-1])}")
            show(key)
    show(())
    return 0


if __name__ == "__main__":
    sys.exit(main())
