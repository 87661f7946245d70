"""Note [import when a program lands] (compile/jobs.py): sending a hot trace to the compile service
imports nothing of Inductor in the program; the first program that lands is imported and loaded
in the program's thread, and used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import json, sys, time
import torch
import adaptive_eager as ae

def step(w, x):
    return ((x @ w).sin() * 2 + 1).relu().sum()

w, x = torch.randn(16, 16), torch.randn(4, 16)
ref = [float(step(w, x)) for _ in range(3)]
out = {}
with ae.adaptive_eager(hot_after=2, step_aside=False):
    got = [float(step(w, x)) for _ in range(6)]  # hot at the 2nd run: sent to the service
    m = ae.metrics()
    out["early"] = {"inductor": "torch._inductor.compile_fx" in sys.modules,
                    "pending": m["compiles_pending"], "compiled_runs": m["compiled_runs"],
                    "service_pending": m["service_pending"]}
    ae.wait_for_compiles(timeout=600)
    for _ in range(4):
        got.append(float(step(w, x)))
    m = ae.metrics()
out["late"] = {"inductor": "torch._inductor.compile_fx" in sys.modules,
               "compiled_runs": m["compiled_runs"], "compiles": m["compiles"],
               "fused_errors": m["fused_errors"]}
out["close"] = all(abs(a - ref[0]) <= 1e-4 * max(1.0, abs(ref[0])) for a in got)
print(json.dumps(out))
"""


def test_the_compiler_is_imported_only_when_a_program_lands(tmp_path: Path,
                                                            cache_dir: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, ADAPTIVE_EAGER_CACHE_DIR=str(cache_dir))
    env.pop("ADAPTIVE_EAGER", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    early, late = out["early"], out["late"]
    # the compile was sent to the service (a cold compile there takes seconds): while no
    # program has come back, nothing of Inductor is imported in the program
    assert early["pending"] + early["service_pending"] >= 1 or early["compiled_runs"] >= 1, out
    if early["compiled_runs"] == 0:
        assert not early["inductor"], out
    # once it lands, the next run imports, loads and uses it
    assert late["inductor"] and late["compiled_runs"] >= 1 and late["fused_errors"] == 0, out
    assert out["close"], out
