"""KV-cache rows read back as attention reads them (templates/kv.cuh): the device decode of each KV format, beside
its numpy reference (lucegen.model.kvformats), so the GPU tests can hold one against the other."""
from __future__ import annotations

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model import kvformats
from ..spec import ChipSpec
from .qgemv import Dequant

THREADS = 256
# KV format -> the device decode (quant.cuh / kv.cuh); fp8 rows are read by the attention kernels' own conversion
DECODERS = {"bf16": "FmtBf16", "q8_0": "FmtQ8_0", "q4_0": "FmtQ4_0", "tq3_0": "FmtTQ3_0"}


def reference(raw: np.ndarray, fmt: str) -> np.ndarray:
    """What attention reads of rows stored in `fmt`: the values (the rotated-domain values for tq3_0)."""
    return kvformats.decode_rotated(raw) if fmt == "tq3_0" else kvformats.decode(raw, fmt)


def units(spec: ChipSpec) -> list[KernelUnit]:
    formats = [{"name": f, "cls": c, "rotated": f == "tq3_0"} for f, c in DECODERS.items()]
    return [KernelUnit("kv_read", "kv.cu.j2", {"formats": formats, "threads": THREADS},
                       tuple(KernelSig(f"kv_read_{f}", THREADS) for f in DECODERS))]


def reader(module, spec: ChipSpec, fmt: str) -> Dequant:
    """op(rows, out, n, head_dim): out [n, head_dim] fp32 = n cached rows of `fmt` as attention reads them."""
    return Dequant(module.kernel(f"kv_read_{fmt}"), spec, THREADS)
