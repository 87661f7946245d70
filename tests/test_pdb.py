"""Debugging: a script under pdb prints a lazy tensor at a breakpoint exactly as eager does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_PDB_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import adaptive_eager as ae

    def main(use_engine):
        torch.manual_seed(0)
        w = torch.randn(3, 3, requires_grad=True)
        x = torch.randn(2, 3)
        ctx = ae.adaptive_eager(backend="replay") if use_engine else None
        if ctx:
            ctx.__enter__()
        for _ in range(3):  # warm: the last iteration is fully deferred
            y = (x @ w).tanh() * 2
            x.add_(0.5)
        breakpoint()
        if ctx:
            ctx.__exit__(None, None, None)

    main(sys.argv[1] == "engine")
""")


def _run_under_pdb(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "prog.py"
    script.write_text(_PDB_SCRIPT)
    commands = "p y\np x\np y.shape\np (y * 0 + 1).sum().item()\nc\n"
    proc = subprocess.run([sys.executable, str(script), mode], input=commands, text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONBREAKPOINT": "pdb.set_trace"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.replace(str(script), "prog.py")


def test_pdb_prints_lazy_tensor_like_eager(tmp_path: Path) -> None:
    eager_out = _run_under_pdb(tmp_path, "eager")
    engine_out = _run_under_pdb(tmp_path, "engine")
    assert "grad_fn=<MulBackward0>" in eager_out
    assert engine_out == eager_out
