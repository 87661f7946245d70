"""Ways in for unmodified programs: the ADAPTIVE_EAGER flag and the script launchers."""

from __future__ import annotations

import atexit
import logging
import runpy
import sys
from pathlib import Path

from adaptive_eager import api, config

log = logging.getLogger("adaptive_eager")
_started = False


def enable_from_env() -> None:
    """Switch the engine on for the main thread until the program exits (idempotent)."""
    global _started
    if _started:
        return
    if not config.enabled_by_env():
        return
    _started = True
    api.enable()
    atexit.register(_at_exit)


def _at_exit() -> None:
    try:
        api.disable()
    except Exception as err:  # the program is ending: report, never mask its own exit status
        log.warning("adaptive_eager: final flush failed: %s", err)


def run_script(path: str, args: list[str]) -> None:
    """Run ``path`` as ``__main__`` with the engine on, as ``python path args...`` would."""
    sys.argv = [path, *args]
    sys.path.insert(0, str(Path(path).resolve().parent))
    api.enable()
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        api.disable()
