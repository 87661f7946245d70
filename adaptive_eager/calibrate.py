"""What the engine costs per op on this machine, measured once per process (a few ms).

The step-aside decision (step_aside_reason in compile/policy.py) weighs fusion gains against
these costs: ``record_s`` is the time to record one op beyond eager's own call,
``replay_extra_s`` the time op-by-op replay spends per op beyond eager's. Measured on a chain of tiny adds, where the kernel
time is negligible, in float64 so the calibration's traces live under their own trie root.
A loop of two-op traces each ended by ``.item()`` measures what a flush costs whatever its
length: ``flush_s`` (finishing, publishing, the sync) and ``replay_fixed_s`` (op-by-op replay's
own cost per run), Note [flushes cost too] in compile/policy.py.
"""

from __future__ import annotations

import logging
import time

import torch

from adaptive_eager.compile import policy
from adaptive_eager.cache.memory import TRIE
from adaptive_eager.config import Options
from adaptive_eager.events import RUN_LOG, Timeline
from adaptive_eager.metrics import METRICS

_N = 200
_K = 50  # short flushes timed for the per-flush costs
_SHORT = 2  # ops in each of them
_done = False
# The thread's CPU time, not the wall clock: on a loaded machine (load 12 on 2 cores) wall-clock
# calibration read 7-55 us per recorded op in three processes, enough to tip the estimate into
# stepping aside; the thread's CPU time read 9-14 us. The loop is single-threaded (16-element
# adds), so time the thread was descheduled is all that drops out.
_clock = time.thread_time


def _eager(x: torch.Tensor) -> float:
    start = _clock()
    for _ in range(_N):
        x = x + 1
    return _clock() - start


def _flushes(x: torch.Tensor) -> float:
    """_K two-op traces (an add and a sum: a one-element tensor's op would run at once, Note
    [host scalars]), each run by the ``.item()`` after it (plain eager off the engine)."""
    start = _clock()
    for _ in range(_K):
        (x + 1).sum().item()
    return _clock() - start


def calibrate(lazy_guard: bool = True) -> None:
    """Measure once per process; keep the defaults if anything goes wrong. ``lazy_guard``: the
    read guard as the user's engine runs it (armed on every op, or only while needed)."""
    global _done
    if _done:
        return
    _done = True
    saved = {k: getattr(METRICS, k) for k in METRICS.__slots__}
    saved = {k: (v.copy() if hasattr(v, "copy") else v) for k, v in saved.items()}
    # The calibration's traces are the engine's, not the user's: their misses (attributed to
    # whatever frame started the engine, e.g. adaptive_eager_autoload.py) must not reach the run
    # log, as its counts must not reach the metrics. Restored, like METRICS, afterwards.
    saved_misses = {k: {**v, "values": list(v["values"]), "traces": list(v["traces"])}
                    for k, v in RUN_LOG.misses.items()}
    saved_timeline, RUN_LOG.timeline = RUN_LOG.timeline, Timeline()  # nor its flushes
    engine_log = logging.getLogger("adaptive_eager")  # nor its "trace miss" INFO lines
    old_level = engine_log.level
    engine_log.setLevel(max(logging.WARNING, engine_log.getEffectiveLevel()))
    had_roots = set(TRIE.roots)
    n_entries = len(TRIE.entry_list)
    old_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        record, replay, eager, flushes, eager_flushes, replay_short = _measure(lazy_guard)
        op = eager / _N
        policy.RECORD_S = max(record - eager, 0.0) / _N
        policy.REPLAY_EXTRA_S = max(replay - eager, 0.0) / _N
        policy.EAGER_OP_S = op
        if replay_short is not None:  # Note [flushes cost too]
            policy.REPLAY_FIXED_S = max(replay_short - _SHORT * (op + policy.REPLAY_EXTRA_S),
                                          0.0)
            policy.FLUSH_S = max((flushes - eager_flushes) / _K - _SHORT * policy.RECORD_S
                                   - replay_short, 0.0)
    except Exception:  # a measurement must never stop an engine from starting
        pass
    finally:
        torch.set_default_dtype(old_dtype)
        for k, v in saved.items():
            setattr(METRICS, k, v)
        RUN_LOG.misses = saved_misses
        RUN_LOG.timeline = saved_timeline
        engine_log.setLevel(old_level)
        for key in set(TRIE.roots) - had_roots:  # the float64 root (and its ambient state)
            TRIE.drop_root(key)
        del TRIE.entry_list[n_entries:]
        TRIE.entries = len(TRIE.entry_list)


def _measure(lazy_guard: bool) -> tuple[float, float, float, float, float, float | None]:
    from adaptive_eager.dispatch.mode import DeferMode, ReadGuardMode
    from adaptive_eager.engine import Engine

    x = torch.zeros(16)
    x0 = torch.zeros(2)
    first = len(TRIE.entry_list)
    engine = Engine(Options(backend="replay", step_aside=False, disk_cache=False,
                            lazy_guard=lazy_guard))
    modes = (ReadGuardMode(engine), DeferMode(engine))
    best_rec = best_rep = best_eager = best_fl = best_eager_fl = float("inf")
    for _ in range(3):
        best_eager = min(best_eager, _eager(x))
        best_eager_fl = min(best_eager_fl, _flushes(x0))
        for m in modes:
            m.__enter__()
        try:
            start = _clock()
            _eager(x)  # recorded, not run
            mid = _clock()
            engine.flush("calibrate")
            end = _clock()
            fl = _flushes(x0)  # each item() flushes a two-op trace
        finally:
            for m in reversed(modes):
                m.__exit__(None, None, None)
        best_rec = min(best_rec, mid - start)
        best_rep = min(best_rep, end - mid)
        best_fl = min(best_fl, fl)
    # the short trace's replay times, as the engine keeps them for every trace
    short = [t for e in TRIE.entry_list[first:] if e.n_ops == _SHORT for t in e.replay_s]
    return (best_rec, best_rep + best_eager, best_eager, best_fl, best_eager_fl,
            min(short) if short else None)
