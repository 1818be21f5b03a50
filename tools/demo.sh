#!/usr/bin/env bash
# The README's `lucegen run` and `lucegen serve` commands on a random-weight test checkpoint, with their real output.
#   bash tools/demo.sh [backend]      (backend: numpy, the default, or cuda)
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${1:-numpy}
dir=$(mktemp -d)
trap 'kill $server 2>/dev/null || true; rm -rf "$dir"' EXIT
lucegen() { python3 -m lucegen.cli "$@"; }
show() { echo "\$ $*"; "$@"; }
show python3 tools/make_checkpoint.py "$dir/tiny" --peaked --formats hf
show lucegen run --backend "$backend" --model "$dir/tiny" --prompt "Hello" --chat --max-tokens 8
echo "\$ lucegen serve --backend $backend --model $dir/tiny --api-key sk-local --port 8765 &"
python3 -m lucegen.cli serve --backend "$backend" --model "$dir/tiny" --served-model-name tiny --api-key sk-local \
    --port 8765 --log-level warning &
server=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 0.5; done
show curl -s http://127.0.0.1:8765/v1/chat/completions -H "Authorization: Bearer sk-local" \
    -d '{"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}'
echo
show curl -sN http://127.0.0.1:8765/v1/completions -H "Authorization: Bearer sk-local" -d '{"model": "tiny",
    "prompt": "abc", "max_tokens": 4, "temperature": 0.8, "seed": 1, "stream": true,
    "stream_options": {"include_usage": true}}'
