#!/bin/bash
# session 39 run 4 (the h200 spec): the staged fronts with thread-owned columns (working tree): tree and layered GPU
# tests; decode A/B HEAD against it; phases by stamps (sn3)
. .lab/setup.sh >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
rm -f specs/h100.yaml .lab/*/specs/h100.yaml
p() { echo "== $1"; timeout $2 python3 -m pytest -q -p no:cacheprovider -rfs "${@:3}" 2>&1 | tail -4; }
(p tree 100 tests/gpu/test_tree_gpu.py; p layered 60 tests/gpu/test_layered_gpu.py) 2>&1 | tee $OUT/tests.txt
(cd .lab/sn3 && PYTHONPATH=$PWD:/tmp/site timeout 45 python3 ../phases.py sn3 22) 2>&1 | grep -v "Warning\|spec_\|decode_step\|verify, budget" | tee $OUT/phases.txt
timeout 100 python3 tools/layered_ab.py --trees .lab/base . --rounds 1 --medians 2 --contexts 512 2>&1 | grep -v Warning | tail -2 | tee $OUT/ab.txt
