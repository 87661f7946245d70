"""Process hygiene: the engine never leaves global state changed, never breaks the process, and
nothing of it reaches what a program saves or inspects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
