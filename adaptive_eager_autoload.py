"""``ADAPTIVE_EAGER=1 python train.py``: torch's device-extension autoload calls ``autoload()``.

This module is deliberately top-level and tiny: torch imports it inside ``import torch`` for every
program on a machine where adaptive_eager is installed, so with the flag unset it must cost nothing
(one environment lookup; the adaptive_eager package is not imported).

A bad setting stops the program here with one line naming the variable and what it accepts, and
exit status 2: torch wraps an Exception from this entry point in its generic "Failed to load the
backend extension" error, but lets SystemExit through.
"""

import os
import sys

# What TORCHINDUCTOR_CACHE_DIR was when torch was imported, before ``import torch._dynamo``
# writes torch's shared default into it (Note [Inductor kernel folder]).
INDUCTOR_DIR_AT_IMPORT = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


# Note [autoload during the package's import]
# ``import adaptive_eager`` before torch (also the CLI, ``python -m adaptive_eager``) imports torch
# from inside the package's own import, and torch's autoload then calls ``autoload()`` while the
# package is partly initialized: ``adaptive_eager.api`` has no ``enable`` yet. Then switching on
# is left to the end of the package's ``__init__`` (``run_deferred()``), which is the first moment
# the engine can exist; the program's own code has not run yet, so it sees the same engine.
deferred = False


def _package_initializing() -> bool:
    pkg = sys.modules.get("adaptive_eager")
    spec = getattr(pkg, "__spec__", None)
    return pkg is not None and bool(getattr(spec, "_initializing", False))


def autoload() -> None:
    global deferred
    if os.environ.get("ADAPTIVE_EAGER", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    if _package_initializing():
        deferred = True
        return
    _enable()


def run_deferred() -> None:
    """Called at the end of the package's import: the switch-on ``autoload()`` left for it."""
    global deferred
    if deferred:
        deferred = False
        _enable()


def _enable() -> None:
    try:
        from adaptive_eager.launch import enable_from_env

        enable_from_env()
    except ValueError as err:  # ConfigError, UnknownBackend: the user's setting, not a bug
        text = str(err)
        if not text.startswith("adaptive_eager"):
            text = f"adaptive_eager: {text}"
        print(text, file=sys.stderr, flush=True)
        raise SystemExit(2) from None
