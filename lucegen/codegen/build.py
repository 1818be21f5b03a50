"""`lucegen build`: render every kernel for (spec x model), compile with NVRTC, cache, write a manifest.

Layout under build/:
    cache/<key[:2]>/<key>.{cubin,json}   content-addressed by (source, headers, options, NVRTC version, arch)
    <spec>[-<arch>]/<model>/             what one build holds: <unit>.cu, <unit>.cubin, include/*.cuh, manifest.json
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..model.config import ModelConfig
from ..spec import ChipSpec
from . import nvrtc
from .render import headers, headers_digest, render
from .unit import KernelUnit

BUILD_DIR = Path(__file__).resolve().parent.parent.parent / "build"


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write through a temporary file in the same folder and rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@dataclass(frozen=True)
class KernelReport:
    unit: str
    name: str
    threads: int
    registers: int
    spill_stores: int | None
    spill_loads: int | None
    stack_bytes: int
    static_smem: int
    dynamic_smem: int
    coresident_blocks: int
    cooperative: bool


@dataclass(frozen=True)
class UnitResult:
    unit: KernelUnit
    source_path: Path
    cubin_path: Path
    key: str
    cached: bool
    kernels: tuple[KernelReport, ...]


@dataclass(frozen=True)
class BuildResult:
    spec: ChipSpec
    model: ModelConfig
    arch: str
    directory: Path
    units: tuple[UnitResult, ...]

    def cubin(self, unit_name: str) -> Path:
        for u in self.units:
            if u.unit.name == unit_name:
                return u.cubin_path
        raise KeyError(f"no kernel unit {unit_name!r} in build {self.directory}")

    def module(self, unit_name: str):
        """Load a unit's cubin into the current CUDA context (needs a GPU)."""
        from ..runtime import Module
        return Module.from_file(self.cubin(unit_name))

    @property
    def kernels(self) -> list[KernelReport]:
        return [k for u in self.units for k in u.kernels]


def _key(source: str, options: Sequence[str], arch: str) -> str:
    h = hashlib.sha256()
    for part in (source, headers_digest(), "\0".join(options), nvrtc.version(), arch):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _compile_cached(unit: KernelUnit, source: str, source_path: Path, arch: str, cache: Path):
    """(key, cubin, resources, came from the cache) for one rendered unit."""
    if unit.arch_specific and not arch.endswith("a"):
        arch += "a"
    options = [*nvrtc.base_options(arch), *unit.options]
    key = _key(source, options, arch)
    cubin_path = cache / key[:2] / f"{key}.cubin"
    meta_path = cubin_path.with_suffix(".json")
    if cubin_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        resources = {k: nvrtc.KernelResources(**v) for k, v in meta["resources"].items()}
        return key, cubin_path.read_bytes(), resources, True
    compiled = nvrtc.compile_cubin(source, source_path.name, arch, options, headers(), source_path)
    write_atomic(cubin_path, compiled.cubin)
    write_atomic(meta_path, json.dumps({"log": compiled.log, "resources": {
        k: dataclasses.asdict(v) for k, v in compiled.resources.items()}}, indent=1))
    return key, compiled.cubin, compiled.resources, False


def build(spec: ChipSpec, model: ModelConfig, units: Sequence[KernelUnit], arch: str | None = None,
          root: Path = BUILD_DIR) -> BuildResult:
    """Render and compile `units`; `arch` overrides the spec's (emulating one chip's kernels on another)."""
    if arch and arch != spec.chip.arch:
        spec = spec.with_arch(arch)
        folder = f"{spec.name}-{arch}"
    else:
        folder = spec.name
    arch = spec.chip.arch
    directory = root / folder / model.name
    for name, text in headers().items():
        write_atomic(directory / "include" / name, text)
    results = []
    for unit in units:
        banner = (f"Rendered by lucegen from templates/{unit.template} for spec {spec.name} ({arch}), "
                  f"model {model.name}. Edit the template, not this file.")
        source = render(unit, banner)
        source_path = directory / f"{unit.name}.cu"
        write_atomic(source_path, source)
        key, cubin, resources, cached = _compile_cached(unit, source, source_path, arch, root / "cache")
        cubin_path = directory / f"{unit.name}.cubin"
        write_atomic(cubin_path, cubin)
        reports = []
        for sig in unit.kernels:
            r = resources.get(sig.name)
            if r is None:
                raise nvrtc.CompileError(f"{source_path}: kernel {sig.name} is listed but not in the cubin")
            regs = -(-r.registers // 8) * 8  # registers are allocated in groups of 8 per thread
            reports.append(KernelReport(
                unit=unit.name, name=sig.name, threads=sig.threads, registers=r.registers,
                spill_stores=r.spill_stores, spill_loads=r.spill_loads, stack_bytes=r.stack_bytes,
                static_smem=r.static_smem, dynamic_smem=sig.dynamic_smem, cooperative=sig.cooperative,
                coresident_blocks=spec.max_coresident_blocks(sig.threads, regs, r.static_smem + sig.dynamic_smem)))
        results.append(UnitResult(unit, source_path, cubin_path, key, cached, tuple(reports)))
    result = BuildResult(spec, model, arch, directory, tuple(results))
    write_atomic(directory / "manifest.json", json.dumps(_manifest(result), indent=1))
    return result


def _manifest(result: BuildResult) -> dict:
    return {
        "spec": result.spec.name,
        "arch": result.arch,
        "nvrtc": nvrtc.version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": result.model.to_dict(),
        "units": [{
            "name": u.unit.name, "template": u.unit.template, "source": u.source_path.name,
            "cubin": u.cubin_path.name, "key": u.key, "cached": u.cached,
            "kernels": [dataclasses.asdict(k) for k in u.kernels],
        } for u in result.units],
    }


def resource_table(result: BuildResult) -> str:
    head = ("kernel", "threads", "regs", "spill st/ld", "stack", "smem", "co-resident")
    spills = lambda k: "?" if k.spill_stores is None else f"{k.spill_stores}/{k.spill_loads}"
    rows = [(k.name, str(k.threads), str(k.registers), spills(k), str(k.stack_bytes),
             str(k.static_smem + k.dynamic_smem), str(k.coresident_blocks)) for k in result.kernels]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)])
