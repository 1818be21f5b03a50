"""What a speculative round's commit costs on the 27B, and whether it runs beside the DFlash draft's next work on a
stream of its own (issue #7; docs/design.md, session 46's plan for LayeredDraft's stream).

The cuda LayeredEngine on random Q4_K_M weights of the real shapes, prefilled with PROMPT random tokens; a chain of
ACCEPTED nodes verified (TreeVerifier.forward) and committed whole, again and again from the same position; beside it
the GPU draft (draft_parts' random bf16 weights, the target's embedding and LM head) on a stream of its own, its
context the prompt's. Medians over REPEAT rounds, in ms:

    host_commit          TreeVerifier.commit() on the host clock (what bench speculative's spec_commit_ms times)
    set_path, replay_call, wait   its parts: the path's upload, the commit graph's launch call, the wait after it
    gpu_commit           the commit graph on the GPU (events around it)
    gpu_verify           the verify of the chain on the GPU
    gpu_append, gpu_draft the draft's append of the round's ACCEPTED feature rows, and its forward of DEPTHS depths
    serial_/concurrent_commit_append          the commit graph, then (or beside it, on the draft's stream) the append
    serial_/concurrent_commit_append_forward  ... and the draft's next forward after the append

    python3 tools/commit_overlap.py [spec]

Prints the medians as one JSON line (also to $OUT/commit_overlap.json where OUT is set). Not a benchmark of record.
"""
import json
import os
import statistics
import sys
import time

import numpy as np

from lucegen.bench.draft_parts import ACCEPTED, TiledDraftWeights, draft_config_path
from lucegen.engine.draft_gpu import GpuDraft
from lucegen.engine.layered import LayeredEngine
from lucegen.engine.layered_weights import RandomSource
from lucegen.model.config import load_config
from lucegen.model.draft_config import DraftConfig
from lucegen.runtime import DeviceArray, Event, device_info
from lucegen.spec import load_spec, spec_for_current_device

PROMPT, REPEAT, WARMUP, DEPTHS = 62, 20, 3, 7

spec = load_spec(sys.argv[1]) if len(sys.argv) > 1 else spec_for_current_device()
cfg = load_config("qwen3.5-27b")
engine = LayeredEngine(RandomSource(cfg, "q4_k_m"), cfg, spec, max_context=4096)
step = engine.step
dcfg = DraftConfig.from_json(draft_config_path())
draft = GpuDraft(spec, dcfg, TiledDraftWeights(dcfg, seed=7), engine.weights, cfg, max_context=4096 + 64)
rng = np.random.default_rng(1)
engine.prefill(rng.integers(0, cfg.vocab_size, PROMPT).tolist())
draft.append_context(rng.standard_normal((PROMPT, dcfg.fc_in), dtype=np.float32), 0)
draft.wait()
feats = DeviceArray.from_numpy(rng.standard_normal((ACCEPTED, dcfg.fc_in), dtype=np.float32))
verifier = engine.verifier()
tokens = rng.integers(0, cfg.vocab_size, ACCEPTED).tolist()
parents, path = [-1, *range(ACCEPTED - 1)], list(range(ACCEPTED))
start, end = Event(), Event()
times: dict[str, list[float]] = {}


def note(name: str, ms: float) -> None:
    times.setdefault(name, []).append(ms)


def gpu_ms(stream, work) -> float:
    start.record(stream)
    work()
    end.record(stream)
    return start.elapsed_ms(end)


def commit_graph() -> tuple[float, float]:
    """The commit of the verified chain as commit() queues it, without moving the position (commit_rows), the graph
    between the events start and end; returns the host ms of the path's upload and of the graph's launch call."""
    tree = verifier.mixer.tree
    t0 = time.perf_counter()
    length = step.tree.set_path(tree, path, stream=step.stream)
    t1 = time.perf_counter()
    start.record(step.stream)
    step.replay((verifier, "commit", tree.n, length), lambda stream: verifier.mixer.commit(length, stream))
    t2 = time.perf_counter()
    end.record(step.stream)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


for _ in range(WARMUP + REPEAT):
    verifier.forward(tokens, parents)
    t = time.perf_counter()
    verifier.commit(path)
    note("host_commit", (time.perf_counter() - t) * 1e3)
    engine.state.position -= ACCEPTED  # every commit from the prompt's end

    note("gpu_verify", gpu_ms(step.stream, lambda: verifier.forward(tokens, parents)))
    upload_ms, call_ms = commit_graph()
    t = time.perf_counter()
    step.wait()
    note("wait", (time.perf_counter() - t) * 1e3)
    note("set_path", upload_ms)
    note("replay_call", call_ms)
    note("gpu_commit", start.elapsed_ms(end))

    note("gpu_append", gpu_ms(draft.stream, lambda: draft.append_context(feats, PROMPT)))
    draft.wait()
    draft.length = PROMPT
    note("gpu_draft", gpu_ms(draft.stream, lambda: draft.forward(tokens[0], PROMPT, DEPTHS)))
    draft.wait()

    for forward in (False, True):
        for together in (False, True):
            verifier.forward(tokens, parents)
            t = time.perf_counter()
            commit_graph()
            if not together:
                step.wait()
            draft.append_context(feats, PROMPT)
            if forward:
                draft.forward(tokens[0], PROMPT + ACCEPTED, DEPTHS)
            draft.wait()
            step.wait()
            kind = "concurrent" if together else "serial"
            note(f"{kind}_commit_append{'_forward' if forward else ''}", (time.perf_counter() - t) * 1e3)
            draft.length = PROMPT

out = {name: round(statistics.median(v[WARMUP:]), 4) for name, v in times.items()}
out.update(gpu=device_info().name, spec=str(spec.path), prompt=PROMPT, accepted=ACCEPTED, depths=DEPTHS)
print(json.dumps(out))
if "OUT" in os.environ:
    with open(os.path.join(os.environ["OUT"], "commit_overlap.json"), "w") as f:
        json.dump(out, f)
