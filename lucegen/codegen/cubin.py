"""Kernel resources read from a cubin's ELF notes (.nv.info), for when NVRTC gives no ptxas report.

The global .nv.info section holds attribute records {u8 format, u8 attribute, payload}; with format 0x04 the
payload is a u16 size and that many bytes. EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11) carry
{u32 symbol index, u32 value}; symbol names come from .symtab and its string table.
"""
from __future__ import annotations

import struct

EIFMT_SVAL, EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x04, 0x11, 0x2F


def _sections(elf: bytes) -> dict[str, tuple[int, int, int]]:
    """name -> (offset, size, link) of every section of a 64-bit little-endian ELF."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = raw[shstrndx][4]
    name = lambda o: elf[names_at + o: elf.index(b"\0", names_at + o)].decode()
    return {name(s[0]): (s[4], s[5], s[6]) for s in raw} | {f"#{i}": (s[4], s[5], s[6]) for i, s in enumerate(raw)}


def _symbol_names(elf: bytes, sections) -> list[str]:
    offset, size, link = sections[".symtab"]
    strings = sections[f"#{link}"][0]
    names = []
    for i in range(size // 24):
        st_name = struct.unpack_from("<I", elf, offset + 24 * i)[0]
        names.append(elf[strings + st_name: elf.index(b"\0", strings + st_name)].decode())
    return names


def kernel_resources(elf: bytes) -> dict[str, dict[str, int]]:
    """{kernel: {"registers": n, "stack_bytes": n}} for every function with a register count."""
    sections = _sections(elf)
    symbols = _symbol_names(elf, sections)
    offset, size, _ = sections[".nv.info"]
    out: dict[str, dict[str, int]] = {}
    p, end = offset, offset + size
    while p < end:
        fmt, attr = elf[p], elf[p + 1]
        if fmt != EIFMT_SVAL:
            p += 4 if fmt in (0x02, 0x03) else 2
            continue
        n = struct.unpack_from("<H", elf, p + 2)[0]
        if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and n == 8:
            sym, value = struct.unpack_from("<II", elf, p + 4)
            key = "registers" if attr == EIATTR_REGCOUNT else "stack_bytes"
            out.setdefault(symbols[sym], {})[key] = value
        p += 4 + n
    return {k: {"stack_bytes": 0, **v} for k, v in out.items() if "registers" in v}
