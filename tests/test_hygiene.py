"""Process hygiene: the engine never leaves global state changed, never breaks the process, and
nothing of it reaches what a program saves or inspects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same
from helpers import assert_state_as_eager

import adaptive_eager as ae

_ROOT = Path(__file__).resolve().parents[1]


def _env(cache_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTIVE_EAGER")}
    env.update({"ADAPTIVE_EAGER_CACHE_DIR": str(cache_dir), "ADAPTIVE_EAGER_BACKEND": "replay"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


# ---- the flag with the package imported before torch ---------------------------------------

_IMPORT_FIRST = """
import adaptive_eager, torch
x = torch.arange(6.0)
print(adaptive_eager.is_enabled(), ((x * 2 + 1).sin()).tolist() == (torch.arange(6.0) * 2 + 1).sin().tolist())
"""


@pytest.mark.parametrize("args", [["-c", _IMPORT_FIRST], ["-m", "adaptive_eager", "cache", "ls"],
                                  ["-m", "adaptive_eager.cli", "report", "--last"]])
def test_flag_with_the_package_imported_before_torch(args: list[str], cache_dir: Path,
                                                     tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, *args], env=_env(cache_dir, ADAPTIVE_EAGER="1"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if args[0] == "-c":
        assert proc.stdout.split() == ["True", "True"]  # the engine is on, results are eager's


def test_bad_setting_with_the_package_imported_first_names_it(cache_dir: Path,
                                                              tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import adaptive_eager"],
                          env=_env(cache_dir, ADAPTIVE_EAGER="1", ADAPTIVE_EAGER_HOT_AFTER="soon"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "ADAPTIVE_EAGER_HOT_AFTER" in proc.stderr, proc.stderr


# ---- the mode stack changed inside torch.inference_mode() ------------------------------------

def _presence() -> Any:
    from adaptive_eager import api

    return api._state.presence


def _aside_and_back_inside_inference_mode(model: torch.nn.Module, x: torch.Tensor) -> list:
    """Module calls under inference mode; under the engine it steps aside inside one block and
    comes back (a probe, ``probe_every=2``) inside the next, as in generate() while a compile
    runs. Between the blocks and after them plain torch calls must work, in and out of it."""
    outs = []
    presence = _presence()
    with torch.inference_mode():
        outs.append(model(x))
        if presence is not None:
            presence.request_aside("asked for by the test")
        outs.append(model(x))  # the step-aside hook acts at this call's end
        if presence is not None:
            assert presence.aside and not presence.active
    outs.append(torch.tensor(1) * 2)
    with torch.inference_mode():
        outs.append(torch.tensor([3.0]) + 1)
        outs.append(model(x))
        outs.append(model(x))  # the second round aside: the probe pushes the modes here
        if presence is not None:
            assert presence.active
    before = ae.metrics()["ops_intercepted"]
    outs.append(model(x) * 2)  # out of the block the engine sees the ops again
    if presence is not None:
        assert ae.metrics()["ops_intercepted"] > before
    with torch.inference_mode():
        outs.append(torch.tensor(1) + model(x))
    return [o.detach().clone() for o in outs]


def test_mode_stack_changes_inside_inference_mode(cache_dir: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 4)
    opts = dict(backend="replay", cache_dir=str(cache_dir), probe_every=2)
    want = _aside_and_back_inside_inference_mode(model, x)
    with ae.adaptive_eager(**opts):
        got = _aside_and_back_inside_inference_mode(model, x)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
    with torch.inference_mode():
        torch.tensor(1)  # the process is not broken
    assert ae.metrics()["key_repairs"] >= 2
    assert_state_as_eager(lambda: _aside_and_back_inside_inference_mode(model, x), **opts)
