"""The engine's messages reach stderr, whether or not the program configured logging.

Python prints a record from a logger with no handler anywhere only at WARNING and above (its
"last resort" handler), so ``ADAPTIVE_EAGER_LOG_LEVEL=INFO`` used to print nothing for an
unmodified script. The ``adaptive_eager`` logger gets a handler of its own (as ``TORCH_LOGS``
does for torch's loggers) that writes to the current ``sys.stderr``, but only while the program
has configured no handler on the root logger: once it has (``logging.basicConfig``), records
propagate there and are printed once, in the program's own format.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("adaptive_eager")


class _StderrUnlessConfigured(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the program configured logging: the root handler prints it
        try:
            stream = sys.stderr
            if stream is not None:
                stream.write(self.format(record) + "\n")
                stream.flush()
        except Exception:  # a closed stream at exit: never fail the program over a message
            self.handleError(record)


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("adaptive_eager") else "adaptive_eager: " + text


_HANDLER = _StderrUnlessConfigured()
_HANDLER.setFormatter(_Prefixed("%(message)s"))


def configure(level: int | str) -> None:
    """Set the engine logger's level and make sure its records reach stderr (idempotent)."""
    LOGGER.setLevel(level)
    if _HANDLER not in LOGGER.handlers:
        LOGGER.addHandler(_HANDLER)
