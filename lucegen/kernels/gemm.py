"""bf16 GEMM on tensor cores, Y = X W^T with fp32 accumulation, and its fused epilogues: numpy reference, units,
launcher.

X [M, K] is the prefill's activations (M = tokens), W [N, K] a weight as stored; K a multiple of 64, N even.
Epilogues: `bf16` and `f32` store Y; `add` adds Y into an fp32 [M, N] array (the residual stream); `silu` writes
silu(gate) * up [M, N/2] bf16 from a W whose rows pair gate_proj and up_proj (row 2i = gate row i, row 2i + 1 = up
row i: the packing of kernels.megakernel, whose weight arena the prefill reads).

Two methods (the spec's tuning.prefill.gemm): `mma` (every chip: mma.sync with cp.async stages, gemm.cuh) and `wgmma`
(Hopper, sm_90a: a TMA producer warpgroup feeding wgmma consumer warpgroups through mbarrier stages, gemm_wgmma.cuh;
the launcher passes X and W as 2-D tensor maps, and launches no more blocks than the SMs hold at once: each takes
tiles in turn, its next tile's loads under its last one's epilogue). Two tile shapes are compiled per chip and
method: a large one (the most throughput per block) and a small one (more blocks for short prompts and narrow
outputs); the launcher picks, per call, the one with the shorter estimated time.

Split-K (tuning.prefill.split_k > 1): an `add` whose tiles are fewer than the SMs (the 0.8B's N = 1024 projections at
a short prompt) is split along K into `splits` slices, slice s taking k tiles [s KT / splits, (s + 1) KT / splits)
of the KT = K / 64 (`slices`), when that unloads the busiest SM and the tiles x slices blocks fit one wave of
resident blocks (`splits`). Each block writes its fp32 partial tile p_s to a slot of the launcher's workspace and
counts itself in on its tile's counter; the last block of a tile to arrive sums the tile's partials in slice order
and adds the sum into the residual once:

    Y = Y0 + ((((p_0 + p_1) + p_2) + ...) + p_{splits-1})      (fp32, left to right; `reference(..., splits)`)

so the result is the same bits run to run, whichever block finishes first (it still depends on the count of
slices, which depends on the prompt's length: chunking a prompt differently changes the sums' grouping). The last
block resets the tile's counter to zero, so the counters (a small buffer the Gemm allocates zeroed once) are zero
before every launch and no memset runs per call; no block ever waits for another. With wgmma (sm_90) a tile's
slices run as one cluster of blocks instead: each keeps its partial in its shared memory, and block r adds rows r,
r + splits, ... of the tile from all the partials, read through distributed shared memory in the same order (no
workspace, no counters). The token-N tiles split too (their partials stored transposed, as Y lays them out): a short
prompt's residual adds take 176-token tiles, whose blocks read less of X and W from L2 per FLOP than 64-row ones.
A token-N block's last tile goes the same way through shared memory for the epilogues that only write Y, which
then store whole rows of it instead of the accumulators' 16-byte pieces of 8 rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..reference.ops import silu
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec

BK = 64          # K columns per pipeline stage

MIN_SLICE = 4    # split-K: k tiles a slice of K takes at least

# wgmma's token-N tiles (TokenTile: tokens, consumer warpgroups of 64 weight rows, relative throughput, slices: 0, or
# the one count of slices of K it is taken for, most tokens: 0, or the longest launch it is taken for, blocks an SM).
# 176 tokens: a 520-token
# prompt is 3 tiles (1.5% padding) where 64-row tiles pad to 576 and 128-row ones to 640; 192 weight rows: the 0.8B's
# 8224-row in-projection is 43 x 3 = 129 tiles, one wave of 132 SMs. Throughputs from the GEMMs of the 0.8B and 27B
# at 520 tokens timed in graphs on the H200 (session 13, .lab/s13_gemm.py): 176x128 is the best tile on 5120-row
# outputs, 176x192 on wider ones. 88 tokens: the 0.8B's residual adds at 520 tokens in 48 tiles, split in two (96
# blocks, clusters of 2), where 176-token tiles take four slices for the same blocks and the same work a block, and
# add twice the partials across blocks (session 18: 0.8B pp520 graph 2,699 -> 2,677 us; 120 or 128 blocks in
# clusters of 3 or 4 do not fit the GPCs in one wave, 3,040 us). So it is taken for launches split in two only:
# unsplit, it reads W from L2 twice as often as a 176-token tile (the 27B's gate/up at 520 tokens: 23.0 ms against
# 20.7 on 176x192).
# 16 tokens (taken for launches of at most 16 tokens: the DFlash draft's block): there the weights are the bytes a
# GEMM moves, so its tiles are narrow (64 rows, two blocks an SM: the draft's 6,144-row [q | k | v] in 96 tiles and
# its 5,120-row residual adds in 80, split in 3 over clusters, where 64x128 tiles made 48 and 40 and left most SMs
# idle while the weights streamed) and as deep as two blocks' shared memory lets them (11 stages on Hopper). Its
# efficiency only ranks it among the tiles at <= 16 tokens, where any value above ~0.2 picks it (64x128 tiles hold as
# many weight rows in 4x the area). The 27B draft's forward (session 45, an H100 with the h200 spec; log
# results/logs/h100-s45-run1-draft-16-token-tiles.txt): 2.118 -> 2.013 ms a graph; [q | k | v] 179 -> 144 us, gate/up
# 725 -> 681; the residual adds one by one 469 -> 528, yet in the graph 2.039 ms with 64x128 tiles for them alone.
class TokenTile(NamedTuple):
    tokens: int
    consumers: int       # warpgroups of 64 weight rows
    efficiency: float    # relative throughput (TileConfig.efficiency)
    slices: int = 0      # TileConfig.slices
    most_tokens: int = 0  # TileConfig.most_tokens
    blocks: int = 1      # blocks an SM (their shared memory bounds the stages)


TOKEN_N_TILES = (TokenTile(176, 3, 1.0), TokenTile(176, 2, 0.9), TokenTile(88, 2, 0.9, slices=2),
                 TokenTile(16, 1, 0.5, most_tokens=16, blocks=2))

# name -> (epilogue functor, output element type, what it does)
EPILOGUES = {
    "bf16": ("StoreBf16", "bf16", "bf16 out"),
    "f32": ("StoreF32", "float", "fp32 out"),
    "add": ("AddF32", "float", "added into an fp32 residual"),
    "silu": ("SiluMulBf16", "bf16", "silu(gate) * up from paired gate/up rows, bf16 out"),
}
# the `add` kernel the launcher runs when it splits K: the slices of a tile summed in order, then added; by the
# tile's last block through a workspace (mma), or by the tile's cluster through its shared memory (wgmma)
SPLIT_ADD = "add_split"
KERNEL_EPILOGUES = {**EPILOGUES, SPLIT_ADD: ("AddF32Split", "float", "added into an fp32 residual, split-K slices "
                                             "summed in slice order by a tile's last block")}
CLUSTER_SPLIT_ADD = ("AddF32Cluster", "float", "added into an fp32 residual, split-K slices (a cluster of blocks) "
                     "summed in slice order through the cluster's shared memory")


@dataclass(frozen=True)
class TileConfig:
    bm: int
    bn: int
    wm: int          # mma: warps along M; wgmma: consumer warpgroups (64 rows each)
    wn: int          # mma: warps along N; wgmma: 1 (a warpgroup takes all BN columns, 128 per wgmma)
    stages: int
    min_blocks: int  # __launch_bounds__ blocks per SM the register allocation must allow
    efficiency: float  # relative throughput of a block's tile, for choosing between configs
    method: str = "mma"
    tokens_n: bool = False  # wgmma with the tokens on the instruction's N: bm tokens x bn = 64 wm weight rows
    slices: int = 0  # 0: any split of K (splits); else the config is taken only for launches split this many ways
    most_tokens: int = 0  # 0: any M; else the config is taken only for launches of at most this many rows

    @property
    def threads(self) -> int:
        return (self.wm + 1) * 128 if self.method == "wgmma" else self.wm * self.wn * 32

    @property
    def smem(self) -> int:
        tiles = self.stages * (self.bm + self.bn) * BK * 2
        # wgmma: 1024 bytes to align the swizzled tiles, a full and an empty mbarrier per stage
        return 1024 + tiles + self.stages * 16 if self.method == "wgmma" else tiles

    @property
    def name(self) -> str:
        return f"{'wt' if self.tokens_n else 'wg' if self.method == 'wgmma' else ''}{self.bm}x{self.bn}"

    def tiles(self, m: int, n: int) -> int:
        return math.ceil(m / self.bm) * math.ceil(n / self.bn)


def _deepest(spec: ChipSpec, bm: int, bn: int, wm: int, wn: int, min_blocks: int, eff: float,
             min_stages: int = 2, max_stages: int = 4, method: str = "mma", tokens_n: bool = False,
             slices: int = 0, most_tokens: int = 0) -> TileConfig | None:
    """The config with the most stages (min_stages .. max_stages) whose shared memory fits a block (and, for
    token-N tiles of more than one block an SM, lets that many share an SM's), or None."""
    for stages in range(max_stages, min_stages - 1, -1):
        cfg = TileConfig(bm, bn, wm, wn, stages, min_blocks, eff, method, tokens_n, slices, most_tokens)
        if cfg.smem <= spec.chip.smem_per_block and (not tokens_n or cfg.smem * min_blocks <= spec.chip.smem_per_sm):
            return cfg
    return None


def tile_configs(spec: ChipSpec) -> tuple[TileConfig, ...]:
    """(large, small, *token-N) tile shapes for the chip and its GEMM method.

    mma: 128x256 with 8 warps where three stages fit (A100, H100, H200), else 128x128 with 4 warps; the small shape
    is 64x128 with 4 warps. Each takes as many stages (<= 4) as fit.
    wgmma: 128x256 with two consumer warpgroups (two m64n128 wgmma per 16 columns of K each) with as many stages
    (<= 6) as fit, and 64x128 with one consumer warpgroup and 4 stages (two blocks share an SM's shared memory); then
    the token-N tiles for short prompts (TOKEN_N_TILES: tokens x weight rows, tokens on wgmma's N, so that a prompt
    splits into few tiles with little padding, one block an SM with as many stages as fit)."""
    if spec.tuning.prefill.gemm == "wgmma":
        large = _deepest(spec, 128, 256, 2, 1, 1, 1.0, min_stages=3, max_stages=6, method="wgmma")
        small = _deepest(spec, 64, 128, 1, 1, 2, 0.8, method="wgmma")
        tokens_n = tuple(c for t in TOKEN_N_TILES
                         if (c := _deepest(spec, t.tokens, 64 * t.consumers, t.consumers, 1, t.blocks, t.efficiency,
                                           max_stages=12, method="wgmma", tokens_n=True, slices=t.slices,
                                           most_tokens=t.most_tokens)))
    else:
        large = _deepest(spec, 128, 256, 2, 4, 1, 1.0, min_stages=3) or _deepest(spec, 128, 128, 2, 2, 1, 0.95)
        small = _deepest(spec, 64, 128, 2, 2, 2, 0.8)
        tokens_n = ()
    if large is None or small is None:
        raise ValueError(f"{spec.name}: {spec.chip.smem_per_block} bytes of shared memory per block hold no GEMM tile")
    return large, small, *tokens_n


def _waves(spec: ChipSpec, c: TileConfig, m: int, n: int, splits: int) -> float:
    """The busiest SM's work in whole tiles: its blocks (blocks that share an SM share its tensor cores, so resident
    blocks do not shorten it), each 1/splits of a tile."""
    return math.ceil(c.tiles(m, n) * splits / spec.chip.sm_count) / splits


def splits(spec: ChipSpec, c: TileConfig, m: int, n: int, k: int, epilogue: str) -> int:
    """Slices of K for config c: 1, but for an `add` with fewer tiles than SMs (a narrow output at a short prompt)
    the count (<= tuning.prefill.split_k and the config's `slices`, >= MIN_SLICE k tiles each, tiles x slices <= one
    wave of resident blocks, which bounds the workspace) that least loads the busiest SM, the fewest on a tie."""
    tiles, wave = c.tiles(m, n), spec.chip.sm_count * c.min_blocks
    if epilogue != "add" or tiles >= spec.chip.sm_count:
        return 1
    cap = min(spec.tuning.prefill.split_k, c.slices or spec.tuning.prefill.split_k)
    most = max(1, min(cap, k // BK // MIN_SLICE, wave // tiles))
    return min(range(1, most + 1), key=lambda s: (_waves(spec, c, m, n, s), s))


def slices(k: int, splits: int) -> list[tuple[int, int]]:
    """The [k0, k1) columns of K each slice of a split launch takes (gemm.cuh's gemm_block_work)."""
    kt = k // BK
    return [(s * kt // splits * BK, (s + 1) * kt // splits * BK) for s in range(splits)]


def workspace(spec: ChipSpec) -> tuple[int, int]:
    """(fp32 partials, tile counters) a split launch may need on this chip: a BM x BN slot per block of one wave,
    a counter per tile; (0, 0) without split-K, or with wgmma's (a cluster's shared memory holds its partials)."""
    if spec.tuning.prefill.split_k <= 1 or spec.tuning.prefill.gemm == "wgmma":
        return 0, 0
    configs = tile_configs(spec)
    split = [c for c in configs if not c.tokens_n]
    return (max(spec.chip.sm_count * c.min_blocks * c.bm * c.bn for c in split),
            max(spec.chip.sm_count * c.min_blocks for c in split))


def choose(spec: ChipSpec, m: int, n: int, k: int = BK, epilogue: str = "bf16") -> TileConfig:
    """The config with the shorter estimated time: the busiest SM's work (with the config's split of K) times the
    time of one tile; on a tie, the one with fewer slices of K (fewer partials to add across blocks). A config with
    `slices` is a candidate only where it splits K that many ways, one with `most_tokens` only up to that many rows."""
    def cost(c: TileConfig) -> tuple[float, int]:
        s = splits(spec, c, m, n, k, epilogue)
        if (c.slices and s != c.slices) or (c.most_tokens and m > c.most_tokens):
            return math.inf, s
        return _waves(spec, c, m, n, s) * c.bm * c.bn / c.efficiency, s
    return min(tile_configs(spec), key=cost)


def product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x w^T in float32 from bf16 (or fp32) operands, row by row: a row's sums do not depend on the other rows
    (BLAS's float32 GEMM blocks a matrix by its shape, and OpenBLAS 0.3.31 rounds a row differently as M changes,
    so a prompt prefilled in chunks would not equal one pass)."""
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    out = np.empty((x32.shape[0], w32.shape[0]), np.float32)
    for i, row in enumerate(x32):
        out[i] = w32 @ row
    return out


def reference(x: np.ndarray, w: np.ndarray, epilogue: str, y: np.ndarray | None = None,
              splits: int = 1) -> np.ndarray:
    """What the kernel writes, in float32 from the (bf16) inputs; `add` needs the fp32 array it adds into. With
    `splits` (an `add` only), K is cut as the kernel's slices are and their fp32 partials are summed in slice order,
    left to right, before the one add into y (the split kernel's order, bit for bit given the partials)."""
    if splits > 1:
        if epilogue != "add":
            raise ValueError(f"split-K is for the `add` epilogue, not {epilogue!r}")
        total = None
        for k0, k1 in slices(x.shape[1], splits):
            p = product(x[:, k0:k1], w[:, k0:k1])
            total = p if total is None else total + p
        return y + total
    acc = product(x, w)
    if epilogue == "add":
        return y + acc
    if epilogue == "silu":
        return silu(acc[:, 0::2]) * acc[:, 1::2]
    return acc


def _kernel_epilogues(method: str) -> dict[str, tuple[str, str, str]]:
    return {**KERNEL_EPILOGUES, SPLIT_ADD: CLUSTER_SPLIT_ADD} if method == "wgmma" else KERNEL_EPILOGUES


def kernel_name(config: TileConfig, epilogue: str) -> str:
    return f"gemm_{config.name}_{epilogue}"


def units(spec: ChipSpec, model: ModelConfig | None = None) -> list[KernelUnit]:
    """One unit per chip (the model's shapes are launch arguments)."""
    configs = tile_configs(spec)
    method = spec.tuning.prefill.gemm
    params = {
        "method": method,
        "max_splits": spec.tuning.prefill.split_k,
        "configs": [dict(name=c.name, bm=c.bm, bn=c.bn, wm=c.wm, wn=c.wn, stages=c.stages, threads=c.threads,
                         min_blocks=c.min_blocks, tokens_n=c.tokens_n) for c in configs],
        "wgmma_ns": sorted({c.bm if c.tokens_n else 128 for c in configs}) if method == "wgmma" else [],
        "epilogues": [dict(name=e, functor=f, out=t, doc=d, split=e == SPLIT_ADD)
                      for e, (f, t, d) in _kernel_epilogues(method).items()],
    }
    sigs = tuple(KernelSig(kernel_name(c, e), c.threads, dynamic_smem=c.smem) for c in configs
                 for e in KERNEL_EPILOGUES)
    return [KernelUnit("prefill_gemm", "prefill_gemm.cu.j2", params, sigs, arch_specific=method == "wgmma")]


def tensor_map(ptr: int, rows: int, cols: int, box_rows: int):
    """The 2-D tensor map of a row-major bf16 [rows, cols] matrix at device address `ptr`, read in boxes of BK
    columns x box_rows rows with the 128-byte swizzle (gemm_wgmma.cuh's tiles); rows past the end read as zeros."""
    return tiled_map(ptr, (cols, rows), (cols * 2,), (BK, box_rows))


@lru_cache(maxsize=4096)
def tiled_map(ptr: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...]):
    """The tensor map of a bf16 tensor at device address `ptr`: dims innermost first, the byte strides of dims 1..,
    read in boxes of `box` elements (the innermost 64 = 128 bytes, for the 128-byte swizzle); elements past the end
    read as zeros. A cuda-python CUtensorMap, which a launch passes by value (the kernel's `const __grid_constant__
    TensorMap`). Cached: a map depends only on these arguments, and the prefill reuses its buffers and weights."""
    from cuda.bindings import driver as drv
    from ..runtime.driver import call
    if ptr % 16 or any(st % 16 for st in strides):
        raise ValueError(f"tensor at {ptr:#x} {dims}, strides {strides}: TMA needs 16-byte aligned addresses")
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    return call("cuTensorMapEncodeTiled", drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, len(dims), ptr,
                [u64(d) for d in dims], [u64(st) for st in strides], [u32(b) for b in box], [u32(1)] * len(dims),
                drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


class Gemm:
    """Y = X W^T for bf16 X [M, K] and W [N, K], with one of EPILOGUES. With mma's split-K, it owns the split launches'
    workspace of partial tiles and their tile counters (zeroed once here; every launch leaves them zero), so the
    launches of one Gemm must run one after another (one stream, or a graph of it)."""

    def __init__(self, module, spec: ChipSpec):
        self.spec = spec
        self.kernels, self.resident = {}, {}
        for c in tile_configs(spec):
            for e in KERNEL_EPILOGUES:
                k = module.kernel(kernel_name(c, e))
                if c.smem > 48 * 1024:
                    k.set_max_dynamic_smem(c.smem)
                self.kernels[c.name, e] = k
            if c.method == "wgmma":  # a persistent grid: the blocks the SMs hold at once
                self.resident[c.name] = spec.chip.sm_count * max(1, k.max_active_blocks_per_sm(c.threads, c.smem))
        partials, counters = workspace(spec)
        self.partials = DeviceArray.empty(partials, np.float32) if partials else None
        self.counters = DeviceArray.zeros(counters, np.uint32) if counters else None

    def __call__(self, x, w, y, m: int, n: int, k: int, epilogue: str, stream=None,
                 config: TileConfig | None = None) -> None:
        """Launch with `config`, or with the one `choose` picks for the shape; `add` splits K where `splits` says."""
        if k % BK or n % 2:
            raise ValueError(f"GEMM {m}x{n}x{k} ({epilogue}): K must be a multiple of {BK} and N even")
        c = config or choose(self.spec, m, n, k, epilogue)
        s = splits(self.spec, c, m, n, k, epilogue)
        if c.method == "wgmma":
            x, w = tensor_map(x.ptr, m, k, c.bm), tensor_map(w.ptr, n, k, c.bn)
        items, args = s * c.tiles(m, n), (x, w, y, m, n, k)
        if s > 1 and c.method != "wgmma":  # one block per item (they fit one wave: `splits`)
            assert items * c.bm * c.bn <= self.partials.size and c.tiles(m, n) <= self.counters.size
            args += (self.partials, self.counters)
        blocks = min(items, self.resident[c.name]) if c.name in self.resident and s == 1 else items
        self.kernels[c.name, SPLIT_ADD if s > 1 else epilogue](blocks, c.threads, *args, smem=c.smem, stream=stream,
                                                                cluster=s if c.method == "wgmma" else 1)

    def free(self) -> None:
        for a in (self.partials, self.counters):
            if a is not None:
                a.free()
