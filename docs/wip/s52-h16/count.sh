. .venv/bin/activate  # from the repo root
python - <<'PY'
from lucegen.codegen.nvrtc import base_options, compile_cubin
c=compile_cubin(open('docs/wip/s52-h16/h16.cu').read(),"h16.cu","sm_90",base_options("sm_90"),{})
open('/tmp/h16.cubin','wb').write(c.cubin)
for k,v in sorted(c.resources.items()): print(k,v.registers,v.spill_stores)
PY
for k in h16_m8_w8_s3 h16_m16_w8_s3 h16_m24_w8_s3; do python3 docs/wip/s52-h16/sass_loops.py /tmp/h16.cubin $k; done
