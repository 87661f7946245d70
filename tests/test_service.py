"""The compile service (Note [compile service]): compiles outlive the program that asked for them,
one compile per key however many processes ask, and a service that cannot be used falls back.

Fused results are compared with eager within rtol=1e-5, atol=1e-5 (fused programs reorder float
arithmetic). Every test stops the services it started (conftest ``_stop_compile_services``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import service

COMPILE_SERVICE = True  # conftest: compiles go through the compile service

_CHAIN = textwrap.dedent("""
    import json, sys, torch
    import adaptive_eager as ae
    torch.manual_seed(0)
    x = torch.randn(int(sys.argv[2]), 64)
    outs = []
    options = json.loads(sys.argv[3])
    with ae.adaptive_eager(cache_dir=sys.argv[1], hot_after=2, **options):
        for _ in range(int(sys.argv[4])):
            h = x * 0.5 * (1 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3)))
            outs.append(h.sum(0)[:8].tolist())
    m = ae.metrics()
    print(json.dumps({"m": {k: m[k] for k in ("compiles", "disk_hits", "compiled_runs",
                      "service_compiles", "service_shared", "service_errors", "fused_errors",
                      "compile_wait_seconds", "program_waits")}, "outs": outs}))
""")


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "chain.py"
    path.write_text(_CHAIN)
    return path


def _cmd(script: Path, cache_dir: Path, rows: int, options: dict, steps: int) -> list[str]:
    return [sys.executable, str(script), str(cache_dir), str(rows), json.dumps(options),
            str(steps)]


def _eager(rows: int) -> list[float]:
    torch.manual_seed(0)
    x = torch.randn(rows, 64)
    return (x * 0.5 * (1 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3)))).sum(0)[:8].tolist()


def _close(a: list, b: list) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def _wait_idle(cache_dir: Path, timeout: float = 600.0) -> dict:
    """Until the service has nothing queued or compiling (hang detection only)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = service.status(cache_dir)
        assert st is not None, "the compile service went away"
        if not st["in_flight"] and not st["queued"] and not st["compiling"]:
            return st
        time.sleep(0.5)
    pytest.fail("the compile service never finished")


def test_compile_requested_by_an_exited_process_is_on_disk_for_the_next(
        tmp_path: Path, cache_dir: Path) -> None:
    script = _script(tmp_path)
    # 3 runs: the trace gets hot and goes to the service; the program exits long before it is
    # compiled (a compile takes seconds here), and says so in one line
    first = subprocess.run(_cmd(script, cache_dir, 256, {}, 3), capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    notes = [ln for ln in first.stderr.splitlines() if "in the compile service" in ln]
    assert len(notes) == 1 and "1 compile continues" in notes[0], first.stderr[-2000:]
    assert str(cache_dir) in notes[0]
    assert json.loads(first.stdout.splitlines()[-1])["m"]["compiled_runs"] == 0
    st = _wait_idle(cache_dir)
    assert st.get("compiles") == 1, st
    second = subprocess.run(_cmd(script, cache_dir, 256, {}, 4), capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    got = json.loads(second.stdout.splitlines()[-1])
    m = got["m"]
    # loaded at the trace's first run here, and used by that very run onwards (fused, fused,
    # then the paired op-by-op run of its measurement: Note [paired timing])
    assert m["compiles"] == 0 and m["disk_hits"] == 1 and m["fused_errors"] == 0, m
    assert m["compiled_runs"] >= 2, m
    for out in got["outs"]:
        _close(out, _eager(256))


@pytest.mark.slow
def test_two_processes_asking_for_one_key_compile_once(tmp_path: Path, cache_dir: Path) -> None:
    script = _script(tmp_path)
    service.connect(cache_dir).close()  # one service for both (else they race to start it)
    procs = [subprocess.Popen(_cmd(script, cache_dir, 128, {"compile_async": False}, 4),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.splitlines()[-1]))
    ms = [r["m"] for r in results]
    assert sum(m["service_compiles"] for m in ms) == 1, ms  # one compile ...
    assert sum(m["service_shared"] + m["disk_hits"] for m in ms) == 1, ms  # ... one waited
    assert all(m["compiled_runs"] >= 1 and m["service_errors"] == 0 for m in ms), ms
    log = (cache_dir / "service" / "log").read_text()
    assert log.count(": ok after") == 1 and "2 waiting" in log, log  # one compile, two waiting
    for r in results:
        for out in r["outs"]:
            _close(out, _eager(128))


def test_unusable_service_falls_back_to_a_helper_of_the_process(cache_dir: Path) -> None:
    folder = service.service_dir(cache_dir)
    (folder / service.sock_name()).write_text("not a socket")  # nobody can listen there
    x = torch.randn(64, 33)
    ref = (x * 0.5 * (1 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3)))).sum(0)
    with ae.adaptive_eager(hot_after=2, compile_async=False, cache_dir=cache_dir):
        for _ in range(4):
            y = (x * 0.5 * (1 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3)))).sum(0)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    m = ae.metrics()
    assert m["service_errors"] == 1 and m["compiles"] == 1 and m["compiled_runs"] >= 1, m
    assert m["service_compiles"] == 0


@pytest.mark.slow
def test_service_that_dies_mid_compile_falls_back(tmp_path: Path, cache_dir: Path) -> None:
    x = torch.randn(96, 40)
    ref = (x * 1.5).tanh() + x
    with ae.adaptive_eager(hot_after=2, compile_async=True, step_aside=False,
                           cache_dir=cache_dir):
        for _ in range(3):
            torch.testing.assert_close((x * 1.5).tanh() + x, ref, rtol=1e-5, atol=1e-6)
        st = service.status(cache_dir)
        assert st is not None and st["in_flight"], st
        os.kill(st["pid"], 9)  # killed while its helper compiles (its helpers follow it)
        ae.wait_for_compiles(timeout=600)
        for _ in range(3):
            torch.testing.assert_close((x * 1.5).tanh() + x, ref, rtol=1e-5, atol=1e-6)
    m = ae.metrics()
    assert m["service_errors"] == 1 and m["compiled_runs"] >= 1, m


def test_idle_service_exits_by_itself(cache_dir: Path) -> None:
    service.connect(cache_dir, idle_s=1).close()
    st = service.status(cache_dir)
    assert st is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and service.status(cache_dir) is not None:
        time.sleep(0.2)
    assert service.status(cache_dir) is None
    assert not (cache_dir / "service" / service.sock_name()).exists()


def test_service_refuses_a_folder_others_can_write(cache_dir: Path) -> None:
    service.service_dir(cache_dir)
    os.chmod(cache_dir, 0o777)
    try:
        with pytest.raises(service.ServiceUnavailable, match="writable by its group or by others"):
            service.connect(cache_dir)
    finally:
        os.chmod(cache_dir, 0o700)
    assert not (cache_dir / "service" / service.sock_name()).exists()
