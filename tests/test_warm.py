"""Warm starts (Note [warm start]) and ``adaptive-eager warm`` (Note [warm command]).

A short training script (MLP + AdamW, 12 steps) is the user's program: it never imports the
engine's API before its last line (it runs under ``ADAPTIVE_EAGER=1`` or the ``warm`` command).
Fused losses are compared with eager's within rtol=1e-4, atol=1e-5 (AdamW over fused steps).
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

from adaptive_eager import service

COMPILE_SERVICE = True  # conftest: compiles go through the compile service

_TRAIN = textwrap.dedent("""
    import json, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randn(64, 8)
    losses = []
    for step in range(12):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    import adaptive_eager as ae
    m = ae.metrics()
    print(json.dumps({"losses": losses, "m": {k: m[k] for k in (
        "compiles", "disk_hits", "compiled_runs", "prefetched", "fused_errors")}}))
""")


def _env(cache_dir: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir), **extra)
    return env


def _eager_losses(tmp_path: Path, script: Path) -> list[float]:
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=_env(tmp_path / "unused", ADAPTIVE_EAGER="0"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])["losses"]


def _run(script: Path, cache_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=_env(cache_dir, ADAPTIVE_EAGER="1"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _wait_idle(cache_dir: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = service.status(cache_dir)
        if st is None or not (st["in_flight"] or st["queued"] or st["compiling"]):
            return
        time.sleep(0.5)
    pytest.fail("the compile service never finished")


def test_warm_command_leaves_programs_that_cache_ls_shows(tmp_path: Path,
                                                         cache_dir: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    warm = subprocess.run([sys.executable, "-m", "adaptive_eager", "warm", "--steps", "6",
                           str(script)], capture_output=True, text=True, env=_env(cache_dir),
                          timeout=600)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert "ran 6 steps" in warm.stderr and "1 compiled" in warm.stderr, warm.stderr[-2000:]
    assert warm.stdout == ""  # the script was stopped before its own print
    ls = subprocess.run([sys.executable, "-m", "adaptive_eager", "cache", "ls"],
                        capture_output=True, text=True, env=_env(cache_dir), timeout=120)
    assert ls.returncode == 0, ls.stderr
    programs = [ln for ln in ls.stdout.splitlines() if ln.startswith("program ")]
    assert len(programs) == 1 and "backend=inductor" in programs[0], ls.stdout
    # the next real run starts fused: its step trace is loaded at engine start
    got = _run(script, cache_dir)
    assert got["m"]["compiles"] == 0 and got["m"]["disk_hits"] == 1, got["m"]
    assert got["m"]["compiled_runs"] >= 1 and got["m"]["fused_errors"] == 0, got["m"]
    torch.testing.assert_close(torch.tensor(got["losses"]),
                               torch.tensor(_eager_losses(tmp_path, script)),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_second_run_of_a_short_script_compiles_nothing_and_runs_fused(
        tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    first = _run(script, cache_dir)  # ends while its compile goes on in the service
    assert first["m"]["compiled_runs"] == 0, first["m"]
    _wait_idle(cache_dir)  # the pause between the runs
    second = _run(script, cache_dir)
    m = second["m"]
    assert m["compiles"] == 0 and m["disk_hits"] == 1 and m["prefetched"] == 1, m
    assert m["compiled_runs"] >= 1 and m["fused_errors"] == 0, m
    eager = _eager_losses(tmp_path, script)
    torch.testing.assert_close(torch.tensor(second["losses"]), torch.tensor(eager),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(eager),
                               rtol=1e-4, atol=1e-5)
