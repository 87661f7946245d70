"""The engine's presence on a thread's mode stack, and stepping aside when nothing gains.

Note [stepping aside]
A Python dispatch mode costs a few microseconds per op against eager's one; a program whose traces
do not profit from fusion (tiny launch-bound ops, traces that never repeat) pays that for nothing.
When the compile manager's measurements say so, the engine leaves the mode stack. Modes cannot be
popped from inside their own handlers (torch re-pushes them afterwards), so leaving happens at the
next safe point in plain Python: after a module's forward or an optimizer step (a global module
hook installed only while a step-aside is pending, and the optimizer step hook), ``sync()``, or
leaving the context. While aside, the rounds (optimizer steps, the outermost modules' calls,
Note [root ticks] in rounds.py, or contexts) are counted and the engine re-enters after
``probe_every`` of them (doubled after each probe in vain, Note [probes back off]) to measure
again.

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

import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch

from adaptive_eager import collector
from adaptive_eager.compile import policy
from adaptive_eager.cores import CoreLoan
from adaptive_eager.dispatch.lazy import LazyTensor, become_real
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.rounds import RoundHooks, _RootTick, _traced_here  # noqa: F401
from adaptive_eager.saving import LearningBudget
from adaptive_eager.trial import TRIAL_MARGIN, Trial

log = logging.getLogger("adaptive_eager")
# _RootTick lives in rounds.py; checkpoints pickled before its hooks stayed out of pickles
# name it as this module's, and still load

PROBE_BACKOFF_MAX = 5  # doublings of the probe interval at most (Note [probes back off])
PROBE_ROUNDS = 200  # a probe that flushed less than PROBE_FLUSHES times ends here too
SYNC_ROUND = 16  # syncs a round of a program whose rounds are syncs (Note [syncs are rounds])
SYNC_ROUNDS_AFTER = 64  # flushes with no round of another kind before syncs become rounds


def _distributed() -> Any:
    """The distributed module (it imports this one's layer: Note [ranks agree])."""
    from adaptive_eager import distributed

    return distributed


def trial_verdict(ratio: float) -> str:
    """The one place a measured trial is decided: "engine" or "eager" (Note [measured trial] in
    trial.py). ``ratio`` is the median over paired rounds of engine round / eager round.

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


class Presence:
    """Pushes and pops one engine's modes on its own thread, and decides at each round end
    whether the engine stays on the mode stack. Its collaborators: the hooks that find the
    round ends (``RoundHooks``, rounds.py), the measured trials (``Trial``, trial.py) and the
    learning budget (``LearningBudget``, saving.py)."""

    def __init__(self, engine: Any, modes: tuple[Any, ...]) -> None:
        self.engine = engine
        self.modes = modes
        self.active = False
        self.thread = threading.get_ident()
        self.pending: str | None = None
        self.aside = False
        self.steps_aside = 0
        self.in_context = False  # between enter() and leave(): optimizer steps count
        self.ticks_from: str | None = None  # "step" once an optimizer has stepped
        self.waiting = False  # aside until the compiles in flight finish (Note [waiting aside])
        self.loan = CoreLoan()  # a core lent to the compile while waiting (Note [compile cores])
        self.calls_in_context = 0  # outermost module calls in the current context
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
        self.hooks = RoundHooks(self)  # Note [root ticks] in rounds.py
        self.trials = Trial()  # Note [measured trial] in trial.py
        self.budget = LearningBudget(self, _distributed)  # Note [learning budget] in budget.py

    # ---- the collaborators' state as tests and tools read it ----------------------------------
    @property
    def trial(self) -> str | None:  # the side a running trial times, or None
        return self.trials.side

    @property
    def verdict(self) -> str | None:  # the last trial's outcome, until a probe reopens it
        return self.trials.verdict

    @property
    def _tick_kind(self) -> str | None:  # Note [root ticks] in rounds.py
        return self.hooks.kind

    @property
    def _depth(self) -> int:
        return self.hooks.depth

    def activate(self) -> None:
        self.quiet = False
        self.budget.round_on = True
        if not self.active:
            for m in self.modes:
                m.__enter__()
            self.active = True
            opts = self.engine.options
            if opts.gc_headroom:
                collector.hold(opts.max_trace_ops)  # Note [young collections]
            hooks = self.hooks
            if (opts.step_flush or opts.step_aside) and hooks.step is None:
                hooks.add_step_hook()
            if opts.step_aside and self.ticks_from in (None, "forward", "sync"):
                hooks.install_ticks()  # rounds of programs without an optimizer

    def deactivate(self) -> None:
        self.quiet = False
        if self.active:
            for m in reversed(self.modes):
                m.__exit__(None, None, None)
            self.active = False
            if self.engine.options.gc_headroom:
                collector.release()  # (held while active: a failed exit keeps it held)
            if self.hooks.ticks:
                self.hooks.install_ticks()  # Note [root ticks] in rounds.py: on the roots only

    # ---- contexts (Note [contexts are rounds]) --------------------------------------------------
    def wants_modes(self) -> bool:
        """Whether entering a context should push the modes (not while aside or timing eager)."""
        return not (self.aside or self.waiting or self.budget.saving or self.trials.side == "eager")

    def enter(self) -> None:
        """The outermost context is entered (again): a safe point in plain Python."""
        self.quiet = False
        self.contexts += 1
        self.in_context = True
        opts = self.engine.options
        hooks = self.hooks
        ticks = self.ticks_from  # Note [cheap contexts] in api.py: "context" is the common case
        if (ticks is None or ticks == "forward" or ticks == "sync") and self.contexts > 1 \
                and opts.step_aside and self.calls_in_context <= 1:
            ticks = self.rounds_from("context")
            hooks.remove_ticks()
        self.calls_in_context = 0
        if ticks == "sync" and opts.step_aside:
            _wrap_sync_methods(self, True)  # off between contexts (leave)
        budget = self.budget
        if not (self.aside or self.waiting or budget.saving or self.trials.side == "eager"):
            self.activate()  # also installs the step hook and, where they are rounds, tick hooks
        else:
            if (self.waiting or budget.landing) and opts.lend_core:
                self.loan.lend()  # Note [compile cores]: again, inside the context only
            if hooks.step is None and (opts.step_flush or opts.step_aside):
                hooks.add_step_hook()  # counts optimizer steps while aside
            if (ticks is None or ticks == "forward" or ticks == "sync") and opts.step_aside:
                hooks.install_ticks()
        if self.pending is not None:
            hooks.install_aside_hook()

    def leave(self) -> None:
        """The outermost context ends (its trace already flushed): end a round, act on a pending
        step-aside, and take the modes and every global hook off until the next context."""
        try:
            if self.ticks_from == "context":
                self.round_ended()
            elif self.pending is not None:
                self.safe_point()
        finally:
            self.loan.give_back()  # outside the context the program's own thread count
            self.in_context = False  # the step hook stays registered (see rounds._StepHook)
            if self._sync_wrapped and self.pending is None:
                _wrap_sync_methods(self, False)  # sync rounds count inside contexts only
            hooks = self.hooks
            if hooks.ticks:
                hooks.remove_ticks()
            if self.active:
                self.deactivate()
            if hooks.aside_hook:
                hooks.remove_aside_hook()
            self._note_quiet()

    def _note_quiet(self) -> None:
        """Note [quiet contexts]: whether the next context may only count, until which round."""
        hooks = self.hooks
        if (self.aside and self.ticks_from == "context" and self.trials.side is None
                and not self.waiting and self.pending is None and not self.active
                and not hooks.aside_hook and not hooks.ticks and not self._sync_wrapped
                and hooks.step is not None
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
        self.hooks.remove_ticks()
        self.deactivate()
        self.hooks.remove_aside_hook()
        self.trials.stop()
        self.hooks.remove_step_hook()

    # ---- stepping aside -----------------------------------------------------------------------
    def request_aside(self, reason: str) -> None:
        """Ask to leave the mode stack at the next safe point (Note [stepping aside])."""
        self.quiet = False
        if self.pending is None and not self.aside:
            self.pending = reason
            self.hooks.install_aside_hook()
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

    def rounds_from(self, kind: str) -> str:
        """Rounds come from ``kind`` from now on: a running trial's rounds so far change meaning,
        sync rounds end (Note [syncs are rounds])."""
        self.quiet = False
        was, self.ticks_from = self.ticks_from, kind
        if was is not None and self.trials.side is not None:
            self.trials.anew()
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
                self.round_ended()  # acts on a pending step-aside too
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
        hooks = self.hooks
        if hooks.aside_hook and hooks.ticks:  # Note [root ticks] in rounds.py:
            hooks.retick = True  # the step-aside hook comes off between calls
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

    # ---- round ends ---------------------------------------------------------------------------
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
        hooks = self.hooks
        if self.ticks_from != "step":
            self.rounds_from("step")
            hooks.remove_ticks()  # optimizer steps are the rounds from now on
        self.round_ended()
        if hooks.aside_hook and self.pending is None:
            hooks.remove_aside_hook()  # acted on: aside, no module call should take the slow path

    def round_ended(self) -> None:
        """At a tick, in plain Python on the engine's thread (Note [measured trial] in
        trial.py)."""
        self.quiet = False
        budget = self.budget
        if budget.account.share and budget.round_ended(time.perf_counter()):
            return
        if self.trials.side is not None:
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
                self.trials.verdict = None
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
        elif self.probing and self.trials.side is None and self.pending is None and self.active:
            self.probe_rounds += 1
            compiler = self.engine.compiler
            if (self.probe_rounds >= PROBE_ROUNDS and compiler.probe_start is not None
                    and compiler.flushes - compiler.probe_start < policy.PROBE_FLUSHES):
                # Note [probes back off]: rounds that record nothing end a probe too
                self._go_aside(f"a probe of {self.probe_rounds} rounds flushed "
                               f"{compiler.flushes - compiler.probe_start} times")
        else:
            self.safe_point()

    # ---- the measured trial (Note [measured trial] in trial.py) --------------------------------
    def start_trial(self) -> None:
        """Called after a flush once the compile manager has settled."""
        self.quiet = False
        trials = self.trials
        if trials.verdict == "engine" and trials.side is None:
            decisions = len(self.engine.compiler.decided)
            if decisions != trials.verdict_decisions:  # a new decision: time it again
                trials.verdict = None
        if (trials.side is not None or trials.verdict is not None or self.aside
                or self.pending is not None or not self.active):
            return
        if _distributed().active():
            # Note [ranks agree]: ranks settle at different steps (each times its own runs),
            # so a trial would run fused rounds on one replica while another runs eager ones
            # (bitwise different arithmetic: DDP replicas diverged in 1 of 5 runs). A job
            # steps aside only on the agreed estimate, at the same flush on every rank.
            trials.for_engine(len(self.engine.compiler.decided))
            self._engine_gains()
            return
        trials.side = "engine"
        trials.anew()

    def _time_round(self) -> None:
        """At a tick during a trial: note the round that ended, switch sides."""
        trials = self.trials
        if trials.note_round(time.perf_counter()):
            self._decide_trial()
            return
        if trials.last_tick is not None:  # not the trial's first tick
            if trials.side == "engine":
                self.engine.flush("trial")
                self.deactivate()
                trials.side = "eager"
            else:
                trials.side = "engine"
                self.activate()
        trials.last_tick = time.perf_counter()

    def _decide_trial(self) -> None:
        ratio, detail = self.trials.end()
        if trial_verdict(ratio) == "engine":
            self.trials.for_engine(len(self.engine.compiler.decided))
            self._engine_gains()
            self.activate()
            log.info("adaptive_eager: trial: staying in the engine (%s)", detail)
        else:
            self.trials.verdict = "eager"
            self._go_aside(f"trial: {detail}")


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
