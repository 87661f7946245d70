"""Run a trace op by op with eager's own kernels and hand the real values to the lazy tensors.

Replay runs below autograd and ADInplaceOrView: the user's ops already went through autograd (graph
built, version counters bumped) when they were recorded, and doing it again would bump version
counters twice (DESIGN trap 1). Python dispatch, torch-function modes and autocast are off too: the
recorded ops are what eager ran after autocast, and they must not be intercepted again.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from adaptive_eager.core.meta import meta_of
from adaptive_eager.dispatch.lazy import LazyTensor, become_real
from adaptive_eager.trace import Slot, Trace


_Tensor = torch.Tensor
_strided = torch.strided


class MetadataMismatch(AssertionError):
    """A real output differs from the metadata its lazy tensor promised (an engine bug)."""


class ReplayGuard:
    """Everything replay must switch off, entered once per trace."""

    def __enter__(self) -> None:
        self._guards = (torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction(),
                        torch._C._AutoDispatchBelowADInplaceOrView(), torch._C._DisableAutocast())
        for g in self._guards:
            g.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for g in reversed(self._guards):
            g.__exit__(*exc)


def _real(a: Any, env: list) -> Any:
    t = type(a)
    if t is Slot:
        return env[a.i]
    if t is LazyTensor:
        return a._ae_real
    if t is list or t is tuple:
        return t(_real(x, env) for x in a)
    return a


def _store(slots: Any, res: Any, env: list) -> None:
    if type(slots) is int:
        env[slots] = res
    elif slots is not None:
        for s, r in zip(slots, res):
            if s is not None:
                _store(s, r, env)


def live_slots(trace: Trace) -> list[int]:
    """Slots whose lazy tensor is still referenced (by the user or by autograd)."""
    return [s for s, ref in enumerate(trace.refs) if ref() is not None]


def _release_plan(trace: Trace, live: list[int]) -> tuple[dict[int, list[int]], list]:
    """Note [replay liveness]
    A value eager would already have freed must not outlive its last use in replay either: a
    loop that makes and drops large temporaries with no sync in between would otherwise hold all
    of them at once. A slot is dead when its lazy tensor is gone (the weak reference in
    ``trace.refs``: the trace never holds the user's lazy tensors); its value is dropped right
    after the last op that reads it (``trace.last``), or, when no op reads it, right after the op
    that made it. Live slots are kept for publish. Paths that need more than the values
    (replay_checked compares metadata) observe each op's outputs as they are made
    (``replay(observe=...)``) rather than keeping every value to the end.

    Returns the plan as a dict by op and as a list by op (None, or a tuple of slots: the C
    loop's form)."""
    alive = set(live)
    made: list[int] | None = None
    plan: dict[int, list[int]] = {}
    for s, last in enumerate(trace.last):
        if s not in alive:
            if last < 0:  # never read: dropped once made
                if made is None:
                    made = _producers(trace)
                last = made[s]
            plan.setdefault(last, []).append(s)
    drops: list = [None] * len(trace.ops)
    for i, slots in plan.items():
        if 0 <= i < len(drops):
            drops[i] = tuple(slots)
    return plan, drops


def _producers(trace: Trace) -> list[int]:
    """The index of the op that made each slot (-1 for none)."""
    made = [-1] * trace.n_slots
    for i, (_op, _args, _kwargs, slots) in enumerate(trace.ops):
        stack = [slots]
        while stack:
            x = stack.pop()
            if type(x) is int:
                made[x] = i
            elif x is not None:
                stack.extend(x)
    return made


def call_plan(trace: Trace) -> list[tuple]:
    """Note [replay call plan]
    Per op: the C++ callable behind its OpOverload (``OpOverload.__call__`` is one more Python
    frame per op), the positions of its top-level arguments that may need resolving (slot
    markers, and tensors from outside, which may be lazy tensors holding values), and whether it
    has arguments that need the general walk (lists holding slots or lazy tensors, marked
    kwargs). Every trace that ends at the same trie node has the same keys, hence the same
    argument structure: the plan is made once per TraceEntry and reused on every hit."""
    plan = []
    for op, args, kwargs, _slots in trace.ops:
        pos = []
        simple = True
        for j, a in enumerate(args):
            t = type(a)
            if t is Slot or t is LazyTensor:
                pos.append(j)
            elif isinstance(a, _Tensor):
                pos.append(j)  # external: the same key may see a lazy tensor next run
            elif (t is list or t is tuple) and _needs_walk(a):
                simple = False
        if kwargs and any(_needs_walk(v) for v in kwargs.values()):
            simple = False
        plan.append((getattr(op, "_op", op), tuple(pos), simple))
    return plan


def _needs_walk(a: Any) -> bool:
    t = type(a)
    if t is Slot or isinstance(a, _Tensor):
        return True
    if t is list or t is tuple:
        return any(_needs_walk(x) for x in a)
    return False


def replay(trace: Trace, live: list[int], check: bool, entry: Any = None,
           observe: Callable[[int, list], None] | None = None) -> list:
    """Execute every op of ``trace`` in order; return the env of real values by slot.

    With the C accelerator (``accel``, Note [replay in C] in _hot.c) the loop runs in C, which
    hands the entries it does not take to ``_replay_one`` (this loop's own body); with
    ADAPTIVE_EAGER_ACCEL=0 it runs here. Both give the same values, op for op. ``observe(i,
    env)``, if given, sees each op's outputs before the values nothing reads any more are dropped
    (Note [replay liveness]); it runs the loop here (a rare path: checked replays)."""
    ops = trace.ops
    env: list[Any] = [None] * trace.n_slots
    plan = None
    if entry is not None:
        cached = entry.replay_plan
        if cached is not None and len(cached) == len(ops):
            plan = cached
        else:
            plan = entry.replay_plan = call_plan(trace)
        key = tuple(live)
        rel = entry.release_plan
        if rel is None or rel[0] != key:
            rel = entry.release_plan = (key, *_release_plan(trace, live))
        release, drops = rel[1], rel[2]
    else:
        plan = call_plan(trace)
        release, drops = _release_plan(trace, live)
    grad_ops = trace.grad_ops
    if _c_replay is not None and observe is None and trace.engine.options.accel:
        with ReplayGuard():
            _c_replay(ops, plan, env, drops, grad_ops or None)
        return env
    i = 0
    with ReplayGuard():
        try:
            # the pure-Python path (accel off): one op as the C loop hands it back, per op
            for i in range(len(plan)):
                _replay_one(ops, plan, grad_ops, i, env)
                if observe is not None:
                    observe(i, env)
                drop = release.get(i)
                if drop is not None:
                    for s in drop:
                        env[s] = None
        except Exception as err:  # KeyboardInterrupt/SystemExit pass as they are: no op raised
            _note_replay_error(err, i, ops)
            raise
    return env


def _replay_one(ops: list, plan: list, grad_ops: dict | None, i: int, env: list) -> None:
    """Op ``i`` of a trace, as replay's loop runs it (less the drops): the entries the C loop
    hands back (not simple, in ``grad_ops``, or too many arguments)."""
    call, pos, simple = plan[i]
    _op, args, kwargs, slots = ops[i]
    if simple:
        ra = list(args)
        for j in pos:
            a = ra[j]
            t = type(a)
            if t is Slot:
                ra[j] = env[a.i]
            elif t is LazyTensor:
                ra[j] = a._ae_real
        rk = kwargs
    else:
        ra = _real(args, env)
        rk = {k: _real(v, env) for k, v in kwargs.items()}
    if grad_ops and i in grad_ops:  # Note [grad-mode kernels] in engine.py
        with torch.set_grad_enabled(grad_ops[i]):
            res = call(*ra, **rk)
    elif rk:
        res = call(*ra, **rk)
    else:
        res = call(*ra)
    if type(slots) is int:
        env[slots] = res
    elif slots is not None:
        _store(slots, res, env)


def _note_replay_error(err: BaseException, i: int, ops: list) -> None:
    """The note an error raised at op ``i`` of a replay gets (Exceptions only: an interrupt is
    no op's error)."""
    if isinstance(err, Exception):
        err.add_note(f"adaptive_eager: raised by deferred op {ops[i][0]} (op {i} of a trace of "
                     f"{len(ops)}) when the trace ran; run with adaptive_eager disabled to see "
                     "the line that recorded it")


def publish(trace: Trace, env: list, check: bool, swap: bool = True) -> None:
    """Give each live lazy tensor its real value; those nothing else holds become real tensors
    (Note [lazy tensors become real] in dispatch/lazy.py), unless ``swap`` is off (a flush from
    another thread: the owner thread may be holding those very objects)."""
    inputs: set[int] | None = None
    became: dict[int, torch.Tensor] = {}
    for s, ref in enumerate(trace.refs):
        w = ref()
        if w is not None and w._ae_real is None:
            real = env[s]
            if not isinstance(real, _Tensor):
                # an op gave no tensor where its metadata promised one (an engine bug): this
                # value raises when read, instead of leaving a lazy tensor with no value
                w._ae_error = MetadataMismatch(
                    f"adaptive_eager: replay produced {type(real).__name__} for slot {s}, the "
                    f"lazy tensor said {w._ae_meta}")
                continue
            if check and meta_of(real) is not w._ae_meta:
                raise MetadataMismatch(f"adaptive_eager: replay produced {meta_of(real)} for slot "
                                       f"{s}, the lazy tensor said {w._ae_meta}")
            done = became.get(id(real))
            if done is not None:  # two slots, one value (an op returned its input)
                w._ae_real = done
                continue
            w._ae_real = real
            if (not swap or type(real) is not _Tensor or w.requires_grad
                    or real.layout is not _strided
                    or w._use_count() != 1):
                continue
            if inputs is None:
                inputs = {id(t._ae_real if type(t) is LazyTensor else t) for t in trace.ext}
            if id(real) not in inputs:  # never turn a user's own tensor into a wrapper
                # refused (a weak reference to either impl): w stays lazy, real stays real
                became[id(real)] = w if become_real(w, real) else real


def poison(trace: Trace, err: BaseException) -> None:
    """After a failed run, every live lazy tensor without a value raises ``err`` when read."""
    for ref in trace.refs:
        w = ref()
        # a publish that failed half-way (a MetadataMismatch under check) may have made some
        # of them plain tensors already (Note [lazy tensors become real])
        if type(w) is LazyTensor and w._ae_real is None:
            w._ae_error = err


try:  # the C loop (Note [replay in C] in _hot.c); without the extension, the loop above
    from adaptive_eager import _hot

    _hot.init_replay(Slot, LazyTensor, _replay_one, _store, _note_replay_error)
    _c_replay: Any = _hot.replay
except (ImportError, AttributeError, TypeError):  # not built, or built from older sources
    _c_replay = None
