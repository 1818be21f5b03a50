"""The tensor-core GEMM's numpy side (lucegen/kernels/qgemm_tc.py): its fp16 weights against the exact
dequantisation, and its kernels compiled for every spec."""
from __future__ import annotations

import numpy as np
import pytest

from lucegen.codegen.build import build
from lucegen.kernels import qgemm_tc
from lucegen.model.config import tiny_config
from lucegen.model.quants import dequantize, ggml_type, quantize
from lucegen.spec import TENSOR_CORE_FORMATS, list_specs, load_spec


def rows(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    return quantize(w, ggml_type(fmt)).reshape(n, -1)


def exact(raw: np.ndarray, fmt: str) -> np.ndarray:
    return dequantize(raw.reshape(-1), ggml_type(fmt)).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_fp16_weights_are_the_dequantised_weights_rounded_to_fp16(fmt, seed):
    """The kernel's fp16 weights: within fp16's rounding of the scale and bias and of the result (3 x 2^-11 of the
    scale group's largest magnitude) of gguf's fp32 dequantisation. A nibble, bit, scale or bias taken from the
    wrong place is a whole quantisation step or more."""
    raw = rows(fmt, 16, 512, seed)
    want = exact(raw, fmt)
    got = qgemm_tc.dequantize_fp16(raw, fmt).astype(np.float32)
    group = 32  # Q4_K's scale groups
    top = np.abs(want).reshape(16, -1, group).max(axis=2, keepdims=True)
    assert (np.abs(got - want).reshape(16, -1, group) <= 3 * 2.0**-11 * top + 1e-30).all()


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
def test_reference_is_close_to_the_exact_product(fmt):
    raw = rows(fmt, 32, 1024, 7)
    x = np.random.default_rng(8).standard_normal((5, 1024), dtype=np.float32)
    want = x.astype(np.float64) @ exact(raw, fmt).astype(np.float64).T
    got = qgemm_tc.reference(raw, fmt, x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("m, rows", [(1, 8), (8, 8), (9, 16), (17, 32), (33, 48), (48, 48), (49, 56), (100, 104)])
def test_padded_rows_cover_every_launch(m, rows):
    """Launches of 48 rows, then the last one's kernel (8, 16, 32 or 48 tokens): X holds that many rows."""
    assert qgemm_tc.padded_rows(m) == rows


def test_rows_past_the_fp16_range_are_scaled_by_a_power_of_two_into_it():
    """A row's largest |x| below 2^15 after the scaling, the least scaling that does it, and 1 for a row that fits."""
    most = np.array([1, 2.0**15, 3e5, 2.0**15 - 1, 1e-30, 6.5e4], np.float32)
    x = np.random.default_rng(0).uniform(-0.5, 0.5, (6, 256)).astype(np.float32) * most[:, None]
    x[:, 7] = -most
    x16, scale = qgemm_tc.x_fp16(x)
    assert np.isfinite(x16).all()
    most = np.abs(x).max(axis=1) / scale
    assert (most < 2.0**15).all() and ((scale == 1) | (most >= 2.0**14)).all()
    assert list(scale) == [1, 2, 16, 1, 1, 2]


def test_shape_problem_names_the_shape_and_the_format():
    assert "104 x 500" in qgemm_tc.shape_problem("q4_k", 104, 500)
    assert "not q8_0" in qgemm_tc.shape_problem("q8_0", 5120, 5120)
    assert qgemm_tc.shape_problem("q4_k", 5120, 17408) is None
    assert "takes q4_k, not q6_k" in qgemm_tc.shape_problem("q6_k", 5120, 17408)  # dropped (spec.py)


@pytest.mark.parametrize("spec_name", list_specs())
def test_kernels_compile_without_spills(tmp_path, spec_name):
    result = build(load_spec(spec_name), tiny_config(), qgemm_tc.units(load_spec(spec_name)), root=tmp_path)
    names = {qgemm_tc.kernel_name(f, rows, tiles) for f in TENSOR_CORE_FORMATS for rows in qgemm_tc.VARIANTS
             for tiles in qgemm_tc.TILES}
    assert {k.name for k in result.kernels} == names | {"qgemm_tc_x16"}
    for k in result.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, f"{k.name} spills on {spec_name}"


# ---- a numpy model of the kernel's lanes ------------------------------------------------------------------------
# What each lane of templates/qgemm_tc.cuh holds, register by register, placed in the mma's A and B by the PTX
# fragment layouts (mma.cuh's top comment), multiplied tile by tile and added in warp order: the kernel's index logic
# (rows, slots, nibbles, bits, scales, X's slot order, the output's places) without a GPU.

def _f16(v) -> np.ndarray:
    return np.asarray(v, np.float64).astype(np.float16)


def _x_slots(x16: np.ndarray) -> np.ndarray:
    """qgemm_tc_x16's order: within each 4 values, positions 1 and 2 swapped."""
    out = x16.copy()
    out[:, 1::4], out[:, 2::4] = x16[:, 2::4], x16[:, 1::4]
    return out


def _words(b: np.ndarray, off: int) -> int:
    return int.from_bytes(b[off:off + 4].tobytes(), "little")


def _q4k_lane(blk: np.ndarray, t: int):
    """A lane's A words of one Q4_K super-block of one row, mma by mma: (k offset in the super-block, (slots 2t, 2t+1
    values, slots 2t+8, 2t+9 values)) as TcQ4K::superblock makes them."""
    from lucegen.model.quants import _half, _scale_min_k4
    d, dmin = _half(blk[None, 0:2])[0], _half(blk[None, 2:4])[0]
    sc, m = _scale_min_k4(blk[None, 4:16])
    out = []
    for c in range(4):
        for hf in range(2):
            sb = 2 * c + hf
            scale, bias = _f16(np.float32(d) * sc[0, sb]), _f16(-(np.float32(dmin) * m[0, sb]))
            for half in range(2):  # qs word .x (values 8t..8t+3), .y (8t+4..)
                w = _words(blk, 16 + 32 * c + 8 * t + 4 * half)
                def pair(shift):
                    q = [(w >> shift) & 0xF, (w >> (shift + 16)) & 0xF]
                    return _f16(np.array(q, np.float64) * np.float64(scale) + np.float64(bias))
                lo, hi = pair(4 * hf), pair(8 + 4 * hf)
                out.append((32 * sb + 8 * t + 4 * half, lo, hi))
    return out


def lanes_model(raw: np.ndarray, fmt: str, x: np.ndarray) -> np.ndarray:
    """Y [M, N] as the kernel computes it, in float64 per mma (the tensor core's own sum order aside)."""
    n, m = raw.shape[0], x.shape[0]
    k = x.shape[1]
    blocks, bb = k // 256, qgemm_tc.BLOCK_BYTES[fmt]
    tokens = qgemm_tc.variant(m)
    xs = np.zeros((tokens, k), np.float16)
    xs[:m] = x.astype(np.float16)
    xs = _x_slots(xs)
    y = np.zeros((m, n))
    for n0 in range(0, n, qgemm_tc.ROWS):
        parts = []
        for w in range(qgemm_tc.WARPS):
            acc = np.zeros((16, tokens))  # D: 16 weight rows x the tokens
            for s in range(w * blocks // qgemm_tc.WARPS, (w + 1) * blocks // qgemm_tc.WARPS):
                per_lane = {}
                for g in range(8):
                    for t in range(4):
                        for r in range(2):  # the lane's rows g and g + 8
                            row = raw[n0 + g + 8 * r].reshape(blocks, bb)[s]
                            per_lane[g, t, r] = _q4k_lane(row, t)
                for j in range(len(per_lane[0, 0, 0])):  # the j-th mma of the super-block, the same in every lane
                    a = np.zeros((16, 16))
                    bmat = np.zeros((16, tokens))
                    for g in range(8):
                        for t in range(4):
                            for r in range(2):
                                k0, lo, hi = per_lane[g, t, r][j]
                                a[g + 8 * r, 2 * t:2 * t + 2] = lo
                                a[g + 8 * r, 2 * t + 8:2 * t + 10] = hi
                            for tile in range(tokens // 8):  # B: the lane's token g of each tile, a uint2 at k0
                                v = xs[8 * tile + g, 256 * s + k0:256 * s + k0 + 4].astype(np.float64)
                                bmat[2 * t:2 * t + 2, 8 * tile + g] = v[0:2]
                                bmat[2 * t + 8:2 * t + 10, 8 * tile + g] = v[2:4]
                    acc += a @ bmat
            parts.append(acc)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        y[:, n0:n0 + 16] = total[:, :m].T
    return y


@pytest.mark.parametrize("fmt", TENSOR_CORE_FORMATS)
@pytest.mark.parametrize("m", [1, 5, 9])
def test_the_lanes_model_is_the_product(fmt, m):
    """The lanes' registers, placed by the fragment layouts, multiply to the reference's product: every weight
    and activation lands in the slot the other operand expects."""
    raw = rows(fmt, 32, 512, m)
    x = np.random.default_rng(m).standard_normal((m, 512), dtype=np.float32)
    got, want = lanes_model(raw, fmt, x), qgemm_tc.reference(raw, fmt, x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-12
