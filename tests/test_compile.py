"""Hot traces become fused programs (Inductor): results within tolerance of eager, disk reuse.

Tolerances: fused programs reorder float arithmetic, so float32 results are compared with
rtol=1e-5, atol=1e-6 (losses and parameters after several optimizer steps: rtol=1e-4, atol=1e-5).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

import adaptive_eager as ae
from adaptive_eager.cache.memory import TRIE
from helpers import train_steps

COMPILE_SERVICE = True  # conftest: compiles go through the compile service

FAST = {"hot_after": 2, "compile_async": False}


def gelu_chain(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3)))


def _loop(x: torch.Tensor, steps: int, **options: Any) -> list[torch.Tensor]:
    out = []
    with ae.adaptive_eager(**{**FAST, **options}):
        for _ in range(steps):
            out.append(gelu_chain(x).sum(0))
            out[-1].tolist()  # a sync point ends the trace each step
    return out


def test_hot_trace_compiles_and_matches_eager(cache_dir: Path) -> None:
    x = torch.randn(64, 33)
    got = _loop(x, 6, cache_dir=cache_dir)
    m = ae.metrics()
    assert m["compiles"] >= 1 and m["compiled_runs"] >= 2, m
    ref = gelu_chain(x).sum(0)
    for y in got:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    states = {e.state for e in TRIE.entry_list if e.n_ops > 1}
    assert states & {"measuring", "fused", "replay"}, states


def test_replay_backend_never_compiles(cache_dir: Path) -> None:
    _loop(torch.randn(8, 8), 5, cache_dir=cache_dir, backend="replay")
    assert ae.metrics()["compiles"] == 0 and ae.metrics()["compiled_runs"] == 0


def _train(steps: int, **options: Any) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    x, y = torch.randn(16, 12), torch.randn(16, 3)
    losses = train_steps(model, opt, x, y, steps, options or None)
    return losses, [p.detach().clone() for p in model.parameters()]


def test_training_loop_compiles_and_matches_eager_within_tolerance(cache_dir: Path) -> None:
    ref_losses, ref_params = _train(8)
    losses, params = _train(8, cache_dir=cache_dir, **FAST)
    m = ae.metrics()
    assert m["compiles"] >= 1 and m["compiled_runs"] >= 1, m
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4,
                               atol=1e-5)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)


def test_background_compile_keeps_running_op_by_op(cache_dir: Path) -> None:
    x = torch.randn(32, 16)
    ref = gelu_chain(x).sum(0)
    with ae.adaptive_eager(hot_after=2, compile_async=True, cache_dir=cache_dir):
        for _ in range(4):
            torch.testing.assert_close(gelu_chain(x).sum(0), ref, rtol=1e-5, atol=1e-6)
        ae.wait_for_compiles(timeout=300)
        for _ in range(4):
            torch.testing.assert_close(gelu_chain(x).sum(0), ref, rtol=1e-5, atol=1e-6)
    m = ae.metrics()
    assert m["compiles"] >= 1 and m["compiled_runs"] >= 1 and m["compiles_pending"] == 0, m


_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import adaptive_eager as ae
    torch.manual_seed(0)
    x = torch.randn(512, 512)  # big enough that fusing the chain wins by far (kept fused)
    outs = []
    with ae.adaptive_eager(hot_after=2, compile_async=False, cache_dir=sys.argv[1]):
        for _ in range(7):
            h = x * 0.5 * (1 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3)))
            outs.append(h.sum(1)[:8].tolist())
    m = ae.metrics()
    print(json.dumps({"metrics": {k: m[k] for k in ("compiles", "disk_hits", "disk_errors",
                      "compiled_runs", "fused_errors")}, "outs": outs}))
""")


def _run_script(tmp_path: Path, cache_dir: Path, script: str = _SCRIPT) -> dict:
    path = tmp_path / "prog.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path), str(cache_dir)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_starts_hot_with_zero_compiles(tmp_path: Path, cache_dir: Path) -> None:
    first = _run_script(tmp_path, cache_dir)
    second = _run_script(tmp_path, cache_dir)
    assert first["metrics"]["compiles"] >= 1, first
    assert second["metrics"]["compiles"] == 0 and second["metrics"]["disk_hits"] >= 1, second
    assert second["metrics"]["fused_errors"] == 0
    _close(second["outs"][-1], first["outs"][-1])


def test_processes_compiling_the_same_trace_at_once(tmp_path: Path, cache_dir: Path) -> None:
    path = tmp_path / "prog.py"
    path.write_text(_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(path), str(cache_dir)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        _close(r["outs"][-1], results[0]["outs"][-1])
    after = _run_script(tmp_path, cache_dir)
    assert after["metrics"]["compiles"] == 0
    _close(after["outs"][-1], results[0]["outs"][-1])


def _close(a: list, b: list) -> None:
    """Fused and op-by-op runs may differ in the last bits (each process decides for itself)."""
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
