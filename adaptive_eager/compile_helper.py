"""Entry point of the compile helper process (Note [compile process] in compile_process.py).

Started as ``python -I -c <bootstrap>`` (compile_process.helper_command), which calls ``main``;
``python -m adaptive_eager.compile_helper`` still works by hand. Kept apart from compile_process.py
so that running it does not execute a module the package has already imported.
"""

import os
import sys


def main() -> None:
    # argv: [-c, package folder, module, function, init, parent pid, nice] from
    # compile_process.helper_command
    argv = sys.argv
    parent = int(argv[5]) if len(argv) > 5 and argv[5].isdigit() else None
    nice = int(argv[6]) if len(argv) > 6 and argv[6].lstrip("-").isdigit() else None
    if parent is not None and os.getppid() != parent:
        os._exit(0)  # orphaned while starting: nobody to compile for
    from adaptive_eager.compile_process import serve

    serve(parent, nice)
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os._exit(0)  # no interpreter teardown: nothing left to say, nothing to print on a dead pipe


if __name__ == "__main__":
    main()
