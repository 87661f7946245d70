"""Public entry points: the context manager, enable/disable, sync and metrics."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from adaptive_eager import config, logs, workers
from adaptive_eager.aside import Presence
from adaptive_eager.calibrate import calibrate
from adaptive_eager.cache.disk import ensure_private_dir, resolve_cache_dir
from adaptive_eager.cache.memory import META_CACHE, TRIE
from adaptive_eager.compiler import _managers, reset_managers
from adaptive_eager.dispatch import hops, regions
from adaptive_eager.dispatch.lazy import install_parameter_patch
from adaptive_eager.dispatch.mode import DeferMode, ReadGuardMode
from adaptive_eager.dispatch.opspec import SPECS
from adaptive_eager.engine import Engine
from adaptive_eager.events import RUN_LOG
from adaptive_eager.metrics import METRICS

log = logging.getLogger("adaptive_eager")


class _ThreadState(threading.local):
    engine: Engine | None = None
    presence: Presence | None = None
    depth: int = 0
    enabled_ctx: "EngineContext | None" = None


_state = _ThreadState()


class EngineContext:
    """``with adaptive_eager(...):`` -- defer this thread's tensor ops while inside.

    Nested and re-entered contexts share the outermost engine; leaving any of them is a sync point.
    Other threads are unaffected (the modes live on this thread's mode stack).
    """

    def __init__(self, **options: Any) -> None:
        self.options = config.resolve(options)  # validate now, at the user's line
        self._entered: list[bool] = []

    def __enter__(self) -> EngineContext:
        st = _state
        outer = st.engine is None
        if outer:
            logs.configure(self.options.log_level)
            install_parameter_patch()
            workers.install()
            install_feature_hooks()
            if self.options.step_aside:
                calibrate()
            engine = Engine(self.options)
            presence = engine.presence = Presence(engine, (ReadGuardMode(engine),
                                                           DeferMode(engine)))
            presence.activate()
            st.engine, st.presence = engine, presence
        st.depth += 1
        self._entered.append(outer)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        st = _state
        outer = self._entered.pop()
        engine = st.engine
        try:
            if engine is not None:
                engine.flush("exit")  # eager would have run everything before the exception
        except Exception as flush_err:
            if exc is None:
                raise
            exc.add_note(f"adaptive_eager: flushing on exit also failed: {flush_err!r}")
        finally:
            st.depth -= 1
            if outer:
                if st.presence is not None:
                    st.presence.close()
                st.engine, st.presence = None, None
                write_run_log(self.options)


def install_feature_hooks() -> None:
    """Rules for higher-order operators and the compiled-region hooks (Notes [higher-order
    operators] in dispatch/hops.py, [compiled regions] in dispatch/regions.py). Cheap after the
    first call: both skip what they already did."""
    regions.install()
    hops.install()


def write_run_log(options: config.Options) -> Path | None:
    """Write this process's run log into the cache folder (when the folder is usable)."""
    directory = resolve_cache_dir(options)
    try:
        ensure_private_dir(directory)
    except Exception as err:
        log.info("adaptive_eager: no run log (%s)", err)
        return None
    return RUN_LOG.write(directory, TRIE.entry_list, metrics())


def adaptive_eager(**options: Any) -> EngineContext:
    """Context manager that runs the enclosed code under the engine.

    >>> import torch, adaptive_eager
    >>> with adaptive_eager.adaptive_eager():
    ...     y = torch.ones(3) * 2
    >>> y.tolist()
    [2.0, 2.0, 2.0]
    """
    return EngineContext(**options)


def enable(**options: Any) -> None:
    """Switch the engine on for this thread until ``disable()`` (idempotent)."""
    if _state.enabled_ctx is None:
        ctx = EngineContext(**options)
        ctx.__enter__()
        _state.enabled_ctx = ctx


def disable() -> None:
    """Flush and switch off what ``enable()`` switched on (no-op if it is off)."""
    ctx = _state.enabled_ctx
    if ctx is not None:
        _state.enabled_ctx = None
        ctx.__exit__(None, None, None)


def is_enabled() -> bool:
    return _state.engine is not None


def sync() -> None:
    """Run every op this thread has deferred so far."""
    if _state.engine is not None:
        _state.engine.flush("sync")
        if _state.presence is not None:
            _state.presence.safe_point()


def metrics() -> dict[str, Any]:
    """Counters since start or the last reset_metrics(), as a plain dict."""
    out = METRICS.as_dict()
    out["known_traces"] = TRIE.entries
    out["metadata_cache_size"] = len(META_CACHE.table)
    return out


def reset_metrics() -> None:
    METRICS.reset()


def clear_caches() -> None:
    """Forget every known trace, op metadata and compiled program in memory (the disk cache
    stays): the next run starts like a fresh process."""
    TRIE.clear()
    META_CACHE.clear()
    for spec in SPECS.values():
        spec.host_learns = 0
    reset_managers()


def wait_for_compiles(timeout: float | None = None) -> None:
    """Block until background compiles submitted so far have finished."""
    for manager in list(_managers.values()):
        manager.wait(timeout)
