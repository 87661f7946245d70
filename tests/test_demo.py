"""The README's first command ends in the demo: it must show a fused program running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_fused_steps_within_tolerance(cache_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_EAGER")}
    env["ADAPTIVE_EAGER_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run([sys.executable, "-m", "adaptive_eager.demo", "--steps", "14"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "losses bitwise equal to eager: True" in proc.stdout
    fused = [ln for ln in proc.stdout.splitlines() if ln.startswith("engine, fused")][0]
    n = int(fused.split("),")[1].split("of them")[0])
    assert n > 0 and fused.endswith("True"), fused
