"""What the numbers were measured on: CPU, cores, memory, library versions, git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], check=False,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "adaptive_eager")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}{' (adaptive_eager/ has uncommitted changes)' if dirty else ''}" or "unknown"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": _usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _mem_total_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "adaptive_eager": _version("adaptive_eager"),
        "git_commit": _git_commit(),
        "device": device,
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for the markdown header."""
    text = (f"{info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable, torch threads "
            f"{info['torch_threads']}), {info['memory_gib']} GiB RAM; {info['os']}; Python "
            f"{info['python']}; torch {info['torch']}; transformers {info['transformers']}; "
            f"adaptive_eager {info['adaptive_eager']} at {info['git_commit']}")
    if "gpu" in info:
        text += f"; GPU {info['gpu']} (CUDA {info['cuda']})"
    return text
