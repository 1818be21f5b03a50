"""The decode megakernel as an Engine (lucegen.engine.base).

One launch runs any number of steps on the device (kernels/megakernel.py): a prompt is fed token by token and the
generated tokens follow without a host round trip, stopping at EOS. The state is a DeviceState, the layout the
prefill kernels share: prefill() of a prompt of PREFILL_FROM tokens or more runs the tensor-core prefill
(engine/prefill.py) over the megakernel's own weight arena, and decoding continues from the state it leaves.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from ..codegen.build import BUILD_DIR, build
from ..kernels import sample, topk
from ..kernels.gdn import CHUNK
from ..kernels.megakernel import Megakernel
from ..model.config import ModelConfig
from ..runtime import DeviceArray, Stream, synchronize
from ..spec import ChipSpec, spec_for_current_device
from . import prefill as tensor_prefill
from .base import ContextOverflow
from .sampling import Sampler, drawn_on_device
from .speculating import Speculating
from .state import DeviceState
from .weights import DeviceWeights

# Prompt tokens from which prefill() runs the tensor-core prefill rather than one decode step a token. Not measured:
# an estimate from the prefill's ~230 launches from Python (a few ms for the 0.8B) against ~0.8 ms a megakernel
# step (0.8B, H200).
PREFILL_FROM = 8


class Steps(NamedTuple):
    tokens: np.ndarray          # int32 [steps done]: the token of each step (its argmax, or its draw)
    logits: np.ndarray | None   # float32 [steps done, vocab] when asked for


class DecodeEngine(Speculating):
    """One sequence through the decode megakernel. `weights`: reference-style (HF names, any float dtype), or None
    for pseudo-random weights of the real shapes filled on the device (benchmarks); traced: the kernel built with
    its timeline stamps (enqueue(trace=...); benchmarks)."""

    def __init__(self, weights: Mapping[str, np.ndarray] | None, config: ModelConfig, spec: ChipSpec | None = None,
                 max_context: int | None = None, build_root: Path | None = None, traced: bool = False):
        self.config = config
        self.spec = spec or spec_for_current_device()
        self.max_context = min(max_context or self.spec.tuning.max_context, config.max_position_embeddings)
        self.kernel = Megakernel(weights, config, self.spec, build_root, traced=traced)
        self.build_root = build_root or BUILD_DIR
        self.state = DeviceState(config, self.max_context)
        self.table = self.kernel.state_table(self.state)
        self.n_done = DeviceArray.empty(1, np.int32)
        self._buffers: dict[str, DeviceArray] = {}
        self._prefill: tuple[tensor_prefill.Prefill, DeviceWeights] | None = None  # built for the first long prompt
        self._rows: tuple[topk.TopKKernel, sample.Sample] | None = None  # built for the first decode_top_k / _top_p

    # ---- the Engine interface -------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.state.position

    def reset(self) -> None:
        self.state.reset()

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Append the tokens; logits [vocab] after the last. PREFILL_FROM tokens or more go through the tensor-core
        prefill where it takes this model; fewer, one decode step each, in one launch."""
        if len(tokens) < PREFILL_FROM or tensor_prefill.shape_problem(self.spec, self.config):
            return self.run(tokens, logits="last").logits[-1]
        ids = np.asarray(tokens, np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in 0 .. {self.config.vocab_size - 1}")
        if self._prefill is None:
            chunk = min(self.spec.tuning.prefill.chunk_tokens, -(-self.max_context // CHUNK) * CHUNK)
            self._prefill = (tensor_prefill.Prefill(self.spec, self.config, chunk_tokens=chunk,
                                                    root=self.build_root),
                             DeviceWeights(self.config, self.spec, self.kernel.weights))
        run, weights = self._prefill
        synchronize()  # the megakernel's launches on the null stream are done before the prefill's stream reads
        return run(weights, self.state, ids).numpy()

    def decode(self, token: int) -> np.ndarray:
        return self.run([token], logits="last").logits[-1]

    def decode_argmax(self, token: int) -> int:
        """decode's step, returning the megakernel's argmax (numpy's rule), not vocab logits."""
        return int(self.run([token]).tokens[-1])

    @property
    def max_top_k(self) -> int:
        """The most tokens decode_top_k returns (tuning.topk.max_k)."""
        return topk.max_k(self.spec)

    def decode_top_k(self, token: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """decode's step, returning the k best tokens of its logits (best first, ties to the lower id) and their
        log-softmax values, found on the device (kernels/topk.py), not vocab logits; step_logits() has the rest."""
        top_k, _ = self._row_kernels()
        self.enqueue([token], logits="last")
        ids, values = top_k(self._buffers["logits"], 1, self.config.vocab_size, k)
        self.state.position += 1
        return ids.numpy()[0], values.numpy()[0]

    def decode_top_p(self, token: int, temperature: float, k: int) -> tuple[np.ndarray, np.ndarray, float, float]:
        """decode's step, returning the k best tokens of its logits (best first, ties to the lower id), their logits,
        and the row's softmax at the temperature (kernels/sample.py's softmax_of: Z and S), found on the device, not
        vocab logits: what Sampler.draw_top_p takes; step_logits() has the rest."""
        top_k, draw = self._row_kernels()
        self.enqueue([token], logits="last")
        V = self.config.vocab_size
        ids, _, values = top_k.best(self._buffers["logits"], 1, V, k)
        draw.softmax(self._buffers["logits"].view(V, np.float32), temperature)
        self.state.position += 1
        return (ids.numpy()[0], values.numpy()[0], *draw.softmax_of(1, temperature)[0])

    def _row_kernels(self) -> tuple[topk.TopKKernel, sample.Sample]:
        """The top-k and sample kernels over the step's logits row (built on first use)."""
        if self._rows is None:
            units = [*topk.units(self.spec, self.config), *sample.units(self.spec, self.config)]
            built = build(self.spec, self.config, units, root=self.build_root)
            self._rows = (topk.TopKKernel(built.module("topk"), self.spec, rows=1, vocab=self.config.vocab_size),
                          sample.Sample(built.module("sample"), self.spec))
        return self._rows

    def step_logits(self) -> np.ndarray:
        """The logits [vocab] of the last step, where it kept them (logits="last")."""
        return self._buffers["logits"].view(self.config.vocab_size, np.float32).numpy()

    def decode_sample(self, token: int, temperature: float, u: float) -> int:
        """decode's step, returning the token the megakernel draws from softmax(logits / temperature) with the
        uniform u (kernels/sample.py's law: Sampler's for the same u), not vocab logits."""
        return int(self.run([token], temperature=temperature, uniforms=[u]).tokens[-1])

    # ---- beyond the interface ---------------------------------------------------------------------------------
    def step(self, token: int, position: int | None = None) -> tuple[np.ndarray, int]:
        """One step at `position` (default: the state's); (logits [vocab], argmax)."""
        if position is not None:
            self.state.position = position
        out = self.run([token], logits="last")
        return out.logits[-1], int(out.tokens[-1])

    def generate(self, prompt: Sequence[int], n: int, eos: int | None = None,
                 sampler: Sampler | None = None) -> list[int]:
        """The prompt after the state, then up to n generated tokens, all in one launch; stops after eos. Greedy,
        or drawn at the sampler's temperature with its next n uniforms (a temperature alone: top_k and top_p take a
        launch a token, lucegen.engine.generate's loop)."""
        if n < 1:
            raise ValueError(f"generate {n} tokens: at least one")
        if sampler is None or sampler.params.temperature == 0:
            out = self.run(prompt, n_new=n - 1, eos=eos)
        elif not drawn_on_device(sampler.params):
            raise ValueError(f"the megakernel draws at a temperature alone, not with {sampler.params}")
        else:
            out = self.run(prompt, n_new=n - 1, eos=eos, temperature=sampler.params.temperature,
                           uniforms=sampler.rng.random(n))
        return [int(t) for t in out.tokens[len(prompt) - 1:]]

    def run(self, tokens: Sequence[int], n_new: int = 0, eos: int | None = None, logits: str | None = None,
            temperature: float = 0.0, uniforms: Sequence[float] = (), phase_limit: int = -1, skip_mask: int = 0,
            prefetch: bool | int = True) -> Steps:
        """len(tokens) + n_new steps in one launch: the tokens, then n_new steps that read the previous token
        (stopping after a token equal to eos). A step's token is its argmax, or at a temperature > 0 the draw with
        the next of `uniforms` (n_new + 1 of them: the last prompt token's step and the generated ones'). logits:
        None, "last" (the last step's) or "all"."""
        self.enqueue(tokens, n_new, eos, logits, temperature, uniforms, phase_limit, skip_mask, prefetch)
        done = int(self.n_done.numpy()[0])
        if phase_limit < 0:
            self.state.position += done
        if not done:  # phase_limit stopped the only step
            return Steps(np.empty(0, np.int32), None)
        toks = self._buffers["tokens"].view(done, np.int32).numpy()
        if logits is None:
            return Steps(toks, None)
        rows = done if logits == "all" else 1
        return Steps(toks, self._buffers["logits"].view((rows, self.config.vocab_size), np.float32).numpy())

    def enqueue(self, tokens: Sequence[int], n_new: int = 0, eos: int | None = None, logits: str | None = None,
                temperature: float = 0.0, uniforms: Sequence[float] = (), phase_limit: int = -1,
                skip_mask: int = 0, prefetch: bool | int = True, stream: Stream | None = None,
                trace: DeviceArray | None = None):
        """The launch of run() without waiting for it or advancing the state (benchmarks time this)."""
        if not len(tokens):
            raise ValueError("no tokens to run")
        ids = np.asarray(tokens, np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must be in 0 .. {self.config.vocab_size - 1}")
        n_steps = len(tokens) + n_new
        if self.position + n_steps > self.max_context:
            raise ContextOverflow(f"{self.position} tokens in the state + {n_steps} steps exceed the context of "
                                  f"{self.max_context} tokens")
        V = self.config.vocab_size
        prompt = self._buffer("prompt", len(tokens), np.int32)
        prompt.view(len(tokens), np.int32).copy_from(ids.astype(np.int32), stream=stream)
        out_tokens = self._buffer("tokens", n_steps, np.int32)
        out_logits = None if logits is None else self._buffer("logits", (n_steps if logits == "all" else 1) * V,
                                                              np.float32)
        draws = None
        if temperature:
            u = np.asarray(uniforms, np.float64)
            if not temperature > 0 or u.shape != (n_new + 1,) or not ((u >= 0) & (u < 1)).all():
                raise ValueError(f"a sampled run of {len(tokens)} tokens and {n_new} new ones takes a temperature "
                                 f"> 0 (got {temperature}) and {n_new + 1} uniforms in [0, 1) (got {u.size})")
            draws = self._buffer("uniforms", n_steps, np.float64)
            draws.view(n_steps, np.float64).copy_from(np.concatenate([np.zeros(len(tokens) - 1), u]), stream=stream)
        self.kernel.launch(self.table, prompt, len(tokens), self.position, n_steps, out_tokens, self.n_done,
                           logits=out_logits, logits_stride=V if logits == "all" else 0,
                           eos=-1 if eos is None else eos, uniforms=draws, temperature=temperature or 1.0,
                           phase_limit=phase_limit, skip_mask=skip_mask,
                           prefetch=prefetch, trace=trace, stream=stream)

    def outputs(self) -> list[DeviceArray]:
        """The device buffers launches write their results to (tests poison them before a launch)."""
        return [self.n_done, *self._buffers.values()]

    def _buffer(self, name: str, size: int, dtype) -> DeviceArray:
        """A device buffer of at least `size` elements, kept between runs."""
        a = self._buffers.get(name)
        if a is None or a.size < size:
            if a is not None:
                a.free()
            a = self._buffers[name] = DeviceArray.empty(max(size, 1), dtype)
        return a

    def free(self) -> None:
        self.free_speculation()
        if self._prefill is not None:
            self._prefill[0].free()
        for kernel in self._rows or ():
            kernel.free()
        self.kernel.free()
        self.state.free()
        for a in (self.table, self.n_done, *self._buffers.values()):
            a.free()
