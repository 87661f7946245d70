"""The two modes that intercept a program: aten ops below autograd, Python reads above them.

``DeferMode`` (a TorchDispatchMode) sees every aten op, forward, backward and optimizer, and
sends it down the path its policy names (dispatch/opspec.py). ``ReadGuardMode`` (a
TorchFunctionMode) sees the Python-level calls that read a tensor's memory without reaching the
dispatcher (print, numpy, tolist, data_ptr, storages, pickling, device moves) and flushes first,
so a real tensor with deferred in-place writes (an optimizer's parameters) is never read stale
(DESIGN trap 12). It is on the stack only while that can happen, or inside torch.func transforms
(Note [read guard]).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from types import MethodType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from adaptive_eager.core import hooks
from adaptive_eager.core.errors import Unsupported
from adaptive_eager.core.meta import _METAS, Meta
from adaptive_eager.dispatch.bounds import in_bounds
from adaptive_eager.dispatch.lazy import LazyTensor, _set_bits, resolve_all
from adaptive_eager.dispatch.opspec import (
    ALLOC, CHECKED, DEFER, GRAD_MODE, INPLACE_VIEW, OUT, PASSTHROUGH, RANDOM, SYNC, spec_for,
)
from adaptive_eager.dispatch.outside import install as _install_outside, note_escape
from adaptive_eager.dispatch.outvariant import run_out
from adaptive_eager.dispatch.regions import active_engine
from adaptive_eager.engine import (
    Engine, NeedRun, RunNow, _flush_before_handoff, is_user_error, owned_engine,
)
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.trace import SLOTS

_DisableDispatch = torch._C._DisableTorchDispatch
_T = torch.Tensor
_transforms_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled
_NO_KWARGS: dict = {}  # the kwargs of every op called without any (nothing writes to it)



class DeferMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's handler in a dynamo-disable shim (two more Python frames per op,
        # a few microseconds): this handler is never traced by dynamo, so it needs none.
        return False

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        if _hot is not None and engine.options.accel:
            # Note [C accelerator] in _hot.c: torch calls C, which records the common case
            # itself and hands every other op to the method below (ADAPTIVE_EAGER_ACCEL=0: off)
            self.__torch_dispatch__ = MethodType(_hot.dispatch, self)
        elif engine.options.accel:
            _warn_no_accel()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        try:
            spec = func._ae_spec  # set by spec_for (Note [hot path costs] in engine.py)
        except AttributeError:
            spec = spec_for(func)
        M.ops_intercepted += 1
        if not kwargs:
            kwargs = _NO_KWARGS  # shared, never written: no dict per op
        eng = self.engine
        policy = spec.policy
        if policy == CHECKED:  # Note [value checks] in dispatch/bounds.py
            if not in_bounds(func, args, kwargs):
                return eng.run_fallback(func, spec, args, kwargs, "index_check")
            policy = DEFER
        if policy == DEFER:
            if spec is _TO_COPY and _copies_to_other_device(args, kwargs):
                return eng.run_eager(func, spec, args, kwargs, "read:to")
            # A pending lazy first argument (the common case) rules out both early exits when
            # the op's view base, if any, is that argument.
            a0 = args[0] if args else None
            if type(a0) is not LazyTensor or a0._ae_real is not None or spec.view_arg:
                if types and types != _ONLY_LAZY and _foreign(types):  # Note [foreign subclasses]
                    return NotImplemented
                view_arg = spec.view_arg
                if view_arg is not None and view_arg < len(args):
                    base = args[view_arg]
                    if type(base) is not LazyTensor or base._ae_real is not None:
                        return eng.run_view(func, spec, args, kwargs)
                if is_host_scalar_op(args):
                    return eng.run_host_scalar(func, spec, args, kwargs)
            try:  # defer() inlined: the hot path pays no extra call
                return eng.record(func, spec, args, kwargs)
            except NeedRun as miss:
                M.meta_misses += 1
                return eng.run_eager(func, spec, args, kwargs, f"new_op:{spec.name}", miss.key)
            except RunNow as why:
                return eng.run_fallback(func, spec, args, kwargs, f"sync({why})")
            except Unsupported as why:
                if types and types != _ONLY_LAZY and _foreign(types):  # Note [foreign subclasses]
                    return NotImplemented
                return eng.run_fallback(func, spec, args, kwargs, f"unsupported({why})")
            except Exception as err:
                if is_user_error(err):
                    raise
                reason = eng.engine_error(err, spec)
                return eng.run_fallback(func, spec, args, kwargs, reason)
        if types and types != _ONLY_LAZY and _foreign(types):  # Note [foreign subclasses]
            return NotImplemented
        if policy == ALLOC or policy == PASSTHROUGH:
            M.ops_eager += 1
            with _DisableDispatch():  # metadata-only: wrappers can be passed as they are
                return func(*args, **kwargs)
        if policy == RANDOM:
            at = _DROPOUT_AT.get(spec)
            if at is not None and _no_dropout(at, args, kwargs):
                if spec in _NOOP_DROPOUTS:  # eager returns its input itself
                    M.ops_eager += 1
                    return args[0]
                return defer(eng, func, spec, args, kwargs, None)
            return eng.run_random(func, spec, args, kwargs)
        if policy == INPLACE_VIEW:
            return eng.run_inplace_view(func, spec, args, kwargs)
        if policy == SYNC:
            return eng.run_sync(func, spec, args, kwargs)
        if policy == GRAD_MODE:
            return defer(eng, func, spec, args, kwargs, _grad_enabled())
        if policy == OUT:  # Note [out= ops] in dispatch/outvariant.py
            return run_out(eng, func, spec, args, kwargs)
        return eng.run_fallback(func, spec, args, kwargs, "fallback")



hooks.engine_mode = DeferMode  # Note [hook slots] in core/hooks.py


# Note [attention without dropout]
# Attention kernels are tagged nondeterministic_seeded for their dropout; with dropout_p == 0
# (eval, or a model without attention dropout) they draw nothing, so they are deferred like any
# op instead of cutting the trace at every attention call. Under inference mode the composite
# ops reach the engine too: ``scaled_dot_product_attention`` (deferred the same way) and
# ``dropout`` & co., which with p == 0 or train=False return their input itself (so does this).
# Position of the probability in each schema (the dropouts' ``train`` follows it):
_aten = torch.ops.aten
_DROPOUT_AT: dict[Any, int] = {
    spec_for(_aten._scaled_dot_product_flash_attention_for_cpu.default): 3,
    spec_for(_aten.scaled_dot_product_attention.default): 4,
}
_NOOP_DROPOUTS = frozenset(spec_for(getattr(_aten, name).default) for name in (
    "dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "dropout_",
    "feature_dropout_", "alpha_dropout_", "feature_alpha_dropout_"))
_DROPOUT_AT.update({spec: 1 for spec in _NOOP_DROPOUTS})


# A copy to another device is a read of the tensor's value, as ``.to``/``.cpu``/``.cuda`` in the
# read guard: it flushes and runs at once (the guard catches the call first while it is armed).
_TO_COPY = spec_for(_aten._to_copy.default)

# Why the C accelerator is absent ("" when it runs): the report and a warning say so, since
# without it an op on a known trace costs about 20% more to record and replay (benchmarks.op_overhead).
ACCEL_MISSING = ""
try:  # the optional C accelerator (setup.py builds it where a compiler exists)
    from adaptive_eager import _hot
except ImportError as _err:
    _hot = None
    ACCEL_MISSING = f"not built ({_err})"
if _hot is not None:
    from adaptive_eager.cache.memory import TrieNode
    from adaptive_eager.dispatch.opspec import OpSpec
    from adaptive_eager.shapes import SymTrace, Template
    from adaptive_eager.trace import Trace

    try:  # shapes' classes: C takes memoised template steps too (Note [C accelerator])
        _hot.init(LazyTensor, _T, torch.nn.Parameter, Meta, SLOTS, _T._make_wrapper_subclass,
                  _set_bits, M, _NO_KWARGS, _TO_COPY, DEFER,
                  DeferMode.__dict__["__torch_dispatch__"], Trace, TrieNode, OpSpec, Engine,
                  Template, SymTrace)
        # first uses of externals numbered in C too (Trace.register's common case)
        from adaptive_eager.dispatch.outside import ESCAPED
        from adaptive_eager.trace import _storage

        _hot.init_register(_METAS, torch.strided, _storage,
                           torch._C._is_torch_function_mode_enabled, ESCAPED)
        # and attention without dropout (Note [attention without dropout])
        _hot.init_dropouts({s: at for s, at in _DROPOUT_AT.items() if s not in _NOOP_DROPOUTS},
                           RANDOM)
    except Exception as err:  # an extension built from other sources: the Python path runs
        import logging

        logging.getLogger("adaptive_eager").warning(
            "adaptive_eager: the C accelerator did not start (%s); recording in Python", err)
        _hot = None
        ACCEL_MISSING = f"did not start ({err})"
_accel_warned = False


def _warn_no_accel() -> None:
    """Once per process: an engine asked for the C accelerator (the default) and has none."""
    global _accel_warned
    if _accel_warned:
        return
    _accel_warned = True
    import logging

    logging.getLogger("adaptive_eager").warning(
        "adaptive_eager: the C accelerator (adaptive_eager._hot) is %s: recording runs in pure "
        "Python, about 20%% slower per op. Reinstall where a C compiler is present "
        "(pip install --force-reinstall --no-deps adaptive_eager, or pip install -e . in a "
        "checkout); ADAPTIVE_EAGER_ACCEL=0 asks for the Python path and silences this.",
        ACCEL_MISSING)


def _no_dropout(at: int, args: tuple, kwargs: dict) -> bool:
    p = args[at] if len(args) > at else kwargs.get("dropout_p", kwargs.get("p", 0.0))
    if type(p) is bool or not isinstance(p, (int, float)):
        return False
    if p == 0.0:
        return True
    if len(args) > at + 1 and at == 1:  # dropout(input, p, train)
        return args[2] is False
    return at == 1 and kwargs.get("train", True) is False


def defer(eng: Engine, func: Any, spec: Any, args: tuple, kwargs: dict,
          grad: bool | None) -> Any:
    """Record one op; whatever cannot be recorded runs eagerly (counted, with its reason)."""
    try:
        return eng.record(func, spec, args, kwargs, grad)
    except NeedRun as miss:
        M.meta_misses += 1
        return eng.run_eager(func, spec, args, kwargs, f"new_op:{spec.name}", miss.key)
    except RunNow as why:
        return eng.run_fallback(func, spec, args, kwargs, f"sync({why})")
    except Unsupported as why:
        return eng.run_fallback(func, spec, args, kwargs, f"unsupported({why})")
    except Exception as err:
        if is_user_error(err):
            raise
        reason = eng.engine_error(err, spec)
        return eng.run_fallback(func, spec, args, kwargs, reason)


# Note [foreign subclasses]
# A tensor subclass with its own __torch_dispatch__ (DTensor, which FSDP2's parameters are;
# AsyncCollectiveTensor; NestedTensor) must see its ops first: the engine cannot record it (its
# metadata and its inner tensors are its own), and running the op below the subclass (detach of
# an ``nn.Parameter(DTensor)`` gave a plain tensor) drops what the subclass does. The mode returns
# NotImplemented for such calls, torch then runs the subclass's handler, and the ops it makes on
# its inner tensors reach this mode again as ordinary ops, deferred as usual. Calls whose only
# subclass is LazyTensor (nearly all) pay one tuple comparison; others the check (the deferred
# path only when recording it failed).
_FOREIGN: dict[type, bool] = {}
_ONLY_LAZY = (LazyTensor,)  # the usual ``types``: compared before any call


def _foreign(types: Any) -> bool:
    for t in types:
        own = _FOREIGN.get(t)
        if own is None:
            own = _FOREIGN[t] = t is not LazyTensor and any(
                "__torch_dispatch__" in vars(k) for k in t.__mro__
                if k is not _T and k is not torch._C.TensorBase)
        if own:
            return True
    return False


def is_host_scalar_op(args: tuple) -> bool:
    """Note [host scalars]
    Ops whose tensors are all real CPU scalars (optimizer step counters, loss scales) run at once:
    deferring them costs more than running them, and a later ``.item()`` on them (Adam reads its
    step counter once per parameter per step) then needs no flush at all."""
    seen = False
    for a in args:
        t = type(a)
        if t is list or t is tuple:
            for x in a:
                if isinstance(x, _T):
                    if type(x) is LazyTensor or x.numel() > 1 or x.device.type != "cpu":
                        return False
                    seen = True
        elif t is LazyTensor:
            return False
        elif isinstance(a, _T):
            if a.numel() > 1 or a.device.type != "cpu":
                return False
            seen = True
    return seen


_DATA_SET = _T.data.__set__  # the C setter: what a mode sees if the .data property is not in
_DEVICE_MOVES = {_T.cpu, _T.cuda, _T.to}
_READS = {
    _T.numpy, _T.tolist, _T.data_ptr, _T.untyped_storage, _T.storage, _T._typed_storage,
    _T.__array__, _T.__repr__, _T.__format__, _T.__reduce_ex__, _T.__deepcopy__, _T.__dlpack__,
    _T.cpu, _T.cuda, _T.to, _DATA_SET,
}


_READ, _EAGER_BACKWARD, _ORIGINAL = 1, 2, 3
# Note [eager backward]
# Any active TorchDispatchMode makes at::isTensorSubclassLike() true, and a few backward formulas
# then take a "composite compliant" branch whose result differs from eager's in the last bit or
# in strides (found by the OpInfo sweep: prod, masked.prod through prod, ormqr). Autograd nodes
# made by these calls run their backward exactly as eager does: the node pops the dispatch mode
# (the autograd engine restores the thread's mode stack after every node) and sees real tensors
# (its gradient inputs and saved tensors are materialized, which flushes the pending trace).
# The four functions are wrapped (install_hooks), so this costs nothing on other calls; with
# ``lazy_guard=False`` the always-armed read guard does it, as before.
_SPECIAL: dict[Any, int] = {f: _READ for f in _READS}  # the always-armed guard's duties
_SPECIAL.update({f: _EAGER_BACKWARD for f in (torch.prod, _T.prod, torch.ormqr, _T.ormqr)})
_SPECIAL_LAZY: dict[Any, int] = {f: _READ for f in _READS}  # the armed-when-needed guard's
_ORIGINALS: dict[Any, Any] = {}  # wrapper -> the function it wraps (install_hooks)


def _with_eager_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    if not torch.is_grad_enabled():
        return func(*args, **kwargs)
    with torch.autograd.graph.saved_tensors_hooks(_keep, resolve_all):
        out = func(*args, **kwargs)
    node = getattr(out, "grad_fn", None)
    if node is not None:
        node.register_prehook(_eager_node)
    return out


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _eager_node(grad_outputs: tuple) -> tuple:
    if type(_get_current_dispatch_mode()) is DeferMode:
        torch._C._pop_torch_dispatch_stack(None)
    return resolve_all(grad_outputs)


def _moves_device(args: tuple, kwargs: dict) -> bool:
    """Whether a .to()/.cpu()/.cuda() call may change the tensor's device."""
    src = args[0] if args else None
    if not isinstance(src, _T):
        return True
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (str, int, torch.device)) and not isinstance(a, bool):
            try:
                if torch.device(a) != src.device:
                    return True
            except (RuntimeError, TypeError):
                return True
        elif isinstance(a, _T) and a.device != src.device:
            return True
    return False


def _copies_to_other_device(args: tuple, kwargs: dict) -> bool:
    """``aten._to_copy`` to another device (the dispatch-level form of a device move)."""
    dev = kwargs.get("device")
    return dev is not None and bool(args) and isinstance(args[0], _T) and dev != args[0].device


# Note [read guard]
# ReadGuardMode (a TorchFunctionMode) costs a Python round trip on every torch call made under it:
# 9.9k instructions of a recorded add's 54k, more than eager's whole add (9.6k). Its duties matter
# only at times, so by default it is on the function-mode stack ("armed") only then:
# - (no longer) a tensor from outside the pending trace has pending writes: Python-level reads of
#   its memory must flush first (DESIGN trap 12); the methods that read it are wrapped instead
#   (Note [reads of pending writes]), and with ``lazy_guard=False`` the always-armed guard does it.
#   Reads through aten ops (item, equal, indexing, copies) need no guard: the dispatch mode sees
#   them.
# - inside torch.func transforms (Note [functorch transforms]): functorch's nesting entry points
#   (vmap, grad/vjp, jvp, functionalize) are wrapped to arm it on entry and disarm on exit.
# The rest of its duties moved to places that cost nothing on other calls: the methods that hand
# out a tensor's memory (numpy, __array__, data_ptr, storages, DLPack: the caller may write it
# after recorded ops read it) are wrapped to flush first, as the guard did; ``.data =`` is a
# property of torch.Tensor whose setter flushes and stores a lazy value's real value (trap 2);
# prod/ormqr's eager backward wraps those functions (Note [eager backward]); a device move on a
# tensor while disarmed reaches the dispatch mode as ``aten._to_copy`` to another device, which
# flushes and runs at once, as the guard's read did.
# Armed, it sits at the bottom of the function-mode stack, so user modes entered before or after
# still pop themselves. It cannot always leave at once: inside its own handler torch holds it off
# the stack and puts it back afterwards (a flush from ``.item()`` under it), the autograd engine
# restores the thread's mode stacks after every node, and a compiled region holds it off the stack
# (``held``). Then it stays on ("stale": correct, only slower) until the next point where it can
# leave: a flush outside those places (the optimizer step hook, ``sync()``, the context's exit), the
# end of a backward call, a transform's entry or exit. An arm inside an autograd node (a real
# ``.grad`` accumulated in place) would vanish with the node: the end of the backward call
# (``torch.autograd._engine_run_backward``, wrapped) arms it again. ``lazy_guard=False``
# (``ADAPTIVE_EAGER_LAZY_GUARD=0``) keeps it armed whenever the engine's modes are on, as before.
#
# Note [guard off while a trace runs]
# Engine.flush disarms the guard before it runs the trace, not after. Once the trace is taken
# (``self.trace`` is a fresh one, ``ext_writes`` cleared) no write is pending any more: the run
# itself lands them in program order, and what runs meanwhile is the engine's own code (the
# replay or program, then ``publish``) plus a custom op's body in its place in the program, none
# of which can read a value ahead of the writes before it. Were the guard on, each of publish's
# ``w.requires_grad``/``real.layout`` reads took the Python mode round trip: 57 of the 121
# guard calls of a GPT-2 AdamW step (one flush, from the optimizer step hook); now 64, about
# 1.0 us each beside eager's 0.08 us for a metadata read (a bare TorchFunctionMode costs the
# same 1.0 us: torch's mode call, not this handler's body, which is 0.1-0.2 us). What the guard
# must see is unchanged: it is armed while writes are pending, and a record made during the run
# (a fallback that defers into the new trace) arms it again through _note_writes as ever. A
# flush inside the guard's handler (``held``), inside an autograd node or inside a transform
# leaves it armed, as sync always did. tests/test_guard_fastpath.py.
_ITEM = torch._C.TensorBase.item  # what torch passes for ``t.item()`` (torch.Tensor.item)
_ITEM_NAME = spec_for(_aten._local_scalar_dense.default).name  # run_sync's fallback_ops key
_Parameter = torch.nn.Parameter
_push_function = torch._C._push_on_torch_function_stack
_pop_function = torch._C._pop_torch_function_stack
_len_function = torch._C._len_torch_function_stack
_function_at = torch._C._get_function_stack_at
_graph_task = torch._C._current_graph_task_id
_get_ident = threading.get_ident


class ReadGuardMode(TorchFunctionMode):
    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        engine.guard = self
        self.always = not engine.options.lazy_guard
        self.table = _SPECIAL if self.always else _SPECIAL_LAZY
        self.thread = engine.owner
        self.present = False  # the engine's modes are on (the context's presence is active)
        self.pushed = False  # on the function-mode stack, or held off it and coming back
        self.held = 0  # times it is off the stack now and will be put back
        self.recheck = False  # armed inside an autograd node: arm again when backward returns
        self.leaving = False  # Note [a stale guard leaves at the next call]

    # Presence (aside.py) and calibrate enter and exit the engine's modes as a pair.
    def __enter__(self) -> ReadGuardMode:
        self.present = True
        if self.always and not self.pushed:
            _push_function(self)  # on top, where the context's entry always put it
            self.pushed = True
            M.guard_arms += 1
        else:
            self.sync()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.present = False
        self.sync()

    def wanted(self) -> bool:
        # pending writes to tensors from outside the trace need no guard: the methods that
        # read their memory in Python flush first (Note [reads of pending writes])
        return self.present and (self.always or _transforms_active())

    def sync(self) -> None:
        """Arm or disarm as wanted, where that can be done now (Note [read guard])."""
        if self.held or _get_ident() != self.thread:
            if self.held and self.pushed and _get_ident() == self.thread and not self.wanted():
                self.leaving = True  # Note [a stale guard leaves at the next call]
            return
        want = self.wanted()
        if want is self.pushed:
            return
        if want:
            if not self._on_stack():
                self._insert()
            self.pushed = True
            M.guard_arms += 1
            if _graph_task() != -1:
                self.recheck = True  # this push lasts only until the node ends
        elif _graph_task() == -1:  # in a node the stack comes back after it: leave later
            self._remove()
            self.pushed = False
            M.guard_disarms += 1

    def after_backward(self) -> None:
        if _graph_task() != -1:
            return  # a backward inside a node: the outer one's end decides
        if self.recheck and not self.held:
            self.recheck = False
            self.pushed = self._on_stack()
        self.sync()

    def _on_stack(self) -> bool:
        return any(_function_at(i) is self for i in range(_len_function()))

    def _insert(self) -> None:
        above = [_pop_function() for _ in range(_len_function())]  # top first
        _push_function(self)
        for mode in reversed(above):
            _push_function(mode)

    def _remove(self) -> None:
        above = [_pop_function() for _ in range(_len_function())]
        for mode in reversed(above):
            if mode is not self:
                _push_function(mode)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.held += 1  # torch took this mode off the stack for the call: it comes back after
        try:
            if not self.present:  # stale after its engine's modes left: plain call
                return func(*args, **kwargs) if kwargs else func(*args)
            if _transforms_active():
                return self._in_transform(func, args, kwargs or {})
            if func is _ITEM and not kwargs and len(args) == 1:
                return self._item(args[0])
            special = self.table.get(func)
            if special is None:
                return func(*args, **kwargs) if kwargs else func(*args)
            if kwargs is None:
                kwargs = {}
            if special is _READ:
                return self._read(func, args, kwargs)
            if special is _ORIGINAL:  # a wrapper of install_hooks: it already did its part
                return _ORIGINALS[func](*args, **kwargs)
            return _with_eager_backward(func, args, kwargs)
        finally:
            self.held -= 1
            if self.leaving and not self.held:
                _leave_after_handler(self)

    def _item(self, t: Any) -> Any:
        """Note [item under the armed guard]
        While the guard is armed (with ``lazy_guard=False``, or in a transform; pending
        writes no longer arm it: Note [reads of pending writes]) and an optimizer's update is
        pending on its parameters, the
        optimizer reads its real CPU step counters with ``.item()`` (AdamW foreach: two per
        parameter per step, 56 in GPT-2's). Each went from here to the dispatch mode, which
        ran it at once (``Engine.run_sync``: the pending trace does not touch the counter) after
        torch's dispatch to Python, the C handler's hand-back and the Python handler. The
        answer is known here already, so it is given here (a real CPU scalar's ``.item()``
        under the armed guard with a trace pending: 5.6 -> 2.4 us, eager's 0.14 us; ad-hoc
        timing loop, idle machine; tests/test_guard_fast.py): an exact
        Tensor/Parameter, with the engine's own dispatch mode on top of the dispatch stack (so
        that mode would be the one to see ``_local_scalar_dense``) and no pending op of its
        trace on the tensor's storage (``Trace.touches_storage``, run_sync's test), runs with
        the dispatch modes off, as run_sync runs it, with run_sync's counters. Anything else
        (a lazy tensor, a subclass, a pending write to its storage, a user's dispatch mode on
        top, keyword arguments, ``item`` replaced by a wrapper) takes the way it always took,
        so a pending write is never read stale: the dispatch mode flushes it first."""
        tt = type(t)
        if tt is _T or tt is _Parameter:
            n = _len_dispatch()
            if n:
                mode = _dispatch_at(n - 1)
                eng = self.engine
                if type(mode) is DeferMode and mode.engine is eng:
                    tr = eng.trace
                    if not tr.ops or not tr.touches_storage(t):
                        M.ops_intercepted += 1
                        M.fallbacks += 1
                        M.fallback_ops[_ITEM_NAME] += 1
                        M.ops_eager += 1
                        with _DisableDispatch():
                            return _ITEM(t)
        return _ITEM(t)

    def _in_transform(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Note [functorch transforms]
        Inside ``torch.func`` transforms (vmap, grad, jacrev, jacfwd, hessian, vjp, jvp) ops run
        plain eager on real values. functorch wraps tensors in its own wrappers (BatchedTensor,
        GradTrackingTensor) above the Python dispatch key and unwraps them below it, so lazy
        tensors would end up inside wrappers whose kernels read their (absent) storage, and
        values swapped in at publish would be hidden behind them. The dispatch mode cannot tell
        (the interpreter stack reads empty inside its handler), but this mode, above functorch,
        can: each torch call inside a transform flushes the pending trace (so lazy inputs have
        values and pending writes have landed), then runs with the engine's dispatch mode off.
        The mode is armed for the transform by hooks on functorch's nesting entry points (Note
        [read guard]). Lazy tensors made before the transform reach their own
        ``__torch_dispatch__``, which runs on their values. Flushes run with functorch off
        (Engine._run_trace). Counted as fallbacks (``fallback_ops["functorch"]``)."""
        self.engine.flush("functorch")
        M.fallbacks += 1
        M.fallback_ops["functorch"] += 1
        mode = _get_current_dispatch_mode()
        if type(mode) is not DeferMode:  # a user's mode above the engine's: leave the stack
            return func(*args, **kwargs)
        popped = torch._C._pop_torch_dispatch_stack(None)
        try:
            return func(*args, **kwargs)
        finally:
            torch._C._push_on_torch_dispatch_stack(popped)

    def _read(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func is _T.to and not _moves_device(args, kwargs):
            return func(*args, **kwargs)
        if (func is _T.cpu or func is _T.cuda) and args and not _moves_device(
                args, {"device": "cpu" if func is _T.cpu else "cuda"}):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "data_set")
        self.engine.flush(f"read:{name}")
        if func == _DATA_SET:
            return func(args[0], resolve_all(args[1]))  # trap 2: never store a wrapper in .data
        if any(type(a) is LazyTensor for a in args):
            if func is _T.__repr__ or func is _T.__format__:
                return getattr(args[0], func.__name__)(*args[1:], **kwargs)
            args = resolve_all(args)
        with _DisableDispatch():
            return func(*args, **kwargs)


_LEAVE_EVENTS = 256  # calls and returns watched at most (torch may have taken it off for good meanwhile)


def _leave_after_handler(guard: ReadGuardMode) -> None:
    """Note [a stale guard leaves at the next call]
    A flush inside the guard's own handler (a read of a tensor with a pending write: ``print``,
    ``tolist``, torch.testing's comparisons) disarms it, but torch holds it off the stack for
    the call and pushes it back after, so it stayed on the torch-function stack in the user's
    code until the next flush outside a handler: a test's ``tearDown`` saw "torch function mode
    stack was leaked", and every torch call paid its round trip meanwhile. So a profile function
    (``sys.setprofile``, this thread only) waits for the first call or return after torch put it
    back (not in its handler, not in an autograd node, on the stack again) and takes it off
    there, then itself (after _LEAVE_EVENTS events at most, or once the guard is wanted again).
    Never over another profile function or torch's profiler: those programs keep the stale
    guard until the next flush point, as before (correct, only slower). The flush marks it
    ``leaving``; the handler's end installs the profile function, so the flush itself
    runs unwatched."""
    guard.leaving = False
    if (sys.getprofile() is not None or torch._C._autograd._profiler_enabled()
            or _get_ident() != guard.thread):
        return
    ref = weakref.ref(guard)
    left = [_LEAVE_EVENTS]

    def point(frame: Any, event: str, arg: Any) -> None:
        g = ref()
        left[0] -= 1
        if g is not None and not g.wanted() and left[0] > 0:
            if g.held or _graph_task() != -1 or not g._on_stack():
                return  # torch has not put it back yet, or an autograd node would
            g._remove()
            g.pushed = False
            M.guard_disarms += 1
        sys.setprofile(None)

    sys.setprofile(point)


# ---- hooks that stand in for the guard's duties while it is disarmed (Note [read guard]) -----
def _thread_guard() -> ReadGuardMode | None:
    eng = owned_engine()
    return None if eng is None else eng.guard


def _after_backward() -> None:
    g = _thread_guard()
    if g is not None and (g.pushed or g.recheck):
        g.after_backward()


def _nesting_hook(orig: Any) -> Any:
    """A functorch nesting entry or exit point that then arms or disarms this thread's guard."""

    @functools.wraps(orig)
    def nesting(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        g = _thread_guard()
        if g is not None and g.present:
            g.sync()
        return out

    nesting._ae_hook = True  # type: ignore[attr-defined]
    return nesting


def _eager_backward_hook(orig: Any) -> Any:
    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        eng = active_engine()
        if eng is None or eng.guard is None or eng.guard.always:
            return orig(*args, **kwargs)  # outside the engine, or its guard does this
        return _with_eager_backward(orig, args, kwargs)

    wrapper._ae_hook = True  # type: ignore[attr-defined]
    _ORIGINALS[wrapper] = orig
    return wrapper


# Methods that hand out the tensor's memory (to numpy, ctypes, DLPack, storages): whoever holds it
# may write it outside torch, after ops recorded earlier read it, so the pending trace runs first
# (what the always-armed guard did on every such call), also while the guard is off.
_EXPOSING = ("numpy", "__array__", "data_ptr", "untyped_storage", "storage", "_typed_storage",
             "__dlpack__")
# Of those, the ones whose result the outside reads and writes later, without any call torch
# sees: their storage escapes (Note [memory the outside can see] in dispatch/outside.py).
_ESCAPING = frozenset(("numpy", "__array__", "__dlpack__"))
_len_dispatch = torch._C._len_torch_dispatch_stack
_dispatch_at = torch._C._get_dispatch_stack_at


def _exposing_hook(orig: Any, name: str) -> Any:
    reason = f"read:{name}"
    escapes = name in _ESCAPING

    @functools.wraps(orig)
    def exposing(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = _len_dispatch()
        if n:  # only from user code under an active engine: its own calls (inside the
            mode = _dispatch_at(n - 1)  # dispatch handler) find its mode off the stack
            if type(mode) is DeferMode:
                eng = mode.engine
                if eng.trace.ops and not eng.busy and not eng.flushing:
                    eng.flush(reason)
                if escapes:
                    # numpy(force=True) copies through aten ops (resolve_conj, detach): on
                    # real values, at once, never deferred into a wrapper numpy then reads
                    with _DisableDispatch():
                        out = orig(self, *args, **kwargs)
                    _escape(self, out)
                    return out
        out = orig(self, *args, **kwargs)
        if escapes:
            _escape(self, out)
        return out

    exposing._ae_hook = True  # type: ignore[attr-defined]
    return exposing


# Note [reads of pending writes]
# A deferred write to a tensor from outside the trace (``a += b`` on a real ``a``, an optimizer
# update, a BatchNorm buffer) is pending until the next flush. Reads of ``a`` through aten ops
# reach the dispatch mode, which runs them after the write; the Python-level methods that read its
# memory without an aten op (``_EXPOSING``, and ``_READING``: ``tolist``, ``print``/``format``,
# pickling, ``deepcopy``) are wrapped on torch.Tensor to flush first. That was the armed read
# guard's duty (Note [read guard]); as a mode on the torch-function stack it stayed there in the
# user's code from the write to the next flush, so a program that ended a function (a test) with
# a write pending and no read after it left "torch function mode stack was leaked" behind
# (test_autograd's in-place tests: ``a += b; self.assertTrue(a.requires_grad)``), and every torch
# call in between paid the mode's round trip. The wrappers cost one check of the dispatch stack
# per call and flush only while the engine's trace holds such a write.
_READING = ("tolist", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__")


def _reading_hook(orig: Any, name: str) -> Any:
    reason = f"read:{name}"

    @functools.wraps(orig)
    def reading(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = _len_dispatch()
        if n:  # only from user code under an active engine (its own calls, inside the
            mode = _dispatch_at(n - 1)  # dispatch handler, find its mode off the stack)
            if type(mode) is DeferMode:
                eng = mode.engine
                if eng.ext_writes and eng.trace.ops and not eng.busy and not eng.flushing:
                    eng.flush(reason)
        return orig(self, *args, **kwargs)

    reading._ae_hook = True  # type: ignore[attr-defined]
    return reading


def _escape(t: torch.Tensor, out: Any) -> None:
    """The memory of ``t`` now reaches ``out`` (an array: for its life; a capsule: for the
    storage's), unless ``out`` is a copy (``numpy(force=True)`` of a conj view)."""
    if type(out).__name__ == "ndarray":
        face = out.__array_interface__
        with torch._C.DisableTorchFunction():
            st = _storage_of(t)
            lo = st.data_ptr()
        if not lo <= face["data"][0] < lo + max(st.nbytes(), 1):
            return
        note_escape(t, out)
    else:
        note_escape(t)


_storage_of = torch._C.TensorBase.untyped_storage
_data_get = torch._C.TensorBase.data.__get__


def _set_data(self: torch.Tensor, value: Any) -> None:
    """``t.data = value`` (trap 2): pending ops of this thread run first (they may write ``t``'s
    old storage, as in eager), and a lazy value is stored as its real value, never as a wrapper."""
    _flush_before_handoff("read:data_set")
    _DATA_SET(self, resolve_all(value))


_hooks_installed = False
_hooks_lock = threading.Lock()


def install_hooks() -> None:
    """Install the functorch and backward hooks of the read guard (idempotent; on the first
    engine start; the function wrappers are installed at import, _install_wrappers)."""
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
        import torch.autograd as autograd
        from torch._functorch import eager_transforms, vmap

        for module, names in ((vmap, ("_vmap_increment_nesting", "_vmap_decrement_nesting")),
                              (eager_transforms, (
                                  "_grad_increment_nesting", "_grad_decrement_nesting",
                                  "_jvp_increment_nesting", "_jvp_decrement_nesting",
                                  "_func_increment_nesting", "_func_decrement_nesting"))):
            for name in names:
                orig = getattr(module, name, None)
                if orig is not None and not getattr(orig, "_ae_hook", False):
                    setattr(module, name, _nesting_hook(orig))

        run_backward = autograd._engine_run_backward

        @functools.wraps(run_backward)
        def _engine_run_backward(*args: Any, **kwargs: Any) -> Any:
            try:
                return run_backward(*args, **kwargs)
            finally:
                _after_backward()

        autograd._engine_run_backward = _engine_run_backward  # type: ignore[assignment]


def _install_wrappers() -> None:
    """Function-level stand-ins, installed when this package is imported: code that takes a
    reference to ``torch.prod`` later (OpInfo's database, ``from torch import prod``) gets them."""
    for owner, name in ((torch, "prod"), (_T, "prod"), (torch, "ormqr"), (_T, "ormqr")):
        if getattr(getattr(owner, name), "_ae_hook", False):
            continue
        wrapper = _eager_backward_hook(getattr(owner, name))
        setattr(owner, name, wrapper)
        _SPECIAL_LAZY[wrapper] = _ORIGINAL  # seen by the armed guard for method calls
        _SPECIAL[wrapper] = _EAGER_BACKWARD  # the always-armed one wraps as before
    if not isinstance(_T.__dict__.get("data"), property):
        _T.data = property(_data_get, _set_data, doc=torch._C.TensorBase.data.__doc__)
    for name in _EXPOSING:
        orig = getattr(_T, name)
        if not getattr(orig, "_ae_hook", False):
            wrapper = _exposing_hook(orig, name)
            setattr(_T, name, wrapper)
            _SPECIAL[wrapper] = _READ  # the always-armed guard reads as before
    for name in _READING:  # Note [reads of pending writes]
        orig = getattr(_T, name)
        if not getattr(orig, "_ae_hook", False):
            wrapper = _reading_hook(orig, name)
            setattr(_T, name, wrapper)
            _SPECIAL[wrapper] = _READ
            _SPECIAL_LAZY[wrapper] = _READ  # armed in a transform: reads as before


_install_wrappers()
_install_outside()
