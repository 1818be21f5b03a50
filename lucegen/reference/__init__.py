"""numpy float32 reference of the Qwen3.5 text model: the truth every generated kernel is tested against.

ops        norms, activations, partial RoPE, argmax
deltanet   causal conv1d, the gated delta rule (recurrent and chunked), the Gated DeltaNet layer
attention  gated full attention with GQA and a KV cache
weights    tensor names / shapes and deterministic random weights
model      State, forward / prefill / decode_step / generate
compare    relative_error, the one way results are compared
"""
from lucegen.reference.compare import relative_error
from lucegen.reference.model import Output, State, decode_step, forward, generate, lm_head, prefill
from lucegen.reference.weights import random_weights, weight_shapes

__all__ = ["Output", "State", "decode_step", "forward", "generate", "lm_head", "prefill", "random_weights",
           "relative_error", "weight_shapes"]
