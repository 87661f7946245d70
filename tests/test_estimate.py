"""Note [flushes cost too]: the step-aside estimate counts what each flush costs, and takes
eager's time from the fastest op-by-op run."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import calibrate as cal
from adaptive_eager import config
from adaptive_eager.compile import policy


def _entry(n_ops: int, fused: list[float], paired: list[float], replay: list[float],
           state: str = "fused", sym: object = None, fused_n: list[int] | None = None,
           paired_n: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(n_ops=n_ops, state=state, fused_s=fused, paired_s=paired,
                           replay_s=replay, sym=sym, fused_n=fused_n or [0] * len(fused),
                           paired_n=paired_n or [0] * len(paired))


def _estimate(decided: list[SimpleNamespace]) -> tuple[float, float]:
    """The step-aside estimate of a compile manager's decisions that decided these traces."""
    hooks = policy.PolicyHooks(save_stats=lambda entry, sample=False: None,
                               agree_keep=lambda entry, keep: keep,
                               agree_aside=lambda reason: reason,
                               distributed_job=lambda: False, recent_entries=list)
    dec = policy.Decisions(config.resolve({}), True, threading.RLock(), hooks)
    dec.decided.extend(decided)
    return dec.round_estimate()


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RECORD_S", 3e-6), ("EAGER_OP_S", 2e-6), ("REPLAY_EXTRA_S", 2.5e-6),
                        ("FLUSH_S", 18e-6), ("REPLAY_FIXED_S", 1e-6)):
        monkeypatch.setattr(policy, name, value)


def test_estimate_counts_flushes_and_the_fastest_replay(pinned: None) -> None:
    # benchmarks' item_loop in a warm process: two short programs, each flushed by an .item();
    # the paired op-by-op runs start with the first calls of their kernels in the process
    a = _entry(4, [12e-6] * 8, [115e-6, 26e-6, 81e-6], [74e-6])
    b = _entry(3, [11e-6] * 8, [57e-6, 25e-6, 37e-6], [119e-6])
    engine, eager = _estimate([a, b])
    per_op = 3e-6 + 2e-6
    assert engine == pytest.approx(12e-6 + 4 * per_op + 18e-6 + 11e-6 + 3 * per_op + 18e-6)
    assert eager == pytest.approx((26e-6 - 4 * 2.5e-6 - 1e-6) + (25e-6 - 3 * 2.5e-6 - 1e-6))
    assert engine > eager  # the engine steps aside here
    # the old estimate (per-op terms only, median of every op-by-op sample) kept the programs
    old_engine = 12e-6 + 4 * 3e-6 + 11e-6 + 3 * 3e-6
    old_eager = (74e-6 - 4 * 2.5e-6) + (119e-6 - 3 * 2.5e-6)
    assert old_engine < old_eager


def test_estimate_of_op_by_op_traces_and_missing_samples(pinned: None) -> None:
    replayed = _entry(10, [], [], [60e-6, 40e-6, 50e-6], state="replay")
    unmeasured = _entry(5, [], [], [], state="failed")
    engine, eager = _estimate([replayed, unmeasured])
    assert engine == pytest.approx(50e-6 + 10 * 5e-6 + 18e-6 + 0.0 + 5 * 5e-6 + 18e-6)
    # eager's side: at least EAGER_OP_S an op (40 - 25 - 1 us is below 10 ops' 20 us; the
    # unmeasured trace has no sample at all)
    assert eager == pytest.approx(10 * 2e-6 + 5 * 2e-6)
    # a large trace is decided by its run, not by the flush term
    big = _entry(400, [10e-3] * 3, [30e-3] * 3, [30e-3])
    engine, eager = _estimate([big])
    assert engine < eager


def test_calibration_measures_the_per_flush_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RECORD_S", -1.0), ("REPLAY_EXTRA_S", -1.0), ("EAGER_OP_S", -1.0),
                        ("FLUSH_S", -1.0), ("REPLAY_FIXED_S", -1.0)):
        monkeypatch.setattr(policy, name, value)  # a constant left unmeasured stays -1
    monkeypatch.setattr(cal, "_done", False)
    cal.calibrate()
    values = {n: getattr(policy, n) for n in ("RECORD_S", "REPLAY_EXTRA_S", "EAGER_OP_S",
                                                 "FLUSH_S", "REPLAY_FIXED_S")}
    for name, v in values.items():
        assert math.isfinite(v) and 0.0 <= v < 0.05, (name, values)
    # a flush does work of its own (a new trace, its entry looked up, outputs published)
    assert values["FLUSH_S"] > 0.0 and values["EAGER_OP_S"] > 0.0, values


def test_a_sync_every_few_ops_steps_aside(graph_backend: object) -> None:
    """A round-less loop (no module, no optimizer, one context) with an .item() every four
    tiny ops: fused programs cannot pay for a flush each, so the engine leaves (at a sync
    point, Note [sync points are safe points]); the values are eager's throughout."""
    torch.manual_seed(0)
    n = 16
    a = torch.eye(n) + 0.01 * torch.randn(n, n)
    b = torch.randn(n)

    def run(steps: int) -> list[float]:
        x = torch.zeros(n)
        out = []
        for _ in range(steps):
            r = b - a @ x
            res = r.norm().item()
            x.add_(r, alpha=0.5 if res > 1.0 else 0.1)
            out.append(res)
        return out

    ref = run(300)
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           compile_process=False, disk_cache=False, probe_every=0):
        got = run(300)
    assert got == ref
    m = ae.metrics()
    assert m["step_asides"] == 1, m
    assert m["kept_fused"] + m["kept_replay"] >= 1, m


def test_estimate_of_a_symbolic_trace_at_one_size(pinned: None) -> None:
    """Note [timing at one size]: a symbolic trace's sides come from its runs fitted at one
    size; the fastest op-by-op run (the shortest sequence) against the median fused one (at a
    long sequence) made the engine look slower than eager."""
    from test_timing_sizes import FUSED, REPLAY

    (fs, fn), (rs, rn) = FUSED, REPLAY
    ms = [t * 1e-3 for t in fs], [t * 1e-3 for t in rs]
    sym = _entry(300, ms[0], ms[1], [], sym=object(), fused_n=fn, paired_n=rn)
    engine, eager = _estimate([sym])
    fused, replay = policy._at_one_size(ms[0], fn, ms[1], rn)
    per_op = 3e-6 + 2e-6
    assert engine == pytest.approx(fused + 300 * per_op + 18e-6)
    assert eager == pytest.approx(replay - 300 * 2.5e-6 - 1e-6)
    static = _entry(300, ms[0], ms[1], [])  # the same samples read as a static trace
    engine_s, eager_s = _estimate([static])
    assert engine_s > eager_s and engine < eager  # steps aside only when sizes are ignored
