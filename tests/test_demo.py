"""The README's first command ends in the demo: it must pass in a new user's cache folder and in
every later run there, whatever the engine decided (fused, or op by op because fusion did not
pay), and fail only on a real fault: results that differ from eager's, or a counted engine fault.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import compiler, config, demo

SMALL = ["--elements", "4096"]


def _run_demo(cache_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m adaptive_eager.demo`` as a user runs it: no engine variable but the folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_EAGER")}
    env["ADAPTIVE_EAGER_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "adaptive_eager.demo", *args], env=env,
                          capture_output=True, text=True, timeout=900)


def _fused_steps(out: str) -> int:
    found = re.search(r"engine, fused\s+: (\d+) of (\d+) steps ran a fused program", out)
    assert found, out
    return int(found.group(1))


@pytest.mark.slow
def test_demo_passes_cold_then_warm_three_times_in_one_cache_folder(cache_dir: Path) -> None:
    # The second and third runs in a folder used to fail ("0 of them ran a fused program"): the
    # first run's decision, kept on disk, was to run op by op, and the demo took that for a fault.
    outputs = []
    for i in range(3):
        proc = _run_demo(cache_dir)
        outputs.append(proc.stdout)
        assert proc.returncode == 0, f"run {i + 1}:\n{proc.stdout}{proc.stderr[-3000:]}"
        assert "final state bitwise equal to eager's: True" in proc.stdout, proc.stdout
        assert re.search(r"final state within \S+ of eager's: True", proc.stdout), proc.stdout
        assert "FAULT" not in proc.stdout and "decision: " in proc.stdout
    cold = outputs[0]
    assert "(1 compiled here" in cold, cold
    assert _fused_steps(cold) > 0, cold  # measured fused at least, whatever it decided
    for warm in outputs[1:]:  # a program from the disk cache, or the stored op-by-op decision
        assert "(0 compiled here" in warm, warm
        assert "loaded from the disk cache" in warm or "earlier run" in warm, warm


def _store_op_by_op_decision(steps: int, elements: int) -> str:
    """Record in the disk cache what a process that measured the demo's fused program slower
    than op by op stores (the compiler's own decision and statistics path); its trace digest."""
    demo.run(steps, elements, {"backend": "replay", "step_aside": False})
    from adaptive_eager.cache.memory import TRIE

    entry = max(TRIE.entry_list, key=lambda e: e.runs)
    assert entry.runs > 1 and entry.n_ops == 13, entry.summary()
    mgr = compiler.manager_for(config.resolve({"step_aside": False}))
    assert mgr.disk is not None
    # far slower fused: no later process finds it worth measuring again (RECHECK_RATIO)
    entry.state = "measuring"
    entry.fused_s, entry.fused_n = [10.0] * 3, [0] * 3
    entry.paired_s, entry.paired_n = [5.0] * 3, [0] * 3
    mgr.decisions._decide(entry)
    assert entry.state == "replay"
    stats = mgr.disk.get_stats(entry.digest)
    assert stats is not None and stats["decision"].startswith("op-by-op"), stats
    ae.clear_caches()
    return entry.digest


def test_demo_warm_op_by_op_decision_is_no_fault(capsys: pytest.CaptureFixture[str]) -> None:
    digest = _store_op_by_op_decision(3, 4096)
    capsys.readouterr()
    for _ in range(2):  # a second and a third run in the folder
        code = demo.main(["--steps", "3", *SMALL])
        out = capsys.readouterr().out
        assert code == 0, out
        assert _fused_steps(out) == 0, out
        assert f"trace {digest[:12]}" in out and "(earlier run)" in out, out
        assert "decision: op-by-op: median fused/op-by-op 2.00" in out, out
        assert "decided in an earlier run" in out and "not a fault" in out, out
        assert "final state within 1e-05 of eager's: True" in out, out
        assert "no step ran fused, so bitwise equal" in out, out
        assert "FAULT" not in out, out


def test_demo_fails_when_engine_results_differ(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    step = demo.step

    def off_under_engine(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return step(x, gain) + (1e-3 if ae.is_enabled() else 0.0)

    monkeypatch.setattr(demo, "step", off_under_engine)
    assert demo.main(["--steps", "2", *SMALL]) == 1
    out = capsys.readouterr().out
    assert "FAULT: op-by-op results differ from eager's; fused results outside" in out, out


def test_demo_fails_on_a_counted_engine_fault(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # results equal eager's, but an op ran outside the trace (a value read under the engine is
    # counted as a fallback): in this workload, where every op defers, that is a fault
    step = demo.step

    def reads_a_value(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        out = step(x, gain)
        float(out[0])
        return out

    monkeypatch.setattr(demo, "step", reads_a_value)
    assert demo.main(["--steps", "2", *SMALL]) == 1
    out = capsys.readouterr().out
    assert "bitwise equal to eager's: True" in out, out
    assert re.search(r"FAULT: fallbacks=\d+", out), out


def test_demo_runs_its_eager_reference_without_an_engine_switched_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    # under ADAPTIVE_EAGER=1 the engine is on before the demo starts: the reference it compares
    # against would have run under the engine
    ae.enable(backend="replay")
    assert demo.main(["--steps", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "the engine was on (ADAPTIVE_EAGER=1): switched off" in out, out
    assert not ae.is_enabled()
