"""Lab: the 27B verify (TreeVerifier graph) at a few budgets and one decode step, on random Q4_K_M weights."""
import os, sys, time
from pathlib import Path
from lucegen.bench import speculative as sp
from lucegen.bench.engines import open_engine
from lucegen.bench.results import Recorder
from lucegen.engine.generate import generate
tag = sys.argv[1]
budgets = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8, 16, 22]
t0 = time.time()
rec = Recorder(gpu="lab", out=Path(os.environ.get("OUT", "/tmp")) / f"verify-{tag}.jsonl")
engine, tok, name = open_engine("random:qwen3.5-27b:q4_k_m", "cuda")
print(f"opened in {time.time() - t0:.0f} s", flush=True)
prompt_ids = tok.encode(sp.PROMPT)
target = generate(engine, tok, prompt_ids, 16, sp.GREEDY, ignore_eos=True).token_ids
sp.BREAKDOWN_BUDGETS = tuple(budgets)
sp.verify(rec, engine, name, prompt_ids, target, budgets, 5)
print(f"done in {time.time() - t0:.0f} s", flush=True)
