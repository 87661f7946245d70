"""Note [paired timing]: while a program is measured, fused runs alternate with op-by-op runs of
the same trace, and the keep/drop decision compares those pairs."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.compile import policy
from adaptive_eager.cache.memory import TRIE
from adaptive_eager.calibrate import calibrate
from adaptive_eager.compile.policy import MEASURE_RUNS


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = torch.tanh(x * 0.9 + w) - 0.1 * x
    return x


def test_measuring_alternates_fused_and_op_by_op_runs(graph_backend: object
                                                      ) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(64), torch.randn(64)
    ref = _step(x, w)
    kinds: list[str] = []
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, step_aside=False,
                           compile_async=False, compile_process=False, disk_cache=False):
        for _ in range(20):
            before = ae.metrics()
            out = _step(x, w)
            ae.sync()
            assert torch.equal(out, ref)  # op by op and the aten-graph program are eager's
            after = ae.metrics()
            kinds.append("F" if after["compiled_runs"] > before["compiled_runs"] else "R")
    entry = max(TRIE.entry_list, key=lambda e: e.n_ops)
    assert entry.state in ("fused", "replay"), entry.state
    assert entry.decision, entry
    assert len(entry.paired_s) == MEASURE_RUNS, entry.paired_s
    first = kinds.index("F")
    # warm-up fused run, then MEASURE_RUNS pairs of (fused, op by op), then the decision
    measured = kinds[first:first + 1 + 2 * MEASURE_RUNS]
    assert measured == ["F"] + ["F", "R"] * MEASURE_RUNS, kinds
    after_decision = set(kinds[first + 1 + 2 * MEASURE_RUNS:])
    assert after_decision == ({"F"} if entry.state == "fused" else {"R"}), (entry.state, kinds)


def _other(y: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        y = torch.sin(y) * 1.1 + 0.2
    return y


def test_estimate_waits_for_every_trace_being_measured(monkeypatch: pytest.MonkeyPatch,
                                                       graph_backend: object) -> None:
    """Note [undecided means measuring too]: a second trace that turns hot later is still being
    measured when the first is decided; the estimate (pinned here to say "step aside") must wait
    for that decision too, or the second program is never used."""
    calibrate()  # measure first, then pin: recording "costs" a second per op
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    torch.manual_seed(0)
    x, w, y = torch.randn(64), torch.randn(64), torch.randn(32)
    ref_a, ref_b = _step(x, w), _other(y)
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           compile_process=False, disk_cache=False, probe_every=0):
        for i in range(40):
            a = _step(x, w)
            ae.sync()
            assert torch.equal(a, ref_a)  # op by op and the aten-graph program are eager's
            if i >= 4:  # this trace starts later: measuring when the first is decided
                b = _other(y)
                ae.sync()
                assert torch.equal(b, ref_b)
    m = ae.metrics()
    assert m["step_asides"] == 1, m
    by_ops = {e.n_ops: e for e in TRIE.entry_list}
    first, second = by_ops[_ops(_step, x, w)], by_ops[_ops(_other, y)]
    assert first.state in ("fused", "replay"), first.state
    assert second.state in ("fused", "replay"), (second.state, second.decision)


def _ops(fn, *args: torch.Tensor) -> int:
    with ae.adaptive_eager(backend="replay"):
        before = ae.metrics()["ops_deferred"]
        fn(*args)
        after = ae.metrics()["ops_deferred"]
        ae.sync()
    return after - before
