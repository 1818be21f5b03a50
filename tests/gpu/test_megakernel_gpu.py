"""The decode megakernel on the GPU against the numpy reference (lucegen.reference), phase by phase and step by step.

Phases: the kernel stops after a given number of phases of a step (phase_limit), so one run leaves a phase's inputs
in the activation buffers and the next its outputs; each phase is checked against the reference's functions applied
to exactly those inputs, so a failure names the phase (and its layer, position and seed). States are random (any
values exercise the math), drawn per example, positions from 0 to 32K.

Steps: many steps in one launch against reference decode steps (logits at every step), from position 0 and from
states past 2K; greedy tokens against the reference on peaked weights; one launch of N steps against N launches;
EOS; HF transformers when torch and transformers are installed.

Outputs, activations and state are poisoned (all bits set: NaN) before every launch, so a value a phase fails to
write, or a state the kernel must not read (KV rows at or past the position, any state at position 0), shows.

Tolerances (relative error ||out - ref|| / ||ref||; the reference runs on the weights the kernel sees, bf16 matrices
and fp32 vectors, so weights are no source of error):
  phases                 1e-5   fp32 arithmetic throughout (bf16 x fp32 products, fp32 sums in another order);
                                the recurrence 2e-5: __expf of the log-decay |g| <= ~50 is off by up to ~60 ulp
  K/V written at `pos`   4e-3   the bf16 rounding of the cache (<= 2^-9 per element)
  whole steps            STEP_RTOL, per model: about 3x the error of the bf16 KV cache, the kernel's one deliberate
                                departure from the fp32 reference. A numpy run of the reference that rounds its cache
                                to bf16 after every step moved the logits (worst step of 24 .. 80, from positions 1,
                                40, 300, 2100) by at most: tiny 5.4e-4, small 6.0e-4, ratio3 3.3e-3 (one kv head for
                                6 query heads, at the first positions); the 0.8B model on the peaked weights its test
                                uses 7.3e-5 (1.6e-3 on plain random weights). A wrong index, position, mask or state
                                layout is off by O(0.1 .. 1).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lucegen.engine.decode import DecodeEngine
from lucegen.engine.sampling import Sampler, SamplingParams
from lucegen.kernels import conv1d
from lucegen.kernels.megakernel import PHASE_KINDS, reference_weights
from lucegen.model.config import LINEAR, load_config, tiny_config
from lucegen.reference import State, decode_step, generate, prefill, random_weights, relative_error
from lucegen.reference.attention import causal_attention
from lucegen.reference.deltanet import recurrent_gated_delta_rule
from lucegen.reference.model import lm_head
from lucegen.reference.ops import apply_rope, argmax, rms_norm, rms_norm_gated, rope_cos_sin, sigmoid, silu
from lucegen.spec import spec_for_current_device
from test_sample import host_token

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PHASE_RTOL, REC_RTOL, KV_RTOL = 1e-5, 2e-5, 4e-3
STEP_RTOL = {"tiny": 2e-3, "small": 2e-3, "ratio3": 1e-2, "0.8b": 5e-4}

_08B = load_config("qwen3.5-0.8b")
MAX_CONTEXT = 33_000  # attention phases are drawn at positions past 32K
CONFIGS = {
    "tiny": tiny_config(max_position_embeddings=MAX_CONTEXT),
    # the real 0.8B shapes (head dims, head counts, widths, the block splits they give) with 8 layers and a small
    # vocabulary, so that the reference keeps up
    "small": dataclasses.replace(_08B, name="small", num_hidden_layers=8, layer_types=_08B.layer_types[:8],
                                 vocab_size=8192),
    # 3 value heads per key head and one kv head (the 27B's ratios)
    "ratio3": tiny_config(name="ratio3", hidden_size=96, num_hidden_layers=8, intermediate_size=192,
                          num_attention_heads=6, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
                          linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=32,
                          max_position_embeddings=MAX_CONTEXT),
}


class Model:
    """An engine and the reference weights it is compared with."""

    def __init__(self, name, cfg, seed=0, peaked=False, max_context=MAX_CONTEXT):
        self.name, self.cfg = name, cfg
        self.weights = reference_weights(random_weights(cfg, seed, peaked=peaked))
        self.engine = DecodeEngine(self.weights, cfg, spec_for_current_device(), max_context=max_context)

    def poison(self) -> None:
        """NaN in every state array, activation and output buffer."""
        s = self.engine.state
        for table in (s.conv, s.recurrent, s.keys, s.values):
            for a in table.values():
                a.fill_bytes(0xFF)
        self.engine.kernel.act.fill_bytes(0xFF)
        for a in self.engine.outputs():
            a.fill_bytes(0xFF)

    def load(self, state: State) -> None:
        self.poison()
        self.engine.state.load_reference(state)

    def layer(self, i: int, name: str) -> np.ndarray:
        return self.weights[f"layers.{i}.{name}"]


_models: dict[tuple, Model] = {}


def model(name: str, peaked: bool = False) -> Model:
    key = (name, peaked)
    if key not in _models:
        cfg = _08B if name == "0.8b" else CONFIGS[name]
        _models[key] = Model(name, cfg, peaked=peaked, max_context=4096 if name == "0.8b" else MAX_CONTEXT)
    return _models[key]


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "non-finite output (unwritten, or a NaN read from poisoned memory)"
    return relative_error(out, ref)


def random_state(cfg, position: int, rng: np.random.Generator) -> State:
    """A state at `position` with random contents (KV rows as the cache holds them: bf16 values)."""
    s = State(position=position)
    if position == 0:
        return s
    K, C = cfg.linear_conv_kernel_dim, cfg.conv_dim
    for i in cfg.linear_layers:
        s.conv[i] = rng.standard_normal((K - 1, C), dtype=np.float32)
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        s.recurrent[i] = 0.3 * rng.standard_normal((hv, dk, dv), dtype=np.float32)
    for i in cfg.full_layers:
        kv = (position, cfg.num_key_value_heads, cfg.head_dim)
        s.keys[i] = rng.standard_normal(kv, dtype=np.float32).astype(BF16).astype(np.float32)
        s.values[i] = rng.standard_normal(kv, dtype=np.float32).astype(BF16).astype(np.float32)
    return s


@dataclasses.dataclass
class Snapshot:
    act: dict[str, np.ndarray]
    conv: dict[int, np.ndarray]
    recurrent: dict[int, np.ndarray]
    keys: dict[int, np.ndarray]
    values: dict[int, np.ndarray]
    logits: np.ndarray | None
    token: int | None


def run_phases(m: Model, state: State, token: int, phases: int) -> Snapshot:
    """The step at state.position with `token`, stopped after `phases` phases (all of them: the LM head too)."""
    m.load(state)
    e = m.engine
    whole = phases == 5 * m.cfg.num_hidden_layers + 1
    out = e.run([token], logits="last" if whole else None, phase_limit=-1 if whole else phases)
    e.state.position = state.position  # a whole step advanced it
    s = e.state
    f32 = lambda a: a.numpy().astype(np.float32)
    return Snapshot({n: e.kernel.activation(n) for n in ("x", "mixed", "mix_out", "mlp")},
                    {i: a.numpy() for i, a in s.conv.items()}, {i: a.numpy() for i, a in s.recurrent.items()},
                    {i: f32(a) for i, a in s.keys.items()}, {i: f32(a) for i, a in s.values.items()},
                    out.logits[-1] if whole else None, int(out.tokens[-1]) if whole else None)


def phase_index(cfg, kind: str, layer: int) -> int:
    return 5 * cfg.num_hidden_layers if kind == "lm_head" else 5 * layer + {
        "lin_in": 0, "att_in": 0, "lin_rec": 1, "att_core": 1, "lin_out": 2, "att_out": 2, "mlp_gu": 3,
        "mlp_down": 4}[kind]


# ---- phases ------------------------------------------------------------------------------------------------------

def check_in(m, layer, token, before, after):
    cfg = m.cfg
    x = m.weights["embed_tokens.weight"][token] if layer == 0 else before.act["x"][:cfg.hidden_size]
    h = rms_norm(x, m.layer(layer, "input_layernorm.weight"), cfg.rms_norm_eps)
    if cfg.layer_types[layer] == LINEAR:
        w = np.concatenate([m.layer(layer, f"linear_attn.in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])
    else:
        w = np.concatenate([m.layer(layer, f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")])
    assert rel_err(after.act["mixed"][:w.shape[0]], w @ h) < PHASE_RTOL
    if layer == 0:  # the residual stream starts as the embedding row
        np.testing.assert_array_equal(after.act["x"][:cfg.hidden_size], x)


def check_rec(m, layer, pos, state, before, after):
    cfg = m.cfg
    C, K = cfg.conv_dim, cfg.linear_conv_kernel_dim
    Hk, Hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    mixed = before.act["mixed"][:C + cfg.value_dim + 2 * Hv][None]
    ring = conv1d.state_to_ring(state.conv[layer], pos) if pos else np.zeros((K, C), np.float32)
    p = lambda n: m.layer(layer, "linear_attn." + n)
    qkv, g, beta, new_ring = conv1d.reference(cfg, mixed, p("conv1d.weight")[:, 0], p("A_log"), p("dt_bias"), ring, pos)
    q, k, v = np.split(qkv, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    q = np.repeat(q.reshape(1, Hk, dk), Hv // Hk, axis=1)  # value head j reads key head j // (Hv / Hk)
    k = np.repeat(k.reshape(1, Hk, dk), Hv // Hk, axis=1)
    o, S = recurrent_gated_delta_rule(q, k, v.reshape(1, Hv, dv), g, beta, state.recurrent.get(layer))
    assert rel_err(after.act["mix_out"][:cfg.value_dim], o.reshape(-1)) < REC_RTOL
    assert rel_err(after.recurrent[layer], S.transpose(0, 2, 1)) < REC_RTOL
    np.testing.assert_array_equal(after.conv[layer][pos % K], new_ring[pos % K])  # this token's raw inputs


def check_core(m, layer, pos, state, before, after):
    cfg = m.cfg
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    qkv = before.act["mixed"][:cfg.q_proj_rows + 2 * cfg.kv_dim]
    qg = qkv[:cfg.q_proj_rows].reshape(1, nh, 2 * hd)
    k_raw, v = qkv[cfg.q_proj_rows:].reshape(2, 1, nkv, hd)
    cos, sin = rope_cos_sin(np.array([pos]), cfg.rotary_dim, cfg.rope_theta)
    q = apply_rope(rms_norm(qg[..., :hd], m.layer(layer, "self_attn.q_norm.weight"), eps), cos, sin)
    k = apply_rope(rms_norm(k_raw, m.layer(layer, "self_attn.k_norm.weight"), eps), cos, sin)
    keys, values = after.keys[layer][:pos + 1], after.values[layer][:pos + 1]
    assert rel_err(keys[pos], k[0]) < KV_RTOL and rel_err(values[pos], v[0]) < KV_RTOL
    if pos:  # the rows before `pos` are the state's, untouched
        np.testing.assert_array_equal(keys[:pos], state.keys[layer])
    # attention over exactly the bf16 rows the kernel read
    o = causal_attention(q, keys, values, hd ** -0.5).reshape(-1) * sigmoid(qg[0, :, hd:].reshape(-1))
    assert rel_err(after.act["mix_out"][:nh * hd], o) < PHASE_RTOL


def check_out(m, layer, before, after):
    cfg = m.cfg
    x = before.act["x"][:cfg.hidden_size]
    if cfg.layer_types[layer] == LINEAR:
        Hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        o = before.act["mix_out"][:cfg.value_dim].reshape(Hv, dv)
        z = before.act["mixed"][cfg.conv_dim:cfg.conv_dim + cfg.value_dim].reshape(Hv, dv)
        h = rms_norm_gated(o, z, m.layer(layer, "linear_attn.norm.weight"), cfg.rms_norm_eps).reshape(-1)
        ref = x + m.layer(layer, "linear_attn.out_proj.weight") @ h
    else:
        o = before.act["mix_out"][:cfg.num_attention_heads * cfg.head_dim]
        ref = x + m.layer(layer, "self_attn.o_proj.weight") @ o
    assert rel_err(after.act["x"][:cfg.hidden_size], ref) < PHASE_RTOL


def check_mlp(m, layer, kind, before, after):
    cfg = m.cfg
    x = before.act["x"][:cfg.hidden_size]
    if kind == "mlp_gu":
        h = rms_norm(x, m.layer(layer, "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        ref = silu(m.layer(layer, "mlp.gate_proj.weight") @ h) * (m.layer(layer, "mlp.up_proj.weight") @ h)
        assert rel_err(after.act["mlp"][:cfg.intermediate_size], ref) < PHASE_RTOL
    else:
        ref = x + m.layer(layer, "mlp.down_proj.weight") @ before.act["mlp"][:cfg.intermediate_size]
        assert rel_err(after.act["x"][:cfg.hidden_size], ref) < PHASE_RTOL


def check_lm_head(m, before, after):
    cfg = m.cfg
    h = rms_norm(before.act["x"][:cfg.hidden_size], m.weights["norm.weight"], cfg.rms_norm_eps)
    ref = lm_head(m.weights) @ h
    assert rel_err(after.logits, ref) < PHASE_RTOL
    assert after.token == argmax(after.logits)  # the merged argmax of the kernel's own logits (lowest index on ties)


POSITIONS = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 31, 32, 33, 2047, 2048, 2100]), st.integers(0, 600))
LONG_POSITIONS = st.one_of(POSITIONS, st.integers(32_000, MAX_CONTEXT - 1))  # attention: chunks over all blocks


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("kind", PHASE_KINDS)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_phase_matches_the_reference(config, kind, seed, data):
    m = model(config)
    pos = data.draw(LONG_POSITIONS if kind == "att_core" else POSITIONS, label="position")
    cfg = m.cfg
    rng = np.random.default_rng(seed)
    layers = cfg.full_layers if kind.startswith("att") else cfg.linear_layers if kind.startswith("lin") else \
        range(cfg.num_hidden_layers)
    layer = data.draw(st.sampled_from(list(layers)), label="layer") if kind != "lm_head" else None
    token = int(rng.integers(cfg.vocab_size))
    state = random_state(cfg, pos, rng)
    k = phase_index(cfg, kind, layer)
    before, after = run_phases(m, state, token, k), run_phases(m, state, token, k + 1)
    if kind in ("lin_in", "att_in"):
        check_in(m, layer, token, before, after)
    elif kind == "lin_rec":
        check_rec(m, layer, pos, state, before, after)
    elif kind == "att_core":
        check_core(m, layer, pos, state, before, after)
    elif kind in ("lin_out", "att_out"):
        check_out(m, layer, before, after)
    elif kind.startswith("mlp"):
        check_mlp(m, layer, kind, before, after)
    else:
        check_lm_head(m, before, after)


# ---- whole steps ---------------------------------------------------------------------------------------------------

def reference_steps(m: Model, state: State, tokens) -> np.ndarray:
    state = state.copy()
    return np.stack([decode_step(m.weights, m.cfg, int(t), state) for t in tokens])


def check_steps(m: Model, state: State, tokens) -> None:
    """len(tokens) steps in one launch from `state`, logits of every step against the reference's."""
    m.load(state)
    out = m.engine.run(tokens, logits="all")
    assert len(out.tokens) == len(tokens) and m.engine.position == state.position + len(tokens)
    ref = reference_steps(m, state, tokens)
    errs = [rel_err(out.logits[i], ref[i]) for i in range(len(tokens))]
    worst = int(np.argmax(errs))
    assert errs[worst] < STEP_RTOL[m.name], \
        f"step {worst} (position {state.position + worst}): relative error {errs[worst]:.2e}"
    np.testing.assert_array_equal(out.tokens, out.logits.argmax(-1))


@pytest.mark.parametrize("config", ["tiny", "small", "ratio3"])
def test_steps_from_position_0_match_the_reference(config):
    m = model(config)
    tokens = np.random.default_rng(1).integers(0, m.cfg.vocab_size, 80)
    check_steps(m, State(), tokens)


@pytest.mark.parametrize("config", ["tiny", "small"])
def test_steps_past_2k_match_the_reference(config):
    """64 steps from position 2100: tiny's state from a reference prefill (the chunked rule) handed to the kernel,
    small's drawn at random (its reference prefill would take minutes)."""
    m = model(config)
    rng = np.random.default_rng(2)
    if config == "tiny":
        state = State()
        prefill(m.weights, m.cfg, rng.integers(0, m.cfg.vocab_size, 2100), state)
    else:
        state = random_state(m.cfg, 2100, rng)
    check_steps(m, state, rng.integers(0, m.cfg.vocab_size, 64))


def test_steps_near_32k_match_the_reference():
    m = model("small")
    rng = np.random.default_rng(3)
    check_steps(m, random_state(m.cfg, 32_700, rng), rng.integers(0, m.cfg.vocab_size, 8))


def test_qwen35_08b_steps_match_the_reference():
    """The real model (24 layers, the 248320-row LM head), on the peaked weights the greedy test uses too (one set
    of 0.8B weights: generating them takes a minute of CPU)."""
    m = model("0.8b", peaked=True)
    check_steps(m, State(), np.random.default_rng(4).integers(0, m.cfg.vocab_size, 24))


@pytest.mark.parametrize("config", ["tiny", "small", "ratio3", "0.8b"])
def test_greedy_tokens_equal_the_reference_on_peaked_weights(config):
    m = model(config, peaked=True)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, m.cfg.vocab_size, 7)]
    m.poison()
    m.engine.reset()
    assert m.engine.generate(prompt, 24) == generate(m.weights, m.cfg, prompt, 24)


def test_one_launch_of_n_steps_equals_n_launches():
    m = model("small")
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, m.cfg.vocab_size, 5)]
    m.load(State())
    many = m.engine.run(prompt, n_new=19, logits="all")
    m.load(State())
    token, single = None, []
    for t in [*prompt, *many.tokens[len(prompt) - 1:-1]]:
        logits, token = m.engine.step(int(t))
        single.append(logits)
    np.testing.assert_array_equal(np.stack(single), many.logits)  # bitwise: no timing-dependent sums anywhere
    assert token == many.tokens[-1]


@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_sampled_steps_draw_from_their_logits_and_feed_the_draw_back(temperature):
    """A sampled launch: every step's token is the host's draw from that step's logits with its uniform (the same
    token where u is not within rounding of a boundary), and the next step reads it: teacher-forcing the drawn
    tokens gives the same logits bit for bit."""
    m = model("small")
    rng = np.random.default_rng(int(temperature * 10))
    prompt = [int(t) for t in rng.integers(0, m.cfg.vocab_size, 5)]
    u = rng.random(20)
    m.load(State())
    out = m.engine.run(prompt, n_new=19, logits="all", temperature=temperature, uniforms=u)
    assert not m.engine.kernel.sync.numpy().any()
    drawn = out.tokens[len(prompt) - 1:]
    for i, token in enumerate(drawn):
        want, margin = host_token(out.logits[len(prompt) - 1 + i], temperature, u[i])
        assert token == want or margin <= 1e-12, f"step {i}: drew {token}, the host {want}"
    m.load(State())  # the same kernel, every token given (the last step's draw aside)
    forced = m.engine.run([*prompt, *drawn[:-1]], logits="all", temperature=temperature, uniforms=u[-1:])
    np.testing.assert_array_equal(forced.logits, out.logits)
    assert forced.tokens[-1] == drawn[-1]


def test_a_seeded_sampled_launch_generates_the_hosts_tokens():
    """generate() with a sampler: one launch, the sampler's uniforms in order; the same tokens as drawing on the
    host from each step's logits with the same seed."""
    m = model("small")
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(temperature=0.9, seed=11)
    m.load(State())
    device = m.engine.generate(prompt, 24, sampler=Sampler(params))
    m.load(State())
    host, sampler = [], Sampler(params)
    logits = m.engine.prefill(prompt)
    for _ in range(24):
        host.append(sampler(logits))
        logits = m.engine.decode(host[-1])
    assert device == host


DEVICE_BEST = {
    "top_k": (SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=5),
              lambda e, s, t: s.draw_top_k(*e.decode_top_k(t, s.params.top_k + 1), e.step_logits)),
    "top_p": (SamplingParams(temperature=0.7, top_p=0.8, seed=6),
              lambda e, s, t: s.draw_top_p(*e.decode_top_p(t, s.params.temperature, 64), e.step_logits)),
}


@pytest.mark.parametrize("law", DEVICE_BEST)
def test_top_k_and_top_p_steps_draw_from_the_devices_best_the_hosts_tokens(law):
    """Steps of a top_k law (with top_p: decode_top_k's k + 1 best) and of top_p alone (decode_top_p's 64 best,
    their logits and the row's softmax) as generate() takes them, drawn on the host from those, the step's logits
    only on a tie at the k-th or a nucleus past the 64: the same tokens as drawing from each step's whole row with
    the same seed."""
    m = model("small")
    params, device_step = DEVICE_BEST[law]

    def tokens(step) -> list[int]:
        m.load(State())
        sampler = Sampler(params)
        out = [sampler(m.engine.prefill([3, 1, 4]))]
        for _ in range(15):
            out.append(step(sampler, out[-1]))
        return out
    assert tokens(lambda s, t: device_step(m.engine, s, t)) == tokens(lambda s, t: s(m.engine.decode(t)))


def test_prefetch_changes_no_result():
    m = model("small")
    tokens = np.random.default_rng(7).integers(0, m.cfg.vocab_size, 6)
    runs = []
    for prefetch in (True, False, 16):  # the spec's prefetches, none, weight tiles far beyond the ring
        m.load(State())
        runs.append(m.engine.run(tokens, logits="all", prefetch=prefetch).logits)
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


def test_every_launch_leaves_its_sync_counters_at_zero():
    """The barrier, attention-ticket and per-block ready counters are back at zero after a launch however it ends
    (every step; EOS; phase_limit right after an in-projection, whose end only bumps ready counters, or later):
    the next launch starts from them without a memset."""
    m = model("small")
    sync = m.engine.kernel.sync
    m.load(State())
    free = m.engine.run([1, 2, 3], n_new=8).tokens
    assert not sync.numpy().any()
    m.load(State())
    m.engine.run([1, 2, 3], n_new=8, eos=int(free[4]))
    assert not sync.numpy().any()
    attention = 5 * m.cfg.full_layers[0]
    for phases in (1, 2, 3, attention + 1, attention + 2, 5 * m.cfg.num_hidden_layers):
        m.load(State())
        m.engine.run([5], phase_limit=phases)
        assert not sync.numpy().any(), f"phase_limit {phases}: {sync.numpy()}"


def test_eos_stops_the_launch():
    m = model("tiny")
    prompt = [3, 1, 4, 1, 5]
    m.load(State())
    free = m.engine.generate(prompt, 24)
    j = len(free) // 2
    eos = free[j]
    stop = free.index(eos)  # the first time eos comes out
    m.load(State())
    assert m.engine.generate(prompt, 24, eos=eos) == free[:stop + 1]
    assert m.engine.position == len(prompt) + stop
    with pytest.raises(ValueError):
        m.engine.generate(prompt, 0)


def test_prompt_tokens_are_not_taken_for_eos():
    """An argmax equal to eos while the prompt is still being read does not stop the launch."""
    m = model("tiny")
    prompt = [7, 8, 9, 10]
    m.load(State())
    during_prompt = m.engine.run(prompt, logits=None).tokens
    m.load(State())
    out = m.engine.run(prompt, n_new=3, eos=int(during_prompt[0]))
    assert len(out.tokens) >= len(prompt)


# ---- HF transformers -------------------------------------------------------------------------------------------------

def _hf_parity_tool():
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("torch and transformers are not installed")
    path = Path(__file__).resolve().parents[2] / "tools" / "hf_parity.py"
    spec = importlib.util.spec_from_file_location("hf_parity", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("hf_parity", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("peaked", [False, True])
def test_matches_hf_transformers(peaked):
    """HF's Qwen3_5ForCausalLM (float32, eager) on the same weights: its greedy tokens fed to the kernel give the
    same logits at every step, and on peaked weights the kernel's greedy tokens are HF's."""
    tool = _hf_parity_tool()
    import torch
    m = model("small", peaked=peaked)
    hf = tool.hf_model(m.cfg, m.weights, "cuda")
    prompt = np.random.default_rng(8).integers(0, m.cfg.vocab_size, 9)
    with torch.no_grad():
        ids = torch.as_tensor(prompt)[None].cuda()
        out = hf(input_ids=ids, use_cache=True)
        cache, tokens, ref = out.past_key_values, [], [out.logits[0, -1].float().cpu().numpy()]
        for _ in range(32):
            tokens.append(int(np.argmax(ref[-1])))
            out = hf(input_ids=torch.tensor([[tokens[-1]]]).cuda(), past_key_values=cache, use_cache=True)
            ref.append(out.logits[0, -1].float().cpu().numpy())
    m.load(State())
    got = m.engine.run([*prompt, *tokens], logits="all").logits[len(prompt) - 1:]
    errs = [rel_err(got[i], ref[i]) for i in range(len(ref))]
    assert max(errs) < STEP_RTOL[m.name], f"worst step {int(np.argmax(errs))}: {max(errs):.2e}"
    if peaked:
        m.load(State())
        assert m.engine.generate([int(t) for t in prompt], 32) == tokens
