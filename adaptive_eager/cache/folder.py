"""The cache folder's layout: the names of what it holds, small file-system helpers that never
follow links, and its warnings (once per kind)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

log = logging.getLogger("adaptive_eager")

DB_NAME = "cache.sqlite"
SECRET_NAME = "secret"
INDUCTOR_DIR = "inductor"
RUNS_DIR = "runs"
_warned: set[str] = set()


def warn_once(kind: str, msg: str, *args: Any) -> None:
    """A warning about the folder, logged once per kind in a process."""
    if kind not in _warned:
        _warned.add(kind)
        log.warning(msg, *args)


def writable(path: Path) -> bool:
    """Whether this process may write ``path`` (effective ids: what opening it would see)."""
    if os.access in os.supports_effective_ids:
        return os.access(path, os.W_OK, effective_ids=True)
    return os.access(path, os.W_OK)


def listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def plain_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode)


def rmdir(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
