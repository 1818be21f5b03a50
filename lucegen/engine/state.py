"""One sequence's state on the GPU, in the layout the prefill and the decode path both read and write.

Per DeltaNet layer i:
    conv[i]       fp32 [K, conv_dim]      a ring: slot p % K holds the raw (pre-conv) in-projection row of absolute
                                          position p; positions before 0 read as zero
    recurrent[i]  fp32 [Hv, dv, dk]       S transposed (o = S^T q; column j of S is dk consecutive floats); read only
                                          when the sequence has tokens (position > 0), so a new one needs no reset
Per full-attention layer i:
    keys[i], values[i]  bf16 [max_context, n_kv, head_dim]   keys after k_norm and RoPE, rows by absolute position
                        (the bf16 KV format; the quantized formats some specs choose are not held here yet)
position: tokens in the state (the next token's position).

The reference (lucegen.reference.model.State) keeps the conv state as [K-1, conv_dim] (oldest first), S as
[Hv, dk, dv] and the caches as [position, n_kv, head_dim] float32; to_reference and load_reference convert.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..kernels.conv1d import ring_to_state, state_to_ring
from ..model.config import ModelConfig
from ..reference.model import State
from ..runtime.memory import DeviceArray

BF16 = ml_dtypes.bfloat16


class DeviceState:
    def __init__(self, cfg: ModelConfig, max_context: int):
        self.cfg, self.max_context, self.position = cfg, max_context, 0
        k, c = cfg.linear_conv_kernel_dim, cfg.conv_dim
        hv, dv, dk = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim
        kv = (max_context, cfg.num_key_value_heads, cfg.head_dim)
        self.conv = {i: DeviceArray.zeros((k, c), np.float32) for i in cfg.linear_layers}
        self.recurrent = {i: DeviceArray.zeros((hv, dv, dk), np.float32) for i in cfg.linear_layers}
        self.keys = {i: DeviceArray.zeros(kv, BF16) for i in cfg.full_layers}
        self.values = {i: DeviceArray.zeros(kv, BF16) for i in cfg.full_layers}

    def reset(self) -> None:
        """Forget the sequence. Nothing is cleared: every kernel reads state only below `position`."""
        self.position = 0

    def to_reference(self) -> State:
        """The state as the numpy reference holds it (float32), for comparisons."""
        p = self.position
        ref = State(position=p)
        if p == 0:
            return ref
        for i in self.cfg.linear_layers:
            ref.conv[i] = ring_to_state(self.conv[i].numpy(), p)
            ref.recurrent[i] = np.ascontiguousarray(self.recurrent[i].numpy().transpose(0, 2, 1))
        for i in self.cfg.full_layers:
            ref.keys[i] = self.keys[i].numpy()[:p].astype(np.float32)
            ref.values[i] = self.values[i].numpy()[:p].astype(np.float32)
        return ref

    def load_reference(self, ref: State) -> None:
        """Take over a reference state (caches rounded to bf16), so that the next tokens continue it."""
        p = ref.position
        if p > self.max_context:
            raise ValueError(f"a state of {p} tokens does not fit {self.max_context}")
        self.position = p
        if p == 0:
            return
        for i in self.cfg.linear_layers:
            self.conv[i].copy_from(state_to_ring(ref.conv[i].astype(np.float32), p))
            self.recurrent[i].copy_from(np.ascontiguousarray(ref.recurrent[i].astype(np.float32).transpose(0, 2, 1)))
        for i in self.cfg.full_layers:
            for cache, rows in ((self.keys[i], ref.keys[i]), (self.values[i], ref.values[i])):
                cache.view(rows.shape, BF16).copy_from(rows.astype(BF16))

    def free(self) -> None:
        for table in (self.conv, self.recurrent, self.keys, self.values):
            for a in table.values():
                a.free()
