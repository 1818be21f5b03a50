"""A token drawn on the device from softmax(logits / temperature) with one uniform (templates/sample.cuh): numpy
reference, unit, launcher.

The law is the host's (lucegen.engine.sampling: filtered_probs at that temperature, then Sampler.draw): the first
token whose running sum of probabilities passes u, for u the request's next uniform, so a seed fixes the tokens
wherever they are drawn. The row is cut into one slice a block; the kernel picks the slice from the blocks' partial
sums, then the token in it, in fp64: the same token as the host's but where u lies within rounding (~1e-15) of the
boundary between two. The decode megakernel draws its tokens with the same device functions (mk_decode.cuh).

One launch draws from many rows (a tree verify's nodes), each with its own uniform; a launch may also stop at the
parts (Sample.softmax): the row's softmax at the temperature (softmax_of: its largest z and sum of exponentials),
from which a top_p nucleus among the device's best tokens is drawn on the host (Sampler.draw_top_p).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec
from . import argmax

PART_DTYPE = np.dtype([("sum", "<f8"), ("max", "<f4"), ("pad", "<i4")])  # a SoftmaxPart (sample.cuh)
PART_BYTES = PART_DTYPE.itemsize


def slices(n: int, blocks: int) -> list[tuple[int, int]]:
    """Block b's slice [n b / blocks, n (b + 1) / blocks) of a row of n (sample.cuh: slice_of)."""
    return [(n * b // blocks, n * (b + 1) // blocks) for b in range(blocks)]


def first_past(w: np.ndarray, u: float) -> tuple[int, float]:
    """The first index whose running sum of w passes u times their sum, and how far into its weight that lies (a
    fraction); where rounding leaves none, the last index of positive weight (0 if none has weight) and 1."""
    running = np.cumsum(w)
    target = u * running[-1] if running.size else 0.0
    i = int(np.searchsorted(running, target, side="right"))
    if i == running.size:
        positive = np.flatnonzero(w > 0)
        return (int(positive[-1]) if positive.size else 0), 1.0
    before = running[i - 1] if i else 0.0
    return i, float(np.clip((target - before) / w[i], 0.0, 1.0))


def parts(logits: np.ndarray, temperature: float, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The blocks' SoftmaxParts of fp32 logits [n] cut among `blocks` blocks: (sums, maxes) [blocks], each slice's
    sum of exp(z - its largest z) in fp64 (z = logit / T) and its largest logit (-inf where the slice is empty)."""
    v, inv_t = np.asarray(logits, np.float32).astype(np.float64), 1.0 / temperature
    cuts = slices(v.size, blocks)
    maxes = np.array([v[a:b].max() if b > a else -np.inf for a, b in cuts])
    with np.errstate(invalid="ignore"):  # a slice of -inf logits: its sum is NaN, and weighs nothing (as on the GPU)
        sums = np.array([np.exp(v[a:b] * inv_t - m * inv_t).sum() if b > a else 0.0
                         for (a, b), m in zip(cuts, maxes)])
    return sums, maxes


def block_weights(sums: np.ndarray, maxes: np.ndarray, temperature: float) -> tuple[np.ndarray, float]:
    """From the parts: each slice's share of the row, w_b = s_b exp(z_b - Z) (the sum of exp(z - Z) over it), and Z,
    the row's largest z (sample_pick's)."""
    inv_t = 1.0 / temperature
    zmax = np.max(maxes) * inv_t
    with np.errstate(invalid="ignore"):
        return np.where(sums > 0, sums * np.exp(maxes * inv_t - zmax), 0.0), float(zmax)


def softmax_of(sums: np.ndarray, maxes: np.ndarray, temperature: float) -> tuple[float, float]:
    """A row's softmax at the temperature from its blocks' parts: (Z, S), its largest z = logit / T and the sum over
    the row of exp(z - Z) (fp64, the blocks' weights added in block order): a token's probability is
    exp(logit / T - Z) / S."""
    weights, zmax = block_weights(sums, maxes, temperature)
    return zmax, float(weights.sum())


def reference(logits: np.ndarray, temperature: float, u: float, blocks: int) -> int:
    """The token the kernel draws from fp32 logits [n] with u in [0, 1), its row cut among `blocks` blocks."""
    sums, maxes = parts(logits, temperature, blocks)
    block, frac = first_past(block_weights(sums, maxes, temperature)[0], u)
    a, b = slices(len(logits), blocks)[block]
    v, inv_t = np.asarray(logits[a:b], np.float32).astype(np.float64), 1.0 / temperature
    return a + first_past(np.exp(v * inv_t - maxes[block] * inv_t), frac)[0]


def units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    t = spec.tuning.argmax.threads  # a pass over a vocabulary row, as the argmax's
    return [KernelUnit("sample", "sample.cu.j2", {"threads": t, "max_blocks": argmax.blocks(spec)},
                       (KernelSig("sample_f32", t),))]


class Sample:
    """Rows of v (fp32 [rows, n]) -> out (int32 [rows]): row r's token drawn with its own uniform at one
    temperature, in one launch. Owns the blocks' parts, the self-resetting tickets (one a row), the uniforms' device
    copy and `out`; they grow on demand, so a CUDA graph that captures a call must be preceded by `reserve` (or a
    call) of at least its rows."""

    def __init__(self, module, spec: ChipSpec, rows: int = 1):
        self.kernel = module.kernel("sample_f32")
        self.threads, self.blocks = spec.tuning.argmax.threads, argmax.blocks(spec)
        self._rows = 0
        self.parts = self.ticket = self.out = self.uniforms = None
        self.reserve(rows)

    def reserve(self, rows: int) -> None:
        """Room for draws from up to `rows` rows at once (allocates only if it grows)."""
        if rows <= self._rows:
            return
        self.free()
        self.parts = DeviceArray.empty(rows * self.blocks * PART_BYTES, np.uint8)
        self.ticket = DeviceArray.zeros(rows, np.uint32)
        self.out = DeviceArray.empty(rows, np.int32)
        self.uniforms = DeviceArray.empty(rows, np.float64)
        self._rows = rows

    def __call__(self, v: DeviceArray, temperature: float, u, stream=None) -> None:
        """u: a uniform in [0, 1) (v is one row), or one a row (a sequence: v holds len(u) rows of equal length),
        uploaded on `stream` before the launch."""
        many = np.ndim(u) > 0
        us = np.asarray(u, np.float64).reshape(-1)
        rows = us.size
        if not temperature > 0 or rows == 0 or not np.all((us >= 0) & (us < 1)):
            raise ValueError(f"a draw at temperature {temperature} (> 0) with uniforms {us} (in [0, 1))")
        if v.size % rows:
            raise ValueError(f"{v.size} logits are not {rows} rows of equal length")
        self.reserve(rows)
        if many:
            self._host_uniforms = us  # alive until the copy ran
            self.uniforms.view(rows).copy_from(us, stream=stream)
        self.kernel((self.blocks, rows), self.threads, v, v.size // rows, (1.0 / temperature, ctypes.c_double),
                    (float(us[0]) if not many else 0.0, ctypes.c_double),
                    self.uniforms if many else (0, ctypes.c_void_p), self.out, self.parts, self.ticket, stream=stream)

    def softmax(self, v: DeviceArray, temperature: float, rows: int = 1, stream=None) -> None:
        """The parts alone of each of v's rows (fp32 [rows, n]) at the temperature (a launch that draws nothing:
        out = -1); softmax_of() reads them once the stream is done."""
        if not temperature > 0 or v.size % rows:
            raise ValueError(f"softmax of {v.size} logits in {rows} rows at temperature {temperature} (> 0)")
        self.reserve(rows)
        self.kernel((self.blocks, rows), self.threads, v, v.size // rows, (1.0 / temperature, ctypes.c_double),
                    (-1.0, ctypes.c_double), (0, ctypes.c_void_p), self.out, self.parts, self.ticket, stream=stream)

    def softmax_of(self, rows: int, temperature: float) -> list[tuple[float, float]]:
        """Each row's (Z, S) (softmax_of) from the parts of the last launch over `rows` rows at that temperature."""
        raw = self.parts.view(rows * self.blocks * PART_BYTES).numpy().view(PART_DTYPE).reshape(rows, self.blocks)
        return [softmax_of(r["sum"], r["max"].astype(np.float64), temperature) for r in raw]

    def free(self) -> None:
        for a in (self.parts, self.ticket, self.out, self.uniforms):
            if a is not None:
                a.free()
