"""Public entry points: the context manager, enable/disable, sync and metrics."""

from __future__ import annotations

import atexit
import logging
import operator
import os
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from adaptive_eager import config, logs, workers
from adaptive_eager.aside import Presence
from adaptive_eager.calibrate import calibrate
from adaptive_eager.cache.disk import ensure_private_dir, resolve_cache_dir
from adaptive_eager.cache.memory import META_CACHE, TRIE
from adaptive_eager.compiler import _managers, reset_managers
from adaptive_eager.dispatch import hops, mode, regions, tls
from adaptive_eager.dispatch.lazy import install_parameter_patch
from adaptive_eager.dispatch.mode import DeferMode, ReadGuardMode
from adaptive_eager.dispatch.mode import install_hooks as mode_hooks
from adaptive_eager.dispatch.opspec import SPECS
from adaptive_eager.engine import _OWNED, Engine
from adaptive_eager.events import RUN_LOG, Timeline
from adaptive_eager.metrics import METRICS

log = logging.getLogger("adaptive_eager")


class _ThreadState(threading.local):
    engine: Engine | None = None
    presence: Presence | None = None
    enabled_ctx: "EngineContext | None" = None
    # The last outermost context's presence (and engine), kept for the next context with the
    # same options: Note [contexts are rounds] in aside.py. Its ``generation`` is the
    # ``_generation`` it was made in. (Nesting is counted per context object, not here: each
    # thread-local access costs more than an attribute.)
    standing: Presence | None = None


_state = _ThreadState()
_generation = 0  # bumped by clear_caches(): every thread's standing presence is stale then

# Note [cheap contexts]
# A program may enter the context around every call of a small function (Note [contexts are
# rounds]), so entering and leaving must cost microseconds, not the milliseconds they did:
# resolving the options read and parsed 15 environment variables (35-65 µs), a new Engine cost
# about 1 ms, setting the logger's level cleared logging's cache, and every exit rewrote the run
# log (about 4 ms of file work). Now: options are resolved once per distinct (environment,
# keywords), the thread's engine is kept while the options stay the same, the logger is set only
# when its level changes, and the run log is written at the first exit, then at most once per
# RUN_LOG_EVERY_S, and at process exit.
# The context loop (once 1.19x eager): the environment is still checked at every
# context, exactly, but against the last resolution only (``_last``), with no tuple built or
# hashed. Keys are only ever added to a dict at its end (insertion order), and os.environ stores
# a fresh bytes object per key set, so "no key was added or re-added since" holds while
# ``len(os.environ._data)`` and the identity of its last key are unchanged (keys shorter than 2
# bytes can be shared objects: then every ADAPTIVE_EAGER_* key is looked up, as ``isdisjoint``);
# the ADAPTIVE_EAGER_* variables set then must still have their values (one ``itemgetter``
# call, compared by identity mostly). The keywords are compared as a dict, and their types
# (``hot_after=True`` is not ``hot_after=1``). Anything else goes the old way: the table keyed by
# the full snapshot.
# The context object has slots and keeps its nesting in an int; ``adaptive_eager()`` builds it
# without a second keyword dict; entering and leaving test the standing presence inline. Before,
# 23 environment reads, a sorted keyword tuple and a 25-item hash were about a third of a
# context's cost.
RUN_LOG_EVERY_S = 2.0
_ENV_KEYS = tuple(s.env for s in config.SETTINGS)
_environ = os.environ
_env_data = getattr(os.environ, "_data", None)  # CPython's raw mapping behind os.environ
_env_keys_raw: tuple[Any, ...] | None = None
if isinstance(_env_data, dict):
    try:
        _env_keys_raw = tuple(os.environ.encodekey(k) for k in _ENV_KEYS)  # type: ignore[attr-defined]
    except Exception:
        _env_keys_raw = None
_RESOLVED: dict[tuple, config.Options] = {}
_configured_level: Any = None
# The last resolution, for the fast check: (keywords, their types, Options, a getter of the
# ADAPTIVE_EAGER_* keys set and their values or None, the raw keys absent, len of the raw
# environ, its last key); the last three are None where os.environ has no raw dict (then slot 3
# is the snapshot tuple).
_last: tuple | None = None


def _env_snapshot() -> tuple:
    if _env_keys_raw is not None and _env_data is getattr(os.environ, "_data", None):
        return tuple(map(_env_data.get, _env_keys_raw))  # type: ignore[union-attr]
    env = os.environ
    return tuple(env.get(k) for k in _ENV_KEYS)


def resolve_options(options: dict[str, Any]) -> config.Options:
    """``config.resolve(options)``, memoized on the relevant environment and the keywords."""
    last = _last
    if last is not None:
        kw, types, hit, present, absent, size, last_key = last
        # types taken in kw's key order: {a: 1, b: True} == {b: 1, a: True} as dicts
        if kw == options and (not options
                              or tuple(map(type, map(options.__getitem__, kw))) == types):
            if absent is not None:
                data = _env_data
                try:
                    same = (os.environ is _environ
                            and _environ._data is data  # type: ignore[attr-defined]
                            and (len(data) == size  # type: ignore[arg-type]
                                 and next(reversed(data), None) is last_key  # type: ignore
                                 or _relast(last, data))  # type: ignore[arg-type]
                            and (present is None or _present_same(present, data)))
                except RuntimeError:  # another thread changed the environment mid-iteration
                    same = False
                if same:
                    return hit
            elif _env_snapshot() == present:
                return hit
    return _resolve_memo(options)


def _resolve_memo(options: dict[str, Any]) -> config.Options:
    global _last
    snap = _env_snapshot()
    try:
        key = (snap, tuple(sorted((k, type(v), v) for k, v in options.items())))
        hash(key)
    except TypeError:  # an unhashable keyword value: config.resolve says what is wrong with it
        return config.resolve(options)
    hit = _RESOLVED.get(key)
    if hit is None:
        hit = config.resolve(options)
        if len(_RESOLVED) > 64:
            _RESOLVED.clear()
        _RESOLVED[key] = hit
    types = tuple(map(type, options.values()))
    data = _env_data
    if (_env_keys_raw is not None and os.environ is _environ
            and data is _environ._data):  # type: ignore[attr-defined]
        pairs = tuple(zip(_env_keys_raw, snap))
        keys = tuple(k for k, v in pairs if v is not None)
        present = None
        if keys:
            get = operator.itemgetter(*keys)
            present = (get, get(data))
        _last = (dict(options), types, hit, present,
                 frozenset(k for k, v in pairs if v is None), len(data),  # type: ignore
                 _last_key(data))  # type: ignore[arg-type]
    else:
        _last = (dict(options), types, hit, snap, None, None, None)
    return hit


_NO_KEY = object()  # never a key: the last-key shortcut is off, every absent key is looked up


def _present_same(present: tuple, data: dict) -> bool:
    """The ADAPTIVE_EAGER_* variables set at the last resolution still have their values (one
    C call; the values are mostly the very objects, so the comparison is by identity)."""
    get, values = present
    try:
        return get(data) == values
    except KeyError:
        return False


def _last_key(data: dict) -> Any:
    try:
        key = next(reversed(data), None)
    except RuntimeError:  # another thread changed the environment meanwhile
        return _NO_KEY
    return key if key is not None and len(key) >= 2 else _NO_KEY


def _relast(last: tuple, data: dict) -> bool:
    """The raw environment's length or last key changed: whether every ADAPTIVE_EAGER_* key
    absent at the last resolution still is (then the next check may be short again)."""
    global _last
    if not data.keys().isdisjoint(last[4]):
        return False
    if _last is last:
        _last = (*last[:5], len(data), _last_key(data))
    return True


class EngineContext:
    """``with adaptive_eager(...):`` -- defer this thread's tensor ops while inside.

    Nested and re-entered contexts share the outermost engine; leaving any of them is a sync point.
    Other threads are unaffected (the modes live on this thread's mode stack).
    """

    __slots__ = ("options", "_outer")

    def __init__(self, **options: Any) -> None:
        self.options = resolve_options(options)  # validate now, at the user's line
        self._outer = 1  # a stack of bits above a sentinel 1: was each entry the outermost

    def __enter__(self) -> EngineContext:
        st = _state
        if st.engine is None:
            presence = st.standing
            options = self.options
            if presence is None or presence.generation != _generation:
                presence = _new_presence(options)
            else:
                engine = presence.engine
                if ((engine.options is not options and engine.options != options)
                        or _OWNED.engine is not engine or engine.trace.ops):
                    presence = _new_presence(options)
            if presence.quiet:  # Note [quiet contexts] in aside.py: aside, only counted
                presence.contexts += 1
                presence.in_context = True
                presence.calls_in_context = 0
            else:
                presence.enter()  # pushes the modes unless this thread runs aside
            st.engine, st.presence = presence.engine, presence
            self._outer = self._outer << 1 | 1
        else:
            self._outer <<= 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        st = _state
        bits = self._outer
        if bits == 1:
            raise RuntimeError("adaptive_eager: a context left more often than entered")
        self._outer = bits >> 1
        presence = st.presence  # set and cleared with st.engine, one thread-local read less
        if bits & 1 and presence is not None and presence.quiet:
            # Note [quiet contexts] in aside.py: nothing was recorded (the engine is off), so
            # the flush and the round end would only count; a due probe takes the full path
            rounds = presence.steps_aside + 1
            tr = presence.engine.trace
            if (rounds < presence.quiet_until and not tr.ops and not tr.ext
                    and tr.node is tr.start and presence is st.standing):
                presence.steps_aside = rounds
                presence.in_context = False
                st.engine, st.presence = None, None
                quiet = _run_log_quiet
                if quiet[0] is not self.options or _monotonic() >= quiet[1]:
                    _run_log_due(self.options)
                return
        engine = presence.engine if presence is not None else st.engine
        try:
            if engine is not None:
                engine.flush("exit")  # eager would have run everything before the exception
        except Exception as flush_err:
            if exc is None:
                raise
            exc.add_note(f"adaptive_eager: flushing on exit also failed: {flush_err!r}")
        finally:
            if bits & 1:
                st.engine, st.presence = None, None
                try:
                    if presence is not None:
                        if presence is st.standing:
                            presence.leave()  # kept for the next context
                        else:
                            presence.close()
                    tls.repair()  # Note [mode stack under inference mode] in dispatch/tls.py
                finally:
                    quiet = _run_log_quiet  # no run log due, this exit already marked pending
                    if quiet[0] is not self.options or _monotonic() >= quiet[1]:
                        _run_log_due(self.options)


_new_context = object.__new__


def _new_presence(options: config.Options) -> Presence:
    """A new engine and presence for this thread, standing for the next contexts."""
    st = _state
    _drop_standing()
    _start_up(options)
    engine = Engine(options)
    presence = engine.presence = Presence(engine, (ReadGuardMode(engine), DeferMode(engine)))
    presence.generation = _generation
    st.standing = presence
    return presence


def _start_up(options: config.Options) -> None:
    """What the first engine of a process (or of new options) needs; cheap when repeated."""
    global _configured_level
    if options.log_level != _configured_level:
        logs.configure(options.log_level)
        _configured_level = options.log_level
    install_parameter_patch()
    workers.install()
    install_feature_hooks()
    if options.step_aside:
        calibrate(options.lazy_guard)


def _drop_standing() -> None:
    st = _state
    presence, st.standing = st.standing, None
    if presence is not None:
        presence.close()


_monotonic = time.monotonic
# (options, time): until then no run log is due for these options and they are marked pending
_run_log_quiet: tuple[Any, float] = (None, 0.0)
_run_log_at: dict[str, float] = {}  # cache folder -> when its run log was last written
_run_log_dirty: dict[str, config.Options] = {}  # folders whose last exit was not yet written
_atexit_installed = False


def _run_log_due(options: config.Options) -> None:
    """Write the run log at the first exit and then at most every RUN_LOG_EVERY_S (Note [cheap
    contexts]); what is left is written at process exit."""
    global _atexit_installed, _run_log_quiet
    key = options.cache_dir or ""
    now = _monotonic()
    last = _run_log_at.get(key)
    if last is not None and now - last < RUN_LOG_EVERY_S:
        _run_log_dirty[key] = options
        _run_log_quiet = (options, last + RUN_LOG_EVERY_S)
        if not _atexit_installed:
            _atexit_installed = True
            atexit.register(_write_pending_run_logs)
        return
    _run_log_at[key] = now
    _run_log_dirty.pop(key, None)
    write_run_log(options)


def _write_pending_run_logs() -> None:
    for key, options in list(_run_log_dirty.items()):
        _run_log_dirty.pop(key, None)
        write_run_log(options)


def install_feature_hooks() -> None:
    """Rules for higher-order operators and the compiled-region hooks (Notes [higher-order
    operators] in dispatch/hops.py, [compiled regions] in dispatch/regions.py). Cheap after the
    first call: both skip what they already did."""
    regions.install()
    hops.install()
    tls.install()  # Note [mode stack under inference mode] in dispatch/tls.py
    mode_hooks()  # the disarmed read guard's stand-ins (Note [read guard] in dispatch/mode.py)


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
    ctx = _new_context(EngineContext)  # as EngineContext(**options), without a second dict
    ctx.options = resolve_options(options)
    ctx._outer = 1
    return ctx


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
    out["accel_missing"] = mode.ACCEL_MISSING  # "" when the C accelerator runs
    return out


def reset_metrics() -> None:
    METRICS.reset()
    RUN_LOG.timeline = Timeline()  # its phases are read off the counters (Note [run timeline])


def clear_caches() -> None:
    """Forget every known trace, op metadata and compiled program in memory (the disk cache
    stays): the next run starts like a fresh process."""
    global _generation
    _generation += 1  # every thread's standing presence is dropped at its next context
    if _state.engine is None:
        _drop_standing()
    TRIE.clear()
    META_CACHE.clear()
    for spec in SPECS.values():
        spec.host_learns = 0
    reset_managers()


def wait_for_compiles(timeout: float | None = None) -> None:
    """Block until background compiles submitted so far have finished."""
    for manager in list(_managers.values()):
        manager.wait(timeout)
