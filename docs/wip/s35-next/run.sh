#!/bin/bash
# Session 35, for a later session (not run): does the decode GEMV keep its rate on rows in tiles of 32 stored block
# by block (design.md session 35, next step 2)? tiled-gemv-timing.patch makes the GEMV of the mma formats (Q4_K,
# Q6_K) read its blocks where that layout would put them, the data left as it is (timing only; random weights).
# Its kernels hold 70 registers against main's 64 (7 blocks an SM of 128 threads against 8): a fall of a few percent
# may be that, not the layout. Set-up (design.md's lab recipe `mk`): mk p0; mk tg;
#   (cd .lab/tg && patch -p1 < ../../docs/wip/s35-next/tiled-gemv-timing.patch)   (from git history once removed)
. .lab/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
rm -f .lab/*/specs/h100.yaml  # the H200 spec on whatever card comes
t() { echo "== $1"; (cd .lab/$1 && PYTHONPATH=$PWD:/tmp/site timeout $2 python3 tools/verify_gemm_time.py specs/h200.yaml 1) 2>&1 | grep -v Warning; }
(t p0 40; t tg 40) 2>&1 | tee $OUT/gemv.txt
PYTHONPATH=$PWD/.lab/p0:/tmp/site timeout 300 python3 tools/layered_ab.py --trees .lab/p0 .lab/tg --rounds 2 \
    --contexts 512 2>&1 | grep -v Warning | tee $OUT/step.txt
