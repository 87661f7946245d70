"""What every part of the compile manager reads from the manager that owns it."""

from __future__ import annotations

from typing import Any


class Part:
    """A collaborator of the compile manager: its options, backend and disk cache are the
    manager's (``owner``), read at each use, so a part never holds a stale copy."""

    owner: Any

    @property
    def options(self) -> Any:
        return self.owner.options

    @property
    def backend(self) -> Any:
        return self.owner.backend

    @property
    def disk(self) -> Any:
        return self.owner.disk
