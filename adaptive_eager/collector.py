"""The garbage collector while the engine records (Note [young collections]).

Note [young collections]
CPython collects its young generation when the count of tracked objects allocated and not yet
freed passes 700, and every tenth young collection moves what survived it into the old
generation; a full collection follows once those survivors come to a quarter of the old
generation. Eager PyTorch frees what an op made before the next op runs, so a training loop
almost never collects (the varlen benchmark's GPT-2 step: 0.015 young collections a step, no
full one). A pending trace keeps about three tracked objects per op alive until its flush (the
op's argument tuple, its output wrapper and that wrapper's weak reference): the same step
under the engine peaked above 700 every step, collected its young generation 0.95 times a step
and, from the survivors, a full collection of the 500k objects torch and transformers leave
tracked every ~400 steps, 230-240 ms each: 0.76 ms a step in all, 6% of the warm step
(``gc.callbacks`` timing, 400 steps).

So while this thread's engine has its modes pushed, the young threshold is raised above what a
full trace keeps alive (700 + 3 per op of ``max_trace_ops``, at most 50,000): the objects of a
pending trace no longer trigger collections (0.003 young collections a step, no full one), and
garbage cycles are still collected, after more allocations. Nothing is frozen (``gc.freeze``
saved as much but keeps cyclic garbage of every object older than the engine uncollected; per
context, it also reset the young count at every entry, so a loop of short contexts could
collect nothing at all). The threshold is raised only where it is the interpreter's own (the
one at import); a program's own setting is left alone, and the old value comes back when the
last engine's modes come off, unless the program set another meanwhile.
``ADAPTIVE_EAGER_GC_HEADROOM=0`` turns this off.
"""

from __future__ import annotations

import gc
import threading

YOUNG_PER_OP = 3  # tracked objects one pending op keeps alive
YOUNG_MAX = 50_000  # the raised threshold at most (max_trace_ops reaches 1,000,000)
_DEFAULT = gc.get_threshold()  # the interpreter's own, unless a program set one before import

_lock = threading.Lock()
_holders = 0  # engines (threads) with their modes pushed
_saved: tuple[int, ...] | None = None  # the threshold we replaced
_ours: tuple[int, ...] | None = None  # the threshold we set


def young_threshold(max_trace_ops: int) -> int:
    return min(_DEFAULT[0] + YOUNG_PER_OP * max_trace_ops, YOUNG_MAX)


def hold(max_trace_ops: int) -> None:
    """An engine pushed its modes: raise the young threshold if it is the interpreter's."""
    global _holders, _saved, _ours
    with _lock:
        _holders += 1
        if _holders > 1 or _saved is not None:
            return
        cur = gc.get_threshold()
        want = young_threshold(max_trace_ops)
        if cur != _DEFAULT or not cur[0] or cur[0] >= want:
            return  # the program's own setting (or collection off): not ours to change
        _saved, _ours = cur, (want, *cur[1:])
        gc.set_threshold(*_ours)


def release() -> None:
    """An engine took its modes off: the last one puts the old threshold back."""
    global _holders, _saved, _ours
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders or _saved is None:
            return
        if gc.get_threshold() == _ours:  # unless the program set its own meanwhile
            gc.set_threshold(*_saved)
        _saved = _ours = None
