"""The engine: one interface (base.Engine) over the backends, the sampler and the generation loop.

base           Engine protocol, ContextOverflow
numpy_backend  NumpyEngine: the Engine over the float32 reference
sampling       SamplingParams, filtered_probs, Sampler
generate       generate(): prefill, decode, stop, stream text, count and time
loader         load_model(): a model folder / .gguf / hub id -> (engine, tokenizer); the backend registry
"""
from .base import ContextOverflow, Engine
from .generate import Generation, check_request, generate
from .loader import BACKENDS, LoadError, load_model, model_name
from .sampling import Sampler, SamplingParams, filtered_probs

__all__ = ["BACKENDS", "ContextOverflow", "Engine", "Generation", "LoadError", "Sampler", "SamplingParams",
           "check_request", "filtered_probs", "generate", "load_model", "model_name"]
