"""One sequence's state on the GPU, in the layout the prefill and the decode path both read and write.

Per DeltaNet layer i:
    conv[i]       fp32 [K, conv_dim]      a ring: slot p % K holds the raw (pre-conv) in-projection row of absolute
                                          position p; positions before 0 read as zero
    recurrent[i]  fp32 [Hv, dv, dk]       S transposed (o = S^T q; column j of S is dk consecutive floats); read only
                                          when the sequence has tokens (position > 0), so a new one needs no reset
Per full-attention layer i:
    keys[i], values[i]  [max_context, n_kv] rows of head_dim values in the state's KV format: bf16 [..., head_dim]
                        (every engine), or the bytes of a quantized row (lucegen.model.kvformats: q8_0, q4_0; the
                        layer-by-layer step's tree attention reads them); keys after k_norm and RoPE, rows by
                        absolute position
position: tokens in the state (the next token's position).

The reference (lucegen.reference.model.State) keeps the conv state as [K-1, conv_dim] (oldest first), S as
[Hv, dk, dv] and the caches as [position, n_kv, head_dim] float32; to_reference and load_reference convert.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..kernels.conv1d import ring_to_state, state_to_ring
from ..model import kvformats
from ..model.config import ModelConfig
from ..reference.model import State
from ..runtime.memory import DeviceArray

BF16 = ml_dtypes.bfloat16


class DeviceState:
    def __init__(self, cfg: ModelConfig, max_context: int, kv_format: str = "bf16"):
        kvformats.check(kv_format, cfg.head_dim)
        self.cfg, self.max_context, self.position, self.kv_format = cfg, max_context, 0, kv_format
        k, c = cfg.linear_conv_kernel_dim, cfg.conv_dim
        hv, dv, dk = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim
        if kv_format == "bf16":
            kv, dtype = (max_context, cfg.num_key_value_heads, cfg.head_dim), BF16
        else:
            kv, dtype = (max_context, cfg.num_key_value_heads, kvformats.row_bytes(kv_format, cfg.head_dim)), np.uint8
        self.conv = {i: DeviceArray.zeros((k, c), np.float32) for i in cfg.linear_layers}
        self.recurrent = {i: DeviceArray.zeros((hv, dv, dk), np.float32) for i in cfg.linear_layers}
        self.keys = {i: DeviceArray.zeros(kv, dtype) for i in cfg.full_layers}
        self.values = {i: DeviceArray.zeros(kv, dtype) for i in cfg.full_layers}

    def kv_values(self, rows: np.ndarray) -> np.ndarray:
        """Cache rows as read back from the device -> float32 [..., head_dim] (what attention reads of them)."""
        return rows.astype(np.float32) if self.kv_format == "bf16" else kvformats.decode(rows, self.kv_format)

    def kv_rows(self, values: np.ndarray) -> np.ndarray:
        """float rows [..., head_dim] -> the cache's rows in its format."""
        return values.astype(BF16) if self.kv_format == "bf16" else kvformats.encode(values, self.kv_format)

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
            ref.keys[i] = self.kv_values(self.keys[i].numpy()[:p])
            ref.values[i] = self.kv_values(self.values[i].numpy()[:p])
        return ref

    def load_reference(self, ref: State) -> None:
        """Take over a reference state (caches rounded to the KV format), so that the next tokens continue it."""
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
                rows = self.kv_rows(rows)
                cache.view(rows.shape, rows.dtype).copy_from(rows)

    def free(self) -> None:
        for table in (self.conv, self.recurrent, self.keys, self.values):
            for a in table.values():
                a.free()
