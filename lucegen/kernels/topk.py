"""Top-k per position on the device: the k best tokens of each row of fp32 logits [n, vocab] and their log-softmax
values, so that a draft hands DDTree n * k ids and values instead of n * vocab logits (templates/topk.cuh).

Order: the larger logit first, the lower token id on ties, exactly np.argsort(-row, kind="stable")[:k]; the kernel
selects on the logits' own bits, so its ids equal the reference's on every input, ties included. The values are
logit - logsumexp(row) in fp32 (tolerance: `logprob_tolerance`).
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from ..codegen.unit import KernelSig, KernelUnit
from ..model.config import ModelConfig
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec
from ..spec_decode.tree import TopK, top_k_ids

KERNEL = "topk_f32"


def reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """ids (int32 [n, k]) and log-softmax values (fp32 [n, k]) of the k best entries of each row of logits [n, V]
    (a 1-D row is taken as [1, V]), best first, ties to the lower id.

    The log-sum-exp is taken in float64 (max-shifted: exp(x - max) <= 1, its sum in [1, V]), so its error (~1e-16
    relative) is far below the one rounding of the result to fp32; the fp32 kernel is measured against it."""
    x = np.asarray(logits, np.float32)
    x = x.reshape(1, -1) if x.ndim == 1 else x
    if not 1 <= k <= x.shape[1]:
        raise ValueError(f"k = {k} must be between 1 and the row length {x.shape[1]}")
    ids = top_k_ids(x, k)
    x64 = x.astype(np.float64)
    peak = x64.max(axis=1, keepdims=True)
    lse = peak + np.log(np.exp(x64 - peak).sum(axis=1, keepdims=True))
    return ids.astype(np.int32), (np.take_along_axis(x64, ids, axis=1) - lse).astype(np.float32)


def logprob_tolerance(logits: np.ndarray, ref_logprobs: np.ndarray) -> np.ndarray:
    """Per-entry bound on |kernel - reference| for reference(logits, k)'s values, argued from fp32.

    The kernel's x - lse is one fp32 subtraction of the exact logit x and its lse = M + log(S), M exact (a logit):
    S = sum exp(x - M) >= 1 is a sum of positive terms, each from the fast exp (ex2.approx of (x - M) log2 e: 2^-22
    relative, plus |x - M| 2^-24 from rounding the argument: 4e-8 |x - M| of a term, e^-1 4e-8 of the largest one
    at most), summed in fp32 (at most ~32 + 2 log2(threads) + blocks ~ 80 roundings deep: 5e-6 relative, in practice
    far less); log S then carries that relative error as an absolute one, plus lg2.approx's ~1e-7. Rounding M + log S
    and x - lse adds half an ulp of each. So |err| <= 1e-5 + 2^-23 (|lse| + |logprob|); the test allows twice that."""
    x = np.asarray(logits, np.float32).reshape(ref_logprobs.shape[0], -1).astype(np.float64)
    peak = x.max(axis=1, keepdims=True)
    lse = np.abs(peak + np.log(np.exp(x - peak).sum(axis=1, keepdims=True)))
    return 2e-5 + 2.0 ** -22 * (lse + np.abs(ref_logprobs.astype(np.float64)))


def max_k(spec: ChipSpec) -> int:
    return spec.tuning.topk.max_k


def units(spec: ChipSpec, model: ModelConfig) -> list[KernelUnit]:
    t = spec.tuning.topk
    return [KernelUnit("topk", "topk.cu.j2", {"threads": t.threads, "slice": t.slice, "max_k": t.max_k},
                       (KernelSig(KERNEL, t.threads),))]


class TopKKernel:
    """logits (fp32 [>= n * vocab], row-major [n, vocab]) -> ids (int32 [n, k]) and log-softmax values (fp32
    [n, k]) on the device, best first. Owns its per-(row, block) candidate lists and statistics, the per-row
    self-resetting tickets, and (unless the caller passes its own) the output arrays; all of them grow on demand,
    so a CUDA graph that captures a call must be preceded by `reserve` (or one call) of at least its shape."""

    def __init__(self, module, spec: ChipSpec, rows: int = 16, vocab: int = 0):
        self.kernel = module.kernel(KERNEL)
        self.spec = spec
        t = spec.tuning.topk
        self.threads, self.slice, self.max_k = t.threads, t.slice, t.max_k
        self._rows = self._blocks = 0
        self.lists = self.stats = self.tickets = self.ids = self.logprobs = self.values = None
        self.reserve(rows, max(vocab, 1))

    def reserve(self, rows: int, vocab: int) -> None:
        """Workspace for up to `rows` rows of `vocab` logits (allocates only if it grows)."""
        blocks = math.ceil(vocab / self.slice)
        if rows <= self._rows and blocks <= self._blocks:
            return
        rows, blocks = max(rows, self._rows), max(blocks, self._blocks)
        self.lists = DeviceArray.empty((rows, blocks, self.max_k, 2), np.uint32)  # (key, token id) entries
        self.stats = DeviceArray.empty((rows, blocks, 2), np.float32)             # (max, sum of exponentials)
        if rows > self._rows:
            self.tickets = DeviceArray.zeros(rows, np.uint32)
            self.ids = DeviceArray.empty(rows * self.max_k, np.int32)
            self.logprobs = DeviceArray.empty(rows * self.max_k, np.float32)
            self.values = DeviceArray.empty(rows * self.max_k, np.float32)
        self._rows, self._blocks = rows, blocks

    def __call__(self, logits: DeviceArray, n: int, vocab: int, k: int, stream=None,
                 ids: DeviceArray | None = None, logprobs: DeviceArray | None = None,
                 values: DeviceArray | bool | None = None) -> tuple[DeviceArray, DeviceArray]:
        """Launch on `stream`; returns (ids [n, k] int32, logprobs [n, k] fp32) device arrays: the given ones, or
        views of this launcher's own (overwritten by its next call)."""
        if logits.dtype != np.float32 or logits.size < n * vocab:
            raise ValueError(f"logits {logits.shape} {logits.dtype} do not hold {n} fp32 rows of {vocab}")
        if not 1 <= k <= min(self.max_k, vocab):
            raise ValueError(f"k = {k} must be between 1 and min(max_k {self.max_k}, vocab {vocab}) "
                             f"(tuning.topk.max_k sets the most)")
        if n < 1:
            raise ValueError(f"n = {n} rows: at least one")
        self.reserve(n, vocab)
        if ids is None:
            ids = self.ids.view((n, k))
        if logprobs is None:
            logprobs = self.logprobs.view((n, k))
        if values is True:
            values = self.values.view((n, k))
        for name, a, dt in (("ids", ids, np.int32), ("logprobs", logprobs, np.float32),
                            *((("values", values, np.float32),) if values is not None else ())):
            if a.dtype != dt or a.size != n * k:
                raise ValueError(f"{name} {a.shape} {a.dtype}: expected {n * k} {np.dtype(dt)}")
        self.kernel((math.ceil(vocab / self.slice), n), self.threads, logits, vocab, k, self.lists, self.stats,
                    self.tickets, ids, logprobs, values if values is not None else (0, ctypes.c_void_p),
                    stream=stream)
        return ids, logprobs

    def best(self, logits: DeviceArray, n: int, vocab: int, k: int, stream=None
             ) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
        """The same launch, also writing the k logits themselves: (ids, logprobs, values [n, k] fp32), views of this
        launcher's own arrays."""
        ids, logprobs = self(logits, n, vocab, k, stream=stream, values=True)
        return ids, logprobs, self.values.view((n, k))

    def top(self, logits: DeviceArray, n: int, vocab: int, k: int, stream=None) -> TopK:
        """The same on the host: a TopK (ids int64 [n, k], log-probs fp32 [n, k]) as DDTree's build_tree takes it;
        only the n * k ids and values are copied."""
        ids, logprobs = self(logits, n, vocab, k, stream=stream)
        if stream is not None:  # lucegen streams do not block: the copies below must wait for the kernel
            stream.synchronize()
        return TopK(ids.numpy().astype(np.int64), logprobs.numpy())

    def free(self) -> None:
        for a in (self.lists, self.stats, self.tickets, self.ids, self.logprobs, self.values):
            a.free()


def device_topk(kernel: TopKKernel, logits_device: DeviceArray, n: int, vocab: int, k: int, stream=None) -> TopK:
    """A draft's best k tokens per position (rows of logits_device [n, vocab] on the device) as DDTree's TopK.
    k above the kernel's max_k (tuning.topk.max_k) is taken as max_k: DDTree then places at most that many tokens a
    depth (build_tree reads K from the TopK's width)."""
    return kernel.top(logits_device, n, vocab, min(k, kernel.max_k, vocab), stream=stream)
