"""Entry point of the compile helper process: ``python -m adaptive_eager.compile_helper``.

Kept apart from compile_process.py so that running it does not execute a module the package has
already imported (see Note [compile process] there).
"""

from adaptive_eager.compile_process import serve

if __name__ == "__main__":
    serve()
