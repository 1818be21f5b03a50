#!/bin/bash
# session 34 run 8: main's qgemm_mma copies as one bulk copy a stage for the weights (and one for the activations)
# instead of one a row: the data is wrong (timing only), the bytes the same. nc = no multiply (copies a row);
# ncc = no multiply, contiguous copies; cc = contiguous copies with the multiply; cw = contiguous weights only
. .lab/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
t() { echo "== $1"; (cd .lab/$1 && PYTHONPATH=$PWD:/tmp/site timeout $2 python3 tools/verify_gemm_time.py specs/h200.yaml 9,16,23 q4_k:gate/up,q4_k:qkv,q4_k:out,q4_k:down) 2>&1 | grep -v Warning; }
(t p0 35; t ncc 30; t cc 30; t nc 30; t cw 30) 2>&1 | tee $OUT/contig.txt
