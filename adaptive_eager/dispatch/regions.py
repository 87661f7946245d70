"""torch.compile regions inside the engine: compiled code runs as compiled code, on real tensors.

Note [compiled regions]
Dynamo evaluates a compiled function's frame with whatever modes are on the thread's stack. Under
the engine that is the engine's own TorchFunctionMode and TorchDispatchMode: Dynamo traces into
them (and fails, or produces a graph of the engine's bookkeeping), and its guards on the mode
stack differ from the ones compiled outside the engine, so after a recompile or two the function
silently runs uncompiled. The engine does not record what Dynamo runs. Instead, a call of a
compiled function or module made while an engine is active on this thread:

1. flushes the pending trace (the region reads real values);
2. turns every lazy argument into its real value, bridged for autograd by ``_Bridge``: the real
   value has no autograd history of its own, so an identity ``autograd.Function`` hands its
   gradient back to the lazy tensor's history;
3. takes the engine's two modes off the stack (``engine_modes_off``: only those two, wherever
   they are; a user's own modes stay) and runs the compiled code exactly as outside the engine
   (same guards, same compiled graph: results are bitwise the ones outside);
4. marks the autograd nodes the region created (walking back from its outputs to its inputs):
   their backward runs later inside the autograd engine, under the engine's modes, where a
   compiled backward would be handed lazy tensors. A pre-hook on each takes the engine's modes off
   for that node and materializes its gradient inputs (as Note [eager backward] in mode.py).

Compiled kernels read storage directly, so they must never be handed a lazy tensor: a compiled
``optimizer.step`` reads kept gradients through the optimizer, which become plain tensors first
(aside.realize_grads, identity kept); any other lazy tensor the region reaches (a closure, a
module attribute) is one Dynamo models conservatively (``nontraceable_tensor_subclasses``): it
graph-breaks and those ops run on the lazy tensor's value. Dynamo also skips this package's
files: the engine's hooks (optimizer step, module calls) may run inside a compiled region.

Hooks (installed once, cheaply): ``torch.compile`` is wrapped when this package is imported, so
functions compiled afterwards pass through ``region_call`` (torch._dynamo is not imported for
it); once torch._dynamo is loaded, ``_TorchDynamoContext.__call__`` (every newly made compiled
function, ``torch._dynamo.optimize`` too) and ``OptimizedModule.__call__`` (every compiled module,
made before or after) are wrapped as well, and every Dynamo context gets one enter hook: a safety
net for functions compiled before this package was imported, which flushes and leaves the
engine's modes for the call but sees neither arguments nor outputs. With no engine active on the
thread each of these costs one read of the dispatch-stack length. ``torch.export.export`` is
wrapped the same way (``export_call``): inside an engine it flushes and exports with the engine's
modes off, so its fake-tensor tracing never meets the DeferMode.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from adaptive_eager.dispatch.lazy import LazyTensor, materialize, resolve_all
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.rounds import _AsideHook, _RootTick, hooks_hidden

_pop_dispatch_key = torch._C._pop_torch_dispatch_stack


def _pop_dispatch() -> Any:
    return _pop_dispatch_key(None)


_push_dispatch = torch._C._push_on_torch_dispatch_stack
_len_dispatch = torch._C._len_torch_dispatch_stack
_pop_function = torch._C._pop_torch_function_stack
_push_function = torch._C._push_on_torch_function_stack
_len_function = torch._C._len_torch_function_stack


def _engine_mode_types() -> tuple[type, type]:
    from adaptive_eager.dispatch.mode import DeferMode, ReadGuardMode

    return DeferMode, ReadGuardMode


def active_engine() -> Any:
    """The engine whose DeferMode is on this thread's dispatch stack (top first), or None."""
    n = _len_dispatch()
    if n == 0:
        return None
    defer = _engine_mode_types()[0]
    for i in range(n - 1, -1, -1):
        mode = torch._C._get_dispatch_stack_at(i)
        if type(mode) is defer:
            return mode.engine
    return None


@contextlib.contextmanager
def engine_modes_off() -> Iterator[None]:
    """Take the engine's DeferMode and ReadGuardMode off this thread's stacks for the block,
    wherever they are; modes above them are popped and pushed back without them, so a user's
    own modes stay active in the same order."""
    defer, guard = _engine_mode_types()
    taken_d = _take(defer, _len_dispatch, _pop_dispatch, _push_dispatch)
    taken_f = _take(guard, _len_function, _pop_function, _push_function)
    for _, g in taken_f:
        g.held += 1  # off the stack for the block: it neither arms nor leaves meanwhile
    try:
        yield
    finally:
        for _, g in taken_f:
            g.held -= 1
        _give_back(taken_f, _pop_function, _push_function)
        _give_back(taken_d, _pop_dispatch, _push_dispatch)


def _take(kind: type, length: Callable[[], int], pop: Callable[..., Any],
          push: Callable[[Any], None]) -> list[tuple[int, Any]]:
    """Pop the stack down to (and including) the lowest ``kind`` mode; push back the others.
    Returns (depth, mode) of each removed engine mode, to restore the stack exactly."""
    n = length()
    if n == 0:
        return []
    popped = [pop() for _ in range(n)]  # top first
    popped.reverse()  # bottom first
    kept, taken = [], []
    for depth, mode in enumerate(popped):
        if type(mode) is kind:
            taken.append((depth, mode))
        else:
            kept.append(mode)
    for mode in kept:
        push(mode)
    return taken


def _give_back(taken: list[tuple[int, Any]], pop: Callable[..., Any],
               push: Callable[[Any], None]) -> None:
    if not taken:
        return
    n = _len_function() if pop is _pop_function else _len_dispatch()
    current = [pop() for _ in range(n)]
    current.reverse()
    for depth, mode in taken:  # ascending depth: each insert lands where it was
        current.insert(min(depth, len(current)), mode)
    for mode in current:
        push(mode)


class _Bridge(torch.autograd.Function):
    """Identity from a lazy tensor to its real value, so gradients flow back to the lazy one's
    autograd history (the real value, computed below autograd, has none)."""

    @staticmethod
    def forward(  # type: ignore[override]
            ctx: Any, lazy: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        return real.detach()

    @staticmethod
    def backward(  # type: ignore[override]
            ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _real_arg(a: Any, bridges: list[Any]) -> Any:
    if type(a) is LazyTensor:
        real = materialize(a)
        if a.requires_grad and torch.is_grad_enabled():
            with engine_modes_off():
                out = _Bridge.apply(a, real)
            bridges.append(out.grad_fn)
            return out
        return real
    return a


def _real_args(args: tuple, kwargs: dict, bridges: list[Any]) -> tuple[tuple, dict]:
    from torch.utils._pytree import tree_map

    def conv(a: Any) -> Any:
        return _real_arg(a, bridges)

    return tree_map(conv, args), tree_map(conv, kwargs)


def _eager_region_node(grad_outputs: tuple) -> tuple:
    defer = _engine_mode_types()[0]
    if type(_get_current_dispatch_mode()) is defer:
        _pop_dispatch()  # restored by the autograd engine after this node
    n = _len_function()
    if n and type(torch._C._get_function_stack_at(n - 1)) is _engine_mode_types()[1]:
        _pop_function()
    return resolve_all(grad_outputs)


def _mark_backward(outputs: Any, stop: set[Any]) -> int:
    """Pre-hook every autograd node the region made (from its outputs back to ``stop``)."""
    from torch.utils._pytree import tree_leaves

    todo = []
    for o in tree_leaves(outputs):
        if isinstance(o, torch.Tensor) and o.grad_fn is not None:
            todo.append(o.grad_fn)
    seen: set[Any] = set()
    marked = 0
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        name = type(node).__name__
        if name == "AccumulateGrad":
            continue  # .grad accumulation: the engine defers it like any other
        node.register_prehook(_eager_region_node)
        marked += 1
        todo.extend(fn for fn, _ in node.next_functions)
    return marked


def _input_nodes(args: tuple, kwargs: dict) -> set[Any]:
    from torch.utils._pytree import tree_leaves

    return {a.grad_fn for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and a.grad_fn is not None}


def run_region(engine: Any, fn: Callable[..., Any], args: tuple, kwargs: dict,
               optimizer: Any = None) -> Any:
    """Run compiled code inside an engine's context (Note [compiled regions])."""
    engine.flush("compiled_region")
    if optimizer is not None:
        # A compiled ``optimizer.step`` reads the gradients through the optimizer, not its
        # arguments: kept lazy gradients become plain tensors first (identity kept).
        from adaptive_eager.aside import realize_grads

        realize_grads(optimizer)
    M.fallbacks += 1
    M.fallback_ops["torch.compile region"] += 1
    bridges: list[Any] = []
    rargs, rkwargs = _real_args(args, kwargs, bridges)
    with engine_modes_off():
        out = fn(*rargs, **rkwargs)
    if torch.is_grad_enabled():
        stop = _input_nodes(rargs, rkwargs)
        stop.update(bridges)
        _mark_backward(out, stop)
    return out


def region_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a compiled callable so calls under an engine take the region path."""
    if getattr(fn, "_ae_region", False):
        return fn
    owner = getattr(getattr(fn, "_torchdynamo_orig_callable", None), "__self__", None)
    optimizer = owner if isinstance(owner, torch.optim.Optimizer) else None

    @functools.wraps(fn)
    def region(*args: Any, **kwargs: Any) -> Any:
        if _len_dispatch():
            engine = active_engine()
            if engine is not None:
                return run_region(engine, fn, args, kwargs, optimizer)
        return fn(*args, **kwargs)

    region._ae_region = True  # type: ignore[attr-defined]
    return region


def export_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch.export.export``: export traces the module with its own fake tensors, which
    under the engine's DeferMode would be recorded (or refused); inside an active engine the
    pending trace is flushed, lazy arguments become their values and the export runs with the
    engine's modes off, as outside it. The exported program reads no lazy tensor: its graph
    is the one made outside the engine."""
    if getattr(fn, "_ae_region", False):
        return fn

    @functools.wraps(fn)
    def export(*args: Any, **kwargs: Any) -> Any:
        if _len_dispatch():
            engine = active_engine()
            if engine is not None:
                engine.flush("compiled_region")
                M.fallbacks += 1
                M.fallback_ops["torch.export"] += 1
                from torch.utils._pytree import tree_map

                def real(a: Any) -> Any:  # example inputs: values, no autograd bridge
                    return materialize(a) if type(a) is LazyTensor else a

                rargs, rkwargs = tree_map(real, args), tree_map(real, kwargs)
                with engine_modes_off(), _global_hooks_hidden(engine.presence):
                    return fn(*rargs, **rkwargs)
        return fn(*args, **kwargs)

    export._ae_region = True  # type: ignore[attr-defined]
    return export


def _global_hooks_hidden(presence: Any) -> Any:
    """Strict torch.export raises on any global module hook (Dynamo then inlines
    ``_call_impl`` into export's own wrapper module, which it skips): this presence's global
    hooks (tick and step-aside) leave the hook dicts for the export and come back under their
    own handles, so the depth count and the handles stay as they were."""
    from torch.nn.modules import module as nn_module

    return hooks_hidden((nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks),
                        lambda h: type(h) in (_RootTick, _AsideHook)
                        and h.presence is not None and h.presence() is presence)


def default_dtype_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch.set_default_dtype`` / ``set_default_tensor_type`` (Note [default dtype]).

    Note [default dtype]
    The default dtype decides ops recorded without one (a factory op with no ``dtype``, a Python
    float promoting an integer tensor), but the trie keys it only at a trace's root, and a trace
    replays under the default set when it is flushed. Changing it inside a trace gave float32
    where eager gave float64 from the second run on. So a change made while this thread's
    engine is active flushes the pending trace first (it replays under the dtype it was recorded
    under), and the next trace starts from the root of the new default. The compile helper gets
    the default with each request (``compile_process._flags``). Another thread's pending trace is
    not flushed (the default is process-wide; Known gaps)."""
    if getattr(fn, "_ae_region", False):
        return fn

    @functools.wraps(fn)
    def set_default(*args: Any, **kwargs: Any) -> Any:
        from adaptive_eager import api

        from adaptive_eager.dispatch import ambient

        engine = api._state.engine
        if engine is None:
            out = fn(*args, **kwargs)
            ambient.changed(None)  # the ambient state read for the trie root is stale
            return out
        if active_engine() is engine:
            engine.flush("default_dtype")
        out = fn(*args, **kwargs)
        ambient.changed(engine)  # an empty trace starts at the new root
        return out

    set_default._ae_region = True  # type: ignore[attr-defined]
    return set_default


# Note [storage methods]
# A storage method that copies or fills memory (``UntypedStorage.copy_``/``fill_``, and the
# sharing calls behind ``Tensor.share_memory_``, ``Module.share_memory()`` and
# torch.multiprocessing's pickling of CPU tensors) runs aten ops from C++ on tensors it makes
# over the storage (``at::empty({0}).set_(storage).copy_(...)``), and the sharing calls then move
# the storage's data pointer to the new shared memory, outside the dispatcher. Under the
# DeferMode that copy was deferred and ran after the pointer had moved: ``model.share_memory()``
# inside the engine left every parameter after the first as zeros (found by an everyday-feature
# sweep). These methods are memory operations, and run as such: this thread's pending trace runs
# first (its writes may target the storage, its reads must see the old contents), then the
# method runs with the engine's modes off. Without an engine on the stack the wrapper costs one
# read of the dispatch-stack length.
_STORAGE_METHODS = ("_share_fd_cpu_", "_share_filename_cpu_", "copy_", "fill_")


def storage_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an ``UntypedStorage`` method that moves memory (Note [storage methods])."""
    if getattr(fn, "_ae_region", False):
        return fn

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _len_dispatch():
            engine = active_engine()
            if engine is not None:
                if engine.trace.ops and not engine.busy and not engine.flushing:
                    engine.flush("storage")
                    # a fallback only where a pending trace was cut short for it: a storage
                    # method with nothing pending costs the engine nothing
                    M.fallbacks += 1
                    M.fallback_ops["storage method"] += 1
                with engine_modes_off():
                    return fn(self, *args, **kwargs)
        return fn(self, *args, **kwargs)

    call._ae_region = True  # type: ignore[attr-defined]
    return call


def swap_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``torch.utils.swap_tensors``: it exchanges two tensors' Python objects' contents, so
    this thread's pending trace runs first (a trace holding either as an input would read the
    other afterwards), and lazy tensors get their values: the engine's weak references to them
    (its live-slot table) go with the flushed trace; before, swapping a lazy tensor raised
    "Cannot swap t2 because it has weakref associated with it"."""
    if getattr(fn, "_ae_region", False):
        return fn

    @functools.wraps(fn)
    def swap_tensors(t1: Any, t2: Any) -> Any:
        from adaptive_eager.engine import _flush_before_handoff

        _flush_before_handoff("swap_tensors")
        for t in (t1, t2):
            if type(t) is LazyTensor:
                materialize(t)
        return fn(t1, t2)

    swap_tensors._ae_region = True  # type: ignore[attr-defined]
    return swap_tensors


_installed = {"compile": False, "dynamo": False, "export": False, "dtype": False,
              "ambient": False, "storage": False, "swap": False}
_install_lock = threading.RLock()  # two threads starting engines must not patch twice


def install() -> None:
    """Install the region hooks (idempotent, cheap): see Note [compiled regions]."""
    with _install_lock:
        _install()


def _install() -> None:
    if not _installed["compile"]:
        _installed["compile"] = True
        original = torch.compile

        @functools.wraps(original)
        def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
            _install_dynamo()
            out = original(model, *args, **kwargs)
            if callable(out) and not isinstance(out, torch.nn.Module) and model is not None:
                return region_call(out)
            return out  # a decorator factory (model None), or an OptimizedModule

        compile._ae_original = original  # type: ignore[attr-defined]
        torch.compile = compile  # type: ignore[assignment]
    if not _installed["export"]:
        _installed["export"] = True
        export_mod = sys.modules.get("torch.export")  # imported by ``import torch``
        if export_mod is not None:
            for name in ("export", "export_for_training"):
                fn = getattr(export_mod, name, None)
                if callable(fn):
                    setattr(export_mod, name, export_call(fn))
    if not _installed["ambient"]:
        _installed["ambient"] = True
        from adaptive_eager.dispatch import ambient

        ambient.install()  # Note [ambient state]
    if not _installed["dtype"]:
        _installed["dtype"] = True
        for name in ("set_default_dtype", "set_default_tensor_type"):
            setattr(torch, name, default_dtype_call(getattr(torch, name)))
    if not _installed["swap"]:
        _installed["swap"] = True
        torch.utils.swap_tensors = swap_call(torch.utils.swap_tensors)
    if not _installed["storage"]:
        _installed["storage"] = True
        for name in _STORAGE_METHODS:
            fn = getattr(torch.UntypedStorage, name, None)
            if callable(fn):
                setattr(torch.UntypedStorage, name, storage_call(fn))
    if "torch._dynamo.eval_frame" in sys.modules:
        _install_dynamo()


def _nothing() -> None:
    return None


def _late_region_enter() -> Callable[[], None]:
    """Enter hook of every Dynamo context (see _install_dynamo)."""
    if not _len_dispatch():
        return _nothing
    engine = active_engine()
    if engine is None:  # not under an engine, or a wrapped call that already left it
        return _nothing
    engine.flush("compiled_region")
    M.fallbacks += 1
    M.fallback_ops["torch.compile region (unwrapped)"] += 1
    off = engine_modes_off()
    off.__enter__()
    return lambda: off.__exit__(None, None, None)


def _get_hooks(self: Any) -> list:
    d = self.__dict__
    hooks = d.get("_ae_enter_exit_hooks")
    if hooks is None:  # a context made before the hooks: its list is in its own __dict__
        hooks = d["_ae_enter_exit_hooks"] = list(d.get("enter_exit_hooks", ()))
    if not hooks or hooks[0] is not _late_region_enter:
        hooks.insert(0, _late_region_enter)
    return hooks


def _set_hooks(self: Any, value: list) -> None:
    self.__dict__["_ae_enter_exit_hooks"] = list(value)


def _install_dynamo() -> None:
    if _installed["dynamo"]:
        return
    with _install_lock:
        if not _installed["dynamo"]:
            _patch_dynamo()
            _installed["dynamo"] = True


def _patch_dynamo() -> None:
    from torch._dynamo import eval_frame, trace_rules

    # The engine's own code (its optimizer-step and module hooks, flushes) can run inside a
    # compiled region, e.g. a compiled ``optimizer.step``: Dynamo must run it, never trace it.
    trace_rules.add("adaptive_eager")
    # A lazy tensor the region reaches other than through its arguments (a kept gradient, a
    # closure) must never be handed to compiled code as if it had storage: Dynamo models it
    # conservatively (graph breaks), and its ops then run on its value outside the engine.
    torch._dynamo.config.nontraceable_tensor_subclasses.add(LazyTensor)

    ctx_call = eval_frame._TorchDynamoContext.__call__

    @functools.wraps(ctx_call)
    def __call__(self: Any, fn: Any) -> Any:
        out = ctx_call(self, fn)
        if (callable(out) and not isinstance(out, torch.nn.Module) and not isinstance(fn, type)
                and isinstance(self, eval_frame.OptimizeContext)):
            return region_call(out)
        return out

    eval_frame._TorchDynamoContext.__call__ = __call__  # type: ignore[method-assign]
    # Compiled functions made before these hooks (torch.compile called before this package was
    # imported) are not wrapped; every compiled call still runs its context's enter hooks, so
    # one more hook there flushes and takes the engine's modes off for the call. It cannot see
    # the arguments (lazy ones reach Dynamo as they are, with their values) nor the outputs (their
    # backward nodes are not marked): a safety net, not the main path.
    eval_frame._TorchDynamoContext.enter_exit_hooks = property(  # type: ignore[attr-defined]
        _get_hooks, _set_hooks)

    mod_call = eval_frame.OptimizedModule.__call__

    @functools.wraps(mod_call)
    def module_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _len_dispatch():
            engine = active_engine()
            if engine is not None:
                return run_region(engine, functools.partial(mod_call, self), args, kwargs)
        return mod_call(self, *args, **kwargs)

    eval_frame.OptimizedModule.__call__ = module_call  # type: ignore[method-assign]
