"""The hooks that end a presence's rounds: module hooks and the optimizer step hook.

A round (Note [measured trial] in trial.py) ends at an optimizer step, at the end of an
outermost module call, of a context or of a sync; this module holds the hooks behind the first
two and the step-aside hook that waits for a safe point (Note [stepping aside] in aside.py).
The presence (aside.py) decides what a round end means; these hooks find the round ends.

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
process-wide) and whose code carries a file name off the skip list (``_seen_by_dynamo``): Dynamo
inlines it to nothing and the graph is the one compiled without the engine. Compiled code runs
outside the engine anyway (Note [compiled regions]), so module calls inside it are no rounds;
calls outside tick as before, at ~0.2 us more per hook call (measured before ``_traced_here``
added a call). Dynamo guards on how many global hooks there are, not on which: a function
compiled outside a context compiles once more inside, not once per context.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

MAX_ROOTS = 4  # outermost modules remembered for ticks while the engine is off (Note [root ticks])

_get_ident = threading.get_ident
_DYNAMO_FILE = "<adaptive_eager.rounds: engine hook>"  # off Dynamo's skip list


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


class RoundHooks:
    """One presence's hooks: the tick hooks that make its outermost module calls rounds (global
    while the engine is on, on the roots while it is off: Note [root ticks]), the global hook
    that waits for a safe point to step aside, and its share of the optimizer step hook. It
    counts how deep the module calls run, keeps the roots, and tells its presence where an
    outermost call ended; the two live and die together (each holds the other)."""

    def __init__(self, presence: Any) -> None:
        self.presence = presence
        self.thread: int = presence.thread
        self.engine = presence.engine
        self.ticks: list[Any] = []  # the tick hooks' handles
        self.kind: str | None = None  # "global" or "roots" while tick hooks are on
        self.retick = False  # change the tick hooks' kind at the next outermost call's start
        self.depth = 0  # module calls running that the tick hooks saw start
        self.roots: dict[int, weakref.ref] = {}  # id -> weak reference of recent outermost modules
        self.aside_hook: list[Any] = []  # the step-aside hook's handle while one is wanted
        self.step: _StepHook | None = None  # this presence's entry in the optimizer step hook

    # ---- the tick hooks' calls (the hot path: every module call while global hooks are on) ----
    def before_call(self, module: Any) -> None:
        # a module the engine's own program calls while flushing is no round of the user's
        if _get_ident() == self.thread and not self.engine.flushing:
            if self.retick and self.depth == 0:  # Note [root ticks]: between outermost calls
                if self.aside_hook and self.presence.pending is None:
                    self.remove_aside_hook()  # the step-aside hook has done its work
                ref = self.roots.get(id(module))
                if not self.put_ticks() and (ref is None or ref() is not module):
                    return  # no hook of the new kind will see this call end
            self.depth += 1

    def after_call(self, module: Any) -> None:
        if _get_ident() != self.thread or self.engine.flushing:
            return
        if self.depth <= 0:  # hooks installed mid-call: this call was never counted
            return
        self.depth -= 1
        presence = self.presence
        if self.depth == 0 and presence.ticks_from in (None, "forward", "sync"):
            if presence.ticks_from != "forward":
                presence.rounds_from("forward")
            presence.calls_in_context += 1
            roots = self.roots
            ref = roots.get(id(module))
            if ref is None or ref() is not module:  # Note [root ticks]
                roots.pop(id(module), None)
                if len(roots) >= MAX_ROOTS:
                    del roots[next(iter(roots))]
                roots[id(module)] = weakref.ref(module)
            presence.round_ended()

    # ---- putting the tick hooks on and off ----------------------------------------------------
    def live_roots(self) -> list[Any]:
        """The roots to tick on while the engine is off; none (global hooks) while it is on."""
        if self.presence.active:
            return []
        return [m for m in (r() for r in self.roots.values()) if m is not None]

    def install_ticks(self) -> None:
        """Tick hooks of the kind the engine's state wants (Note [root ticks]). Installed ones
        change kind at the start of the next outermost call (``before_call``): never from a
        forward hook, whose caller may be iterating the very dict (torch's exception path)."""
        if self.ticks:
            self.retick = ("roots" if self.live_roots() else "global") != self.kind
            return
        self.put_ticks()

    def put_ticks(self) -> bool:
        """Replace the tick hooks by the wanted kind; True if they are global."""
        roots = self.live_roots()
        kind = "roots" if roots else "global"
        self.remove_ticks()
        self.depth = 0
        presence = self.presence
        if kind == "roots":
            _hide_ticks_from_torchscript()
            _hide_ticks_from_pickles()
            try:
                before, after = _RootTick(presence, False), _RootTick(presence, True)
                for m in roots:
                    self.ticks.append(m.register_forward_pre_hook(before))
                    self.ticks.append(m.register_forward_hook(after, always_call=True))
            except Exception:  # a module that takes no hooks (TorchScript): global ones
                self.remove_ticks()
                kind = "global"
        if kind == "global":
            self.ticks = [  # Note [hooks under Dynamo]: not bound methods
                register_module_forward_pre_hook(_RootTick(presence, False)),
                register_module_forward_hook(_RootTick(presence, True), always_call=True)]
        self.kind = kind
        return kind == "global"

    def remove_ticks(self) -> None:
        for h in self.ticks:
            h.remove()
        self.ticks = []
        self.kind = None
        self.retick = False

    # ---- the step-aside hook and the optimizer step hook ---------------------------------------
    def install_aside_hook(self) -> None:
        if not self.aside_hook:
            self.aside_hook = [register_module_forward_hook(_AsideHook(self.presence))]
            self.add_step_hook()

    def remove_aside_hook(self) -> None:
        for h in self.aside_hook:
            h.remove()
        self.aside_hook = []

    def add_step_hook(self) -> None:
        if self.step is None:
            self.step = _StepHook.add(self.presence)

    def remove_step_hook(self) -> None:
        if self.step is not None:
            self.step.remove()
            self.step = None


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

    def __init__(self, presence: Any, after: bool) -> None:
        self.presence = weakref.ref(presence) if presence is not None else None
        self.after = after

    @_seen_by_dynamo
    def __call__(self, module: Any, args: Any, *output: Any) -> None:
        if _traced_here():  # folded by Dynamo: the hook traces to nothing
            return
        presence = self.presence() if self.presence is not None else None
        if presence is not None:
            if self.after:
                presence.hooks.after_call(module)
            else:
                presence.hooks.before_call(module)

    def __deepcopy__(self, memo: dict) -> _RootTick:
        return _RootTick(None, self.after)

    def __reduce__(self) -> tuple:
        return (_RootTick, (None, self.after))


class _AsideHook:
    """The global forward hook that waits for a safe point to step aside (Note [stepping
    aside] in aside.py); nothing to Dynamo, like the tick hooks (Note [hooks under Dynamo])."""

    __slots__ = ("presence",)

    def __init__(self, presence: Any) -> None:
        self.presence = weakref.ref(presence)

    @_seen_by_dynamo
    def __call__(self, module: Any, args: Any, output: Any) -> None:
        if _traced_here():
            return
        presence = self.presence()
        if presence is not None and presence.pending is not None:
            presence.safe_point()
