"""Compile CUDA source to a cubin with NVRTC (cuda.bindings.nvrtc); no GPU or driver needed.

Headers: the CUDA runtime headers (cuda_bf16.h, ...) and CCCL come from the nvidia-cuda-runtime / nvidia-cuda-cccl
wheels or a local toolkit, found with cuda.pathfinder; lucegen's own .cuh headers are passed in memory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence


class CompileError(RuntimeError):
    """NVRTC rejected a rendered file: the message holds the log and the offending source lines."""


@dataclass(frozen=True)
class KernelResources:
    registers: int
    spill_stores: int | None  # None: not reported (read from the cubin, which records no spill counts)
    spill_loads: int | None
    stack_bytes: int
    static_smem: int


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    log: str
    resources: Mapping[str, KernelResources]


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


def _check(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        _, msg = _nvrtc().nvrtcGetErrorString(err)
        raise CompileError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")
    return rest[0] if len(rest) == 1 else rest


@lru_cache(maxsize=1)
def version() -> str:
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


@lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    """Directories holding cuda_bf16.h and CCCL (cuda/std/...), from the header wheels or a local toolkit."""
    from cuda import pathfinder
    dirs = []
    for lib in ("cudart", "cccl"):
        found = pathfinder.locate_nvidia_header_directory(lib)
        if found is None:
            raise CompileError(
                f"CUDA headers for {lib!r} not found: install the nvidia-cuda-runtime and nvidia-cuda-cccl wheels "
                "(pip install 'cuda-toolkit[cudart,cccl]') or a CUDA toolkit")
        dirs.append(found.abs_path)
    return tuple(dict.fromkeys(dirs))


def base_options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", "-default-device",
            "--use_fast_math", "-lineinfo", *(f"-I{d}" for d in include_dirs())]


def compile_cubin(source: str, filename: str, arch: str, options: Sequence[str],
                  headers: Mapping[str, str], source_path: Path | None = None) -> Compiled:
    nvrtc = _nvrtc()
    names = [n.encode() for n in headers]
    bodies = [t.encode() for t in headers.values()]
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), len(names), bodies, names),
                  "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        if int(err) != 0:
            files = {filename: (source_path or Path(filename), source), **{n: (Path(n), t) for n, t in headers.items()}}
            raise CompileError(_explain(log, files))
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return Compiled(cubin=cubin, log=log, resources=resources(log, cubin))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _explain(log: str, files: Mapping[str, tuple[Path, str]]) -> str:
    """The NVRTC log, then each line it complains about, named by file (the rendered .cu or a header) and line."""
    main_path = next(iter(files.values()))[0]
    out = [f"NVRTC could not compile {main_path}:", log.strip()]
    for name, line in dict.fromkeys(re.findall(r"([\w./-]+)\((\d+)\): (?:error|catastrophic error)", log)):
        path, text = files.get(name, (Path(name), ""))
        lines, n = text.splitlines(), int(line)
        if 1 <= n <= len(lines):
            out.append(f"  {path}:{n}: {lines[n - 1].strip()}")
    return "\n".join(out)


def resources(log: str, cubin: bytes) -> dict[str, KernelResources]:
    """Each kernel's resources from the ptxas report, or from the cubin's notes where the report lacks it (an
    NVRTC that served the program from a cache of its own printed no report on the lab GPU's image)."""
    from .cubin import kernel_resources
    out = parse_ptxas(log)
    for name, r in kernel_resources(cubin).items():
        out.setdefault(name, KernelResources(registers=r["registers"], spill_stores=None, spill_loads=None,
                                             stack_bytes=r["stack_bytes"], static_smem=0))
    return out


_PROPS = re.compile(r"Function properties for (\w+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, KernelResources]:
    """Registers, spills, stack and static shared memory of each entry function, from `ptxas -v` output.

    Each function's report is a "Function properties for <name>" line, its stack/spill line and, for entry
    functions, its "Used N registers" line; the report is keyed by that name, so the order in which ptxas
    interleaves "Compiling entry function" lines does not matter.
    """
    out: dict[str, KernelResources] = {}
    current, frame = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _PROPS.search(line):
            current, frame = m.group(1), (0, 0, 0)
        elif current and (m := _FRAME.search(line)):
            frame = tuple(int(g) for g in m.groups())
        elif current and (m := _USED.search(line)):
            out[current] = KernelResources(registers=int(m.group(1)), stack_bytes=frame[0], spill_stores=frame[1],
                                           spill_loads=frame[2], static_smem=int(m.group(2) or 0))
            current = None
    return out
