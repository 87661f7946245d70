"""The ``replay`` backend: never compiles; every trace runs op by op with eager's kernels."""

from __future__ import annotations

from typing import Any


class ReplayBackend:
    name = "replay"
    compiles = False

    def options_key(self) -> str:
        return "replay"

    def compile(self, graph: Any) -> Any:
        raise NotImplementedError("the replay backend does not compile")

    def serialize(self, program: Any) -> bytes:
        raise NotImplementedError("the replay backend has no programs")

    def load(self, data: bytes, graph: Any) -> Any:
        raise NotImplementedError("the replay backend has no programs")
