"""Compile helpers run at the lowest CPU priority (Note [compile priority] in compile_process.py):
the program's own helper and the compile service's, from before they import torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import service
from adaptive_eager.compile_process import HELPER

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")


def _policy(pid: int) -> int | None:
    try:
        return os.sched_getscheduler(pid)
    except (ProcessLookupError, OSError):
        return None


def _wait_policy(pid: int, timeout: float = 60.0) -> int | None:
    """The process's scheduling class once its bootstrap has run (bounded wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _policy(pid) == os.SCHED_IDLE:
            return os.SCHED_IDLE
        time.sleep(0.05)
    return _policy(pid)


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_the_programs_own_helper_runs_at_idle_priority() -> None:
    HELPER.close()
    proc = HELPER._ensure()
    try:
        assert _wait_policy(proc.pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the program keeps its own
    finally:
        HELPER.close()


def test_the_service_helpers_run_at_idle_priority_and_compile(cache_dir: Path) -> None:
    x = torch.randn(64, 33)
    ref = (x * 1.5).tanh() + x.sin()
    with ae.adaptive_eager(hot_after=2, compile_async=False, step_aside=False,
                           cache_dir=cache_dir, compile_service=True):
        for _ in range(5):
            torch.testing.assert_close((x * 1.5).tanh() + x.sin(), ref, rtol=1e-5, atol=1e-6)
    m = ae.metrics()
    assert m["service_compiles"] >= 1 and m["compiled_runs"] >= 1, m
    st = service.status(cache_dir)
    assert st is not None and st["helpers"] >= 1, st
    broker = int(st["pid"])
    helpers = _children(broker)
    assert helpers, "the service has no helper process"
    assert _policy(broker) == os.SCHED_OTHER  # the broker only stores and answers
    assert all(_wait_policy(h) == os.SCHED_IDLE for h in helpers)


_FALLBACK = """
import os, sys
sys.path.insert(0, sys.argv[1])
from adaptive_eager.compile_helper import take_lowest_priority
def refuse(*args):
    raise OSError("no SCHED_IDLE here")
os.sched_setscheduler = refuse
first, second = take_lowest_priority(), take_lowest_priority()
print(first, second, os.nice(0))
"""


def test_without_sched_idle_the_helper_takes_nice_19() -> None:
    root = str(Path(ae.__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", _FALLBACK, root], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["nice", "19", "nice", "19", "19"], out  # and taking it twice stays at 19
