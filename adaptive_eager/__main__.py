"""``python -m adaptive_eager SCRIPT [ARGS...]`` runs a script under the engine."""

from adaptive_eager.cli import main

if __name__ == "__main__":
    raise SystemExit(main(default_command="run"))
