"""Energy benchmark: tokens per joule of the decode path, from NVML's total-energy counter, with the watts drawn.

The decode suite's engine (bench.decode.Setup: the megakernel on random weights of the real shapes) runs tg128
launches back to back for ENERGY_SECONDS. Records:

    tok_per_joule   tokens / joules; limit: the tokens per joule of the bandwidth limit's rate at the same power
                    (what the same watts would give if every token only streamed its weights at the spec's read rate)
    decode_watts    the mean power over the run; limit: the board's enforced power limit
    HF              transformers decoding greedily for as long, when torch imports (bench/torch_peers.py, in a process
                    of its own; it reads the same NVML counter)

Without pynvml (the nvidia-ml-py package) the suite says so and records nothing.
"""
from __future__ import annotations

import importlib.util

from ..runtime import Stream
from ..runtime.driver import call
from .decode import HF_TOKENS, TG, Setup
from .nvml import measure_energy
from .peers import peer
from .results import Recorder

ENERGY_SECONDS = 6.0


def pci_bus_id(ordinal: int = 0) -> str:
    """The PCI bus id ("0000:1b:00.0") of CUDA device `ordinal` as this process sees it."""
    return call("cuDeviceGetPCIBusId", 32, call("cuDeviceGet", ordinal)).split(b"\0")[0].decode()


def run(recorder: Recorder | None = None, model: str = "qwen3.5-0.8b", seconds: float = ENERGY_SECONDS) -> None:
    if importlib.util.find_spec("pynvml") is None:
        print("energy: pynvml (pip install nvidia-ml-py) is not installed; nothing measured")
        return
    stream = Stream()
    setup = Setup.open(model, None, TG + 8)
    rec = recorder or Recorder(gpu=setup.spec.name)
    engine = setup.engine

    def tg128() -> None:
        engine.enqueue([1], TG - 1, stream=stream)
        stream.synchronize()

    bus_id = pci_bus_id()
    joules, launches, elapsed, power_limit = measure_energy(bus_id, seconds, tg128)
    tokens, watts = launches * TG, joules / elapsed
    tok_j = tokens / joules
    rec.record("tok_per_joule", setup.name, tok_j, "tok/J", setup.limit / watts, watts=round(watts, 1),
               tok_s=round(tokens / elapsed, 1), seconds=round(elapsed, 2), j_per_token=round(joules / tokens, 5))
    rec.record("decode_watts", setup.name, watts, "W", power_limit, tok_s=round(tokens / elapsed, 1))
    engine.free()

    hf = peer("hf_decode", setup.cfg.to_hf_dict()["text_config"], HF_TOKENS, seconds, bus_id)
    if hf is None:
        print("  HF transformers: no torch peer (not installed, or its process failed), skipped")
        return
    hf_tokens = hf["runs"] * HF_TOKENS  # as in the decode suite's HF rate: the steps after a 1-token prompt
    rec.record("tok_per_joule", setup.name, hf_tokens / hf["joules"], "tok/J", None,
               watts=round(hf["joules"] / hf["seconds"], 1), tok_s=round(hf_tokens / hf["seconds"], 1),
               peer=hf["label"], megakernel_ratio=round(tok_j * hf["joules"] / hf_tokens, 1))
