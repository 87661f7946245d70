"""benchmarks/phase_split: the varlen GPT-2 step timed by phase, eager and under the engine
(replay backend: losses bitwise equal to eager's at every step)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import adaptive_eager as ae  # noqa: E402
from benchmarks import phase_split as P  # noqa: E402


def test_phases_recorded_under_the_engine_match_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTIVE_EAGER_STEP_ASIDE", "0")
    monkeypatch.setenv("ADAPTIVE_EAGER_BACKEND", "replay")
    eager, eager_losses, n = P._run(False, "small", 4, 1)
    engine, engine_losses, n_engine = P._run(True, "small", 4, 1)
    assert n == n_engine == 3
    assert engine_losses == eager_losses  # op by op: bitwise
    m = ae.metrics()
    assert m["ops_intercepted"] > 4 * 300 and m["step_asides"] == 0, m
    assert len(eager) == len(engine) == len(P.PHASES)
    assert eager[3] == 0.0 and engine[3] > 0.0  # only the engine flushes
    text = P.table(eager, engine, compile_ms=5.0)
    assert "| engine kept on |" in text and "torch.compile's whole step: 5.00 ms" in text


def test_skip_must_leave_timed_steps() -> None:
    with pytest.raises(SystemExit):
        P.main(["--steps", "5", "--skip", "5"])


def test_fused_only_times_no_op_by_op_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # replay never runs a fused program: every step is filtered out, and that is an error
    monkeypatch.setenv("ADAPTIVE_EAGER_STEP_ASIDE", "0")
    monkeypatch.setenv("ADAPTIVE_EAGER_BACKEND", "replay")
    with pytest.raises(SystemExit, match="no step was timed"):
        P._run(True, "small", 3, 1, fused_only=True)


@pytest.mark.slow
def test_compiled_step_matches_eager_losses() -> None:
    _, eager_losses, _ = P._run(False, "small", 3, 1)
    ms, compiled_losses = P._run_compiled("small", 3, 1)
    assert ms > 0 and len(compiled_losses) == 3
    assert max(abs(a - b) for a, b in zip(eager_losses, compiled_losses)) < 1e-4
