"""A model's weights on the GPU for the layer-by-layer step (lucegen/engine/layered.py), as loaded: each matrix in
its checkpoint format (GGUF bytes exactly as stored; an HF checkpoint's matrices as bf16 rows), read through
kernels/qgemv.py; norm weights, conv1d taps, A_log and dt_bias in fp32, in HF conventions (zero-centred norms,
A_log itself).

A fused projection (the DeltaNet in-projection [qkv | z | b | a], attention's [q (query, gate per head) | k | v],
the MLP's [gate | up]) is a list of Parts: runs of consecutive matrices of one format concatenated row-wise (rows
are independent bytes, so this is exact), each written to its columns of the fused rows.

Value-head order: GGUF files hold the DeltaNet value heads in llama.cpp's tiled order (gguf_file.convert); the
GGUF matrices are used in that order and the small tensors are put in it too (`tiled`), so the DeltaNet kernels
run with value head j reading key head j % Hk and the recurrent state / conv ring hold heads in that order. An HF
checkpoint keeps HF's grouped order (the prefill's and the megakernel's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..kernels import qgemm_tc
from ..kernels.qgemv import device_weights, fmt_of
from ..model.config import LINEAR, ModelConfig
from ..model.gguf_file import GGUFCheckpoint, _retile, gguf_name, split_name
from ..model.quants import GGMLType, block_shape, quantize
from ..runtime.memory import DeviceArray

MATRIX_PARTS = {  # fused projection -> the canonical matrices in its row order
    "lin_in": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
               "linear_attn.in_proj_a.weight"),
    "att_in": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "lin_out": ("linear_attn.out_proj.weight",),
    "att_out": ("self_attn.o_proj.weight",),
    "down": ("mlp.down_proj.weight",),
}
VECTORS = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
           "conv": "linear_attn.conv1d.weight", "a_log": "linear_attn.A_log", "dt_bias": "linear_attn.dt_bias",
           "norm": "linear_attn.norm.weight", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


@dataclass
class Part:
    fmt: str          # kernels.qgemv format name
    w: DeviceArray    # the rows as the kernels read them (qgemv.device_weights)
    n: int            # rows
    col: int          # first column of the fused rows it writes


@dataclass
class Projection:
    parts: list[Part]
    n: int  # fused rows
    k: int  # row width

    @property
    def nbytes(self) -> int:
        """The matrices' bytes as the checkpoint stores them (what the limits count; the GPU's Q6_K pairs take 2.9%
        more: kernels/repack.py)."""
        return sum(p.n * fmt_of(p.fmt).gguf_row_bytes(self.k) for p in self.parts)

    def apply(self, mm, x, y, m: int, stream, xq=None) -> None:
        """y [m, n] = x [m, k] W^T, each part straight into its columns of y's rows. mm[(fmt, k)]: the qgemv
        launchers. xq: x's XBlocks, made by the kernel that wrote x (else each quantized part quantizes x itself)."""
        for part in self.parts:
            mm[part.fmt, self.k](part.w, x, y.view(m * self.n - part.col, offset_bytes=4 * part.col), part.n, m,
                                 stream=stream, xq=xq, ldy=self.n)


def tiled(cfg: ModelConfig, name: str, x: np.ndarray) -> np.ndarray:
    """A canonical DeltaNet tensor with its value heads in llama.cpp's tiled order (gguf_file.convert's
    reordering alone); conv1d as [conv_dim, K]; other tensors unchanged."""
    leaf = split_name(name)[1]
    hk, dv, qk = cfg.linear_num_key_heads, cfg.linear_value_head_dim, 2 * cfg.key_dim
    r = cfg.linear_num_value_heads // hk
    tile = lambda a, axis, hd: _retile(a, axis, hk, r, hd, inverse=False)
    if leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        x = x.reshape(x.shape[0], -1)
        return np.concatenate([x[:qk], tile(x[qk:], 0, dv)])
    if leaf == "linear_attn.in_proj_z.weight":
        return tile(x, 0, dv)
    if leaf in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias",
                "linear_attn.A_log"):
        return tile(x, 0, 1)
    if leaf == "linear_attn.out_proj.weight":
        return tile(x, 1, dv)
    return x


class Source:
    """Where the weights come from: matrix(name) -> (format, uint8 rows), vector(name) -> fp32."""
    tiled = False

    def __init__(self, weights: Mapping[str, np.ndarray], cfg: ModelConfig):
        self.weights, self.cfg = weights, cfg

    def matrix(self, name: str) -> tuple[str, np.ndarray]:
        """bf16 rows of a canonical (HF) checkpoint."""
        return "bf16", quantize(np.asarray(self.weights[name], np.float32), GGMLType.BF16)

    def vector(self, name: str) -> np.ndarray:
        x = np.asarray(self.weights[name], np.float32)
        x = tiled(self.cfg, name, x) if self.tiled else x
        return np.ascontiguousarray(x.reshape(x.shape[0], -1) if name.endswith("conv1d.weight") else x)


class GGUFSource(Source):
    """A GGUF file: matrices as stored, small tensors canonical (dequantized, conventions undone) then tiled."""
    tiled = True

    def __init__(self, checkpoint: GGUFCheckpoint):
        super().__init__(checkpoint, checkpoint.config)
        self.checkpoint = checkpoint

    def matrix(self, name: str) -> tuple[str, np.ndarray]:
        raw = self.checkpoint.raw(gguf_name(name))
        if raw.type in (GGMLType.F32, GGMLType.F16):
            raise ValueError(f"{self.checkpoint.path}: {raw.name} is {raw.type.name}; the layer-by-layer step "
                             f"multiplies quantized or bf16 matrices only (formats: q8_0, q4_0, q4_k, q5_k, q6_k, "
                             f"bf16)")
        return fmt_of(raw.type).name, raw.data.reshape(raw.shape[0], -1)


# ---- random weights of the real shapes (benchmarks: speed does not depend on the values) ------------------------
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_rows(fmt: str, n: int, k: int, rng: np.random.Generator, pool: dict) -> np.ndarray:
    """n rows of k values in `fmt` with random bytes and valid fp16 scales in [2^-10, 2^-6) (bf16: random values),
    cut from one random pool per format (the same bytes repeat; L2 caches addresses, not contents)."""
    f = fmt_of(fmt)
    _, block = block_shape(f.ggml)
    nbytes = n * f.gguf_row_bytes(k)
    if fmt not in pool or pool[fmt].size < nbytes:
        size = max(nbytes, 64 << 20) // block * block + block
        if fmt == "bf16":
            b = quantize(rng.standard_normal(size // 2, np.float32) * np.float32(0.02), GGMLType.BF16).ravel()
        else:
            b = rng.integers(0, 256, size, np.uint8)
            blocks = b[:size // block * block].reshape(-1, block)
            for off in SCALE_OFFSETS[fmt]:
                scales = (2.0 ** rng.uniform(-10, -6, blocks.shape[0])).astype(np.float16)
                blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
        pool[fmt] = b
    return pool[fmt][:nbytes].reshape(n, -1)


class RandomSource(Source):
    """Random weights of `cfg` in quant mix `mix` (checkpoint.gguf_types), GGUF's tiled head order."""
    tiled = True

    def __init__(self, cfg: ModelConfig, mix: str = "q4_k_m", seed: int = 0):
        from ..model.checkpoint import gguf_types
        from ..model.weights import weight_shapes
        super().__init__({}, cfg)
        self.types, _ = gguf_types(cfg, mix)
        self.shapes, self.rng, self.pool = weight_shapes(cfg), np.random.default_rng(seed), {}

    def matrix(self, name: str) -> tuple[str, np.ndarray]:
        n, k = self.shapes[name]
        fmt = fmt_of(self.types[name]).name
        return fmt, random_rows(fmt, n, k, self.rng, self.pool)

    def vector(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        if name.endswith("A_log"):
            return np.log(self.rng.uniform(1, 16, shape)).astype(np.float32)
        x = self.rng.normal(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.1, shape)
        return np.ascontiguousarray(x.astype(np.float32).reshape(shape[0], -1) if len(shape) == 3 else
                                    x.astype(np.float32))


def fuse(matrices: list[tuple[str, np.ndarray]]) -> tuple[list[tuple[str, np.ndarray, int]], int, int]:
    """Matrices (format, rows) stacked row-wise into one projection: ([(format, rows, first column)] with
    consecutive matrices of one format joined, fused rows, row width K)."""
    widths = {r.shape[1] // block_shape(fmt_of(f).ggml)[1] * block_shape(fmt_of(f).ggml)[0] for f, r in matrices}
    if len(widths) != 1:
        raise ValueError(f"matrices of different row widths {sorted(widths)} cannot be fused")
    runs: list[tuple[str, list[np.ndarray]]] = []
    for fmt, rows in matrices:
        if runs and runs[-1][0] == fmt:
            runs[-1][1].append(rows)
        else:
            runs.append((fmt, [rows]))
    out, col = [], 0
    for fmt, blocks in runs:
        rows = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
        out.append((fmt, rows, col))
        col += rows.shape[0]
    return out, col, widths.pop()


# ---- the device copy ------------------------------------------------------------------------------------------
class LayeredWeights:
    """embed (a Projection of the embedding rows, gathered by token), lm_head, final_norm, and layers[i]: the
    layer's Projections (lin_in/att_in, lin_out/att_out, gate_up, down) and fp32 tensors (VECTORS' keys).
    tensor_core_formats: the formats whose matrices the step multiplies on kernels/qgemm_tc.py, in its layout (the
    embedding's gather keeps GGUF's rows, so a tied LM head in such a format gets a copy of its own)."""

    def __init__(self, source: Source, tensor_core_formats: tuple[str, ...] = ()):
        self.cfg, self.tiled, self.tc = source.cfg, source.tiled, tensor_core_formats
        cfg = self.cfg
        self.embed = self._projection(source, ["embed_tokens.weight"], gathered=True)
        tied = cfg.tie_word_embeddings and all(part.fmt not in self.tc for part in self.embed.parts)
        self.lm_head = self.embed if tied else self._projection(
            source, ["embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"])
        self.final_norm = DeviceArray.from_numpy(source.vector("norm.weight"))
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            mixer = ("lin_in", "lin_out") if kind == LINEAR else ("att_in", "att_out")
            layer = {key: self._projection(source, [p + n for n in MATRIX_PARTS[key]])
                     for key in (*mixer, "gate_up", "down")}
            for key, n in VECTORS.items():
                if (n.startswith("linear_attn") and kind != LINEAR) or (n.startswith("self_attn") and kind == LINEAR):
                    continue
                layer[key] = DeviceArray.from_numpy(source.vector(p + n))
            self.layers.append(layer)

    def _projection(self, source: Source, names: list[str], gathered: bool = False) -> Projection:
        """The matrices' rows fused, each part in the layout its kernels read: the tensor-core GEMM's
        (tensor_core_formats), or the qgemv kernels' (and the embedding gather's: `gathered`)."""
        runs, n, k = fuse([source.matrix(name) for name in names])
        place = lambda rows, fmt: (qgemm_tc.device_weights(rows, fmt) if fmt in self.tc and not gathered
                                   else device_weights(rows, fmt))
        return Projection([Part(fmt, place(rows, fmt), rows.shape[0], col) for fmt, rows, col in runs], n, k)

    def pairs(self) -> list[tuple[str, int]]:
        """(format, K) of every projection: the qgemv kernels the step needs."""
        projs = [self.lm_head, *(p for layer in self.layers for p in layer.values() if isinstance(p, Projection))]
        return sorted({(part.fmt, p.k) for p in projs for part in p.parts})

    def matrix_bytes_per_token(self) -> int:
        """Bytes of matrices one decode step reads: every layer's, the LM head, one embedding row."""
        layers = sum(p.nbytes for layer in self.layers for p in layer.values() if isinstance(p, Projection))
        return layers + self.lm_head.nbytes + self.embed.nbytes // self.cfg.vocab_size

    def free(self) -> None:
        arrays = [self.final_norm, *(part.w for p in (self.embed, self.lm_head) for part in p.parts)]
        for layer in self.layers:
            for v in layer.values():
                if isinstance(v, Projection):
                    arrays.extend(part.w for part in v.parts)
                else:
                    arrays.append(v)
        for a in {id(a): a for a in arrays}.values():
            a.free()

