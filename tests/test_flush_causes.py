"""Flush causes by source line (Note [flush causes] in explain.py): each flush counted under the
user's line and its reason, with the ops it ran op by op, ranked in the report by time lost."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import explain
from adaptive_eager.metrics import METRICS
from adaptive_eager.report import build_report, flush_causes, flush_kind, format_report

HERE = Path(__file__).resolve()
REPLAY = {"backend": "replay", "step_aside": False}


def _line_of(marker: str) -> int:
    """The line of this file holding ``marker`` in a comment."""
    for i, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return i
    raise AssertionError(marker)


def _sites_at(line: int) -> dict[str, list]:
    return {k: v for k, v in METRICS.flush_sites.items() if f"{HERE}:{line} " in k}


def test_each_flush_is_counted_at_the_users_line(cache_dir: Path) -> None:
    x = torch.randn(256)
    with ae.adaptive_eager(cache_dir=cache_dir, **REPLAY):
        for _ in range(5):
            y = (x * 2).sin().cos().sum()
            y.item()  # marker: item
    rows = _sites_at(_line_of("marker: item"))
    assert len(rows) == 1, METRICS.flush_sites
    (key, (flushes, ops, op_by_op, seconds)), = rows.items()
    assert key.startswith("sync:aten._local_scalar_dense.default at ")
    assert key.endswith(f"({inspect.currentframe().f_code.co_name})")
    # the first round ran each new op at once to learn its outputs: nothing pending at its item()
    assert flushes == 4 and ops == op_by_op >= 4 * 4 and seconds > 0


def test_reasons_name_what_ended_the_trace(cache_dir: Path) -> None:
    x = torch.randn(64)
    with ae.adaptive_eager(cache_dir=cache_dir, **REPLAY):
        for _ in range(3):  # the first round runs each new op at once, to learn its outputs
            a = x * 2 + 1
            str(a)  # marker: print
            b = x.sin() * 3
            b[b > 0].sum()  # marker: mask
            c = x.cos() + 2
            np.asarray(c)  # marker: numpy
    kinds = {}
    for marker in ("print", "mask", "numpy"):
        rows = _sites_at(_line_of(f"marker: {marker}"))
        assert rows, (marker, METRICS.flush_sites)
        kinds[marker] = flush_kind(next(iter(rows)).partition(" at ")[0])[0]
    assert kinds["print"].startswith("a read of a pending tensor in Python")
    assert kinds["mask"].startswith("a data-dependent shape (aten.index")
    assert kinds["numpy"] == kinds["print"]


def test_report_ranks_the_line_that_ran_most_ops_op_by_op_first(cache_dir: Path) -> None:
    x = torch.randn(4096)
    with ae.adaptive_eager(cache_dir=cache_dir, **REPLAY):
        for _ in range(20):
            y = x
            for _ in range(40):
                y = torch.tanh(y * 0.9) + 0.1
            y.sum().item()  # marker: heavy
            (x + 1).sum().item()  # marker: light
    run = build_report(cache_dir, last=True)["runs"][0]
    causes = run["flush_causes"]
    heavy, light = _line_of("marker: heavy"), _line_of("marker: light")
    assert causes[0]["where"].startswith(f"{HERE}:{heavy} "), causes
    assert causes[0]["flushes"] == 19 and causes[0]["ops_op_by_op"] == causes[0]["ops"]
    assert any(c["where"].startswith(f"{HERE}:{light} ") for c in causes[1:])
    assert causes[0]["lost_s"] is None  # nothing fused in this run: no ratio to estimate with
    text = format_report(build_report(cache_dir, last=True))
    section = text.split("flush causes by time lost", 1)[1].splitlines()
    assert f"{HERE}:{heavy} " in section[1] and "s op by op" in section[1]
    assert "optimizer.step()" in section[2]  # the advice for an .item()


def test_time_lost_uses_the_runs_fused_to_op_by_op_ratio() -> None:
    traces = [{"fused_ms": 1.0, "replay_ms": 4.0}, {"fused_ms": 1.0, "replay_ms": 4.0},
              {"fused_ms": None, "replay_ms": 9.0}]
    sites = {"sync:aten._local_scalar_dense.default at a.py:3 (f)": [10, 200, 100, 2.0],
             "optimizer_step at a.py:9 (f)": [10, 50, 0, 0.0]}
    rows = flush_causes(sites, traces)
    assert rows[0]["where"] == "a.py:3 (f)" and rows[0]["lost_s"] == pytest.approx(1.5)
    assert rows[1]["lost_s"] == 0.0 and rows[1]["kind"] == "the optimizer step"
    slower = flush_causes(sites, [{"fused_ms": 5.0, "replay_ms": 4.0}])
    assert slower[0]["lost_s"] == 0.0  # fused was not faster: nothing lost by not fusing
    assert flush_causes({"bad": "row", "x at y": [1, 2]}, traces) == []  # a malformed log row


def test_the_table_of_lines_is_bounded(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(explain, "FLUSH_SITES_MAX", 2)
    x = torch.randn(16)
    with ae.adaptive_eager(cache_dir=cache_dir, **REPLAY):
        for _ in range(3):
            (x + 1).sum().item()
            (x + 2).sum().item()
            (x + 3).sum().item()
            (x + 4).sum().item()
    keys = [k for k in METRICS.flush_sites if k.startswith("sync:")]
    assert len(METRICS.flush_sites) <= 3, METRICS.flush_sites  # two lines, then one shared row
    assert sum(k.endswith("(other lines)") for k in keys) == 1, keys
    total = sum(v[0] for v in METRICS.flush_sites.values())
    assert total == METRICS.flushes
