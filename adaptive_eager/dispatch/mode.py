"""The two modes that intercept a program: aten ops below autograd, Python reads above them.

``DeferMode`` (a TorchDispatchMode) sees every aten op, forward, backward and optimizer, and
sends it down the path its policy names (dispatch/opspec.py). ``ReadGuardMode`` (a
TorchFunctionMode) sees the Python-level calls that read a tensor's memory without reaching the
dispatcher (print, numpy, tolist, data_ptr, storages, pickling, device moves, ``.data =``) and
flushes first, so a real tensor with
deferred in-place writes (an optimizer's parameters) is never read stale (DESIGN trap 12).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from adaptive_eager.dispatch.lazy import LazyTensor, resolve_all
from adaptive_eager.dispatch.opspec import (
    ALLOC, DEFER, INPLACE_VIEW, OUT, PASSTHROUGH, RANDOM, SYNC, spec_for,
)
from adaptive_eager.dispatch.outvariant import run_out
from adaptive_eager.engine import (
    GRAD_MODE, Engine, NeedRun, RunNow, is_user_error,
)
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.trace import Unsupported

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
        if policy == DEFER:
            # A pending lazy first argument (the common case) rules out both early exits when
            # the op's view base, if any, is that argument.
            a0 = args[0] if args else None
            if type(a0) is not LazyTensor or a0._ae_real is not None or spec.view_arg:
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
                return eng.run_fallback(func, spec, args, kwargs, f"unsupported({why})")
            except Exception as err:
                if is_user_error(err):
                    raise
                reason = eng.engine_error(err, spec)
                return eng.run_fallback(func, spec, args, kwargs, reason)
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


_DATA_SET = _T.data.__set__
_DEVICE_MOVES = {_T.cpu, _T.cuda, _T.to}
_READS = {
    _T.numpy, _T.tolist, _T.data_ptr, _T.untyped_storage, _T.storage, _T._typed_storage,
    _T.__array__, _T.__repr__, _T.__format__, _T.__reduce_ex__, _T.__deepcopy__, _T.__dlpack__,
    _T.cpu, _T.cuda, _T.to, _DATA_SET,
}


_READ, _EAGER_BACKWARD = 1, 2
# Note [eager backward]
# Any active TorchDispatchMode makes at::isTensorSubclassLike() true, and a few backward formulas
# then take a "composite compliant" branch whose result differs from eager's in the last bit or
# in strides (found by the OpInfo sweep: prod, masked.prod through prod, ormqr). Autograd nodes
# made by these calls run their backward exactly as eager does: the node pops the dispatch mode
# (the autograd engine restores the thread's mode stack after every node) and sees real tensors
# (its gradient inputs and saved tensors are materialized, which flushes the pending trace).
_SPECIAL: dict[Any, int] = {f: _READ for f in _READS}
_SPECIAL.update({f: _EAGER_BACKWARD for f in (torch.prod, _T.prod, torch.ormqr, _T.ormqr)})


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


class ReadGuardMode(TorchFunctionMode):
    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if _transforms_active():
            return self._in_transform(func, args, kwargs or {})
        special = _SPECIAL.get(func)
        if special is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        if special is _READ:
            return self._read(func, args, kwargs)
        return _with_eager_backward(func, args, kwargs)

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
        Lazy tensors made before the transform reach their own ``__torch_dispatch__``, which
        runs on their values. Flushes run with functorch off (Engine._run_trace). Counted as fallbacks (``fallback_ops["functorch"]``)."""
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
