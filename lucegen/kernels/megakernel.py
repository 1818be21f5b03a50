"""The decode megakernel: one persistent cooperative launch per token (or per N tokens) for a whole Qwen3.5 model.

The algorithm lives in templates/mk_decode.cuh (and mk_deltanet.cuh, mk_attention.cuh, ring.cuh); this module
holds what is rendered into it and what the host does around it:

    Layout        where every weight, activation and shared-memory area lives, and the launch shape: the single
                  source of the constants rendered into megakernel.cu.j2 and of the weight packing
    units()       the kernel unit `lucegen build` compiles (per spec x model)
    DecodeEngine  uploads packed weights once, owns the KV / conv / recurrent state on the device, and runs
                  step(token, position) -> logits and generate(prompt, n, eos) through the megakernel

The truth it is tested against is lucegen.reference (numpy float32); `reference_weights()` gives the reference
the exact values the kernel sees (bf16 matrices, fp32 vectors).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import FULL, LINEAR, ModelConfig
from ..spec import ChipSpec

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
KERNEL, SAMPLED_KERNEL = "mk_decode", "mk_decode_sampled"  # each step's argmax; each step's draw
ALIGN = 256          # bytes: every tensor and activation starts on a 256-byte boundary
MAX_SLOTS = 16       # ring slots per block: beyond this the ring only costs shared memory
SHARED_RESERVE = 1024  # bytes of a block's shared memory left to the runtime

SEGMENT_BYTES = 24  # sizeof(Segment) in mk_decode.cuh

# The values of a traced launch per (step, phase, block), in the order of TraceField in mk_decode.cuh.
TRACE_FIELDS = ("start", "gemv", "gemv_end", "done", "tiles_ready", "tiles")

# Phase kinds, in the order of PhaseKind in mk_decode.cuh: bit k of skip_mask leaves kind k out (timing).
PHASE_KINDS = ("lin_in", "lin_rec", "lin_out", "att_in", "att_core", "att_out", "mlp_gu", "mlp_down", "lm_head")


class LayoutError(ValueError):
    """The model does not fit the megakernel's limits on this chip (shared memory, block counts)."""


def _align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class Tensor:
    """A packed tensor: byte offset (from the arena, or from its layer's base), shape and dtype."""
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def _place(specs: Sequence[tuple[str, tuple[int, ...], np.dtype]], start: int = 0) -> tuple[dict[str, Tensor], int]:
    out, off = {}, start
    for name, shape, dtype in specs:
        off = _align(off)
        out[name] = Tensor(off, shape, dtype)
        off += out[name].nbytes
    return out, _align(off)


def linear_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    H, I, Hv = cfg.hidden_size, cfg.intermediate_size, cfg.linear_num_value_heads
    return [("ln1", (H,), F32), ("in", (lin_in_rows(cfg), H), BF16),
            ("conv", (cfg.conv_dim, cfg.linear_conv_kernel_dim), F32), ("a_log", (Hv,), F32),
            ("dt_bias", (Hv,), F32), ("norm", (cfg.linear_value_head_dim,), F32),
            ("out", (H, cfg.value_dim), BF16), ("ln2", (H,), F32), ("gate_up", (2 * I, H), BF16),
            ("down", (H, I), BF16)]


def full_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return [("ln1", (H,), F32), ("in", (att_in_rows(cfg), H), BF16), ("q_norm", (hd,), F32),
            ("k_norm", (hd,), F32), ("out", (H, cfg.num_attention_heads * hd), BF16), ("ln2", (H,), F32),
            ("gate_up", (2 * I, H), BF16), ("down", (H, I), BF16)]


def lin_in_rows(cfg: ModelConfig) -> int:
    """DeltaNet in-projection rows: [qkv (conv channels) | z | b | a]."""
    return cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads


def att_in_rows(cfg: ModelConfig) -> int:
    """Attention in-projection rows: [q_proj (per head: query, gate) | k_proj | v_proj]."""
    return cfg.q_proj_rows + 2 * cfg.kv_dim


def pack_layer_tensor(weights: Mapping[str, np.ndarray], cfg: ModelConfig, layer: int, name: str) -> np.ndarray:
    """Packed tensor `name` of `layer` from reference-style weights (HF names without "model.language_model.")."""
    p = f"layers.{layer}."
    w = lambda n: np.asarray(weights[p + n])
    if name == "ln1":
        return w("input_layernorm.weight")
    if name == "ln2":
        return w("post_attention_layernorm.weight")
    if name == "gate_up":  # rows (gate_i, up_i) adjacent: one warp's row pair gives silu(gate_i) * up_i
        return np.stack([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], axis=1).reshape(-1, cfg.hidden_size)
    if name == "down":
        return w("mlp.down_proj.weight")
    if cfg.layer_types[layer] == LINEAR:
        a = lambda n: w("linear_attn." + n)
        return {"in": lambda: np.concatenate([a("in_proj_qkv.weight"), a("in_proj_z.weight"), a("in_proj_b.weight"),
                                              a("in_proj_a.weight")]),
                "conv": lambda: a("conv1d.weight")[:, 0, :], "a_log": lambda: a("A_log"),
                "dt_bias": lambda: a("dt_bias"), "norm": lambda: a("norm.weight"),
                "out": lambda: a("out_proj.weight")}[name]()
    s = lambda n: w("self_attn." + n)
    return {"in": lambda: np.concatenate([s("q_proj.weight"), s("k_proj.weight"), s("v_proj.weight")]),
            "q_norm": lambda: s("q_norm.weight"), "k_norm": lambda: s("k_norm.weight"),
            "out": lambda: s("o_proj.weight")}[name]()


def reference_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights as the kernel sees them, in float32 for the reference: matrices rounded to bf16, vectors exact."""
    return {n: (w.astype(BF16) if w.ndim >= 2 else w).astype(F32) for n, w in weights.items()}


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """inv_freq[i] = 1 / theta^(2i / rotary_dim) in float32, as reference.ops.rope_cos_sin (and HF) build it."""
    rot = cfg.rotary_dim
    return (1 / np.float32(cfg.rope_theta) ** (np.arange(0, rot, 2, dtype=np.float32) / np.float32(rot))).astype(F32)


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(1, limit))


class Layout:
    """Everything the megakernel's constants say, computed once from (model config, chip spec).

    Weights: one arena of packed tensors (each 256-byte aligned): the embeddings, then per layer its tensors in
    the order of linear_tensors / full_tensors, then the final norm and (untied models) the LM head.
    Activations: one fp32 buffer (offsets in floats). Shared memory per block: the weight ring's slots, their
    mbarriers, a work area (the staged GEMV input or a work item's arrays), reduction scratch and flags, K-split
    partial sums, the block's rows of the residual stream and its table of weight segments.
    """

    def __init__(self, cfg: ModelConfig, spec: ChipSpec, traced: bool = False):
        self.cfg, self.spec, self.traced = cfg, spec, traced  # traced: the timeline's stamps compiled in (timing)
        mk = spec.tuning.megakernel
        self.blocks, self.threads = mk.blocks, mk.threads_for(cfg.name)
        self.warps = self.threads // 32
        self.prefetch = mk.prefetch_distance
        H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.group = nh // nkv

        # work split of the recurrence (value columns per item) and of attention (fewest positions per item)
        Hv, dv, dk = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim
        self.dn_slice = dv // _divisor_at_most(dv, self.blocks // Hv)
        # an attention item covers at least what its warps read in one round (a head's warps, 2 rows each: the
        # loop's rows in flight together, mk_attention.cuh), so a short context is one round trip, over more items
        self.att_min_chunk = 2 * (self.warps // self.group)
        if self.group + 2 > self.warps:
            raise LayoutError(f"{cfg.name}: {self.group} query heads per kv head need {self.group + 2} warps per block;"
                              f" the spec gives {self.warps}")

        # weight arena
        self.linear, self.linear_bytes = _place(linear_tensors(cfg))
        self.full, self.full_bytes = _place(full_tensors(cfg))
        off = _align(V * H * BF16.itemsize)
        self.embed = Tensor(0, (V, H), BF16)
        self.layer_offsets = []
        for kind in cfg.layer_types:
            self.layer_offsets.append(off)
            off += self.linear_bytes if kind == LINEAR else self.full_bytes
        self.final_norm = Tensor(off, (H,), F32)
        off = _align(off + self.final_norm.nbytes)
        self.lm_head = self.embed if cfg.tie_word_embeddings else Tensor(off, (V, H), BF16)
        self.arena_bytes = off if cfg.tie_word_embeddings else _align(off + self.lm_head.nbytes)
        slot_of = {LINEAR: 0, FULL: 0}
        self.layer_slots = []
        for kind in cfg.layer_types:
            self.layer_slots.append(slot_of[kind])
            slot_of[kind] += 1
        self.n_linear, self.n_full = slot_of[LINEAR], slot_of[FULL]

        # activations (fp32 element offsets)
        self.max_chunks = max(1, self.blocks // nkv)
        acts = [("x", H), ("mixed", max(lin_in_rows(cfg), att_in_rows(cfg))),
                ("mix_out", max(cfg.value_dim, nh * hd)), ("mlp", I),
                ("att_ml", nkv * self.max_chunks * self.group * 2),
                ("att_acc", nkv * self.max_chunks * self.group * hd), ("argmax", 2 * self.blocks),
                ("logits", V), ("sample", 4 * self.blocks)]  # a sampled step's logits and its blocks' parts
        self.act, self.act_sizes, n = {}, dict(acts), 0
        for name, size in acts:
            self.act[name] = n
            n += _align(size, ALIGN // 4)
        self.act_floats = n

        # shared memory: ring slots hold whole rows (a gate/up pair at least, and the longest row)
        ks = (H, cfg.value_dim, nh * hd, I)
        self.slot_bytes = _align(max(spec.tuning.gemv.tile_bytes, 2 * 2 * H, 2 * max(ks)), 128)
        self.partial_floats = max([-(-most // self.tiling(k)[0]) * self.tiling(k)[0] * self.k_split(k)
                                   for k, counts in self.block_row_counts().items() for most in counts
                                   if self.k_split(k) > 1], default=0)
        att_floats = (self.group * hd + 2 * hd + cfg.rotary_dim + 2 * self.warps + self.warps * hd
                      + self.max_chunks * self.group + self.group)
        self.work_bytes = _align(4 * max(max(ks), 2 * dk + self.dn_slice + 2, att_floats), 128)
        self.scratch_bytes = _align(8 * self.warps + 16, 128)
        self.partial_bytes = _align(4 * self.partial_floats, 128)
        self.own_bytes = _align(4 * -(-H // self.blocks), 128)  # the block's rows of the residual stream
        # the block's weight segments of a step (mk_decode.cuh: SegmentMap's table of 24-byte Segments)
        self.segment_bytes = _align(SEGMENT_BYTES * (4 * cfg.num_hidden_layers + 1), 128)
        # loads a thread keeps in flight while staging a GEMV input (mk_decode.cuh: stage): 4 on sm_90 and later
        # (measured on the H200; spill-free there), 1 on sm_80/86/89, whose kernels spill with 4
        self.stage_batch = 4 if spec.chip.cc >= 90 else 1
        fixed = self.work_bytes + self.scratch_bytes + self.partial_bytes + self.own_bytes + self.segment_bytes
        budget = spec.chip.smem_per_block - SHARED_RESERVE - fixed
        self.slots = min(MAX_SLOTS, budget // (self.slot_bytes + 16))
        if self.slots < 2:
            raise LayoutError(f"{cfg.name} on {spec.name}: {spec.chip.smem_per_block} bytes of shared memory per "
                              f"block hold {fixed} bytes of work areas but not two {self.slot_bytes}-byte weight "
                              f"slots")
        self.smem_slots = 0
        self.smem_bars = self.slots * self.slot_bytes
        self.smem_work = _align(self.smem_bars + 16 * self.slots, 128)
        self.smem_scratch = self.smem_work + self.work_bytes
        self.smem_partials = self.smem_scratch + self.scratch_bytes
        self.smem_own = self.smem_partials + self.partial_bytes
        self.smem_segments = self.smem_own + self.own_bytes
        self.smem_bytes = self.smem_segments + self.segment_bytes

    # ---- how the GEMVs are cut ----------------------------------------------------------------------------------
    def gemv_widths(self) -> list[int]:
        """The row widths K of the streamed matrices: hidden (in-projections, gate/up, LM head), the DeltaNet and
        attention out-projections, intermediate (down)."""
        c = self.cfg
        return sorted({c.hidden_size, c.value_dim, c.num_attention_heads * c.head_dim, c.intermediate_size})

    def tiling(self, k: int) -> tuple[int, int]:
        """(rows a warp reduces together, rows per ring slot) for rows of k bf16: 4 rows where they fit (x is read
        once for all of them), whole groups per slot. A gate/up pair needs groups of 2 at least."""
        fit = self.slot_bytes // (2 * k)
        rows = 4 if fit >= 4 else 2 if fit >= 2 else 1
        return rows, fit // rows * rows

    def block_row_counts(self) -> dict[int, list[int]]:
        """Per row width k of the streamed matrices: the most rows a block takes of each width-k matrix."""
        c, most = self.cfg, lambda n: -(-n // self.blocks)
        H = c.hidden_size
        out = {k: [] for k in self.gemv_widths()}
        out[H] += [most(c.vocab_size), 2 * most(c.intermediate_size)]  # LM head; gate/up in (gate, up) pairs
        out[c.intermediate_size].append(most(H))
        if c.linear_layers:
            out[H].append(most(lin_in_rows(c)))
            out[c.value_dim].append(most(H))
        if c.full_layers:
            out[H].append(most(att_in_rows(c)))
            out[c.num_attention_heads * c.head_dim].append(most(H))
        return out

    def k_split(self, k: int) -> int:
        """K slices per row group of the width-k GEMVs (mk_decode.cuh: ring_gemv): where a block's rows make fewer
        groups than there are consumer warps (a down-projection's 8 rows: 2 groups for 15 warps), each group's K
        is cut so that about every warp has a unit, each slice at least 32 chunks of 16 bytes (one per lane)."""
        counts = self.block_row_counts()[k]
        if not counts:
            return 1
        groups = -(-min(counts) // self.tiling(k)[0])
        return max(1, min((self.warps - 1) // groups, k // 8 // 32))

    def block_rows(self, n: int, block: int) -> tuple[int, int]:
        """Block `block`'s rows [r0, r1) of an n-row GEMV (mk_decode.cuh: block_rows)."""
        return n * block // self.blocks, n * (block + 1) // self.blocks

    def phases_per_token(self) -> int:
        """Phases of a decode step (mk_decode.cuh): 5 a layer (in-projection, mixer, out-projection, gate/up, down)
        and the LM head."""
        return 5 * self.cfg.num_hidden_layers + 1

    def phase_kind(self, k: int) -> str:
        """The PHASE_KINDS name of phase k of a step."""
        if k == self.phases_per_token() - 1:
            return "lm_head"
        layer, sub = divmod(k, 5)
        if sub >= 3:
            return ("mlp_gu", "mlp_down")[sub - 3]
        pre = "att" if self.cfg.layer_types[layer] == FULL else "lin"
        return f"{pre}_{('in', 'rec' if pre == 'lin' else 'core', 'out')[sub]}"

    def barriers_per_token(self) -> int:
        """Grid barriers a decode step passes: 4 a layer (after the mixer, the out-projection, gate/up and down;
        the in-projection's rows are waited for by the blocks that read them) and the LM head's."""
        return 4 * self.cfg.num_hidden_layers + 1

    # ---- what the kernel reads per token ------------------------------------------------------------------------
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every layer, the final norm, the LM head and one embedding row."""
        layers = sum(self.linear_bytes if k == LINEAR else self.full_bytes for k in self.cfg.layer_types)
        return layers + self.final_norm.nbytes + self.lm_head.nbytes + self.cfg.hidden_size * BF16.itemsize

    def layer_tensors(self, layer: int) -> dict[str, Tensor]:
        """Layer `layer`'s packed tensors with absolute arena offsets."""
        rel = self.linear if self.cfg.layer_types[layer] == LINEAR else self.full
        base = self.layer_offsets[layer]
        return {n: Tensor(base + t.offset, t.shape, t.dtype) for n, t in rel.items()}

    def packed(self, weights: Mapping[str, np.ndarray]):
        """(Tensor, array) for every tensor of the arena, from reference-style weights, in the arena's dtypes."""
        yield self.embed, np.asarray(weights["embed_tokens.weight"]).astype(BF16, copy=False)
        for layer in range(self.cfg.num_hidden_layers):
            for name, t in self.layer_tensors(layer).items():
                a = pack_layer_tensor(weights, self.cfg, layer, name).astype(t.dtype, copy=False)
                yield t, a.reshape(t.shape)
        yield self.final_norm, np.asarray(weights["norm.weight"]).astype(F32, copy=False)
        if not self.cfg.tie_word_embeddings:
            yield self.lm_head, np.asarray(weights["lm_head.weight"]).astype(BF16, copy=False)

    # ---- rendering ----------------------------------------------------------------------------------------------
    def params(self) -> dict:
        cfg = self.cfg
        hexf = lambda v: float(np.float32(v)).hex() + "f"
        return dict(
            layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, inter=cfg.intermediate_size,
            n_linear=self.n_linear, n_full=self.n_full,
            vocab=cfg.vocab_size, eps=hexf(cfg.rms_norm_eps),
            lin=dict(hk=cfg.linear_num_key_heads, hv=cfg.linear_num_value_heads, dk=cfg.linear_key_head_dim,
                     dv=cfg.linear_value_head_dim, conv_k=cfg.linear_conv_kernel_dim, key_dim=cfg.key_dim,
                     value_dim=cfg.value_dim, conv_dim=cfg.conv_dim, in_rows=lin_in_rows(cfg), slice=self.dn_slice),
            att=dict(nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, hd=cfg.head_dim, rot=cfg.rotary_dim,
                     in_rows=att_in_rows(cfg), min_chunk=self.att_min_chunk),
            inv_freq=[hexf(v) for v in rope_inv_freq(cfg)],
            layer_kinds=[int(k == FULL) for k in cfg.layer_types], layer_offsets=self.layer_offsets,
            layer_slots=self.layer_slots,
            linear={n.upper(): t.offset for n, t in self.linear.items()},
            full={n.upper(): t.offset for n, t in self.full.items()},
            embed=self.embed.offset, final_norm=self.final_norm.offset, lm_head=self.lm_head.offset,
            act={n.upper(): o for n, o in self.act.items()},
            tilings=[dict(k=k, rows=self.tiling(k)[0], tile_rows=self.tiling(k)[1], split=self.k_split(k))
                     for k in self.gemv_widths()],
            partial_floats=self.partial_floats, smem_partials=self.smem_partials, smem_own=self.smem_own,
            smem_segments=self.smem_segments, segment_bytes=SEGMENT_BYTES, stage_batch=self.stage_batch,
            threads=self.threads, blocks=self.blocks, prefetch=self.prefetch,
            weight_prefetch_tiles=self.spec.tuning.megakernel.weight_prefetch_tiles,
            barrier_tiles=self.spec.tuning.megakernel.barrier_tiles,
            inflight_tiles=self.spec.tuning.megakernel.inflight_tiles, slots=self.slots,
            slot_bytes=self.slot_bytes, work_bytes=self.work_bytes, smem_bars=self.smem_bars,
            smem_work=self.smem_work, smem_scratch=self.smem_scratch, smem_bytes=self.smem_bytes,
            trace=self.traced, kernels=[(KERNEL, False), (SAMPLED_KERNEL, True)])

    def unit(self) -> KernelUnit:
        return KernelUnit("megakernel", "megakernel.cu.j2", self.params(),
                          tuple(KernelSig(name, self.threads, cooperative=True, dynamic_smem=self.smem_bytes)
                                for name in (KERNEL, SAMPLED_KERNEL)))


def units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    """The megakernel for this spec and model; none where the model exceeds the chip's shared memory per block
    (e.g. Qwen3.5-27B's 17408-wide down-projection rows on the 99 KB of a consumer GPU's block)."""
    try:
        return [Layout(model, spec).unit()]
    except LayoutError:
        return []


class Megakernel:
    """The compiled megakernel with its packed weights and activation buffers on the device.

    `weights`: reference-style weights to pack and upload, or None for pseudo-random weights filled on the device
    (benchmarks: the real shapes, no host copy). launch() runs steps over a DeviceState (lucegen/engine/state.py),
    whose per-layer arrays the kernel reads through a table of their addresses (state_table()).
    """

    def __init__(self, weights: Mapping[str, np.ndarray] | None, cfg: ModelConfig, spec: ChipSpec,
                 build_root: Path | None = None, seed: int = 0, traced: bool = False):
        from ..codegen.build import BUILD_DIR, build
        from ..runtime import DeviceArray, device_info
        self.cfg, self.spec = cfg, spec
        self.layout = lay = Layout(cfg, spec, traced)
        result = build(spec, cfg, [lay.unit()], root=build_root or BUILD_DIR)
        module = result.module("megakernel")
        self.kernel, self.sampled = module.kernel(KERNEL), module.kernel(SAMPLED_KERNEL)
        for kernel in (self.kernel, self.sampled):
            if lay.smem_bytes > 48 * 1024:
                kernel.set_max_dynamic_smem(lay.smem_bytes)
            resident = kernel.max_active_blocks_per_sm(lay.threads, lay.smem_bytes) * device_info().sm_count
            if resident < lay.blocks:
                raise LayoutError(f"{spec.name}: {lay.blocks} blocks of {kernel.name} must all be resident, but "
                                  f"this GPU holds {resident} ({lay.smem_bytes} bytes of shared memory each)")
        self.weights = DeviceArray.empty(lay.arena_bytes, np.uint8)
        if weights is None:
            self._fill_random(build_root or BUILD_DIR, seed)
        else:
            for t, a in lay.packed(weights):
                self.weights.view(a.shape, a.dtype, t.offset).copy_from(np.ascontiguousarray(a))
        self.act = DeviceArray.zeros(lay.act_floats, F32)
        # barrier, blocks left, attention tickets, ready counters (mk_decode.cuh: DecodeParams.sync); every launch
        # leaves them at zero
        self.sync = DeviceArray.zeros(2 + cfg.num_key_value_heads + lay.blocks, np.uint32)

    def _fill_random(self, build_root: Path, seed: int) -> None:
        """Uniform pseudo-random weights with the variances reference.random_weights gives (activations stay O(1)):
        matrices 1/fan_in, embeddings 1, (1 + w) norms and dt_bias 0.01, the DeltaNet norm around 1, A_log of
        [1, 16)."""
        from ..codegen.build import build
        from . import fill
        f = fill.Fill(build(self.spec, self.cfg, fill.units(self.spec), root=build_root).module("fill"), self.spec)
        tensors = [("embed", self.layout.embed), ("final_norm", self.layout.final_norm)]
        tensors += [(n, t) for i in range(self.cfg.num_hidden_layers) for n, t in self.layout.layer_tensors(i).items()]
        for i, (name, t) in enumerate(tensors):
            a = self.weights.view(t.shape, t.dtype, t.offset)
            if name == "a_log":
                lo, hi = 0.0, float(np.log(16.0))
            elif name == "norm":
                lo, hi = 0.9, 1.1
            else:
                var = 1.0 if name == "embed" else 0.01 if len(t.shape) == 1 else 1.0 / t.shape[-1]
                lo, hi = -float(np.sqrt(3 * var)), float(np.sqrt(3 * var))
            f.uniform(a, seed + i, lo, hi)

    def state_table(self, state):
        """The addresses of a DeviceState's arrays in the order the kernel reads them: conv rings, recurrent states
        (linear layers), keys, values (full layers)."""
        from ..runtime import DeviceArray
        lin, full = self.cfg.linear_layers, self.cfg.full_layers
        ptrs = ([state.conv[i].ptr for i in lin] + [state.recurrent[i].ptr for i in lin]
                + [state.keys[i].ptr for i in full] + [state.values[i].ptr for i in full])
        return DeviceArray.from_numpy(np.array(ptrs or [0], np.uint64))

    def launch(self, table, prompt, n_prompt: int, position: int, n_steps: int, tokens, n_done, *, logits=None,
               logits_stride: int = 0, eos: int = -1, uniforms=None, temperature: float = 1.0,
               phase_limit: int = -1, skip_mask: int = 0, prefetch: bool | int = True, trace=None,
               stream=None) -> None:
        """n_steps decode steps from `position` (asynchronous). Step s reads prompt[s] while s < n_prompt, else the
        previous step's token; writes its token to tokens[s] and, when `logits` is given, its logits at
        logits + s * logits_stride; stops after a generated step whose token is `eos`. n_done: steps done. A
        step's token is its argmax, or with `uniforms` (fp64 [n_steps] on the device) the token drawn from
        softmax(logits / temperature) with uniforms[s] (kernels/sample.py's law).
        prefetch: True (the spec's L2 prefetches), False (none), or a number of weight tiles to prefetch beyond the
        ring (a sweep; where the spec's weight_prefetch_tiles compiled the weight prefetch in).
        trace: None, or (a kernel built traced) a uint64 device array of trace_size(n_steps) values that receives
        the launch's timeline (mk_decode.cuh: TraceField)."""
        if trace is not None and not self.layout.traced:
            raise ValueError("a timeline needs the megakernel built with traced=True")
        if prefetch is True:
            prefetch = max(1, self.spec.tuning.megakernel.weight_prefetch_tiles)
        if uniforms is not None and not temperature > 0:
            raise ValueError(f"a sampled launch at temperature {temperature}: it must be > 0")
        out = (logits.ptr if logits is not None else 0, ctypes.c_void_p)
        draws = (uniforms.ptr if uniforms is not None else 0, ctypes.c_void_p)
        kernel = self.kernel if uniforms is None else self.sampled
        kernel(self.layout.blocks, self.layout.threads, self.weights, table, self.act, self.sync, prompt, n_prompt,
               position, n_steps, eos, tokens, out, logits_stride, n_done, phase_limit, skip_mask, int(prefetch),
               (trace.ptr if trace is not None else 0, ctypes.c_void_p), draws, (1.0 / temperature, ctypes.c_double),
               smem=self.layout.smem_bytes, stream=stream, cooperative=True)

    def trace_size(self, n_steps: int) -> int:
        """The values a traced launch of n_steps writes: TRACE_FIELDS per (step, phase, block)."""
        return n_steps * self.layout.phases_per_token() * self.layout.blocks * len(TRACE_FIELDS)

    def activation(self, name: str) -> np.ndarray:
        """An activation buffer as the last launch left it (Layout.act's names): for per-phase tests."""
        return self.act.view(self.layout.act_sizes[name], F32, 4 * self.layout.act[name]).numpy()

    def free(self) -> None:
        for a in (self.weights, self.act, self.sync):
            a.free()
