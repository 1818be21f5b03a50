"""tools/sass_diff.py's comparison of two disassemblies: the same text, the same code up to a consistent renaming of
registers (the data flow kept), the same instructions in another order, or other instructions."""
from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("sass_diff", Path(__file__).parents[1] / "tools" / "sass_diff.py")
sass_diff = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_diff)


def sass(*lines: str) -> str:
    """nvdisasm -c's layout: a section header, then each instruction after its offset."""
    return "\n".join(["\t.section\t.text.k,\"ax\",@progbits", ".text.k:",
                      *(f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(lines))])


CODE = ("LDG.E R2, desc[UR4][R4.64]", "LDG.E R3, desc[UR4][R6.64]", "@!P0 FADD R5, R2, -R3", "STG.E [R8.64], R5")


def test_the_same_text_is_identical():
    assert sass_diff.compare(sass(*CODE), sass(*CODE)) == "identical"


def test_offsets_and_spacing_do_not_count():
    other = sass(*CODE).replace("/*0010*/                   ", "/*0400*/ ")
    assert sass_diff.compare(sass(*CODE), other) == "identical"


def test_registers_renamed_throughout_are_the_same_code():
    renamed = [line.replace("R2", "R20").replace("R3", "R31").replace("UR4", "UR9").replace("P0", "P3")
               for line in CODE]
    assert sass_diff.compare(sass(*CODE), sass(*renamed)) == "renamed"


def test_operands_swapped_are_not_a_renaming():
    swapped = [*CODE[:2], "@!P0 FADD R5, R3, -R2", CODE[3]]  # b - a for a - b: the same names, another data flow
    assert sass_diff.compare(sass(*CODE), sass(*swapped)) == "reordered"


def test_instructions_in_another_order_are_reordered():
    assert sass_diff.compare(sass(*CODE), sass(CODE[1], CODE[0], *CODE[2:])) == "reordered"


def test_added_and_removed_instructions_are_counted():
    other = [*CODE[:3], "FMUL R5, R5, 0.5", "FMUL R5, R5, 0.5", CODE[3]]
    assert sass_diff.compare(sass(*CODE), sass(*other)) == "differs: +2 -0"
    assert sass_diff.compare(sass(*other), sass(*CODE[1:])) == "differs: +0 -3"
