"""Entry point of the compile helper process (Note [compile process] in compile_process.py).

Started as ``python -I -c <bootstrap>`` (compile_process.helper_command), which calls ``main``;
``python -m adaptive_eager.compile_helper`` still works by hand. Kept apart from compile_process.py
so that running it does not execute a module the package has already imported.
"""

import os
import sys


def take_lowest_priority() -> str:
    """Put this process (and what it starts from now on) at the lowest CPU priority (Note
    [compile priority] in compile_process.py); returns what it took, for the log."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19 - os.nice(0))
        return "nice 19"
    except (AttributeError, OSError):
        return "unchanged"


def main() -> None:
    # argv: [-c, package folder, module, function, init, parent pid] from
    # compile_process.helper_command
    argv = sys.argv
    parent = int(argv[5]) if len(argv) > 5 and argv[5].isdigit() else None
    take_lowest_priority()  # idempotent; the bootstrap took it already
    if parent is not None and os.getppid() != parent:
        os._exit(0)  # orphaned while starting: nobody to compile for
    from adaptive_eager.compile_process import serve

    serve(parent)
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os._exit(0)  # no interpreter teardown: nothing left to say, nothing to print on a dead pipe


if __name__ == "__main__":
    main()
