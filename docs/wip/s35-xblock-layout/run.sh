#!/bin/bash
# Session 35's last run, prepared and not run (no device time left): the XBlocks in groups of 8 rows slice by slice
# (xblock-layout.patch applied to the repo root) against main (.lab/p0: design.md's lab recipe `mk p0`); the verify
# GEMM's times, then the GPU tests that check its bits. Set-up: `git apply docs/wip/s35-xblock-layout/xblock-layout.patch`
# after `mk p0`; `git show 6c4cbd8:docs/wip/s34-run9/verify_time.py > .lab/verify_time.py`; .lab/setup.sh as design.md
# says. Then, if the times and tests hold: the rest of test_layered_gpu, test_tree_gpu, test_draft_gpu,
# test_layered_draft_gpu, and `lucegen bench speculative`.
. .lab/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
rm -f specs/h100.yaml .lab/*/specs/h100.yaml  # the H200 spec (qgemm_mma) on whatever card comes
t() { echo "== $1"; (cd $1 && PYTHONPATH=$PWD:/tmp/site timeout $2 python3 tools/verify_gemm_time.py specs/h200.yaml 9,16,23) 2>&1 | grep -v Warning; }
(t . 28; t .lab/p0 28) 2>&1 | tee $OUT/gemm.txt
export PYTHONPATH=$PWD:/tmp/site
p() { echo "== $1"; timeout $2 python3 -m pytest -q -x -p no:cacheprovider "${@:3}" 2>&1 | tail -4; }
(p qgemv 75 tests/gpu/test_qgemv_gpu.py -k "not dequant"
 p layered 90 tests/gpu/test_layered_gpu.py -k "tree_verify or speculative or row_kernels_match") 2>&1 | tee $OUT/tests.txt
