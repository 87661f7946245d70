"""Child processes of a program under the engine: DataLoader workers run plain eager.

Note [worker processes]
A DataLoader worker (forked or spawned) used to inherit the engine: it traced the dataset's
``__getitem__`` ops, made them hot and started a compile helper of its own, so four workers on
two cores meant five processes compiling at once (the minGPT adder ran 4.7x slower than eager).
A worker's ops are small, run once per sample, and are not what the user asked to speed up.
So a DataLoader worker leaves the engine as its first act (``_worker_loop`` is wrapped: it is
the target of every worker, fork, spawn and forkserver alike) and never starts one, unless
``ADAPTIVE_EAGER_WORKERS=1``. Before a fork, the forking thread's pending trace is flushed, so
the child starts from the values eager would have had (deferred writes to real tensors included).
"""

from __future__ import annotations

import os
import threading
from typing import Any

_installed = False
_lock = threading.Lock()
_ORIGINAL: Any = None  # DataLoader's own worker loop
IN_WORKER = False  # set in a DataLoader worker that left the engine


def workers_keep_engine(engine: Any) -> bool:
    """The inherited engine's option, or (a spawned worker, no engine yet) the variable."""
    if engine is not None:
        return bool(engine.options.workers)
    from adaptive_eager import config

    setting = next(s for s in config.SETTINGS if s.name == "workers")
    try:
        return bool(setting.parse(setting.env, os.environ.get(setting.env, "0")))
    except config.ConfigError:
        return False


def install() -> None:
    """Flush before fork; wrap DataLoader's worker loop (once per process)."""
    global _installed, _ORIGINAL
    with _lock:
        if _installed:
            return
        _installed = True
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=_before_fork)
        from torch.utils.data._utils import worker

        if worker._worker_loop is not _worker_loop:
            _ORIGINAL = worker._worker_loop
            worker._worker_loop = _worker_loop


def _worker_loop(*args: Any, **kwargs: Any) -> Any:
    """DataLoader's worker loop, entered with the engine off. A spawned worker unpickles this
    function by name, so it runs here too, before any install() in the child."""
    leave_engine()
    original = _ORIGINAL
    if original is None:
        from torch.utils.data._utils import worker

        original = worker._worker_loop
    return original(*args, **kwargs)


def _before_fork() -> None:
    from adaptive_eager import api

    st = api._state
    if st.engine is not None:
        try:
            st.engine.flush("fork")
        except Exception:  # a fork must never fail because of the engine; the child re-raises
            pass


def leave_engine() -> None:
    """In a worker process: switch the inherited engine off, without running anything (the
    parent flushed before the fork; a spawned child has only what the autoload started)."""
    global IN_WORKER
    from adaptive_eager import api

    st = api._state
    if workers_keep_engine(st.engine):
        return
    IN_WORKER = True
    if st.presence is not None:
        st.presence.close()
    st.engine, st.presence, st.enabled_ctx, st.depth = None, None, None, 0
