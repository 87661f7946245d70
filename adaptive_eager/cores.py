"""Lending a core to a compile: the program's intra-op threads while it waits aside.

Note [compile cores]
While a compile runs beside it, the program waits aside in plain eager (Note [waiting aside]).
On a machine where its intra-op pool has a thread on every core, that costs far more than the
compile's share of the CPU: an OpenMP team waits at every barrier for the thread that lost its
core, and the compile keeps taking cores whatever its priority (Note [compile priority]). On the
2-core VM (two torch threads; benchmarks/whole_run.py ``logged_step``, 200 steps, eager 3.3 s),
eager took 17.3 s beside a SCHED_IDLE compile and 47.7 s beside two SCHED_IDLE busy loops; with
one torch thread it took 3.0 s alone and 3.1 s beside the same compile. So while the engine
waits aside for its compile, and only inside its context, the engine's thread runs with one
intra-op thread fewer than the cores it may use (never fewer than one, and only when its pool
has a thread per core); the thread count comes back when the compile is done, when the context
ends (user code outside it sees its own setting) and when the engine closes. ``torch``'s count
is per thread (each thread's OpenMP setting), so lending and returning happen on the engine's
own thread. A count the program changed meanwhile is left as the program set it. The cost:
reductions split over fewer threads round differently, so those plain-eager steps are not
bitwise eager's (as fused ones are not); ``lend_core=False`` (``ADAPTIVE_EAGER_LEND_CORE=0``)
keeps the program's own count.
"""

from __future__ import annotations

import os

import torch

from adaptive_eager.metrics import METRICS as M


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CoreLoan:
    """One engine thread's loan of a core to its compiles (Note [compile cores])."""

    __slots__ = ("saved", "ours")

    def __init__(self) -> None:
        self.saved: int | None = None  # the thread count before the loan; None: no loan
        self.ours = 0  # the count set for the loan

    def lend(self) -> None:
        if self.saved is not None:
            return
        threads, cores = torch.get_num_threads(), usable_cores()
        if cores < 2 or threads < cores:
            return  # a core is free already
        self.saved, self.ours = threads, cores - 1
        torch.set_num_threads(self.ours)
        M.cores_lent += 1

    def give_back(self) -> None:
        if self.saved is None:
            return
        if torch.get_num_threads() == self.ours:  # else the program set its own meanwhile
            torch.set_num_threads(self.saved)
        self.saved = None
