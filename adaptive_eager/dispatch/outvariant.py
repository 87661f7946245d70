"""``out=`` ops deferred as their functional op followed by a ``copy_`` into each out tensor.

Note [out= ops]
An ``out=`` overload (``aten.mul.out``, ``aten.sum.IntList_out``, ``aten.max.dim_max``, ...)
writes its result into tensors the caller passes, and eager *resizes* an out tensor of the wrong
shape (with a warning when it was not empty). DDP's reducer writes every gradient into its bucket
with ``at::mul_out(bucket_view, grad, 1/world)``, once per parameter per step, so running these
ops at once cut the backward into one trace per parameter. When it is sound, the op is recorded
as its functional overload (same arguments minus the outs: ``aten.mul.Tensor``) and then one
``aten.copy_`` per out, so the write lands in program order at replay, on the out tensor's own
storage, as other deferred in-place writes to real tensors do. Sound means, per call:

- the functional overload is itself deferrable (opspec: policy DEFER, no view, no grad-mode
  kernel; random, data-dependent and allocating ops keep the run-at-once fallback);
- every out is a plain real tensor (a pending lazy out, a subclass, a list of outs: fallback)
  that shares no storage with any real input (an out aliasing an input can make eager raise,
  or read what it already wrote; pending lazy inputs never alias real tensors, because views of
  real tensors are made at once);
- the functional result has exactly the out's dtype, device and size, and the same strides on
  every dimension longer than 1. Then eager's out kernel (for structured kernels the very same
  ``impl``; for the others ``foo()`` is ``empty`` + ``foo_out``) computes the same values into
  the same layout, and the copy changes no bit. Anything else (a resize, with or without its
  warning; a dtype cast into the out; a transposed out) runs the ``out=`` op itself at once,
  after a flush: eager's behaviour exactly, warning included. The functional op already recorded
  for the comparison stays in the trace as a dead op (its result is never read).

The first call of a new (op, input metadata) runs the functional op for real to learn its
metadata (as every deferred op's first call does) and copies its result into the out the same
way, or runs the ``out=`` op itself when the checks above fail.
"""

from __future__ import annotations

from typing import Any

import torch

from adaptive_eager.core.meta import meta_of
from adaptive_eager.dispatch.lazy import LazyTensor, resolve_all
from adaptive_eager.dispatch.opspec import OpSpec, spec_for
from adaptive_eager.core.errors import Unsupported
from adaptive_eager.engine import Engine, NeedRun, RunNow, is_user_error
from adaptive_eager.metadata import refresh_wrapper
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.trace import _storage

_Tensor = torch.Tensor
_DisableDispatch = torch._C._DisableTorchDispatch
_DisableFunction = torch._C.DisableTorchFunction
_COPY = spec_for(torch.ops.aten.copy_.default)


def _mode() -> Any:
    """dispatch/mode.py, which imports this module (so not at import time here)."""
    from adaptive_eager.dispatch import mode
    return mode


def run_out(eng: Engine, op: Any, spec: OpSpec, args: tuple, kwargs: dict) -> Any:
    """An ``out=`` op under the engine (Note [out= ops])."""
    plan = spec.functional
    if plan is None:
        return eng.run_fallback(op, spec, args, kwargs, "fallback")
    fspec, names = plan
    outs = []
    for n in names:
        o = kwargs.get(n)
        if type(o) is not _Tensor:  # a lazy out, a subclass, None: at once
            return _fallback(eng, op, spec, args, kwargs, names)
        outs.append(o)
    fkwargs = {k: v for k, v in kwargs.items() if k not in names}
    if _overlaps(outs, args, fkwargs):
        return eng.run_fallback(op, spec, args, kwargs, "out_overlaps_input")
    mode = _mode()
    if not eng.trace.ops and mode.is_host_scalar_op((*args, *fkwargs.values(), *outs)):
        # Note [host scalars] in mode.py: only real CPU scalars, cheaper run at once
        M.ops_eager += 1
        with _DisableDispatch(), _DisableFunction():
            return op(*args, **kwargs)
    fop = fspec.op
    try:
        res = eng.record(fop, fspec, args, fkwargs)
    except NeedRun as miss:
        M.meta_misses += 1
        res = eng.run_eager(fop, fspec, args, fkwargs, f"new_op:{fspec.name}", miss.key)
        if not _fits(res, outs):
            return _run_out_now(op, spec, args, kwargs, outs)
        M.ops_eager += len(outs)
        with _DisableDispatch(), _DisableFunction():
            for o, r in zip(outs, _seq(res)):
                o.copy_(r)
        return _returned(outs)
    except (RunNow, Unsupported):
        return eng.run_fallback(op, spec, args, kwargs, "out_unsupported")
    except Exception as err:
        if is_user_error(err):
            raise
        return eng.run_fallback(op, spec, args, kwargs, eng.engine_error(err, fspec))
    if not _fits(res, outs):
        return eng.run_fallback(op, spec, args, kwargs, "out_resized")
    for o, r in zip(outs, _seq(res)):
        mode.defer(eng, _COPY.op, _COPY, (o, r), {}, None)  # a new copy's metadata: at once
    return _returned(outs)


def _fallback(eng: Engine, op: Any, spec: OpSpec, args: tuple, kwargs: dict,
              names: tuple[str, ...]) -> Any:
    """Run the ``out=`` op at once; a lazy out that eager resized gets its new shape (the
    wrapper's sizes are fixed at creation, DESIGN trap 3)."""
    out = eng.run_fallback(op, spec, args, kwargs, "out_arg")
    for n in names:
        o = kwargs.get(n)
        if type(o) is LazyTensor and o._ae_real is not None:
            with _DisableFunction():
                moved = meta_of(o._ae_real) is not o._ae_meta
            if moved:
                refresh_wrapper(o)
    return out


def _run_out_now(op: Any, spec: OpSpec, args: tuple, kwargs: dict, outs: list) -> Any:
    """The ``out=`` op itself on real values (the trace was flushed by the run before)."""
    M.ops_eager += 1
    M.fallbacks += 1
    M.fallback_ops[spec.name] += 1
    with _DisableFunction():
        op(*resolve_all(args), **{k: resolve_all(v) for k, v in kwargs.items()})
    return _returned(outs)


def _returned(outs: list) -> Any:
    return outs[0] if len(outs) == 1 else tuple(outs)


def _seq(res: Any) -> tuple:
    return tuple(res) if type(res) is tuple or type(res) is list else (res,)


def _fits(res: Any, outs: list) -> bool:
    """Whether each functional result has its out's dtype, device, size and layout."""
    rs = _seq(res)
    if len(rs) != len(outs):
        return False
    with _DisableFunction():
        return all(_fits_one(r, o) for r, o in zip(rs, outs))


def _fits_one(r: Any, o: torch.Tensor) -> bool:
    if not isinstance(r, _Tensor):
        return False
    m = r._ae_meta if type(r) is LazyTensor else meta_of(r)
    mo = meta_of(o)
    if (m.size != mo.size or m.dtype != mo.dtype or m.device != mo.device or m.bits
            or mo.bits):
        return False
    return not any(n > 1 and a != b for n, a, b in zip(m.size, m.stride, mo.stride))


def _overlaps(outs: list, args: tuple, kwargs: dict) -> bool:
    """Whether an out shares storage with a real input (or with another out); also True for
    tensors without a storage to compare (sparse): those run at once."""
    try:
        return _shares_storage(outs, args, kwargs)
    except (RuntimeError, NotImplementedError):
        return True


def _shares_storage(outs: list, args: tuple, kwargs: dict) -> bool:
    with _DisableFunction():
        addrs = [_storage(o).data_ptr() for o in outs]  # the C method: no read-hook frame
        if len(set(addrs)) != len(addrs):
            return True
        seen = set(addrs)
        for a in (*args, *kwargs.values()):
            for x in (a if type(a) is list or type(a) is tuple else (a,)):
                if type(x) is LazyTensor:
                    x = x._ae_real
                    if x is None:
                        continue  # pending: never a view of a real tensor
                if isinstance(x, _Tensor) and _storage(x).data_ptr() in seen:
                    return True
    return False
