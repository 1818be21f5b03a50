"""A model's weights on the GPU: one arena in the decode megakernel's packing (kernels.megakernel.Layout), which the
prefill reads as well, so one copy of the weights serves both.

The arena holds bf16 matrices [out, in] (the DeltaNet in-projection fused as [qkv | z | b | a], the attention one as
[q_proj (per head: query, gate) | k_proj | v_proj], gate_proj and up_proj rows paired) and fp32 vectors (norm weights,
conv1d [conv_dim, K], A_log, dt_bias). DeviceWeights gives views of it by the Layout's tensor names: embed, lm_head
(the embeddings when tied), final_norm, and layers[i] = {ln1, in, out, ln2, gate_up, down, and conv, a_log, dt_bias,
norm (DeltaNet) or q_norm, k_norm (attention)}.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..kernels.megakernel import Layout, Tensor
from ..model.config import ModelConfig
from ..runtime.memory import DeviceArray
from ..spec import ChipSpec


class DeviceWeights:
    def __init__(self, cfg: ModelConfig, spec: ChipSpec, arena: DeviceArray | None = None):
        """Views of `arena` (a megakernel's weights, kept by it), or of a new uninitialised one for `cfg` laid out for
        `spec`."""
        self.cfg = cfg
        self.layout = Layout(cfg, spec)
        if arena is not None and arena.nbytes < self.layout.arena_bytes:
            raise ValueError(f"a weight arena of {arena.nbytes} bytes is smaller than {cfg.name}'s layout on "
                             f"{spec.name} ({self.layout.arena_bytes} bytes)")
        self.owned = arena is None
        self.arena = DeviceArray.empty(self.layout.arena_bytes, np.uint8) if arena is None else arena
        self.embed, self.lm_head = self.view(self.layout.embed), self.view(self.layout.lm_head)
        self.final_norm = self.view(self.layout.final_norm)
        self.layers = [{name: self.view(t) for name, t in self.layout.layer_tensors(i).items()}
                       for i in range(cfg.num_hidden_layers)]

    def view(self, t: Tensor) -> DeviceArray:
        return self.arena.view(t.shape, t.dtype, t.offset)

    @classmethod
    def upload(cls, cfg: ModelConfig, spec: ChipSpec, weights: Mapping[str, np.ndarray]) -> "DeviceWeights":
        """Canonical weights (HF names, any float dtype; lucegen.model.weights) onto the GPU, tensor by tensor."""
        dev = cls(cfg, spec)
        for t, a in dev.layout.packed(weights):
            dev.view(t).copy_from(np.ascontiguousarray(a))
        return dev

    @classmethod
    def random(cls, cfg: ModelConfig, spec: ChipSpec, fill, seed: int = 0) -> "DeviceWeights":
        """Pseudo-random weights filled on the GPU (kernels.fill.Fill), scaled as reference.random_weights scales
        them so activations stay O(1): matrices uniform with variance 1/fan_in, embeddings unit variance, (1 + w)
        norms and dt_bias near 0, the DeltaNet output norm near 1, A_log = log of [1, 16)."""
        dev = cls(cfg, spec)
        sym = lambda a, s, var: fill.uniform(a, s, -np.sqrt(3 * var), np.sqrt(3 * var))
        sym(dev.embed, seed, 1.0)
        if not cfg.tie_word_embeddings:
            sym(dev.lm_head, seed + 1, 1.0 / cfg.hidden_size)
        sym(dev.final_norm, seed + 2, 0.01)
        for i, layer in enumerate(dev.layers):
            for j, (name, a) in enumerate(layer.items()):
                s = seed + 1000 * (i + 1) + j
                if name == "a_log":
                    fill.uniform(a, s, 0.0, float(np.log(16.0)))
                elif name == "norm":
                    fill.uniform(a, s, 0.9, 1.1)
                elif len(a.shape) == 1:
                    sym(a, s, 0.01)
                else:
                    sym(a, s, 1.0 / a.shape[-1])
        return dev

    def free(self) -> None:
        if self.owned:
            self.arena.free()
