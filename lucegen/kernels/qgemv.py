"""Quantized GEMV and small-M GEMM, Y = X W^T for W [N, K] in a GGUF format: numpy reference, units, launchers.

W is stored exactly as in the GGUF file (lucegen.model.quants' layouts; bf16 as plain bf16 rows), X is fp32
[M, K], Y fp32 [M, N]. The kernels (templates/qgemv.cuh) stream W through shared memory once (16-byte cp.async),
decode each weight piece once in registers, bit-equal to quants.dequantize, and multiply it into an M-tile of
activation rows held in shared memory as fp32: MT = 1 for the decode GEMV, up to 8 for the GEMM of a tree verify.
M is any number of rows, in M-tiles; the weights are re-read once per M-tile, by blocks that run side by side so
that the re-reads come from L2. Why a tile of 8, not all 64 rows at once: 64 rows of activations do not fit in
shared memory beside the weight stages, nor 64 x rows-per-warp accumulators in registers, and with fp32 FMAs the
kernel is bound by arithmetic, not bytes, from about 8 rows on an RTX 3090 (sooner on an H200). Every (format, K)
gets both kernels, with the same arithmetic per output, so a GEMM row is the GEMV of that row bit for bit.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..model.quants import GGMLType, block_shape, dequantize, quantize
from ..runtime.memory import DeviceArray
from ..spec import WEIGHT_FORMATS, ChipSpec

DEFAULT_MIX = "q4_k_m"  # the quantization lucegen builds for by default (the 27B's deployment)
MT_CHOICES = (8, 4, 2)  # activation rows per GEMM block pass, the largest whose stages fit shared memory
RESERVED_SMEM = 1024    # shared memory the hardware keeps per block (sm_80+)


@dataclass(frozen=True)
class Format:
    """A weight format as the kernels read it (quant.cuh's trait `cls`): a block of `block_values` values in
    `block_bytes` bytes, decoded in `pieces` pieces; `aligned16` when every block starts on a 16-byte boundary."""
    name: str
    ggml: GGMLType
    cls: str
    block_values: int
    block_bytes: int
    pieces: int
    aligned16: bool

    @property
    def slice_values(self) -> int:
        """K is processed in slices of one piece per lane of a warp."""
        return 32 * self.block_values // self.pieces

    @property
    def slice_bytes(self) -> int:
        return self.slice_values // self.block_values * self.block_bytes

    @property
    def slot_bytes(self) -> int:
        """Shared memory for one row's slice: widened to 16-byte boundaries unless blocks are 16-byte aligned."""
        return self.slice_bytes if self.aligned16 else (self.slice_bytes + 14 + 15) // 16 * 16

    def row_bytes(self, k: int) -> int:
        check_k(self, k)
        return k // self.block_values * self.block_bytes


FORMATS = {f.name: f for f in (
    Format("bf16", GGMLType.BF16, "FmtBf16", 8, 16, 1, True),
    Format("q8_0", GGMLType.Q8_0, "FmtQ8_0", 32, 34, 1, False),
    Format("q4_0", GGMLType.Q4_0, "FmtQ4_0", 32, 18, 1, False),
    Format("q4_k", GGMLType.Q4_K, "FmtQ4_K", 256, 144, 8, True),
    Format("q5_k", GGMLType.Q5_K, "FmtQ5_K", 256, 176, 8, True),
    Format("q6_k", GGMLType.Q6_K, "FmtQ6_K", 256, 210, 8, False),
)}
assert tuple(FORMATS) == WEIGHT_FORMATS


def fmt_of(name: str | GGMLType) -> Format:
    """The Format of a spec weight-format name ('q4_k') or a ggml type."""
    for f in FORMATS.values():
        if name in (f.name, f.ggml):
            return f
    raise ValueError(f"no quantized GEMV for weight format {name!r} (formats: {', '.join(FORMATS)})")


def check_k(fmt: Format, k: int) -> None:
    if k <= 0 or k % fmt.block_values:
        raise ValueError(f"{fmt.name} rows of K = {k} values: K must be a positive multiple of the "
                         f"{fmt.name} block of {fmt.block_values} values")


# ---- numpy reference -----------------------------------------------------------------------------------------
def encode(w: np.ndarray, fmt: str) -> np.ndarray:
    """float rows [N, K] -> the format's bytes [N, row_bytes] (quants.quantize; bf16 rounds to nearest even)."""
    return quantize(w, fmt_of(fmt).ggml)


def reference(raw: np.ndarray, fmt: str, x: np.ndarray) -> np.ndarray:
    """Y [M, N] = X [M, K] times the dequantized rows of raw [N, row_bytes]^T, in float64."""
    w = dequantize(raw, fmt_of(fmt).ggml).astype(np.float64)
    return np.atleast_2d(x).astype(np.float64) @ w.T


# ---- kernel shapes -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tuning:
    threads: int
    rows: int     # rows per warp and pass (their pieces share each activation load)
    mt: int       # activation rows per block pass
    stages: int   # pipeline items in flight
    xfull: bool   # the M-tile's activations loaded once (all of K), not with each stage

    def smem(self, fmt: Format, k: int) -> int:
        """Dynamic shared memory: per stage, the pass's rows' slice (and the M-tile's activations of the slice),
        or once, the M-tile's activations of every slice."""
        g = self.threads // 32 * self.rows
        x = self.mt * fmt.slice_values * 4 * (-(-k // fmt.slice_values) if self.xfull else 1)
        return (x if self.xfull else 0) + self.stages * (g * fmt.slot_bytes + (0 if self.xfull else x))


def tuning(spec: ChipSpec, fmt: Format, k: int, gemm: bool) -> Tuning:
    """The GEMV (MT = 1) or GEMM tuning of a spec: the spec's GEMV threads and rows per warp; the GEMM's M-tile
    the largest (8, 4, 2) whose two stages fit a block. Then, within the budget (the GEMV: room for two blocks
    per SM; the GEMM: one block), activations loaded once if that leaves two stages, and the most stages (up to 4)."""
    g, c = spec.tuning.gemv, spec.chip
    base = Tuning(threads=g.threads, rows=g.rows_per_warp, mt=1, stages=2, xfull=False)
    if gemm:
        fits = [mt for mt in MT_CHOICES if dataclasses.replace(base, mt=mt).smem(fmt, k) <= c.smem_per_block]
        base = dataclasses.replace(base, mt=fits[0] if fits else MT_CHOICES[-1])
        budget = c.smem_per_block
    else:
        budget = min(c.smem_per_block, c.smem_per_sm // 2 - RESERVED_SMEM)
    options = [dataclasses.replace(base, xfull=x, stages=n) for x in (True, False) for n in (4, 3, 2)]
    t = next((o for o in options if o.smem(fmt, k) <= budget), base)
    if t.smem(fmt, k) > c.smem_per_block:
        raise ValueError(f"{spec.name}: {fmt.name} {'GEMM' if gemm else 'GEMV'} of K = {k} with {t} needs "
                         f"{t.smem(fmt, k)} bytes of shared memory; a block may use {c.smem_per_block}")
    return t


def kernel_name(fmt: Format, k: int, t: Tuning) -> str:
    return f"qgemv_{fmt.name}_k{k}" if t.mt == 1 else f"qgemm_{fmt.name}_k{k}_m{t.mt}"


# ---- which (format, K) pairs a model needs -------------------------------------------------------------------
def _matrix_pairs(items: Iterable[tuple[str, GGMLType, tuple[int, ...]]], tied: bool) -> list[tuple[str, int]]:
    """(format, K) of the matrices a forward multiplies: 2-D tensors except the conv1d taps and the embeddings
    (a row gather), unless the embeddings are tied and serve as the LM head."""
    out = set()
    for name, t, shape in items:
        if len(shape) != 2 or "conv1d" in name or ("token_embd" in name and not tied):
            continue
        if t not in (GGMLType.F32, GGMLType.F16):
            out.add((fmt_of(t).name, shape[-1]))
    return sorted(out)


def mix_pairs(model: ModelConfig, mix: str = "q4_k_m") -> list[tuple[str, int]]:
    """The (format, K) pairs of `model` quantized with lucegen's rendition of a llama.cpp mix."""
    from ..model.checkpoint import gguf_types
    from ..model.gguf_file import gguf_name, gguf_shape
    from ..model.weights import weight_shapes
    types, _ = gguf_types(model, mix)
    return _matrix_pairs(((gguf_name(n), types[n], gguf_shape(n, s)) for n, s in weight_shapes(model).items()),
                         model.tie_word_embeddings)


def gguf_pairs(checkpoint) -> list[tuple[str, int]]:
    """The (format, K) pairs of a GGUF file's matrices (lucegen.model.gguf_file.GGUFCheckpoint)."""
    raws = (checkpoint.raw(name) for name in checkpoint.tensors)
    return _matrix_pairs(((r.name, r.type, r.shape) for r in raws), checkpoint.config.tie_word_embeddings)


def units(spec: ChipSpec, model: ModelConfig, pairs: Iterable[tuple[str, int]] | None = None) -> list[KernelUnit]:
    """One unit per format: the GEMV and the GEMM of each of its K, and the format's dequantizer. By default the
    pairs of the model in DEFAULT_MIX that the spec runs; an engine loading a GGUF file passes gguf_pairs(file)."""
    if pairs is None:
        pairs = [(f, k) for f, k in mix_pairs(model, DEFAULT_MIX) if f in spec.tuning.weight_formats]
    pairs = sorted(set(pairs))
    out = []
    for name in dict.fromkeys(f for f, _ in pairs):
        fmt = fmt_of(name)
        kernels = []
        for k in sorted(k for f, k in pairs if f == name):
            check_k(fmt, k)
            for gemm in (False, True):
                t = tuning(spec, fmt, k, gemm)
                kernels.append({"name": kernel_name(fmt, k, t), "k": k, "mt": t.mt, "rows": t.rows, "stages": t.stages,
                                "xfull": t.xfull, "smem": t.smem(fmt, k), "min_blocks": 1 if gemm else 2})
        threads = spec.tuning.gemv.threads
        sigs = tuple(KernelSig(k["name"], threads, dynamic_smem=k["smem"]) for k in kernels)
        out.append(KernelUnit(f"qgemv_{fmt.name}", "qgemv.cu.j2",
                              {"fmt": fmt.name, "cls": fmt.cls, "threads": threads, "kernels": kernels},
                              (*sigs, KernelSig(f"qdequant_{fmt.name}", threads))))
    return out


# ---- launchers -----------------------------------------------------------------------------------------------
def device_weights(raw: np.ndarray) -> DeviceArray:
    """Rows of format bytes on the device, the allocation padded to a 16-byte multiple (the kernels read whole
    16-byte words)."""
    raw = np.ascontiguousarray(raw).view(np.uint8).ravel()
    out = DeviceArray.empty(-(-raw.size // 16) * 16, np.uint8)
    out.view(raw.size).copy_from(raw)
    return out


class QMatmul:
    """Y [M, N] = X [M, K] W^T for W [N, K] in format `fmt`: the GEMV kernel for M = 1, the GEMM for M > 1."""

    def __init__(self, module, spec: ChipSpec, fmt: str, k: int):
        self.fmt, self.k = fmt_of(fmt), k
        self.row_bytes = self.fmt.row_bytes(k)
        self.ops = []
        for gemm in (False, True):
            t = tuning(spec, self.fmt, k, gemm)
            kernel = module.kernel(kernel_name(self.fmt, k, t))
            smem = t.smem(self.fmt, k)
            if smem > 48 * 1024:
                kernel.set_max_dynamic_smem(smem)
            per_sm = min(spec.tuning.gemv.blocks_per_sm, kernel.max_active_blocks_per_sm(t.threads, smem))
            if per_sm < 1:
                raise RuntimeError(f"{kernel.name} does not fit an SM ({t.threads} threads, {smem} bytes)")
            self.ops.append((kernel, t, smem, per_sm * spec.chip.sm_count))

    def grid(self, m: int) -> int:
        """Blocks for M rows: whole groups of one block per M-tile (consecutive, so they share L2)."""
        _, t, _, blocks = self.ops[m > 1]
        mtiles = -(-m // t.mt)
        return mtiles * max(1, blocks // mtiles)

    def __call__(self, w: DeviceArray, x: DeviceArray, y: DeviceArray, n: int, m: int = 1, stream=None) -> None:
        if n < 1 or m < 1:
            raise ValueError(f"need at least one row of W and of X; got n = {n}, m = {m}")
        if w.nbytes < -(-n * self.row_bytes // 16) * 16:
            raise ValueError(f"{self.fmt.name} weights of {n} rows x {self.k} need {n * self.row_bytes} bytes "
                             f"padded to 16 (device_weights); got {w.nbytes}")
        if x.size < m * self.k or y.size < m * n or x.dtype != np.float32 or y.dtype != np.float32:
            raise ValueError(f"x must be fp32 [{m}, {self.k}] and y fp32 [{m}, {n}]; got {x} and {y}")
        kernel, t, smem, _ = self.ops[m > 1]
        kernel(self.grid(m), t.threads, w, x, y, n, m, smem=smem, stream=stream)


class Dequant:
    """out [N, K] fp32 = the values of N rows of K (a kernel around qdequant<F>: a format's decode alone), e.g.
    module.kernel("qdequant_q4_k")."""

    def __init__(self, kernel, spec: ChipSpec, threads: int):
        self.kernel, self.threads, self.blocks = kernel, threads, 4 * spec.chip.sm_count

    def __call__(self, w: DeviceArray, out: DeviceArray, n: int, k: int, stream=None) -> None:
        if out.size < n * k or out.dtype != np.float32:
            raise ValueError(f"out must be fp32 [{n}, {k}]; got {out}")
        self.kernel(self.blocks, self.threads, w, out, n, k, stream=stream)
