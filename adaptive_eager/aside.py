"""The engine's presence on a thread's mode stack, and stepping aside when nothing gains.

Note [stepping aside]
A Python dispatch mode costs a few microseconds per op against eager's one; a program whose traces
do not profit from fusion (tiny launch-bound ops, traces that never repeat) pays that for nothing.
When the compile manager's measurements say so, the engine leaves the mode stack. Modes cannot be
popped from inside their own handlers (torch re-pushes them afterwards), so leaving happens at the
next safe point in plain Python: after a module's forward or an optimizer step (a global module
hook installed only while a step-aside is pending, and the optimizer step hook), ``sync()``, or
leaving the context. While aside, the rounds (optimizer steps, the outermost modules' calls,
Note [root ticks], or contexts) are counted and the engine re-enters after ``probe_every`` of
them (doubled after each probe in vain, Note [probes back off]) to measure again.

Note [measured trial]
The cost estimate behind stepping aside (Decisions.step_aside_reason) under-counts real models:
recording an op inside a module's forward or autograd's backward costs several times what the
calibration loop of tiny adds measures. So once the compile manager has settled (every hot trace
compiled and decided), the engine runs a trial: rounds alternate between the engine and plain
eager (E, G, E, G, ...) until each side has ``TRIAL_TICKS`` of them, and the engine stays only if
the median of the pairs' ratios (engine round / the eager round after it) is under
``TRIAL_MARGIN``. Timing the two sides in separate phases (8 engine rounds, then 8 eager ones)
mis-decided on a loaded machine, where load changes over seconds: mid-size Llama kept an engine
that ran 0.73x eager; alternating rounds see the same load, as Note [paired timing]
does for keep decisions. A round is the time between two ticks: the ends of optimizer steps,
or, in programs without an optimizer, the ends of outermost ``nn.Module`` calls, contexts, or
syncs (Note [syncs are rounds]). A probe after ``probe_every`` rounds aside
starts the question over, and so does a new keep/drop decision after a verdict for the engine
(the engine the trial timed is not the engine that runs any more).

Note [probes back off]
A probe is not free: it records and replays op by op for PROBE_FLUSHES flushes or more, and its
new traces may compile. In ``generate()`` (a round per token) a probe every 2000 rounds cost
about 60 tokens at 3-5x eager's time, over 10% of the time aside. So each probe that ends aside
again doubles the rounds before the next one (up to PROBE_BACKOFF_MAX doublings); a verdict for
the engine resets the interval to ``probe_every``. Over N rounds aside the probes then cost
O(log N) probes instead of N / probe_every. A probe also ends after PROBE_ROUNDS rounds with
fewer than PROBE_FLUSHES flushes: rounds that record nothing (``with adaptive_eager(): pass``,
a loop of contexts around Python-only work) never reached the flush-counted end, so the engine
stayed on for good at 4-6 us a context instead of the 1 us of a quiet one (Note [quiet contexts]).

Note [contexts are rounds]
A program may wrap each call of a small function in ``with adaptive_eager():`` and never call a
module or an optimizer. Entering and leaving the context is plain Python, so it is a safe point,
and the ends of contexts are its rounds. The thread keeps one Presence (and its Engine) across
contexts with the same options (api.py's ``_ThreadState.standing``), so what was learned - aside,
waiting, a trial half done, the verdict - outlives each context. Contexts become the rounds from
the first re-entry on, unless the context just left held several outermost module calls (a
context around a whole epoch of forward calls keeps the module calls as its rounds); optimizer
steps still outrank both. Aside, entering pushes no modes: a context costs a few microseconds.

Note [quiet contexts]
Aside with contexts as the rounds, entering and leaving did the same checks every time: the
presence's enter() and leave(), an empty flush and a round end, about 1.8 us of a bare context's
2.4 (benchmarks' context_loop: 200 contexts around a 39 us function, 0.92x eager). Leaving such a
context now notes whether the presence is quiet (aside, contexts are the rounds, no trial, no wait,
no request, no hook or wrapper on, the engine off) and the round at which the next probe is due;
the next context's entry and exit then only count (api.py), and every other path through the
presence (an optimizer step inside the context, a trial, a probe, a request, clear_caches) turns
quiet off first, so it takes the full path again.

Note [waiting aside]
While a compile is in flight the engine replays its traces op by op, which is slower than eager
(every op pays recording and replay on top of its kernel), and recording teaches nothing more:
the trace is already hot and submitted. So at the end of a round with a compile in flight the
engine steps aside, runs plain eager, and comes back at the first round end after the compiles
finished, to pick up and time the programs. Rounds, as in the trial, are optimizer steps,
outermost module calls, contexts or syncs; a program with none of them replays while it waits.

Note [syncs are rounds]
A program with no optimizer, no module call and a single context (a solver loop reading
``.item()`` every iteration) had no rounds: no waiting aside while its first compile ran (20-30 s
with a cold compile service here, every iteration at 10x eager's time: a 2-second script ran
all of it that way), no trial, no probe. Its syncs are the next best ticks: once SYNC_ROUNDS_AFTER
flushes went by with no round of another kind, or when it steps aside with none, the sync
methods are wrapped as for a pending
step-aside (Note [sync points are safe points]) and every SYNC_ROUND-th sync of the thread
inside the context ends a round, at the same safe point (not in a handler, not in an autograd
node). The wrappers stay while the engine is aside (about 0.3 us per sync, the price of coming
back); between contexts they are off. Any other kind of round (an optimizer step, an outermost
module call, a second context) replaces them, and the wrappers come off.

Note [root ticks]
Outermost module calls are found with global module hooks, and any global module hook sends
every module call in the process down ``nn.Module._call_impl``'s slow path (the hook loops, a
closure per call): about 5% of GPT-2's ``generate()`` per token at width 64, all of it paid in
plain eager while aside, where the engine should cost nothing. So global hooks are kept only
while the engine is on the mode stack (recording dwarfs them, and they see every new outermost
module); whenever it is off (aside, waiting, a trial's eager rounds) the ticks come from hooks
on the few modules that were outermost in recent rounds, the roots, and every other call takes
the fast path. The global hook that waits for a safe point to step aside (``_AsideHook``)
comes off once it has acted, too; it used to stay for the rest of the context. Hooks change only
at the start of an outermost call, in the pre-hook (the depth count must see both ends of a
call, and a forward hook may be running inside torch's loop over the live hook dict, which
raises if the dict changes). A root that stops being called while the engine is off (the
program moved on to another model) ticks no more until a context, an optimizer step or that
root does; the engine then stays off longer, which costs nothing. The hook objects copy and
pickle as inert hooks (a copied or saved model keeps no tie to the engine; unpickling one needs
adaptive_eager importable).

Note [hooks under Dynamo]
Dynamo traces a module call through ``nn.Module._call_impl``, hooks included, and this package's
files are on its skip list (Note [compiled regions] in dispatch/regions.py): a call of one of the
engine's module hooks was a graph break, so ``torch.compile(fn, fullgraph=True)`` of code calling
a module raised inside a context, and without fullgraph every module call split the graph. A
disabled hook (``torch._dynamo.disable``) is a graph break too, and ``dont_skip_tracing`` costs
~15 us per eager call. So every module hook of the engine (the tick hooks, global or on roots, and
the step-aside hook) is a ``_RootTick``/``_AsideHook`` whose ``__call__`` returns at once when
this thread traces it (``_traced_here``: Dynamo folds ``is_dynamo_compiling()`` to True; a
non-strict export runs under a fake mode on this thread; ``is_compiling()`` alone is
process-wide) and whose
code carries a file name off the skip list (``_seen_by_dynamo``): Dynamo inlines it to nothing
and the graph is the one compiled without the engine. Compiled code runs outside the engine
anyway (Note [compiled regions]), so module calls inside it are no rounds; calls outside tick as
before, at ~0.2 us more per hook call (measured before ``_traced_here`` added a call). Dynamo guards on how many global hooks there are, not on
which: a function compiled outside a context compiles once more inside, not once per context.

Note [any call is a safe point]
A loop inside one context with no module call, no optimizer step and no sync (``tiny_ops`` under
``ADAPTIVE_EAGER=1``: 200 tiny ops a step, traces cut only by the cap) had no safe point at all:
asked to step aside, it ran its fused 4000-op program at 0.2-0.4x eager's speed until the
context ended. While a step-aside is pending on the engine's thread, a profile function
(``sys.setprofile``, per thread) now waits for the next return, from a Python function or a C
one such as ``torch.tanh``, with no frame of this package's or torch's on the stack, in plain
Python (``_plain_python_here``: no handler of the engine running, no autograd node, no flush;
and no ``__torch_dispatch__``/``__torch_function__`` frame: inside a user's mode above the
engine's, that mode is popped, so the stack's top looked like plain Python; and torch's Python
pops modes through contextlib, whose frames are the standard library's), and
steps aside there; it takes itself off at once then, or when nothing is pending any more. Only
where no other kind of round exists (rounds from syncs or none): the others have their safe
points, and moving their step-aside within a round would shift their round counts. Events
inside the engine's handlers cost about a microsecond each for that short while. Never over
another profiler or tracer's hook (``sys.getprofile()`` set, torch's profiler on): those
programs keep the other safe points.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from adaptive_eager import collector
from adaptive_eager.budget import Account
from adaptive_eager.compile import policy
from adaptive_eager.compile.policy import _median
from adaptive_eager.cores import CoreLoan
from adaptive_eager.dispatch.lazy import LazyTensor, become_real
from adaptive_eager.metrics import METRICS as M

log = logging.getLogger("adaptive_eager")

TRIAL_TICKS = 8  # rounds timed each way in a trial
TRIAL_MARGIN = 0.97  # the engine stays only if its median round is at least 3% shorter
TRIAL_CLEAR_PAIRS = 3  # pairs after which a clear verdict ends a trial (Note [clear trials])
TRIAL_CLEAR = 2.0  # every pair this many times faster (or slower) one way is a clear verdict
PROBE_BACKOFF_MAX = 5  # probes in vain double the interval at most this often (Note [probes back off])
MAX_ROOTS = 4  # outermost modules remembered for ticks while the engine is off (Note [root ticks])
PROBE_ROUNDS = 200  # a probe that flushed less than PROBE_FLUSHES times ends here too
SYNC_ROUND = 16  # syncs a round of a program whose rounds are syncs (Note [syncs are rounds])
SYNC_ROUNDS_AFTER = 64  # flushes with no round of another kind before syncs become rounds


GRACE_ROUNDS = 32  # rounds to time a landed program and try it (Note [learning budget])


def _distributed() -> Any:
    """The distributed module (it imports this one's layer: Note [ranks agree])."""
    from adaptive_eager import distributed

    return distributed
_DYNAMO_FILE = "<adaptive_eager.aside: engine hook>"  # off Dynamo's skip list


def _seen_by_dynamo(fn: Any) -> Any:
    """Give a hook's code a file name Dynamo does not skip, so it inlines the hook (which returns
    at once while compiling) instead of breaking the graph (Note [hooks under Dynamo])."""
    fn.__code__ = fn.__code__.replace(co_filename=_DYNAMO_FILE)
    return fn


_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_get_mode = torch._C._get_dispatch_mode


@_seen_by_dynamo
def _traced_here() -> bool:
    """Whether this thread traces the hook's module call (Note [hooks under Dynamo]): Dynamo
    folds ``is_dynamo_compiling()`` to True (False in eager); torch.export's non-strict
    tracing runs the module under a fake mode on this thread's stack. ``is_compiling()`` alone
    is a process-wide flag: a compile or export in another thread would skip this thread's
    hooks (a call's pre-hook seen and its post-hook not leaves the depth count stuck)."""
    return torch.compiler.is_dynamo_compiling() or (
        torch.compiler.is_compiling() and _get_mode(_FAKE_KEY) is not None)


# Note [clear trials]
# A trial times TRIAL_TICKS rounds each way because a small difference (a few percent) needs
# them to rise above the noise of a shared machine. A large one does not: a fused chain ran 0.02 s
# a round against eager's 1.27 s, and the trial still ran every second round plain for 16 rounds
# (more when a new decision started it over), half the steps at eager's speed. So from
# TRIAL_CLEAR_PAIRS pairs on, a trial ends as soon as every pair so far says the same by at least
# TRIAL_CLEAR either way; noise that moves a whole paired round by 2x in every pair is not
# plausible, and the verdict is the one the full trial would reach.
def clear_ratio(periods: list[float], eager_periods: list[float]) -> float | None:
    """The median engine/eager ratio of the pairs so far when they all agree clearly, else None."""
    n = min(len(periods), len(eager_periods))
    if n < TRIAL_CLEAR_PAIRS:
        return None
    ratios = [a / b for a, b in zip(periods[:n], eager_periods[:n]) if b > 0]
    if len(ratios) < n:
        return None
    if max(ratios) * TRIAL_CLEAR <= 1.0 or min(ratios) >= TRIAL_CLEAR:
        return _median(ratios)
    return None


def trial_verdict(ratio: float) -> str:
    """The one place a measured trial is decided: "engine" or "eager" (Note [measured trial]).
    ``ratio`` is the median over paired rounds of engine round / eager round.

    Decisions are per process (per thread, really: each thread times its own rounds); in a
    distributed job every rank takes the first rank's verdict (Note [ranks agree])."""
    stay = _distributed().agree_trial(ratio < TRIAL_MARGIN)
    return "engine" if stay else "eager"


# Note [sync points are safe points]
# A program that calls no module and no optimizer inside one context (a solver loop reading
# ``.item()`` every iteration) had no safe point: the step-aside the estimate asked for stayed
# pending for the whole context, and the benchmark's ``item_loop`` ran 0.07x eager's speed
# through fused programs of four ops. The value of a sync (``item``, ``bool``, ``float``,
# ``int``) reaches the user's Python after the engine's handlers returned, so while a
# step-aside is pending those methods are wrapped in Python: after the original call, the
# thread's engine steps aside if neither of its modes is in a handler (its dispatch mode on top
# of the stack: not inside its own handler, nor under a user's mode; its read guard not held)
# and no autograd node runs (autograd puts the mode stacks back after a node). The wrappers
# exist only while some thread's step-aside is pending (plain torch before and after; a
# presence that dies with its thread gives its share back). Code Dynamo compiles calls the
# tensor methods itself (a wrapper in place changes nothing there). A user's TorchFunctionMode
# that compares ``func`` with ``torch.Tensor.item`` sees the wrapper in that window.
# ``tolist`` is not among them: it reads memory itself, and the read guard knows it by identity
# (a wrapper in its place missed the guard's flush and read a pending write's old values).
_SYNC_METHODS = ("item", "__bool__", "__float__", "__int__")
_sync_lock = threading.RLock()  # _dropped may run in a collection under it
_sync_users = 0  # presences with a step-aside pending that wrapped the methods
_current_mode = torch.utils._python_dispatch._get_current_dispatch_mode
_graph_task = torch._C._current_graph_task_id


_NO_ARG: Any = object()


def _sync_wrapper(name: str) -> Any:
    orig = getattr(torch._C.TensorBase, name)

    def method(self: torch.Tensor, arg: Any = _NO_ARG) -> Any:
        # none of these takes an argument: a star-args signature cost 0.1 us a call, and an
        # argument given still gets torch's own error
        out = orig(self) if arg is _NO_ARG else orig(self, arg)
        ref = _PENDING.get(_get_ident())
        if ref is not None:
            p = ref()
            if p is None:
                return out
            # Note [counting syncs]: a sync that only counts toward its round takes no call
            if (p.ticks_from == "sync" and p.pending is None and p._syncs < _SYNC_COUNT_ONLY
                    and p.in_context and not p.quiet and not _compiler._is_compiling_flag):
                p._syncs += 1
            elif not _traced_here():
                p.sync_point()
        return out

    method.__name__ = method.__qualname__ = name
    method.__doc__ = orig.__doc__
    method._ae_sync_point = True  # type: ignore[attr-defined]
    return method


# Note [counting syncs]
# While syncs are the rounds (Note [syncs are rounds]) and the engine is aside, every ``.item()``
# of a solver loop paid about 1 us for its wrapper: the Dynamo check (four Python calls) and
# ``sync_point`` with the call it makes, where 15 of every 16 syncs only add one to a count.
# The wrapper now adds that one itself when ``sync_point`` would do nothing else (syncs are the
# rounds, no step-aside pending, in the context, not quiet, this sync not the round's last) and
# no compile or export is tracing (``is_compiling()``'s flag, read without its call; Dynamo
# folds ``is_dynamo_compiling()`` only in code it traces, and it does not trace this file), and
# the wrapper takes no star-args (0.1 us more a call). ``.item()`` aside: 575 -> 445 ns (eager's
# own 148); the benchmark's item_loop aside: 71.3 -> 68.8 us a step in one process, 63-65 us after
# the context. Every other sync takes the full path as before.
_SYNC_COUNT_ONLY = SYNC_ROUND - 1
_get_ident = threading.get_ident
_compiler = torch.compiler
_SYNC_WRAPPERS = {name: _sync_wrapper(name) for name in _SYNC_METHODS}


def _dropped(ref: Any) -> None:
    """A presence with a share died without close() (its thread ended): take the share back."""
    global _sync_users
    with _sync_lock:
        for thread, r in list(_PENDING.items()):
            if r is ref:
                del _PENDING[thread]
                _sync_users -= 1
                if _sync_users == 0:
                    for name, fn in _SYNC_WRAPPERS.items():
                        if torch.Tensor.__dict__.get(name) is fn:
                            delattr(torch.Tensor, name)
# thread -> weak reference to its presence, step-aside pending or syncs its rounds
_PENDING: dict[int, Any] = {}


def _wrap_sync_methods(presence: Any, on: bool) -> None:
    """Install the sync-point wrappers for ``presence`` (on) or take its share away (off).
    Under the lock: a step-aside may be asked for on an autograd thread while the owner acts."""
    global _sync_users
    with _sync_lock:
        if presence._sync_wrapped is on:
            return
        presence._sync_wrapped = on
        if on:
            _PENDING[presence.thread] = weakref.ref(presence, _dropped)
            _sync_users += 1
            if _sync_users == 1:
                for name, fn in _SYNC_WRAPPERS.items():
                    setattr(torch.Tensor, name, fn)
        else:
            ref = _PENDING.get(presence.thread)
            if ref is not None and ref() in (presence, None):
                del _PENDING[presence.thread]
            _sync_users -= 1
            if _sync_users == 0:
                for name, fn in _SYNC_WRAPPERS.items():
                    if torch.Tensor.__dict__.get(name) is fn:
                        delattr(torch.Tensor, name)


_SKIP_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
              os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


_HANDLERS = frozenset(("__torch_dispatch__", "__torch_function__"))


def _users_stack(frame: Any) -> bool:
    """Whether no frame on the Python stack is torch's, this package's or a handler's: torch's
    Python changes the mode stacks in steps (``handle_torch_function`` pops a mode through
    contextlib, whose frames are the standard library's), and a user's mode above the engine's
    is popped while its handler runs, so the stack's top alone looks like plain Python."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_SKIP_DIRS) or code.co_name in _HANDLERS:
            return False
        frame = frame.f_back
    return True


def _profile_point(presence_ref: weakref.ref) -> Any:
    """The profile function of Note [any call is a safe point]."""

    def point(frame: Any, event: str, arg: Any) -> None:
        if event != "return" and event != "c_return":
            return
        p = presence_ref()
        if p is None or p.pending is None or not p.active:
            sys.setprofile(None)
            if p is not None:
                p._profiling = False
            return
        if p._plain_python_here() and _users_stack(frame):
            sys.setprofile(None)
            p._profiling = False
            p.safe_point()

    return point


class _StepHook:
    """One optimizer step hook for the whole process, registered once and never removed.

    torch runs the global step hooks while iterating their OrderedDict; registering or removing
    one from another thread meanwhile (two threads, two engines: one entering or leaving while
    the other's step runs its hook, which flushes and so lets the other thread run) raised
    "OrderedDict mutated during iteration" in the stepping thread. Each thread's Presence is
    looked up here instead (one dict lookup per optimizer step). A presence stays registered
    between contexts (adding and removing cost about 6 us per context, Note [cheap contexts] in
    api.py; ``Presence.in_context`` says whether a step counts), weakly: a thread that ends
    without closing its presence does not keep its engine alive."""

    _by_thread: dict[int, weakref.ref] = {}
    _registered = False
    _lock = threading.Lock()

    def __init__(self, thread: int, presence: Any) -> None:
        self.thread, self.presence = thread, presence

    @classmethod
    def add(cls, presence: Any) -> _StepHook:
        with cls._lock:
            if not cls._registered:
                register_optimizer_step_post_hook(cls._dispatch)
                cls._registered = True
            handle = cls(presence.thread, presence)
            cls._by_thread[presence.thread] = weakref.ref(presence)
            return handle

    @classmethod
    def _dispatch(cls, *args: Any) -> None:
        ref = cls._by_thread.get(threading.get_ident())
        presence = ref() if ref is not None else None
        if presence is not None and presence.in_context:
            presence._after_step(*args)

    def remove(self) -> None:
        with _StepHook._lock:
            ref = _StepHook._by_thread.get(self.thread)
            if ref is not None and ref() in (self.presence, None):
                del _StepHook._by_thread[self.thread]


class Presence:
    """Pushes and pops one engine's modes on its own thread."""

    def __init__(self, engine: Any, modes: tuple[Any, ...]) -> None:
        self.engine = engine
        self.modes = modes
        self.active = False
        self.thread = threading.get_ident()
        self.pending: str | None = None
        self.aside = False
        self.steps_aside = 0
        self._hooks: list[Any] = []
        self._step_hook: Any = None
        self.in_context = False  # between enter() and leave(): optimizer steps count
        # Note [measured trial]
        self.ticks_from: str | None = None  # "step" once an optimizer has stepped
        self.trial: str | None = None  # the side being timed: "engine", "eager" or None
        self.periods: list[float] = []  # engine rounds of the trial
        self.eager_periods: list[float] = []  # eager rounds, each after an engine round
        self.last_tick: float | None = None
        self.verdict: str | None = None  # the last trial's outcome, until a probe reopens it
        self.verdict_decisions = 0  # the compile manager's decisions when it was given
        self.waiting = False  # aside until the compiles in flight finish (Note [waiting aside])
        self.loan = CoreLoan()  # a core lent to the compile while waiting (Note [compile cores])
        self._depth = 0
        self._tick_hooks: list[Any] = []
        self.calls_in_context = 0  # outermost module calls in the current context
        # Note [root ticks]: id -> weak reference of recent outermost modules
        self._roots: dict[int, weakref.ref] = {}
        self._tick_kind: str | None = None  # "global" or "roots" while tick hooks are on
        self._retick = False  # change the tick hooks' kind at the next outermost call end
        self.contexts = 0  # contexts entered (Note [contexts are rounds])
        self.asides_said = 0
        self.probing = False  # back in the engine for a probe, no verdict yet
        self.probes_in_vain = 0  # probes that ended aside again (Note [probes back off])
        self.probe_rounds = 0  # rounds of the current probe (Note [probes back off])
        self.generation = 0  # api.py's clear_caches() generation this presence serves
        self._sync_wrapped = False  # Note [sync points are safe points]
        self._syncs = 0  # syncs since the last sync round (Note [syncs are rounds])
        self._profiling = False  # Note [any call is a safe point]
        # Note [quiet contexts]: the next context may only count; probe due at this round
        self.quiet = False
        self.quiet_until = 0
        # Note [learning budget] in budget.py
        opts = engine.options
        self.account = Account(opts.budget / 100.0 if opts.step_aside else 0.0)
        self._round_on = False  # the engine was on during the round now running
        self._landing = False  # aside on the budget with a compile in flight (a core lent)
        self._held = False  # aside on the budget after a stint that held a compile back
        self._grace = 0  # rounds after a landing in which the account does not send it aside
        self._held_mark = M.compiles_held  # when the engine last went aside on the budget
        self.saving = bool(self.account.share) and not engine.compiler.programs.warm \
            and not _distributed().active()  # aside to stay within the budget
        if not self.saving:
            self.account.share = 0.0
        policy.hold_compiles(self.saving)  # this thread's (a presence is made on its thread)

    def activate(self) -> None:
        self.quiet = False
        self._round_on = True
        if not self.active:
            for m in self.modes:
                m.__enter__()
            self.active = True
            opts = self.engine.options
            if opts.gc_headroom:
                collector.hold(opts.max_trace_ops)  # Note [young collections]
            if (opts.step_flush or opts.step_aside) and self._step_hook is None:
                self._step_hook = _StepHook.add(self)
            if opts.step_aside and self.ticks_from in (None, "forward", "sync"):
                self._install_tick_hooks()  # rounds of programs without an optimizer

    def deactivate(self) -> None:
        self.quiet = False
        if self.active:
            for m in reversed(self.modes):
                m.__exit__(None, None, None)
            self.active = False
            if self.engine.options.gc_headroom:
                collector.release()  # (held while active: a failed exit keeps it held)
            if self._tick_hooks:
                self._install_tick_hooks()  # Note [root ticks]: hooks on the roots only

    # ---- contexts (Note [contexts are rounds]) --------------------------------------------------
    def wants_modes(self) -> bool:
        """Whether entering a context should push the modes (not while aside or timing eager)."""
        return not (self.aside or self.waiting or self.saving or self.trial == "eager")

    def enter(self) -> None:
        """The outermost context is entered (again): a safe point in plain Python."""
        self.quiet = False
        self.contexts += 1
        self.in_context = True
        opts = self.engine.options
        ticks = self.ticks_from  # Note [cheap contexts] in api.py: "context" is the common case
        if (ticks is None or ticks == "forward" or ticks == "sync") and self.contexts > 1 \
                and opts.step_aside and self.calls_in_context <= 1:
            if ticks is not None and self.trial is not None:
                self._time_anew()  # rounds change meaning
            ticks = self._ticks_now("context")
            self._remove_tick_hooks()
        self.calls_in_context = 0
        if ticks == "sync" and opts.step_aside:
            _wrap_sync_methods(self, True)  # off between contexts (leave)
        if not (self.aside or self.waiting or self.saving or self.trial == "eager"):
            self.activate()  # also installs the step hook and, where they are rounds, tick hooks
        else:
            if (self.waiting or self._landing) and opts.lend_core:
                self.loan.lend()  # Note [compile cores]: again, inside the context only
            if self._step_hook is None and (opts.step_flush or opts.step_aside):
                self._step_hook = _StepHook.add(self)  # counts optimizer steps while aside
            if (ticks is None or ticks == "forward" or ticks == "sync") and opts.step_aside:
                self._install_tick_hooks()
        if self.pending is not None:
            self._install_hooks()

    def leave(self) -> None:
        """The outermost context ends (its trace already flushed): end a round, act on a pending
        step-aside, and take the modes and every global hook off until the next context."""
        try:
            if self.ticks_from == "context":
                self._round_ended()
            elif self.pending is not None:
                self.safe_point()
        finally:
            self.loan.give_back()  # outside the context the program's own thread count
            self.in_context = False  # the step hook stays registered (see _StepHook)
            if self._sync_wrapped and self.pending is None:
                _wrap_sync_methods(self, False)  # sync rounds count inside contexts only
            if self._tick_hooks:
                self._remove_tick_hooks()
            if self.active:
                self.deactivate()
            if self._hooks:
                self._remove_hooks()
            self._note_quiet()

    def _note_quiet(self) -> None:
        """Note [quiet contexts]: whether the next context may only count, until which round."""
        if (self.aside and self.ticks_from == "context" and self.trial is None
                and not self.waiting and self.pending is None and not self.active
                and not self._hooks and not self._tick_hooks and not self._sync_wrapped
                and self._step_hook is not None
                and (self.engine.guard is None or not self.engine.guard.pushed)):
            every = self.probe_interval()
            self.quiet_until = every if every else 1 << 62
            self.quiet = True

    def close(self) -> None:
        self.quiet = False
        self.loan.give_back()
        self.in_context = False
        self._remove_profile_point()
        if self._sync_wrapped:
            _wrap_sync_methods(self, False)
        self._remove_tick_hooks()
        self.deactivate()
        self._remove_hooks()
        if self.trial is not None:
            self.trial = None
            M.trials_running = 0
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    # ---- stepping aside -----------------------------------------------------------------------
    def request_aside(self, reason: str) -> None:
        """Ask to leave the mode stack at the next safe point (Note [stepping aside])."""
        self.quiet = False
        if self.pending is None and not self.aside:
            self.pending = reason
            self._install_hooks()
            _wrap_sync_methods(self, True)
            self._install_profile_point()

    def _install_profile_point(self) -> None:
        """Note [any call is a safe point]: only on this presence's thread, over no other hook,
        in a program without module calls, optimizer steps or contexts as its rounds."""
        if (self.ticks_from in (None, "sync") and threading.get_ident() == self.thread
                and self.active and sys.getprofile() is None
                and not torch._C._autograd._profiler_enabled()):
            sys.setprofile(_profile_point(weakref.ref(self)))
            self._profiling = True

    def _remove_profile_point(self) -> None:
        if self._profiling and threading.get_ident() == self.thread:
            if getattr(sys.getprofile(), "__qualname__", "").startswith("_profile_point"):
                sys.setprofile(None)
            self._profiling = False

    def _unwrap_sync(self) -> None:
        if self._sync_wrapped and self.ticks_from != "sync":  # Note [syncs are rounds]
            _wrap_sync_methods(self, False)

    def _ticks_now(self, kind: str) -> str:
        """Rounds come from ``kind`` from now on; sync rounds end (Note [syncs are rounds])."""
        self.quiet = False
        was, self.ticks_from = self.ticks_from, kind
        if was == "sync" and self.pending is None:
            self._unwrap_sync()
        return kind

    def consider_sync_rounds(self, after: int = SYNC_ROUNDS_AFTER) -> None:
        """At every 32nd flush, and when stepping aside (``after`` 0): syncs become the rounds
        of a program that has no other kind (Note [syncs are rounds])."""
        self.quiet = False
        if (self.ticks_from is None and self.in_context and self.engine.options.step_aside
                and self.engine.compiler.flushes >= after):
            self.ticks_from = "sync"
            self._syncs = 0
            _wrap_sync_methods(self, True)

    def _plain_python_here(self) -> bool:
        """In the engine's thread, outside its handlers and outside any autograd node
        (autograd restores the mode stacks after a node, and would put the dispatch mode back
        on a presence that believes it is aside)."""
        if _graph_task() != -1 or threading.get_ident() != self.thread or self.engine.flushing:
            return False
        return not self.active or (_current_mode() is self.modes[-1] and not self.modes[0].held)

    def sync_point(self) -> None:
        """After a sync method returned a value (Notes [sync points are safe points], [syncs
        are rounds])."""
        self.quiet = False
        if self.ticks_from == "sync" and self.in_context:
            self._syncs += 1
            if self._syncs >= SYNC_ROUND and self._plain_python_here():
                self._syncs = 0
                self._round_ended()  # acts on a pending step-aside too
                return
        if self.pending is None:
            self._unwrap_sync()
            return
        if self.active and self._plain_python_here():
            self.safe_point()

    def safe_point(self) -> None:
        """Called in plain Python on the engine's thread: act on a pending step-aside."""
        # not while flushing: a module the engine's program calls is inside its handlers
        if (self.pending is not None and self.active and not self.engine.flushing
                and threading.get_ident() == self.thread):
            reason, self.pending = self.pending, None
            self._unwrap_sync()
            self._go_aside(reason)

    def _go_aside(self, reason: str) -> None:
        self.quiet = False
        self.pending = None  # also when a trial decides: a stale request would act on re-entry
        self._remove_profile_point()
        self._unwrap_sync()
        self.engine.flush("step_aside")
        self.deactivate()
        self.consider_sync_rounds(0)  # no rounds yet: no probe without them
        self.aside = True
        self.steps_aside = 0
        M.step_asides += 1
        if self._hooks and self._tick_hooks:
            self._retick = True  # the step-aside hook comes off between calls (Note [root ticks])
        if self.probing:  # Note [probes back off]
            self.probing = False
            self.probes_in_vain = min(self.probes_in_vain + 1, PROBE_BACKOFF_MAX)
        # said once as a warning; every later step-aside (after each probe) at INFO
        level = logging.INFO if self.asides_said else logging.WARNING
        self.asides_said += 1
        log.log(level, "adaptive_eager: stepping aside (%s); this thread runs plain eager, "
                "probing again after %d rounds", reason, self.probe_interval())

    def probe_interval(self) -> int:
        """Rounds aside before the next probe (Note [probes back off]); 0: never."""
        return self.engine.options.probe_every << self.probes_in_vain

    def _engine_gains(self) -> None:
        """A verdict for the engine: probes start from ``probe_every`` again."""
        self.probing = False
        self.probes_in_vain = 0

    def _after_step(self, *args: Any) -> None:
        """After every optimizer step: end the trace there (one trace per training iteration,
        as torch_xla's mark_step), and drive stepping aside and probing."""
        self.quiet = False
        if threading.get_ident() != self.thread:
            return
        if self.active and self.pending is None and self.engine.options.step_flush:
            self.engine.flush("optimizer_step")
            if args:
                realize_grads(args[0])
        if self.ticks_from != "step":
            if self.trial is not None:
                self._time_anew()  # rounds change meaning
            self._ticks_now("step")
            self._remove_tick_hooks()  # optimizer steps are the rounds from now on
        self._round_ended()
        if self._hooks and self.pending is None:
            self._remove_hooks()  # acted on: aside, no module call should take the slow path

    def _round_ended(self) -> None:
        """At a tick, in plain Python on the engine's thread (Note [measured trial])."""
        self.quiet = False
        if self.account.share and self._spend():
            return
        if self.trial is not None:
            self._time_round()
        elif self.waiting:
            # compiling() takes locks (~3 us a round): asked only once the process-wide count
            # of compiles in flight, which each compile's done-callback lowers, says none, or
            # every 16th round (another thread's compile may hold the count up)
            self.steps_aside += 1
            if ((not M.compiles_pending or (self.steps_aside & 15) == 0)
                    and not self.engine.compiler.compiling()):
                self.waiting = False
                self.loan.give_back()
                self.activate()
                log.info("adaptive_eager: compiles done; back in the engine")
        elif self.aside:
            self.steps_aside += 1
            every = self.engine.options.probe_every << self.probes_in_vain  # probe_interval()
            if every and self.steps_aside >= every:
                self.aside = False
                self.probing = True
                self.probe_rounds = 0
                self.verdict = None
                self.engine.compiler.new_probe()
                self.activate()
                log.info("adaptive_eager: probing again after %d rounds aside", every)
        elif (self.active and self.pending is None and M.compiles_pending
              and self.engine.options.step_aside and self.engine.compiler.compiling()):
            # Note [waiting aside]: a compile is in flight and op-by-op replay is slower than
            # eager; nothing more is learned by recording until the program is ready.
            self.engine.flush("compile_wait")
            self.deactivate()
            self.waiting = True
            if self.engine.options.lend_core:
                self.loan.lend()
            self.steps_aside = 0
            M.compile_waits += 1
            log.info("adaptive_eager: plain eager while compiling")
        elif self.probing and self.trial is None and self.pending is None and self.active:
            self.probe_rounds += 1
            compiler = self.engine.compiler
            if (self.probe_rounds >= PROBE_ROUNDS and compiler.probe_start is not None
                    and compiler.flushes - compiler.probe_start < policy.PROBE_FLUSHES):
                # Note [probes back off]: rounds that record nothing end a probe too
                self._go_aside(f"a probe of {self.probe_rounds} rounds flushed "
                               f"{compiler.flushes - compiler.probe_start} times")
        else:
            self.safe_point()

    # ---- the learning budget (Note [learning budget] in budget.py) ---------------------------
    def _spend(self) -> bool:
        """At a round end: account the round that ended (Note [learning budget] in budget.py);
        True if the budget took this round end (aside on it, or coming back from it)."""
        now = time.perf_counter()
        acc = self.account
        acc.round_ended(now, self.ticks_from,
                        self._round_on or self.active or self.waiting or M.compiles_pending > 0)
        self._round_on = self.active
        if self.trial is not None or self.aside or self.probing or self.verdict == "engine":
            return False
        if self.saving:
            M.budget_rounds += 1
            if not self._landing and now < acc.due:
                return True  # the common round aside: nothing to pay for yet
        if acc.base is None:
            return self.saving  # no eager round measured yet: nothing to weigh against
        if _distributed().active():  # Note [ranks agree]: no account in a distributed job
            acc.share = 0.0
            policy.hold_compiles(False)
            if self.saving:
                self._come_back("a distributed job")
            return False
        spent, allowance = acc.spent(), acc.allowance(now)
        policy.hold_compiles(spent + policy.compile_cost() > allowance)
        if self.saving:
            if self._landing and (not M.compiles_pending or (M.budget_rounds & 15) == 0) \
                    and not self.engine.compiler.compiling():
                self._grace = GRACE_ROUNDS
                self._come_back("a program landed")
            elif acc.affords_a_round(now, policy.compile_cost() if self._held else 0.0):
                self._come_back(f"{spent * 1e3:.1f} ms spent of {allowance * 1e3:.1f} allowed")
            return True
        if self.waiting:
            self._grace = GRACE_ROUNDS  # counted down from the compile's landing
            return False
        if self._grace:  # a program that landed is timed (and tried) before the account speaks
            self._grace -= 1
            return False
        if spent > allowance and self.active and self.pending is None:
            self.engine.flush("budget")
            self.deactivate()
            self.saving = True
            # Note [compile cores]: a compile in flight stalls a full OpenMP team even at the
            # lowest priority (2.6 s of eager's became 11 s): the core is lent while aside too
            self._landing = M.compiles_pending > 0
            if self._landing and self.engine.options.lend_core:
                self.loan.lend()
            # a compile held in this stint: come back when it is affordable too
            self._held, self._held_mark = M.compiles_held != self._held_mark, M.compiles_held
            M.budget_asides += 1
            log.info("adaptive_eager: plain eager within the learning budget (%.1f ms spent "
                     "beyond eager's, %.1f ms allowed)", spent * 1e3, allowance * 1e3)
            return True
        return False

    def _come_back(self, why: str) -> None:
        self.saving = False
        self._landing = False
        self.loan.give_back()
        self.activate()
        log.info("adaptive_eager: in the engine again (learning budget: %s)", why)

    # ---- the measured trial (Note [measured trial]) -------------------------------------------
    def start_trial(self) -> None:
        """Called after a flush once the compile manager has settled."""
        self.quiet = False
        if self.verdict == "engine" and self.trial is None:
            decisions = len(self.engine.compiler.decided)
            if decisions != self.verdict_decisions:  # Note [measured trial]: time it again
                self.verdict = None
        if (self.trial is not None or self.verdict is not None or self.aside
                or self.pending is not None or not self.active):
            return
        if _distributed().active():
            # Note [ranks agree]: ranks settle at different steps (each times its own runs),
            # so a trial would run fused rounds on one replica while another runs eager ones
            # (bitwise different arithmetic: DDP replicas diverged in 1 of 5 runs). A job
            # steps aside only on the agreed estimate, at the same flush on every rank.
            self.verdict = "engine"
            self.verdict_decisions = len(self.engine.compiler.decided)
            self._engine_gains()
            return
        self.trial = "engine"
        self._time_anew()

    def _time_anew(self) -> None:
        self.periods, self.eager_periods, self.last_tick = [], [], None

    def _time_round(self) -> None:
        """At a tick during a trial: note the round that ended, switch sides (Note [measured
        trial])."""
        now = time.perf_counter()
        if self.last_tick is None and not self.periods and not self.eager_periods \
                and not M.trials_running:
            M.trials += 1  # counted from the first tick: a program without rounds has no trial
            M.trials_running = 1
        if self.last_tick is not None:
            (self.periods if self.trial == "engine" else self.eager_periods).append(
                now - self.last_tick)
            if (len(self.periods) >= TRIAL_TICKS and len(self.eager_periods) >= TRIAL_TICKS) or (
                    self.trial == "eager"
                    and clear_ratio(self.periods, self.eager_periods) is not None):
                self._decide_trial()  # Note [clear trials]: a clear verdict ends it early
                return
            if self.trial == "engine":
                self.engine.flush("trial")
                self.deactivate()
                self.trial = "eager"
            else:
                self.trial = "engine"
                self.activate()
        self.last_tick = time.perf_counter()

    def _decide_trial(self) -> None:
        engine, eager = _median(self.periods), _median(self.eager_periods)
        ratios = [a / b for a, b in zip(self.periods, self.eager_periods) if b > 0]
        ratio = _median(ratios) if ratios else float("inf")
        self._time_anew()
        self.trial = None
        M.trials_running = 0
        detail = (f"median round {engine * 1e3:.3f} ms under the engine, {eager * 1e3:.3f} ms "
                  f"in plain eager, {ratio:.3f}x eager's time over alternating rounds")
        if trial_verdict(ratio) == "engine":
            self.verdict = "engine"
            self.verdict_decisions = len(self.engine.compiler.decided)
            self._engine_gains()
            self.activate()
            log.info("adaptive_eager: trial: staying in the engine (%s)", detail)
        else:
            self.verdict = "eager"
            self._go_aside(f"trial: {detail}")

    def _before_call(self, module: Any, inputs: Any) -> None:
        # a module the engine's own program calls while flushing is no round of the user's
        if threading.get_ident() == self.thread and not self.engine.flushing:
            if self._retick and self._depth == 0:  # Note [root ticks]: between outermost calls
                if self._hooks and self.pending is None:
                    self._remove_hooks()  # the step-aside hook has done its work
                ref = self._roots.get(id(module))
                if not self._put_tick_hooks() and (ref is None or ref() is not module):
                    return  # no hook of the new kind will see this call end
            self._depth += 1

    def _after_call(self, module: Any, inputs: Any, output: Any) -> None:
        if threading.get_ident() != self.thread or self.engine.flushing:
            return
        if self._depth <= 0:  # hooks installed mid-call: this call was never counted
            return
        self._depth -= 1
        if self._depth == 0 and self.ticks_from in (None, "forward", "sync"):
            if self.ticks_from == "sync":
                if self.trial is not None:
                    self._time_anew()  # rounds change meaning
                self._ticks_now("forward")
            self.ticks_from = "forward"
            self.calls_in_context += 1
            roots = self._roots
            ref = roots.get(id(module))
            if ref is None or ref() is not module:  # Note [root ticks]
                roots.pop(id(module), None)
                if len(roots) >= MAX_ROOTS:
                    del roots[next(iter(roots))]
                roots[id(module)] = weakref.ref(module)
            self._round_ended()

    def _live_roots(self) -> list[Any]:
        """The roots to tick on while the engine is off; none (global hooks) while it is on."""
        if self.active:
            return []
        return [m for m in (r() for r in self._roots.values()) if m is not None]

    def _install_tick_hooks(self) -> None:
        """Tick hooks of the kind the engine's state wants (Note [root ticks]). Installed ones
        change kind at the start of the next outermost call (``_before_call``): never from a
        forward hook, whose caller may be iterating the very dict (torch's exception path)."""
        self.quiet = False
        if self._tick_hooks:
            self._retick = ("roots" if self._live_roots() else "global") != self._tick_kind
            return
        self._put_tick_hooks()

    def _put_tick_hooks(self) -> bool:
        """Replace the tick hooks by the wanted kind; True if they are global."""
        roots = self._live_roots()
        kind = "roots" if roots else "global"
        self._remove_tick_hooks()
        self._depth = 0
        if kind == "roots":
            _hide_ticks_from_torchscript()
            _hide_ticks_from_pickles()
            try:
                before, after = _RootTick(self, False), _RootTick(self, True)
                for m in roots:
                    self._tick_hooks.append(m.register_forward_pre_hook(before))
                    self._tick_hooks.append(m.register_forward_hook(after, always_call=True))
            except Exception:  # a module that takes no hooks (TorchScript): global ones
                self._remove_tick_hooks()
                kind = "global"
        if kind == "global":
            self._tick_hooks = [  # Note [hooks under Dynamo]: not bound methods
                register_module_forward_pre_hook(_RootTick(self, False)),
                register_module_forward_hook(_RootTick(self, True), always_call=True)]
        self._tick_kind = kind
        return kind == "global"

    def _remove_tick_hooks(self) -> None:
        for h in self._tick_hooks:
            h.remove()
        self._tick_hooks = []
        self._tick_kind = None
        self._retick = False

    def _install_hooks(self) -> None:
        self.quiet = False
        if not self._hooks:
            self._hooks = [register_module_forward_hook(_AsideHook(self))]
            if self._step_hook is None:
                self._step_hook = _StepHook.add(self)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


@contextlib.contextmanager
def hooks_hidden(dicts: tuple[dict, ...], ours: Any) -> Iterator[None]:
    """Take the hooks ``ours(hook)`` selects out of these hook dicts for the block and put them
    back under their own handles (a tracer that cannot handle the engine's hooks: TorchScript,
    strict torch.export); they come back at the end of each dict."""
    saved = []
    for d in dicts:
        taken = {k: h for k, h in d.items() if ours(h)}
        for k in taken:
            del d[k]
        saved.append((d, taken))
    try:
        yield
    finally:
        for d, taken in saved:
            d.update(taken)


def _hide_ticks_from_torchscript() -> None:
    """``torch.jit.script`` compiles every hook on the module it scripts (``get_hook_stubs``):
    a root's tick hooks are not scriptable and are no part of the user's model (Note [root
    ticks]), so they are left out while it looks; a user's own hooks are scripted as in eager."""
    from torch.jit import _recursive

    orig = _recursive.get_hook_stubs
    if getattr(orig, "_ae_wrapped", False):
        return

    def get_hook_stubs(nn_module: Any) -> Any:
        with hooks_hidden((nn_module._forward_hooks, nn_module._forward_pre_hooks),
                          lambda h: type(h) is _RootTick):
            return orig(nn_module)

    get_hook_stubs._ae_wrapped = True  # type: ignore[attr-defined]
    _recursive.get_hook_stubs = get_hook_stubs


_TICK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_TICK_EXTRAS = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_forward_pre_hooks_with_kwargs")


def _hide_ticks_from_pickles() -> None:
    """A root's tick hooks are the engine's, not the model's (Note [root ticks]): ``torch.save``
    of the module, ``pickle`` and ``copy.deepcopy`` leave them out (``Module.__getstate__``),
    so a checkpoint written under the engine loads where the engine is absent, and under
    ``torch.load(weights_only=True)``'s allow-list of globals."""
    orig = torch.nn.Module.__getstate__
    if getattr(orig, "_ae_wrapped", False):
        return

    @functools.wraps(orig)
    def __getstate__(self: torch.nn.Module) -> Any:
        state = orig(self)
        for name in _TICK_DICTS:
            hooks = state.get(name)
            if not hooks or not any(type(h) is _RootTick for h in hooks.values()):
                continue
            ours = {k for k, h in hooks.items() if type(h) is _RootTick}
            state[name] = type(hooks)((k, h) for k, h in hooks.items() if k not in ours)
            for extra in _TICK_EXTRAS:  # the hooks' flags, keyed by the same handle ids
                flags = state.get(extra)
                if flags and not ours.isdisjoint(flags):
                    state[extra] = type(flags)((k, v) for k, v in flags.items() if k not in ours)
        return state

    __getstate__._ae_wrapped = True  # type: ignore[attr-defined]
    torch.nn.Module.__getstate__ = __getstate__  # type: ignore[method-assign]


class _RootTick:
    """A tick hook, on one root module (Note [root ticks]) or global. It holds its presence
    weakly (the user's module must not keep the engine alive), copies and pickles as an inert
    hook, and is nothing to Dynamo (Note [hooks under Dynamo])."""

    __slots__ = ("presence", "after")

    def __init__(self, presence: Presence | None, after: bool) -> None:
        self.presence = weakref.ref(presence) if presence is not None else None
        self.after = after

    @_seen_by_dynamo
    def __call__(self, module: Any, args: Any, *output: Any) -> None:
        if _traced_here():  # folded by Dynamo: the hook traces to nothing
            return
        presence = self.presence() if self.presence is not None else None
        if presence is not None:
            if self.after:
                presence._after_call(module, args, None)
            else:
                presence._before_call(module, args)

    def __deepcopy__(self, memo: dict) -> _RootTick:
        return _RootTick(None, self.after)

    def __reduce__(self) -> tuple:
        return (_RootTick, (None, self.after))


class _AsideHook:
    """The global forward hook that waits for a safe point to step aside (Note [stepping
    aside]); nothing to Dynamo, like the tick hooks (Note [hooks under Dynamo])."""

    __slots__ = ("presence",)

    def __init__(self, presence: Presence) -> None:
        self.presence = weakref.ref(presence)

    @_seen_by_dynamo
    def __call__(self, module: Any, args: Any, output: Any) -> None:
        if _traced_here():
            return
        presence = self.presence()
        if presence is not None and presence.pending is not None:
            presence.safe_point()


def realize_grads(optimizer: Any) -> None:
    """Gradients kept across steps (``zero_grad(set_to_none=False)``, accumulation) are lazy
    tensors the parameter's ``.grad`` slot also holds, so publishing cannot make them plain
    (Note [lazy tensors become real]); after the step's flush, do it here, identity kept."""
    for group in getattr(optimizer, "param_groups", ()):
        for p in group["params"]:
            g = p.grad
            if type(g) is not LazyTensor:
                continue
            real = g._ae_real
            if (real is None or type(real) is not torch.Tensor or g.requires_grad
                    or real.layout is not torch.strided
                    or getattr(getattr(g._ae_trace, "engine", None), "shared", False)):
                continue  # shared: another thread may hold this very object (threads Note)
            p.grad = None
            if g._use_count() == 1:
                become_real(g, real)
            p.grad = g
