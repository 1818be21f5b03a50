"""CPU: the packed layout read back as h16.cu reads it (lop3 magic, fp16 HFMA2 of exact q) against gguf's dequant."""
import sys; sys.path.insert(0, 'docs/wip/s52-h16')
import numpy as np
from proto import repack, TSB
from lucegen.engine.layered_weights import random_rows
from lucegen.model.quants import dequantize
rng = np.random.default_rng(3)
n, k = 64, 1024
raw = random_rows("q4_k", n, k, rng, {})
p = repack(raw, k).view(np.uint32).reshape(n // 16, k // 256, TSB // 4)
W = np.zeros((n, k))
f16 = lambda u: np.array([u & 0xFFFF, u >> 16], np.uint16).view(np.float16).astype(np.float64)
for T in range(n // 16):
    for sb in range(k // 256):
        rec = p[T, sb]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            dw, dmw = rec[576 + 2 * g], rec[576 + 2 * g + 1]
            d2, dm2 = f16(dw), f16(dmw)
            for kk in range(16):
                c, i = kk // 4, kk % 4
                w = int(rec[(c * 32 + lane) * 4 + i])
                j = kk // 2
                sw = int(rec[512 + 8 * g + j])
                sc2 = np.array([sw & 63, (sw >> 16) & 63]); m2 = np.array([(sw >> 8) & 63, (sw >> 24) & 63])
                s = (sc2 * d2).astype(np.float16).astype(np.float64)  # fl16(sc d)
                o = (m2 * dm2).astype(np.float16).astype(np.float64)
                for sh, (dk) in ((0, 0), (8, 8)):
                    ww = w >> sh
                    lo = f16(((ww & 0x000F000F) | 0x64006400)) - 1024
                    hi = (f16(((ww & 0x00F000F0) | 0x64006400)) - 1024) / 16
                    k0 = 256 * sb + 16 * kk + 2 * t + dk
                    for h in range(2):
                        W[16 * T + g, k0 + h] = np.float16(lo[h] * s[0] - o[0])
                        W[16 * T + g + 8, k0 + h] = np.float16(hi[h] * s[1] - o[1])
ref = dequantize(raw, "q4_k").reshape(n, k).astype(np.float64)
print("max abs diff", np.abs(W - ref).max(), "rel", np.abs(W - ref).max() / np.abs(ref).max(), "covered", np.count_nonzero(W) / W.size)
