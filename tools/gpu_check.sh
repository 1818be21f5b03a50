#!/usr/bin/env bash
# Everything the lab GPU run does, in one call: GPU tests, HF parity, benchmarks. Logs and results go to $OUT/logs,
# packed at the end into $OUT/logs.tgz (the lab returns at most 8 files from $OUT).
#   LUCEGEN_COMMIT=<sha> OUT=<dir> bash tools/gpu_check.sh [stage ...]   (stages: tests parity bench demo;
#   default all; a stage may also be "tests:<pytest args>", e.g. tests:tests/gpu/test_layered_gpu.py)
#   LUCEGEN_CHECKPOINT=<snapshot dir> [LUCEGEN_DRAFT=<DFlash draft dir>] add the prompt-set runner to the bench stage
#   BENCH="decode prefill" picks the bench stage's suites
# Then, here: unpack, append logs/results.jsonl to results/<gpu>.jsonl and run tools/results_table.py --write.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lucegen-out}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# packages the GPU image lacks, carried as wheels: gguf for every stage; flash-linear-attention (fla) only for the
# bench's HF peer, since the HF-parity tests need HF on its torch reference ops (tools/hf_parity.py refuses fla)
for wheel in .wheels/*.whl; do
    [ -e "$wheel" ] || continue
    case $(basename "$wheel") in fla*|flash_linear_attention*) site=/tmp/site-peers ;; *) site=/tmp/site ;; esac
    python3 -m pip install -q --no-index --no-deps --no-compile --target $site "$wheel"
done
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
stages=${*:-tests parity bench demo}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv \
    | tee "$LOGS/nvidia-smi.txt"
python3 -m lucegen.cli doctor | tee "$LOGS/doctor.txt"
for stage in $stages; do
    echo "=== $stage"
    case $stage in
        tests|tests:*)
                args=${stage#tests}; args=${args#:}
                python3 -m pytest -m gpu ${args:-tests} -q -rf -p no:cacheprovider 2>&1 \
                    | tee "$LOGS/pytest-gpu-$(echo "${args:-all}" | tr -c 'a-zA-Z0-9_.-' '_').txt"
                status=$((status | ${PIPESTATUS[0]})) ;;
        parity) python3 tools/hf_parity.py tiny ratio3 qwen3.5-0.8b --out "$LOGS" 2>&1 | tee "$LOGS/hf-parity.txt"
                status=$((status | ${PIPESTATUS[0]})) ;;
        bench)  # speculative: the cuda engine on the tiny checkpoint (its ar rate; the speculative parts once the
                # cuda engine has speculate()); prompts: only with a real checkpoint (and draft) on the machine
                for suite in ${BENCH:-gemv qgemv decode decode-gguf energy prefill tree "speculative --model tiny" \
                               "speculative --model random:qwen3.5-27b:q4_k_m"} \
                             ${LUCEGEN_CHECKPOINT:+"prompts --set humaneval --model $LUCEGEN_CHECKPOINT --limit 3 \
                               ${LUCEGEN_DRAFT:+--draft $LUCEGEN_DRAFT --mode ddtree}"}; do
                    PYTHONPATH="$PYTHONPATH${PYTHONPATH:+:}/tmp/site-peers" \
                        python3 -m lucegen.cli bench $suite --results "$LOGS/results.jsonl" 2>&1 \
                        | tee "$LOGS/bench-$(printf %s "$suite" | tr -c 'a-zA-Z0-9_.-' '_').txt"
                    status=$((status | ${PIPESTATUS[0]}))
                done ;;
        demo)   bash tools/demo.sh cuda 2>&1 | tee "$LOGS/demo-cuda.txt"   # the README's commands on the GPU backend
                status=$((status | ${PIPESTATUS[0]})) ;;
        *)      echo "unknown stage $stage"; status=1 ;;
    esac
done
find "$LOGS" -name "*.txt" -exec sed -i 's/\x0//g' {} +   # NUL bytes some kernels' printf leaves in the logs
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $status
