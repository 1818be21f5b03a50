#!/bin/bash
# Session 34's run 9, for the next session (not run): qgemm_mma's copies as two TMA tensor copies a stage (the
# block's weight rows, its M-tile's XBlocks) instead of one bulk copy a row (48 a stage): the same bytes in the same
# slots, so the same bits. The patch also passes every CPU test (tests/host_kernels.py fakes the maps).
# Set-up (design.md's lab recipe `mk`): mk p0; mk tm; mk tmnc;
#   for d in tm tmnc; do (cd .lab/$d && git apply ../../docs/wip/s34-run9/qgemm-mma-tensor-maps.patch); done
#   mk nc; the multiply off in tmnc and in nc (a copy of main):
#     sed -i 's|if (s \* Q::SLICE_VALUES + (wb \* F::PIECES + 4 \* q) \* PV >= K) continue;|if (s >= 0) continue;|' \
#         .lab/tmnc/templates/qgemv.cuh .lab/nc/templates/qgemv.cuh
#   cp docs/wip/s34-run9/verify_time.py .lab/     (the files from git at this wip commit)
. .lab/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
rm -f .lab/*/specs/h100.yaml  # the H200 spec on whatever card comes
t() { echo "== $1"; (cd .lab/$1 && PYTHONPATH=$PWD:/tmp/site timeout $2 python3 tools/verify_gemm_time.py specs/h200.yaml 9,16,23) 2>&1 | grep -v Warning; }
(t p0 60; t tm 60; t nc 45; t tmnc 45) 2>&1 | tee $OUT/tm.txt
(cd .lab/tm && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m pytest -q -x tests/gpu/test_qgemv_gpu.py tests/gpu/test_layered_gpu.py -k "not dequant and (qgemv or tree_verify or speculative or m_token)" 2>&1 | tail -5) | tee $OUT/tests.txt
v() { echo "== verify $1"; (cd .lab/$1 && PYTHONPATH=$PWD:/tmp/site timeout $2 python3 ../verify_time.py $1 16,22) 2>&1 | grep -v "Warning\|verify_kernel_us\|spec_verify"; }
(v p0 80; v tm 80) 2>&1 | tee $OUT/verify.txt
