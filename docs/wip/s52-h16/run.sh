# session 52: the h16 prototype alone (little device time left)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/gguf*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $OUT/gpu.txt
grep -q H100 $OUT/gpu.txt && rm -f specs/h100.yaml
H16_SHAPES=gate/up,down timeout 150 python3 docs/wip/s52-h16/proto.py > $OUT/h16.txt 2>&1; echo "rc $?" >> $OUT/h16.txt
tail -20 $OUT/h16.txt
