"""tools/sass_size.py: each instruction of one kernel attributed to its inlining chain (nvdisasm -gi's comments,
innermost frame first, outermost last), and every call site's size the code inlined under it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).parents[1] / "tools"
sys.path.insert(0, str(TOOLS))  # sass_size imports sass_diff as the tools do
spec = importlib.util.spec_from_file_location("sass_size", TOOLS / "sass_size.py")
sass_size = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_size)


def instr(i: int, text: str = "NOP") -> str:
    return f"        /*{16 * i:04x}*/                   {text} ;"


SASS = "\n".join([
    ".text.other:",
    '\t//## File "/b/k.cu", line 3',
    instr(0),
    ".text.k:",
    '\t//## File "/b/k.cu", line 10',
    instr(0),
    '\t//## File "/b/g.cuh", line 5 inlined at "/b/f.cuh", line 20',
    '\t//## File "/b/f.cuh", line 20 inlined at "/b/k.cu", line 11',
    instr(1, "FFMA R1, R2, R3, R1"),
    instr(2),  # no comment: the chain above still holds
    '\t//## File "/b/f.cuh", line 21 inlined at "/b/k.cu", line 11',
    instr(3),
    "\t.section\t.nv.global.init,\"aw\",@progbits",
    instr(0, ".word 0x0"),  # data after the code: not the kernel's
])


def test_chains_are_outermost_first_and_only_the_kernels():
    assert sass_size.chains(SASS, "k") == [
        (("/b/k.cu", "10"),),
        (("/b/k.cu", "11"), ("/b/f.cuh", "20"), ("/b/g.cuh", "5")),
        (("/b/k.cu", "11"), ("/b/f.cuh", "20"), ("/b/g.cuh", "5")),
        (("/b/k.cu", "11"), ("/b/f.cuh", "21")),
    ]
    assert sass_size.chains(SASS, "missing") == []


def test_a_call_site_counts_everything_inlined_under_it():
    sizes = sass_size.call_site_sizes(sass_size.chains(SASS, "k"), depth=2)
    assert sizes[(("/b/k.cu", "11"),)] == 3
    assert sizes[(("/b/k.cu", "11"), ("/b/f.cuh", "20"))] == 2
    assert sizes[(("/b/k.cu", "10"),)] == 1
    assert max(len(k) for k in sizes) == 2  # nothing deeper than asked
