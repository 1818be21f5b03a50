"""The megakernel timeline's analysis (lucegen/bench/timeline.py) on hand-made traces, and the phase names it uses."""
import numpy as np
import pytest

from lucegen.bench.timeline import DONE, GEMV, GEMV_END, READY, START, TILES, analyse
from lucegen.kernels.megakernel import PHASE_KINDS, TRACE_FIELDS, Layout
from lucegen.model.config import FULL, load_config
from lucegen.spec import load_spec


def make_trace(steps, kinds, blocks, rng):
    """Phases back to back; every block starts a phase `exit` ns after the last block finished the one before,
    stages, runs its GEMV (GEMV phases only) and finishes. Returns the trace and the truth per (step, phase)."""
    t = np.zeros((steps, len(kinds), blocks, len(TRACE_FIELDS)), np.uint64)
    truth = {}
    release = 1_000_000
    for s in range(steps):
        for k, kind in enumerate(kinds):
            exit_, stage, gemv, tail = rng.integers(100, 2000, (4, blocks))
            has_gemv = kind != "mix"
            start = release + exit_
            done = start + stage + (gemv + tail if has_gemv else 0)
            t[s, k, :, START], t[s, k, :, DONE] = start, done
            if has_gemv:
                t[s, k, :, GEMV], t[s, k, :, GEMV_END] = start + stage, start + stage + gemv
                t[s, k, :, TILES] = rng.integers(1, 12, blocks)
                t[s, k, :, READY] = rng.integers(0, 4, blocks)
            last = int(done.argmax())
            truth[s, k] = dict(wall=int(done.max()) - release, exit=int(exit_[last]), stage=int(stage[last]),
                               gemv=int(gemv[last]), tail=int(tail[last]), has_gemv=has_gemv)
            release = int(done.max())
    return t, truth


def test_analyse_splits_each_phase_at_its_last_block():
    rng = np.random.default_rng(1)
    kinds = ["a", "mix", "b", "a"]
    steps, slots = 5, 4
    trace, truth = make_trace(steps, kinds, 7, rng)
    times, per_token = analyse(trace, kinds, slots, skip_steps=1)
    n = steps - 1
    for kind in dict.fromkeys(kinds):
        cells = [truth[s, k] for s in range(1, steps) for k, kk in enumerate(kinds) if kk == kind]
        got = times[kind]
        assert got.wall == pytest.approx(sum(c["wall"] for c in cells) / n / 1e3)
        assert got.exit == pytest.approx(sum(c["exit"] for c in cells) / n / 1e3)
        if kind == "mix":
            assert got.gemv == 0 and np.isnan(got.ready_share)
            assert got.work == pytest.approx(sum(c["stage"] for c in cells) / n / 1e3)
        else:
            for part in ("stage", "gemv", "tail"):
                assert getattr(got, part) == pytest.approx(sum(c[part] for c in cells) / n / 1e3)
            sel = [k for k, kk in enumerate(kinds) if kk == kind]
            ready = trace[1:, sel, :, READY].astype(np.int64).sum()
            looked = np.minimum(trace[1:, sel, :, TILES].astype(np.int64), slots).sum()
            assert got.ready_share == pytest.approx(ready / looked)
    assert per_token == pytest.approx(sum(c["wall"] for (s, _), c in truth.items() if s >= 1) / n / 1e3)
    assert sum(t.wall for t in times.values()) == pytest.approx(per_token)


def test_analyse_needs_a_step_after_the_skipped_ones():
    trace, _ = make_trace(1, ["a"], 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="nothing after skipping"):
        analyse(trace, ["a"], 4)


def test_phase_kinds_follow_the_layer_types():
    cfg = load_config("qwen3.5-0.8b")
    lay = Layout(cfg, load_spec("h200"))
    kinds = [lay.phase_kind(k) for k in range(lay.phases_per_token())]
    assert len(kinds) == 5 * cfg.num_hidden_layers + 1 and kinds[-1] == "lm_head"
    assert set(kinds) == set(PHASE_KINDS)
    for layer, kind in enumerate(cfg.layer_types):
        mixer = kinds[5 * layer:5 * layer + 3]
        assert mixer == (["att_in", "att_core", "att_out"] if kind == FULL else ["lin_in", "lin_rec", "lin_out"])
        assert kinds[5 * layer + 3:5 * layer + 5] == ["mlp_gu", "mlp_down"]
