"""Compiler backends for hot traces, and the registry that finds them by name.

A backend turns a ``TraceGraph`` (graph.py) into a callable program, and serializes programs so
the disk cache can hand them to later processes. Other packages add backends through the
``adaptive_eager.backends`` entry-point group (name -> a zero-argument factory returning a Backend),
so a compiler for other hardware (e.g. AWS Neuron) plugs in without changing this package.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Protocol

ENTRY_POINT_GROUP = "adaptive_eager.backends"


class Program(Protocol):
    def __call__(self, *inputs: Any) -> Any: ...


class Backend(Protocol):
    """What the engine needs from a compiler."""

    name: str
    compiles: bool  # False: traces always replay op by op (the baseline)
    # Optional ``separate_process = True``: the backend object pickles and its compile runs in
    # a helper process (compile_process.py); absent or False: compiled in a thread here.

    def options_key(self) -> str:
        """Everything about this backend's configuration that changes generated code."""
        ...

    def compile(self, graph: Any) -> Program:
        """Compile a trace graph; raise to refuse (the trace then stays op by op)."""
        ...

    def serialize(self, program: Program) -> bytes:
        ...

    def load(self, data: bytes, graph: Any) -> Program:
        ...


class UnknownBackend(ValueError):
    pass


def _builtin() -> dict[str, Callable[[], Backend]]:
    from adaptive_eager.backends.inductor import InductorBackend
    from adaptive_eager.backends.replay import ReplayBackend

    return {"inductor": InductorBackend, "replay": ReplayBackend}


_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend called ``name``: built in, or from the entry-point group."""
    backend = _instances.get(name)
    if backend is not None:
        return backend
    factories = _builtin()
    factory: Callable[[], Any] | None = factories.get(name)
    if factory is None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == name:
                factory = ep.load()
                break
    if factory is None:
        known = sorted(set(factories) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
        raise UnknownBackend(f"adaptive_eager: unknown backend {name!r}; available: "
                             f"{', '.join(known)} (set ADAPTIVE_EAGER_BACKEND or backend=...)")
    backend = _instances[name] = factory()
    return backend
