"""Render Jinja CUDA templates (templates/*.cu.j2) into CUDA source.

Templates stay thin: they render constants, types, unroll counts and the list of kernels; the algorithms live in
the .cuh device-function headers beside them, which NVRTC sees as named in-memory headers.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

import jinja2

from .unit import KernelUnit

TEMPLATES_DIR = Path(__file__).resolve().parent.parent.parent / "templates"


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def headers() -> dict[str, str]:
    """Every device-function header, by include name."""
    return {p.name: p.read_text() for p in sorted(TEMPLATES_DIR.glob("*.cuh"))}


def headers_digest() -> str:
    h = hashlib.sha256()
    for name, text in headers().items():
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def render(unit: KernelUnit, banner: str) -> str:
    try:
        return _env().get_template(unit.template).render(banner=banner, **unit.params)
    except jinja2.TemplateError as e:
        where = f"{e.filename}:{e.lineno}" if getattr(e, "lineno", None) else unit.template
        raise RuntimeError(f"rendering {unit.name} from {where}: {e}") from e
