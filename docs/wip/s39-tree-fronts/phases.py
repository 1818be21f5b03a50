"""Lab: tree_deltanet's phases (stamps from .lab/stampify.py) in a verify of each budget and a decode step."""
import os, sys, time
import numpy as np
from pathlib import Path
from cuda.bindings import driver as drv
from lucegen.bench import speculative as sp
from lucegen.bench.engines import open_engine
from lucegen.bench.results import Recorder
from lucegen.engine.generate import generate
NAMES = ["entry", "pre-wait", "wait", "sync1", "stage", "taps", "fronts", "sums", "gates", "recur", "commit", "norm"]
tag = sys.argv[1]
rec = Recorder(gpu="lab", out=Path(os.environ.get("OUT", "/tmp")) / f"phases-{tag}.jsonl")
engine, tok, name = open_engine("random:qwen3.5-27b:q4_k_m", "cuda")
prompt_ids = tok.encode(sp.PROMPT)
target = generate(engine, tok, prompt_ids, 16, sp.GREEDY, ignore_eos=True).token_ids
sp.BREAKDOWN_BUDGETS = ()
handle = engine.step.tree._dn.module.handle
err, dptr, size = drv.cuModuleGetGlobal(handle, b"lab_stamps")
assert err == 0, err
def read():
    a = np.zeros((3, 512, 16, 2), np.uint64)
    drv.cuCtxSynchronize()
    assert drv.cuMemcpyDtoH(a.ctypes.data, dptr, a.nbytes)[0] == 0
    return a.astype(np.int64)
def report(label, a, blocks=384):
    a = a[:blocks]
    cyc, ns = a[:, :, 0], a[:, :, 1]
    used = [i for i in range(16) if (cyc[:, i] != 0).all()]
    rate = np.median((cyc[:, used[-1]] - cyc[:, used[0]]) / np.maximum(ns[:, used[-1]] - ns[:, used[0]], 1))  # cycles/ns
    t0 = ns[:, used[0]].min()
    print(f"  {label}: {blocks} blocks, ~{rate:.2f} GHz; block starts {0:.1f} .. {(ns[:, used[0]].max() - t0) / 1e3:.1f} us, ends "
          f"{(ns[:, used[-1]].min() - t0) / 1e3:.1f} .. {(ns[:, used[-1]].max() - t0) / 1e3:.1f} us")
    for i, j in zip(used, used[1:]):
        d = (cyc[:, j] - cyc[:, i]) / rate / 1e3
        print(f"    {NAMES[i]:>8} -> {NAMES[j]:<8} median {np.median(d):7.2f} us  max {d.max():7.2f}")
    d = (cyc[:, used[-1]] - cyc[:, used[0]]) / rate / 1e3
    print(f"    {'total':>20} median {np.median(d):7.2f} us  max {d.max():7.2f}", flush=True)
for b in [int(x) for x in sys.argv[2].split(",")]:
    sp.verify(rec, engine, name, prompt_ids, target, [b], 3)
    a = read()
    report(f"verify budget {b} (last launch)", a[0])
    report(f"decode step (last launch)", a[1])
