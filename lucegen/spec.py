"""Chip specs: one YAML per GPU, validated on load.

A spec holds the chip's facts (arch, SM count, shared memory, registers, memory, bandwidth) and the tuning choices
the kernels are rendered with (block counts, threads, DDTree budget, KV format, ...). Every error names the file,
the key (as a dotted path) and the reason.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"

KV_FORMATS = ("bf16", "fp8", "q8_0", "q4_0", "tq3_0")
WEIGHT_FORMATS = ("bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
# Archs lucegen renders kernels for. NVRTC is asked as well (supported_archs) when it can be loaded.
KNOWN_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
REG_ALLOC_UNIT = 256         # registers a warp is given at a time (every arch listed)
WARP_ALLOC_GRANULARITY = 4   # warps given registers together: one per SM sub-partition


class SpecError(ValueError):
    """A spec that cannot be used. The message names the file, the key and the reason."""


@dataclass(frozen=True)
class Chip:
    """Facts about the silicon (from the vendor's datasheet or the device's own properties)."""
    arch: str                   # e.g. sm_90
    sm_count: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    regs_per_sm: int
    smem_per_sm: int            # bytes of shared memory per SM
    smem_per_block: int         # bytes a block may opt in to
    l2_bytes: int
    memory_bytes: int
    bandwidth_gbs: float        # datasheet DRAM bandwidth
    measured_read_gbs: float | None = None   # a measured pure-read rate on this chip, where we have one

    @property
    def cc(self) -> int:
        """Compute capability as an integer: sm_90 -> 90."""
        return int(self.arch.removeprefix("sm_").rstrip("a"))

    @property
    def read_gbs(self) -> float:
        """The bandwidth ceiling benchmarks compare with: measured where known, else the datasheet's."""
        return self.measured_read_gbs or self.bandwidth_gbs


@dataclass(frozen=True)
class Launch:
    """A grid shape: blocks (0 = as many as the chip co-schedules) and threads per block."""
    threads: int
    blocks: int = 0


GEMV_METHODS = ("ldg", "bulk")
# kernels/qgemm_tc.py's. Not Q6_K: its rows are repacked on the GPU at load (pairs of blocks, 16-byte aligned) for
# the int8 GEMV/GEMM, and qgemm_tc's TcQ6K read GGUF's 210-byte blocks (~38% of the read rate; off in every spec),
# so it was dropped rather than ported.
TENSOR_CORE_FORMATS = ("q4_k",)
MMA_FORMATS = ("q4_k", "q6_k")  # the formats with an int8 mma GEMM (kernels/qgemv.py's Format.mma)
QGEMM_METHODS = ("dp4a", "mma")  # the quantized GEMM (M > 1): integer dot products, or int8 mma.sync (sm_80+)


@dataclass(frozen=True)
class GemvTuning:
    method: str = "ldg"         # ldg: 16-byte loads from registers; bulk: copy-engine tiles into shared memory (sm_90+)
    threads: int = 256
    rows_per_warp: int = 2      # ldg: rows one warp reduces at once (independent 16-byte loads in flight)
    blocks_per_sm: int = 4
    tile_bytes: int = 16384     # bulk: bytes per shared-memory tile (whole rows)
    stages: int = 4             # bulk: tiles in flight per block


@dataclass(frozen=True)
class ModelMinBlocks:
    model: str    # a model config's name (qwen3.5-27b)
    min_blocks: int


@dataclass(frozen=True)
class FormatMmaFrom:
    format: str         # a weight format the int8 mma GEMM takes (MMA_FORMATS)
    gemm_mma_from: int  # the smallest M it takes in that format


@dataclass(frozen=True)
class QGemvTuning:
    """The quantized GEMV (M = 1) and small-M GEMM of kernels/qgemv.py (templates/qgemv.cuh: work split, rings)."""
    threads: int = 256
    rows_per_warp: int = 1    # rows a warp multiplies at once (they share each activation load)
    span: int = 2             # K-slices (32 pieces) a warp loads before multiplying: 16-byte loads in flight per lane
    gemm_m_tile: int = 8      # activation rows per block of the GEMM (M > 1); the weights are re-read per M-tile
    gemm_span: int = 1
    gemm_rows_per_warp: int = 1  # the GEMM's: each activation row read from L1 serves this many weight rows
    stages: int = 0           # items (span slices of its rows) in each warp's cp.async ring in shared memory; 0: none,
                              # the loads go straight into registers
    gemm: str = "dp4a"        # the GEMM (M > 1) of the formats that have both: dp4a, or mma (int8 tensor cores)
    gemm_mma_from: int = 2    # with gemm = mma: the smallest M the int8 mma GEMM takes (dp4a's M-tiles below it)
    format_mma_from: tuple[FormatMmaFrom, ...] = ()  # formats whose mma GEMM takes calls from another M
    quad_sums: bool = False   # with gemm = mma: Q4_K's products summed by quads of lanes, not by lanes (quant.cuh's
                              # QuadSums), in the GEMV and every GEMM alike: the mma GEMM keeps a quarter of the
                              # sums (M-tiles of 24), the GEMV pays two shuffles and adds a piece
    tensor_core_formats: tuple[str, ...] = ()  # formats whose rows go through kernels/qgemm_tc.py at every M (the
                                               # decode GEMV and the verify GEMM in one batch-invariant kernel)
    min_blocks: int = 2       # the GEMV's blocks an SM at least (__launch_bounds__): more cap its registers, for more
                              # warps (loads in flight) an SM
    model_min_blocks: tuple[ModelMinBlocks, ...] = ()  # models whose GEMVs take another floor (one that spills
                                                       # another model's shapes)

    def mma_from_for(self, fmt: str) -> int:
        """The smallest M the int8 mma GEMM takes in format `fmt` (with gemm = mma)."""
        return next((f.gemm_mma_from for f in self.format_mma_from if f.format == fmt), self.gemm_mma_from)

    def min_blocks_for(self, model: str | None) -> int:
        """The GEMV's floor of blocks an SM for `model` (None: the spec's)."""
        return next((m.min_blocks for m in self.model_min_blocks if m.model == model), self.min_blocks)


@dataclass(frozen=True)
class LayeredTuning:
    """The layer-by-layer step (lucegen/engine/layered.py)."""
    pdl: bool = False  # programmatic dependent launch (sm_90+): a kernel's blocks are launched while the kernel
                       # before it finishes, and wait for it where they read what it wrote (templates/common.cuh)
    row_threads: int = 0  # threads a block of its row kernels (add + RMSNorm, SiLU x up); 0: tuning.norm.threads


@dataclass(frozen=True)
class ModelThreads:
    model: str    # a model config's name (qwen3.5-27b)
    threads: int


@dataclass(frozen=True)
class MegakernelTuning:
    blocks: int
    threads: int
    prefetch_distance: int = 1  # phases ahead whose state, KV and norm weights idle blocks pull into L2
    weight_prefetch_tiles: int = 0  # weight tiles beyond the ring's that each block asks L2 for
    barrier_tiles: int = 0  # weight tiles a block issues into its ring while it waits at a grid barrier (0: all it has
                            # free slots for)
    inflight_tiles: int = 0  # weight tiles a block's ring may have issued and not yet landed (0: as many as it has slots)
    model_threads: tuple[ModelThreads, ...] = ()  # models whose megakernel takes other threads

    def threads_for(self, model: str) -> int:
        """Threads per block of `model`'s megakernel."""
        return next((m.threads for m in self.model_threads if m.model == model), self.threads)


@dataclass(frozen=True)
class DDTreeTuning:
    budget: int = 22
    chain_seed: bool = True
    block_size: int = 16
    max_budget: int | None = None  # the largest tree the GPU engines allocate and compile their tree kernels for
                                   # (default: budget); above budget, a smaller tuned budget leaves larger trees
                                   # verifiable (bench speculative's sweep, lucegen tune, --budget)
    deltanet_slice: int = 16  # value columns a tree DeltaNet item (one block) holds, 4 a warp (lucegen/kernels/
                              # tree.py): fewer, larger items make each key head's q and k fronts fewer times; the
                              # layered decode step's DeltaNet is the same kernel (a 1-node tree)

    @property
    def capacity(self) -> int:
        """Nodes below the root a GPU engine's tree verify takes at most."""
        return self.max_budget or self.budget


@dataclass(frozen=True)
class DraftTuning:
    """The DFlash draft on the GPU (lucegen/engine/draft_gpu.py)."""
    window: int = 4096  # context rows its per-layer K/V rings hold: past this many committed tokens the draft attends
                        # the last `window` only (the published server keeps a feature ring of min(context, 4096))


GEMM_METHODS = ("mma", "wgmma")


@dataclass(frozen=True)
class ModelPdl:
    model: str    # a model config's name (qwen3.5-0.8b)
    pdl: bool


@dataclass(frozen=True)
class PrefillTuning:
    chunk_tokens: int = 8192  # prompt tokens per pass through the layers (their activations must fit memory)
    gemm: str = "mma"         # mma: mma.sync + cp.async (sm_80+); wgmma: TMA + warpgroup MMA (sm_90a, Hopper only)
    split_k: int = 1          # most slices of K for a residual-add GEMM with fewer tiles than SMs, their partial tiles
                              # added in slice order (deterministic, but the grouping depends on the prompt's length);
                              # 1: none, and every sum of the prefill is the same however the prompt is chunked
    pdl: bool = False         # programmatic dependent launch (sm_90+): each kernel's blocks start while the one before
                              # finishes (the GEMM's first weight tiles load then); the same arithmetic either way
    model_pdl: tuple[ModelPdl, ...] = ()  # models whose prefill launches otherwise than `pdl` says
    attention: str = "mma"    # the attention where its (query tile, head) blocks fill the SMs: mma.sync (sm_80+), or
                              # wgmma with TMA (sm_90a, Hopper only; attention_wgmma.cuh)
    attention_split: int = 1  # blocks (a cluster, sm_90+) sharing a query tile's keys when the attention's (query
                              # tile, head) blocks would leave SMs idle; 1: one block walks all of a tile's keys

    def pdl_for(self, model: str) -> bool:
        """Whether `model`'s prefill launches programmatically."""
        return next((m.pdl for m in self.model_pdl if m.model == model), self.pdl)


@dataclass(frozen=True)
class TopKTuning:
    """The per-position top-k of draft logits on the device (kernels/topk.py, templates/topk.cuh)."""
    threads: int = 256   # a power of two
    slice: int = 8192    # logits a block reads (a multiple of threads): 31 blocks a row of a 248,320 vocabulary
    max_k: int = 64      # the most tokens a position may ask for (32, 64 or 128): the largest DDTree budget it feeds


@dataclass(frozen=True)
class Tuning:
    megakernel: MegakernelTuning
    gemv: GemvTuning = field(default_factory=GemvTuning)
    qgemv: QGemvTuning = field(default_factory=QGemvTuning)
    layered: LayeredTuning = field(default_factory=LayeredTuning)
    norm: Launch = field(default_factory=lambda: Launch(threads=256))
    argmax: Launch = field(default_factory=lambda: Launch(threads=512, blocks=0))
    topk: TopKTuning = field(default_factory=TopKTuning)
    ddtree: DDTreeTuning = field(default_factory=DDTreeTuning)
    prefill: PrefillTuning = field(default_factory=PrefillTuning)
    draft: DraftTuning = field(default_factory=DraftTuning)
    kv_format: str = "bf16"
    weight_formats: tuple[str, ...] = ("bf16",)
    max_context: int = 32768


@dataclass(frozen=True)
class ChipSpec:
    name: str
    description: str
    chip: Chip
    tuning: Tuning
    path: Path | None = field(default=None, compare=False)

    def with_arch(self, arch: str) -> "ChipSpec":
        """The same spec compiled for another arch (emulation: a 3090 spec's kernels on an H200)."""
        source = f"{self.path or self.name} emulated at {arch}"
        check_arch(arch, source, "arch override")
        return validate(dataclasses.replace(self, chip=dataclasses.replace(self.chip, arch=arch)), source)

    def with_prefill(self, **changes: Any) -> "ChipSpec":
        """The same spec with other prefill tuning (gemm="wgmma", split_k=4, ...), validated."""
        prefill = dataclasses.replace(self.tuning.prefill, **changes)
        return validate(dataclasses.replace(self, tuning=dataclasses.replace(self.tuning, prefill=prefill)),
                        f"{self.path or self.name} with prefill {changes}")

    def max_coresident_blocks(self, threads: int, regs_per_thread: int = 0, smem: int = 0) -> int:
        """Blocks of `threads` threads the whole chip holds at once (occupancy bound, per SM x SMs). Registers go to
        a warp in units of REG_ALLOC_UNIT, and to warps in groups of WARP_ALLOC_GRANULARITY (an SM's four
        sub-partitions each hold a quarter of its register file): 17 warps of 120 registers do not fit 64K."""
        c = self.chip
        per_sm = min(c.max_blocks_per_sm, c.max_threads_per_sm // threads)
        if regs_per_thread:
            warp_regs = -(-regs_per_thread * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
            warps = c.regs_per_sm // warp_regs // WARP_ALLOC_GRANULARITY * WARP_ALLOC_GRANULARITY
            per_sm = min(per_sm, warps // -(-threads // 32))
        if smem:
            per_sm = min(per_sm, c.smem_per_sm // smem)
        return per_sm * c.sm_count

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("path")
        return d


# ---- loading and validation ---------------------------------------------------------------------------------

def _fail(source: str, key: str, reason: str) -> typing.NoReturn:
    raise SpecError(f"{source}: {key}: {reason}")


def supported_archs() -> tuple[str, ...]:
    """Archs the installed NVRTC can compile for (falls back to KNOWN_ARCHS when NVRTC cannot be loaded)."""
    try:
        from cuda.bindings import nvrtc
        err, archs = nvrtc.nvrtcGetSupportedArchs()
        if int(err) == 0:
            return tuple(f"sm_{a}" for a in archs)
    except Exception:  # NVRTC not loadable here: validate against the static list
        pass
    return KNOWN_ARCHS


def check_arch(arch: Any, source: str, key: str) -> str:
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+a?", arch):
        _fail(source, key, f"expected an arch like 'sm_90', got {arch!r}")
    base = arch.rstrip("a")
    if base not in supported_archs():
        _fail(source, key, f"{arch} is not supported by the installed NVRTC (supports {', '.join(supported_archs())})")
    return arch


def _build(cls: type, data: Any, source: str, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    if not isinstance(data, Mapping):
        _fail(source, prefix.rstrip(".") or "<top>", f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "path"}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        _fail(source, f"{prefix}{unknown[0]}", f"unknown key (known keys here: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                _fail(source, key, "missing required key")
            continue
        kwargs[name] = _convert(hints[name], data[name], source, key)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, source, key + ".")
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, source, key)
    if origin is tuple:
        if not isinstance(value, list):
            _fail(source, key, f"expected a list, got {type(value).__name__}")
        (inner, _) = typing.get_args(tp)
        return tuple(_convert(inner, v, source, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            _fail(source, key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(source, key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(source, key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(source, key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"spec schema has an unsupported type {tp} at {key}")  # a bug in this module, not the YAML


def _check_launch(spec: ChipSpec, source: str, key: str, threads: int, blocks: int) -> None:
    if threads % 32 or not 32 <= threads <= 1024:
        _fail(source, f"{key}.threads", f"{threads} must be a multiple of 32 between 32 and 1024")
    limit = spec.max_coresident_blocks(threads)
    if blocks < 0 or blocks > limit:
        _fail(source, f"{key}.blocks",
              f"{blocks} blocks of {threads} threads cannot all be co-resident on {spec.chip.sm_count} SMs "
              f"(at most {limit})")


def gemm_methods(spec: ChipSpec) -> tuple[str, ...]:
    """The prefill GEMM methods the chip runs: wgmma is Hopper's alone (sm_90a; Blackwell's tensor cores take
    tcgen05 instead)."""
    return GEMM_METHODS if spec.chip.cc == 90 else ("mma",)


def validate(spec: ChipSpec, source: str) -> ChipSpec:
    c, t = spec.chip, spec.tuning
    check_arch(c.arch, source, "chip.arch")
    for name in ("sm_count", "max_threads_per_sm", "max_blocks_per_sm", "regs_per_sm", "smem_per_sm",
                 "smem_per_block", "l2_bytes", "memory_bytes"):
        if getattr(c, name) <= 0:
            _fail(source, f"chip.{name}", f"must be positive, got {getattr(c, name)}")
    if c.smem_per_block > c.smem_per_sm:
        _fail(source, "chip.smem_per_block", f"{c.smem_per_block} exceeds smem_per_sm {c.smem_per_sm}")
    if c.bandwidth_gbs <= 0:
        _fail(source, "chip.bandwidth_gbs", f"must be positive, got {c.bandwidth_gbs}")
    if c.measured_read_gbs is not None and not 0 < c.measured_read_gbs <= c.bandwidth_gbs * 1.05:
        _fail(source, "chip.measured_read_gbs", f"{c.measured_read_gbs} is not within the datasheet's {c.bandwidth_gbs}")
    mk = t.megakernel
    if mk.blocks <= 0:
        _fail(source, "tuning.megakernel.blocks", "a persistent kernel needs at least one block")
    _check_launch(spec, source, "tuning.megakernel", mk.threads, mk.blocks)
    for i, m in enumerate(mk.model_threads):
        _check_launch(spec, source, f"tuning.megakernel.model_threads[{i}]", m.threads, mk.blocks)
    if mk.prefetch_distance < 0:
        _fail(source, "tuning.megakernel.prefetch_distance", "must be >= 0")
    if mk.weight_prefetch_tiles < 0:
        _fail(source, "tuning.megakernel.weight_prefetch_tiles", "must be >= 0")
    if mk.barrier_tiles < 0:
        _fail(source, "tuning.megakernel.barrier_tiles", "must be >= 0 (0: no cap)")
    if mk.inflight_tiles < 0:
        _fail(source, "tuning.megakernel.inflight_tiles", "must be >= 0 (0: no cap)")
    _check_launch(spec, source, "tuning.norm", t.norm.threads, t.norm.blocks)
    if t.layered.row_threads and (t.layered.row_threads % 32 or not 32 <= t.layered.row_threads <= 1024):
        _fail(source, "tuning.layered.row_threads", f"{t.layered.row_threads} must be 0 (tuning.norm.threads) or a "
              "multiple of 32 between 32 and 1024")
    _check_launch(spec, source, "tuning.argmax", t.argmax.threads, t.argmax.blocks)
    _check_launch(spec, source, "tuning.gemv", t.gemv.threads, t.gemv.blocks_per_sm * c.sm_count)
    if not 1 <= t.gemv.rows_per_warp <= 8:
        _fail(source, "tuning.gemv.rows_per_warp", f"{t.gemv.rows_per_warp} must be between 1 and 8")
    _check_launch(spec, source, "tuning.qgemv", t.qgemv.threads, c.sm_count)
    for key in ("rows_per_warp", "span", "gemm_span", "gemm_rows_per_warp"):
        if not 1 <= getattr(t.qgemv, key) <= 8:
            _fail(source, f"tuning.qgemv.{key}", f"{getattr(t.qgemv, key)} must be between 1 and 8")
    floors = (("tuning.qgemv.min_blocks", t.qgemv.min_blocks),
              *((f"tuning.qgemv.model_min_blocks[{i}].min_blocks", m.min_blocks)
                for i, m in enumerate(t.qgemv.model_min_blocks)))
    for key, floor in floors:
        if not 1 <= floor <= c.max_threads_per_sm // t.qgemv.threads:
            _fail(source, key, f"{floor} must be between 1 and {c.max_threads_per_sm // t.qgemv.threads} (blocks of "
                  f"{t.qgemv.threads} threads an SM)")
    if t.qgemv.stages == 1 or not 0 <= t.qgemv.stages <= 8:
        _fail(source, "tuning.qgemv.stages", f"{t.qgemv.stages} must be 0 (no ring) or between 2 and 8")
    if unknown := set(t.qgemv.tensor_core_formats) - set(TENSOR_CORE_FORMATS):
        _fail(source, "tuning.qgemv.tensor_core_formats", f"{', '.join(sorted(unknown))}: the tensor-core kernel "
              f"takes {', '.join(TENSOR_CORE_FORMATS)}")
    if t.qgemv.gemm not in QGEMM_METHODS:
        _fail(source, "tuning.qgemv.gemm", f"{t.qgemv.gemm!r} is not one of {', '.join(QGEMM_METHODS)}")
    if t.qgemv.quad_sums and t.qgemv.gemm != "mma":
        _fail(source, "tuning.qgemv.quad_sums", "sums by quads serve the int8 mma GEMM (gemm: mma); the dp4a GEMM's "
              "M-tile of 8 spills with them")
    thresholds = (("tuning.qgemv.gemm_mma_from", t.qgemv.gemm_mma_from),
                  *((f"tuning.qgemv.format_mma_from[{i}].gemm_mma_from", f.gemm_mma_from)
                    for i, f in enumerate(t.qgemv.format_mma_from)))
    for key, m in thresholds:
        if not 2 <= m <= 65:
            _fail(source, key, f"{m} must be between 2 and 65 (a tree verify's rows)")
    for i, f in enumerate(t.qgemv.format_mma_from):
        if f.format not in MMA_FORMATS:
            _fail(source, f"tuning.qgemv.format_mma_from[{i}].format", f"{f.format!r}: the int8 mma GEMM takes "
                  f"{', '.join(MMA_FORMATS)}")
    if t.qgemv.gemm_m_tile not in (2, 4, 8, 16):
        _fail(source, "tuning.qgemv.gemm_m_tile", f"{t.qgemv.gemm_m_tile} must be 2, 4, 8 or 16")
    if t.gemv.method not in GEMV_METHODS:
        _fail(source, "tuning.gemv.method", f"{t.gemv.method!r} is not one of {', '.join(GEMV_METHODS)}")
    if t.gemv.method == "bulk" and c.cc < 90:
        _fail(source, "tuning.gemv.method", f"bulk copies need sm_90 or newer; this chip is {c.arch}")
    if not 2 <= t.gemv.stages <= 8:
        _fail(source, "tuning.gemv.stages", f"{t.gemv.stages} must be between 2 and 8")
    if t.gemv.tile_bytes % 16 or t.gemv.stages * t.gemv.tile_bytes > c.smem_per_block:
        _fail(source, "tuning.gemv.tile_bytes", f"{t.gemv.stages} stages of {t.gemv.tile_bytes} bytes must be "
              f"16-byte multiples fitting the {c.smem_per_block} bytes of shared memory a block may use")
    if t.kv_format not in KV_FORMATS:
        _fail(source, "tuning.kv_format", f"{t.kv_format!r} is not one of {', '.join(KV_FORMATS)}")
    if t.kv_format == "fp8" and c.cc < 89:
        _fail(source, "tuning.kv_format", f"fp8 KV needs sm_89 or newer; this chip is {c.arch}")
    for i, wf in enumerate(t.weight_formats):
        if wf not in WEIGHT_FORMATS:
            _fail(source, f"tuning.weight_formats[{i}]", f"{wf!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    if not 1 <= t.ddtree.budget <= 1024:
        _fail(source, "tuning.ddtree.budget", f"{t.ddtree.budget} must be between 1 and 1024")
    if t.ddtree.max_budget is not None and not t.ddtree.budget <= t.ddtree.max_budget <= 1024:
        _fail(source, "tuning.ddtree.max_budget", f"{t.ddtree.max_budget} must be between the budget "
              f"({t.ddtree.budget}) and 1024")
    if t.ddtree.block_size < 2:
        _fail(source, "tuning.ddtree.block_size", "must be at least 2")
    if t.ddtree.deltanet_slice not in (8, 16, 32, 64):
        _fail(source, "tuning.ddtree.deltanet_slice", f"{t.ddtree.deltanet_slice} is not 8, 16, 32 or 64 (4 value "
              f"columns a warp, 2 to 16 warps a block)")
    if t.max_context < 1024:
        _fail(source, "tuning.max_context", f"{t.max_context} is below the 1024-token minimum")
    if t.prefill.chunk_tokens % 64 or not 64 <= t.prefill.chunk_tokens <= t.max_context:
        _fail(source, "tuning.prefill.chunk_tokens", f"{t.prefill.chunk_tokens} must be a multiple of 64 (the "
              f"DeltaNet chunk) between 64 and max_context {t.max_context}")
    if t.prefill.gemm not in GEMM_METHODS:
        _fail(source, "tuning.prefill.gemm", f"{t.prefill.gemm!r} is not one of {', '.join(GEMM_METHODS)}")
    for key, pdl in (("tuning.layered.pdl", t.layered.pdl), ("tuning.prefill.pdl", t.prefill.pdl),
                     *((f"tuning.prefill.model_pdl[{i}].pdl", m.pdl) for i, m in enumerate(t.prefill.model_pdl))):
        if pdl and c.cc < 90:
            _fail(source, key, f"programmatic dependent launch needs sm_90 or newer; this chip is {c.arch}")
    if t.prefill.gemm not in gemm_methods(spec):
        _fail(source, "tuning.prefill.gemm", f"wgmma is Hopper's (sm_90a) instruction; this chip is {c.arch}")
    if t.prefill.attention not in GEMM_METHODS:
        _fail(source, "tuning.prefill.attention", f"{t.prefill.attention!r} is not one of {', '.join(GEMM_METHODS)}")
    if t.prefill.attention not in gemm_methods(spec):
        _fail(source, "tuning.prefill.attention", f"wgmma is Hopper's (sm_90a) instruction; this chip is {c.arch}")
    if t.draft.window < 64:
        _fail(source, "tuning.draft.window", f"{t.draft.window} must be at least 64 context rows")
    if not 1 <= t.prefill.attention_split <= 8 or (t.prefill.attention_split > 1 and c.cc < 90):
        _fail(source, "tuning.prefill.attention_split", f"{t.prefill.attention_split} must be 1, or 2 to 8 blocks of "
              f"a cluster on sm_90 or newer (this chip is {c.arch})")
    if not 1 <= t.prefill.split_k <= 8:
        _fail(source, "tuning.prefill.split_k", f"{t.prefill.split_k} must be between 1 (no split) and 8")
    _check_topk(spec, source)
    return spec


def topk_shared_bytes(threads: int, slice_: int, max_k: int) -> int:
    """Static shared memory of templates/topk.cuh's kernel (TopKShape): the gathered entries >= L, the group
    maxima and a list per warp (8 bytes an entry), and a few words."""
    groups = min(2 * max_k, threads)
    return 8 * (max_k * (slice_ // groups) + groups + threads // 32 * max_k + threads // 32) + 16


def _check_topk(spec: ChipSpec, source: str) -> None:
    k = spec.tuning.topk
    if k.threads & (k.threads - 1) or not 64 <= k.threads <= 1024:
        _fail(source, "tuning.topk.threads", f"{k.threads} must be a power of two between 64 and 1024")
    if k.max_k not in (32, 64, 128) or k.max_k > k.threads:
        _fail(source, "tuning.topk.max_k", f"{k.max_k} must be 32, 64 or 128, and at most threads ({k.threads})")
    if k.slice % k.threads or not 1 <= k.slice // k.threads <= 64:
        _fail(source, "tuning.topk.slice", f"{k.slice} must be 1 to 64 times threads ({k.threads})")
    smem = topk_shared_bytes(k.threads, k.slice, k.max_k)
    if smem > 48 * 1024:
        _fail(source, "tuning.topk.slice", f"{k.slice} values a block with max_k {k.max_k} need {smem} bytes of "
              f"static shared memory (at most 49152)")


def load_spec(path: str | Path) -> ChipSpec:
    """Load and validate a spec. `path` may also be a bare name ('h200') found in specs/."""
    p = Path(path)
    if not p.exists() and not p.suffix and (SPECS_DIR / f"{p.name}.yaml").exists():
        p = SPECS_DIR / f"{p.name}.yaml"
    source = str(p)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"{source}: no such spec file (specs available: {', '.join(list_specs())})") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{source}: not valid YAML: {e}") from None
    spec = _build(ChipSpec, data, source, "")
    return validate(dataclasses.replace(spec, path=p), source)


def list_specs() -> list[str]:
    return sorted(p.stem for p in SPECS_DIR.glob("*.yaml"))


def all_specs() -> list[ChipSpec]:
    return [load_spec(SPECS_DIR / f"{n}.yaml") for n in list_specs()]


def match_device(arch: str, sm_count: int, memory_bytes: int) -> ChipSpec | None:
    """The spec describing a device: same arch and SM count, nearest memory size (H100 80 GB vs H200 141 GB)."""
    candidates = [s for s in all_specs() if s.chip.arch == arch and s.chip.sm_count == sm_count]
    return min(candidates, key=lambda s: abs(s.chip.memory_bytes - memory_bytes), default=None)


def spec_for_current_device() -> ChipSpec:
    """The spec of the GPU in this machine; an unknown GPU gets the H200 spec emulated at its arch."""
    from .runtime.driver import device_info
    info = device_info()
    return match_device(info.arch, info.sm_count, info.memory_bytes) or load_spec("h200").with_arch(info.arch)
