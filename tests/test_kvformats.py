"""KV-cache formats on the reference: sizes, each format's round trip on freshly drawn rows, TQ3_0's rotation,
levels and byte layout, attention in the rotated domain, and the reference forward with each format's KV."""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lucegen.codegen.render import TEMPLATES_DIR
from lucegen.model import kvformats as kv
from lucegen.model import quants
from lucegen.model.config import tiny_config
from lucegen.reference.model import State, prefill
from lucegen.reference.weights import random_weights

from test_qgemv import host_decode, host_decoder

FORMATS = list(kv.BYTES_PER_VALUE)


def sphere_marginal(d: int = 128, n: int = 2_000_001) -> tuple[np.ndarray, np.ndarray]:
    """The density of one coordinate of a uniformly random unit vector in R^d, on a grid over [-1, 1]."""
    t = np.linspace(-1, 1, n)
    f = (1 - t * t) ** ((d - 3) / 2)
    return t, f / np.trapezoid(f, t)


def cumulative(t: np.ndarray, f: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum((f[1:] + f[:-1]) / 2 * np.diff(t))])


def test_row_sizes():
    assert {f: kv.row_bytes(f, 256) for f in FORMATS} == {"bf16": 512, "fp8": 256, "q8_0": 272, "q4_0": 144,
                                                          "tq3_0": 112}
    assert kv.row_bytes("tq3_0", 256) * 8 / 256 == 3.5  # bits per value
    with pytest.raises(kv.KVFormatError, match="head_dim 96"):
        kv.row_bytes("tq3_0", 96)
    with pytest.raises(kv.KVFormatError, match="unknown KV format 'q2_k'"):
        kv.encode(np.zeros((1, 128), np.float32), "q2_k")


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), rows=st.integers(1, 64), groups=st.integers(1, 3),
       scale=st.floats(1e-2, 1e2), seed=st.integers(0, 2**32 - 1))
def test_round_trip_shape_and_size(fmt, rows, groups, scale, seed):
    x = (scale * np.random.default_rng(seed).standard_normal((rows, 128 * groups))).astype(np.float32)
    raw = kv.encode(x, fmt)
    assert raw.dtype == np.uint8 and raw.shape == (rows, kv.row_bytes(fmt, 128 * groups))
    back = kv.decode(raw, fmt)
    assert back.dtype == np.float32 and back.shape == x.shape and np.isfinite(back).all()
    np.testing.assert_array_equal(kv.encode(back, fmt) if fmt != "tq3_0" else raw, raw)  # stored values are fixed points


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_gguf_block_formats_are_the_gguf_blocks(fmt):
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    np.testing.assert_array_equal(kv.encode(x, fmt), quants.quantize(x, fmt))


def test_tq3_levels_are_lloyd_max_for_a_rotated_unit_vector():
    t, f = sphere_marginal()
    c = kv.TQ3_LEVELS.astype(np.float64)
    edges = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])  # the nearest-level cells
    mass, moment = (np.diff(np.interp(edges, t, cumulative(t, g))) for g in (f, f * t))
    np.testing.assert_allclose(moment / mass, c, rtol=0, atol=2e-8)  # each level is the mean of its cell
    gaussian = np.array([0.2451, 0.7560, 1.3440, 2.1520]) / np.sqrt(128)  # Lloyd-Max for N(0, 1/128): not these
    assert np.abs(c[4:] - gaussian).max() > 1e-4


def test_tq3_rotation_is_orthonormal_and_the_signed_hadamard():
    eye = np.eye(128)
    r = kv.rotate(eye)  # rows: R e_i = column i of R
    np.testing.assert_allclose(r @ r.T, eye, atol=1e-12)
    np.testing.assert_allclose(kv.unrotate(kv.rotate(eye)), eye, atol=1e-12)
    s1 = np.array([-1.0 if (kv.SIGNS1 >> i) & 1 else 1.0 for i in range(128)])
    s2 = np.array([-1.0 if (kv.SIGNS2 >> i) & 1 else 1.0 for i in range(128)])
    h = np.abs(r.T * s2[:, None] * s1[None, :] * np.sqrt(128))  # undo the signs and the scale: |H| is all ones
    np.testing.assert_allclose(h, 1.0, atol=1e-12)
    assert 40 < bin(kv.SIGNS1).count("1") < 90 and kv.SIGNS1 != kv.SIGNS2


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 3), log_scale=st.floats(-3, 3), seed=st.integers(0, 2**32 - 1))
def test_tq3_keeps_each_groups_norm(rows, groups, log_scale, seed):
    x = (10.0 ** log_scale * np.random.default_rng(seed).standard_normal((rows, 128 * groups))).astype(np.float32)
    back = kv.decode(kv.encode(x, "tq3_0"), "tq3_0")
    n = lambda a: np.linalg.norm(a.astype(np.float64).reshape(rows, groups, 128), axis=-1)
    np.testing.assert_allclose(n(back), n(x), rtol=2.0**-11 + 1e-6)  # the fp16 scale's rounding


def test_tq3_error_is_the_lloyd_max_distortion():
    """On Gaussian rows (any rotation of which is Gaussian) the relative error is the quantizer's distortion."""
    t, f = sphere_marginal()
    c = kv.TQ3_LEVELS.astype(np.float64)
    nearest = c[np.abs(t[:, None] - c[None, :]).argmin(axis=1)]
    distortion = 128 * np.trapezoid(f * (t - nearest) ** 2, t)  # E|u - c(u)|^2 for a unit vector u
    x = np.random.default_rng(1).standard_normal((4000, 256)).astype(np.float32)
    back = kv.decode(kv.encode(x, "tq3_0"), "tq3_0")
    err = np.linalg.norm(back - x) / np.linalg.norm(x)
    assert err == pytest.approx(np.sqrt(distortion), rel=0.03)  # about 0.18: 3 bits of a Gaussian
    assert err > np.linalg.norm(kv.codec("q4_0")(x) - x) / np.linalg.norm(x)  # Q4_0 spends a bit more


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_tq3_byte_layout(seed):
    x = np.random.default_rng(seed).standard_normal((1, 128)).astype(np.float32)
    u = kv.rotate(x.astype(np.float64))[0] / np.linalg.norm(x.astype(np.float64))
    idx = np.abs(u[:, None] - kv.TQ3_LEVELS[None, :].astype(np.float64)).argmin(axis=1)  # the nearest level
    scale = np.float16(np.linalg.norm(x.astype(np.float64)) / np.linalg.norm(kv.TQ3_LEVELS[idx].astype(np.float64)))
    raw = kv.encode(x, "tq3_0")[0]
    for b in range(4):  # four self-contained blocks of 32 values
        block = raw[14 * b:14 * (b + 1)]
        assert block[0:2].view(np.float16)[0] == scale  # the group's |x| / |c|, in every block
        for j in range(32):
            i = idx[32 * b + j]
            assert (block[2 + j // 4] >> (2 * (j % 4))) & 3 == i & 3 and (block[10 + j // 8] >> (j % 8)) & 1 == i >> 2
    np.testing.assert_array_equal(kv.decode_rotated(raw[None])[0], kv.TQ3_LEVELS[idx] * np.float32(scale))


def test_attention_reads_tq3_in_the_rotated_domain():
    """q.k and sum p v computed on the stored (rotated) values equal the same on the decoded rows."""
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((50, 256)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal(256)
    kr, vr = (kv.decode_rotated(kv.encode(a, "tq3_0")).astype(np.float64) for a in (k, v))
    kd, vd = (kv.decode(kv.encode(a, "tq3_0"), "tq3_0").astype(np.float64) for a in (k, v))
    scores = kr @ kv.rotate(q)
    np.testing.assert_allclose(scores, kd @ q, rtol=1e-6, atol=1e-6)
    p = np.exp(scores - scores.max())
    p /= p.sum()
    np.testing.assert_allclose(kv.unrotate(p @ vr), p @ vd, rtol=1e-6, atol=1e-6)


def test_the_reference_applies_the_codec_to_every_cached_row():
    cfg = tiny_config(head_dim=128)
    w = random_weights(cfg, 0)
    tokens = list(range(1, 12))
    plain = prefill(w, cfg, tokens, State())
    np.testing.assert_array_equal(prefill(w, cfg, tokens, State(kv_codec=lambda a: a)), plain)
    seen = []
    state = State(kv_codec=lambda a: seen.append(a.shape) or kv.codec("bf16")(a))
    assert not np.array_equal(prefill(w, cfg, tokens, state), plain)
    assert seen == [(11, 2, 128)] * 2 * len(cfg.full_layers)  # K and V of each attention layer, the block's own
    assert np.array_equal(state.keys[3], kv.codec("bf16")(state.keys[3]))  # the cache holds stored values
    assert state.copy().kv_codec is state.kv_codec


def test_logits_error_against_bf16_kv_orders_the_formats():
    cfg = tiny_config(head_dim=128)
    w = random_weights(cfg, 0)
    tokens = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 40))
    errors = {e.fmt: e for e in kv.logits_error(w, cfg, tokens, prompt=24)}
    assert set(errors) == {"fp8", "q8_0", "q4_0", "tq3_0"}
    assert 0 < errors["q8_0"].rel_error < errors["q4_0"].rel_error < errors["tq3_0"].rel_error < 0.1
    assert errors["q8_0"].rel_error < 2e-3 and errors["q8_0"].top1_agree == 1.0
    assert all(0 < e.max_abs and 0 <= e.top1_agree <= 1 for e in errors.values())


@pytest.fixture(scope="module")
def tq3_host_decoder(tmp_path_factory):
    return host_decoder(tmp_path_factory.mktemp("kv"), "kv.cuh", "FmtTQ3_0")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), groups=st.integers(1, 3), offset=st.sampled_from([0, 2, 6, 10, 14]),
       log_scale=st.floats(-3, 3), seed=st.integers(0, 2**32 - 1))
def test_device_tq3_decode_is_bit_equal_to_the_reference(tq3_host_decoder, tmp_path_factory, rows, groups, offset,
                                                          log_scale, seed):
    """templates/kv.cuh's FmtTQ3_0, compiled for the host, reads what encode wrote: decode_rotated, bit for bit."""
    exe = tq3_host_decoder
    x = (10.0 ** log_scale * np.random.default_rng(seed).standard_normal((rows, 128 * groups))).astype(np.float32)
    raw = kv.encode(x, "tq3_0")
    ours = host_decode(exe, raw, len(raw), 128 * groups, offset, tmp_path_factory.mktemp("io"))
    np.testing.assert_array_equal(ours.view(np.uint32), kv.decode_rotated(raw).view(np.uint32))


def test_device_tq3_constants_are_the_references():
    text = (TEMPLATES_DIR / "kv.cuh").read_text()
    for name, mask in (("TQ3_SIGNS1", kv.SIGNS1), ("TQ3_SIGNS2", kv.SIGNS2)):
        lo, hi = re.search(name + r"\[2\] = \{(0x[0-9a-f]+)ull, (0x[0-9a-f]+)ull\}", text).groups()
        assert int(lo, 16) | int(hi, 16) << 64 == mask
    levels = [float.fromhex(v) for v in re.findall(r"TQ3_LEVEL\d = (0x[0-9a-fp.+-]+)f", text)]
    np.testing.assert_array_equal(np.float32(levels), kv.TQ3_LEVELS[4:])


# ---- the tree attention's KV rows (kv.cuh KVBf16, KVQ8_0, KVQ4_0), compiled for the host -------------------------
KV_ROWS_MAIN = r"""
#include "kv.cuh"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
using namespace lucegen;
// argv: format rows head_dim in enc dec. Each row of `in` (floats) through KV::store_block, block by block, into
// `enc`; then every 8-value chunk of the encoded rows back through KV::load and KV::values into `dec`. tq3_0 (its
// encoder is warp-wide: GPU-tested): `in` holds encoded rows, which are decoded alone.
static size_t read(const char* path, void* to, size_t size, size_t n) {
    FILE* f = std::fopen(path, "rb");
    const size_t got = std::fread(to, size, n, f);
    std::fclose(f);
    return got;
}
template <class KV> int run(int rows, int hd, bool encoded, const char* in, const char* enc, const char* dec) {
    const int row_bytes = hd / 32 * KV::BLOCK_BYTES;
    std::vector<float> x(static_cast<size_t>(rows) * hd), y(x.size());
    std::vector<unsigned char> bytes(static_cast<size_t>(rows) * row_bytes + 16);
    unsigned char* b = bytes.data() + (16 - reinterpret_cast<size_t>(bytes.data()) % 16) % 16;
    bool ok;
    if constexpr (KV::GROUP == 32) {
        ok = read(in, x.data(), 4, x.size()) == x.size();
        for (int r = 0; r < rows; ++r)
            for (int k = 0; k < hd / 32; ++k) KV::store_block(x.data() + r * hd + 32 * k, b + r * row_bytes + k * KV::BLOCK_BYTES);
    } else {
        ok = encoded && read(in, b, 1, static_cast<size_t>(rows) * row_bytes) == static_cast<size_t>(rows) * row_bytes;
    }
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < hd / 8; ++c) {
            float v[8];
            KV::values(KV::load(b + r * row_bytes, c), v);
            std::memcpy(y.data() + r * hd + 8 * c, v, sizeof v);
        }
    FILE* f = std::fopen(enc, "wb");
    std::fwrite(b, 1, static_cast<size_t>(rows) * row_bytes, f);
    std::fclose(f);
    f = std::fopen(dec, "wb");
    std::fwrite(y.data(), 4, y.size(), f);
    std::fclose(f);
    return !ok;
}
int main(int argc, char** argv) {
    const int rows = std::atoi(argv[2]), hd = std::atoi(argv[3]);
    if (!std::strcmp(argv[1], "bf16")) return run<KVBf16>(rows, hd, false, argv[4], argv[5], argv[6]);
    if (!std::strcmp(argv[1], "q8_0")) return run<KVQ8_0>(rows, hd, false, argv[4], argv[5], argv[6]);
    if (!std::strcmp(argv[1], "tq3_0")) return run<KVTQ3_0>(rows, hd, true, argv[4], argv[5], argv[6]);
    return run<KVQ4_0>(rows, hd, false, argv[4], argv[5], argv[6]);
}
"""


@pytest.fixture(scope="module")
def kv_rows_host(tmp_path_factory):
    """A host executable running kv.cuh's KV row formats (KV_ROWS_MAIN), or a skip without a C++ compiler."""
    import shutil
    import subprocess
    from test_qgemv import HOST_SHIM
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++ or clang++)")
    d = tmp_path_factory.mktemp("kvrows")
    for name in ("quant.cuh", "kv.cuh"):
        shutil.copy(TEMPLATES_DIR / name, d)
    (d / "common.cuh").write_text(HOST_SHIM)
    (d / "cuda_fp16.h").write_text("#pragma once\n")
    (d / "main.cpp").write_text(KV_ROWS_MAIN)
    subprocess.run([cxx, "-std=c++17", "-O1", "-ffp-contract=off", f"-I{d}", str(d / "main.cpp"), "-o",
                    str(d / "kvrows")], check=True, capture_output=True)
    return d


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(["bf16", "q8_0", "q4_0"]), rows=st.integers(1, 5), hd=st.sampled_from([32, 64, 256]),
       log_scale=st.floats(-4, 4), ties=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_tree_attention_kv_rows_are_ggufs_bit_for_bit(kv_rows_host, fmt, rows, hd, log_scale, ties, seed):
    """The rows the tree attention writes are kvformats.encode's (gguf's quantizers for Q8_0 and Q4_0) bit for bit,
    and what it reads of them is kvformats.decode's: on random rows, and rows of few distinct values (ties in the
    largest magnitude, and values on rounding boundaries)."""
    import subprocess
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, hd)) * 2.0 ** log_scale).astype(np.float32)
    if ties:  # repeated magnitudes of both signs, and zero blocks
        x = (rng.integers(-4, 5, (rows, hd)) * np.float32(2.0 ** log_scale / 4)).astype(np.float32)
    d = kv_rows_host
    x.tofile(d / "in.bin")
    subprocess.run([str(d / "kvrows"), fmt, str(rows), str(hd), str(d / "in.bin"), str(d / "enc.bin"),
                    str(d / "dec.bin")], check=True)
    enc = np.fromfile(d / "enc.bin", np.uint8).reshape(rows, -1)
    np.testing.assert_array_equal(enc, kv.encode(x, fmt))
    np.testing.assert_array_equal(np.fromfile(d / "dec.bin", np.float32).reshape(rows, hd), kv.decode(enc, fmt))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 3), log_scale=st.floats(-3, 3), seed=st.integers(0, 2**32 - 1))
def test_tree_attention_reads_tq3_rows_as_the_reference_decodes_them(kv_rows_host, rows, groups, log_scale, seed):
    """kv.cuh's KVTQ3_0, chunk by chunk, reads what kvformats.encode wrote as decode_rotated does, bit for bit (the
    rotated domain attention works in)."""
    import subprocess
    hd = 128 * groups
    x = (10.0 ** log_scale * np.random.default_rng(seed).standard_normal((rows, hd))).astype(np.float32)
    raw = kv.encode(x, "tq3_0")
    d = kv_rows_host
    raw.tofile(d / "in.bin")
    subprocess.run([str(d / "kvrows"), "tq3_0", str(rows), str(hd), str(d / "in.bin"), str(d / "enc.bin"),
                    str(d / "dec.bin")], check=True)
    np.testing.assert_array_equal(np.fromfile(d / "enc.bin", np.uint8).reshape(rows, -1), raw)
    got = np.fromfile(d / "dec.bin", np.float32).reshape(rows, hd)
    np.testing.assert_array_equal(got.view(np.uint32), kv.decode_rotated(raw).view(np.uint32))
