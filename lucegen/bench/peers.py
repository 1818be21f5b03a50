"""The torch peers (bench/torch_peers.py), each run in a child process that imports torch before anything else.

    peer("matmul_tflops", 8192, 8192, 8192)  ->  the function's JSON result, or None

None where torch is not installed, or where the child failed twice (its last line of stderr is printed: a failed
`import torch` is not retried in the same process, but a fresh process imports it). The child is
`python -m lucegen.bench.peers <module:function> <JSON list of arguments>`; it prints the result as the last line
of its stdout.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from typing import Any

TORCH_PEERS = "lucegen.bench.torch_peers"
ATTEMPTS = 2
TIMEOUT_S = 1800


def peer(function: str, *args: Any, module: str = TORCH_PEERS) -> Any:
    """module.function(*args) in a child process; None without torch, or if it failed ATTEMPTS times."""
    if importlib.util.find_spec("torch") is None:
        return None
    command = [sys.executable, "-m", __name__, f"{module}:{function}", json.dumps(args)]
    for attempt in range(1, ATTEMPTS + 1):
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            print(f"peer {function}: attempt {attempt} ran past {TIMEOUT_S} s")
            continue
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines:
            return json.loads(lines[-1])
        reason = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        print(f"peer {function}: attempt {attempt} failed ({reason})")
    return None


def main(argv: list[str]) -> int:
    """The child: torch first, then module.function(*args); its result as the last line of stdout."""
    import torch
    if not torch.cuda.is_available():
        print("torch sees no CUDA device", file=sys.stderr)
        return 3
    target, args = argv
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(*json.loads(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
