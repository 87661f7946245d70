"""The engine's messages reach stderr with no logging set up by the program, and only once
when it has set logging up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent("""
    import logging, sys
    if sys.argv[1] == "configured":
        logging.basicConfig(format="ROOT %(name)s %(message)s")
    import torch
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    for i in range(4):
        y = (x * 2 + 1).sin() @ x.T
        print(round(y.sum().item(), 3))
""")


@pytest.mark.parametrize("setup", ["plain", "configured"])
def test_info_messages_reach_stderr_once(tmp_path: Path, cache_dir: Path, setup: str) -> None:
    script = tmp_path / "prog.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_EAGER")}
    env.update(ADAPTIVE_EAGER="1", ADAPTIVE_EAGER_LOG_LEVEL="INFO", ADAPTIVE_EAGER_BACKEND="replay",
               ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir), ADAPTIVE_EAGER_BUDGET="0")
    proc = subprocess.run([sys.executable, str(script), setup], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "trace miss" in ln]
    assert lines, proc.stderr[-3000:]  # INFO lines were printed, no basicConfig needed
    if setup == "plain":
        assert all(ln.startswith("adaptive_eager: ") for ln in lines), lines
    else:  # the program's own format, and each message once
        assert all(ln.startswith("ROOT adaptive_eager ") for ln in lines), lines
    eager = subprocess.run([sys.executable, str(script), setup], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path,
                           env={k: v for k, v in env.items() if k != "ADAPTIVE_EAGER"})
    assert proc.stdout == eager.stdout
