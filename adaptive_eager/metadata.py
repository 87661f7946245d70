"""Output metadata without running the whole trace: the metadata cache's keys, views worked out
on meta stand-ins, and what a real run of an op teaches (its outputs' layout, whether they share
storage with the inputs, whether it resized what it wrote). The engine (engine.py) asks here on a
trie miss and after every op it had to run for real."""

from __future__ import annotations

from typing import Any

import torch

from adaptive_eager.core.errors import Unsupported
from adaptive_eager.core.meta import CONJ, NEG, intern_meta, meta_of
from adaptive_eager.dispatch.lazy import LazyTensor
from adaptive_eager.dispatch.opspec import GRAD_MODE, INPLACE_VIEW, OpSpec

_Tensor = torch.Tensor
_DisableDispatch = torch._C._DisableTorchDispatch
_DisableFunction = torch._C.DisableTorchFunction
_storage = torch._C.TensorBase.untyped_storage


def metadata_key(op: Any, spec: OpSpec, args: tuple, kwargs: dict,
                  offsets: bool = True) -> tuple:
    """``offsets=False``: pending inputs keyed without their storage offsets too (Note [fresh
    outputs ignore offsets])."""
    key = (torch.get_default_dtype(), op, _meta_key(args, spec, offsets),
           _meta_key(tuple(kwargs.items()), spec, offsets) if kwargs else None)
    if spec.policy == GRAD_MODE:  # Note [grad-mode kernels] in engine.py
        return (*key, torch.is_grad_enabled())
    return key


def _meta_key(items: tuple, spec: OpSpec, offsets: bool = True) -> tuple:
    """Like the trace key, but with every tensor as its metadata id (see cache/memory.py)."""
    out: list[Any] = []
    with _DisableFunction():
        for a in items:
            t = type(a)
            if t is LazyTensor and a._ae_real is None and offsets:
                out.append(a._ae_meta.mid)  # pending: its offset matters to views of it
            elif isinstance(a, _Tensor):
                m = a._ae_meta if t is LazyTensor else meta_of(a)
                # external: offset-free, as in the trace key (Note [views of real tensors],
                # engine.py)
                out.append(intern_meta(m.size, m.stride, 0, m.dtype, m.device, m.bits).mid)
            elif t is list or t is tuple:
                out.append(_meta_key(tuple(a), spec, offsets))
            elif t is float or t is complex or t is int or t is bool:
                out.append((t, a) if spec.structural or t is int or t is bool else t)
            else:
                out.append(a)
    return tuple(out)


def view_metadata(op: Any, spec: OpSpec, args: tuple, kwargs: dict) -> Any:
    """Output metadata of a view of a pending lazy tensor, without running anything.

    A view reads no data, so it runs on meta stand-ins with the inputs' exact sizes, strides,
    offsets and view bits: the result has the view's exact metadata. Without this, a view first
    seen on a real tensor (made at once, engine.run_view) would need one more eager run once its
    input became lazy, and chains of them would take a run per level to defer. Never on the
    wrappers themselves: under inference mode, ops that only may return a view (``to``,
    ``reshape``, ``contiguous``: composite ops that then reach this mode) copy when they must,
    and a copy reads the data a wrapper does not have (a segfault). A result that does not alias
    its base was such a copy: its metadata then come from a real run (NeedRun)."""
    if spec.view_arg is None:
        return None
    try:
        with _DisableDispatch(), _DisableFunction():
            margs = tuple(_stand_in(a) for a in args)
            mkwargs = {k: _stand_in(v) for k, v in kwargs.items()} if kwargs else {}
            base = margs[spec.view_arg]
            out = op(*margs, **mkwargs)
            return _view_spec(out, base, args[spec.view_arg].device)
    except Exception:
        return None


def _stand_in(a: Any) -> Any:
    """A meta tensor with a tensor's metadata (no data, so nothing can read any)."""
    t = type(a)
    if t is list or t is tuple:
        return t(_stand_in(x) for x in a)
    if not isinstance(a, _Tensor):
        return a
    m = a._ae_meta if t is LazyTensor else meta_of(a)
    extent = m.offset + 1 + sum((n - 1) * st for n, st in zip(m.size, m.stride)) if all(
        m.size) else m.offset
    x = torch.empty(extent, dtype=m.dtype, device="meta").as_strided(m.size, m.stride, m.offset)
    if m.bits & CONJ:
        torch._C._set_conj(x, True)
    if m.bits & NEG:
        torch._C._set_neg(x, True)
    return x


def _view_spec(out: Any, base: torch.Tensor, device: torch.device) -> Any:
    """Metadata of a view made on meta stand-ins, on the real device; raises for a copy."""
    if type(out) is list or type(out) is tuple:
        return type(out)(_view_spec(o, base, device) for o in out)
    if not isinstance(out, _Tensor) or not torch._C._is_alias_of(out, base):
        raise Unsupported("not a view")
    bits = (CONJ if out.is_conj() else 0) | (NEG if out.is_neg() else 0)
    return intern_meta(out.shape, out.stride(), out.storage_offset(), out.dtype, device, bits)


EAGER_ONLY = "eager-only"  # metadata-cache value: outputs a lazy tensor cannot stand for


# Note [fresh outputs ignore offsets]
# A pending lazy input is keyed in the metadata cache with its storage offset, since a view of it
# has an offset that follows from it. An op whose outputs share no storage with its inputs has
# metadata that follows from the inputs' sizes, strides, dtypes and the arguments alone (the
# kernel allocates its outputs; TensorIterator lays them out by strides), so its learnt metadata
# are also kept under a key without pending inputs' offsets (``MetaCache.fresh``) and serve a
# later miss whose inputs differ only in offset. Without it, a Python loop over time steps
# (``dt[:, t] * a`` for t in range(32): a pending view at another offset each time) needed an
# eager run, and so a flush, for every t; each flush made the rest of that step's tensors real,
# so each step learnt only the next few offsets: the selective-scan benchmark ran 23 steps op by
# op, cut into 3-4 traces each, before its whole step repeated. Ops that may alias an input (by
# their schema, or as found when learning: ``_unsafe_view`` shares storage unannotated) are
# keyed with offsets as before.
# Note [in-place ops that resize]
# An in-place op returns its input with the input's metadata, so the engine defers it with the
# wrapper as it is. A few kernels resize what they write instead: ``addbmm_`` with a broadcast
# self (shape (1,) or ()) runs as addbmm.out into self and resizes it to the product's shape.
# Deferred, the wrapper would keep the old shape and every later op would be keyed, computed
# and shaped against it (a view of it took 1 element where eager took 50). The op's learning run
# (its first real run) compares the layout of each tensor it writes before and after; an op
# seen to resize one is from then on handled as the metadata-changing in-place ops are
# (``t_``, ``resize_``: run at once, the wrapper made to follow), for every call, since whether
# it resizes depends on the shapes. Every other real run of an op that writes (fallbacks, custom
# ops without a fake impl) is checked the same way, so a wrapper never keeps a stale shape. Ops
# in torch's OpInfo database that do this: addbmm_ alone.
def resizes_what_it_writes(spec: OpSpec, args: tuple) -> None:
    spec.policy, spec.reason = INPLACE_VIEW, "resizes the tensor it writes in place"
    for i in spec.writes or ():
        a = args[i] if type(i) is int and i < len(args) else None
        if type(a) is LazyTensor and a._ae_real is not None:
            refresh_wrapper(a)


def written_layouts(spec: OpSpec, args: tuple) -> tuple:
    """Sizes, strides and offsets of the positional tensors an op writes (real values)."""
    out = []
    for i in spec.writes:
        a = args[i] if type(i) is int and i < len(args) else None
        if isinstance(a, _Tensor) and a.layout == torch.strided:
            out.append((i, tuple(a.shape), a.stride(), a.storage_offset()))
    return tuple(out)


def fresh(out: Any, args: tuple, kwargs: dict) -> bool:
    """Whether no tensor output of a real run shares storage with a tensor input."""
    outs = out if type(out) is tuple or type(out) is list else (out,)
    if not all(isinstance(o, _Tensor) or o is None for o in outs):
        return False
    ins: list = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, _Tensor):
            ins.append(a)
        elif type(a) is list or type(a) is tuple:
            ins.extend(x for x in a if isinstance(x, _Tensor))
    is_alias = torch._C._is_alias_of
    return not any(o is not None and is_alias(o, x) for o in outs for x in ins)


def output_spec(out: Any, ret_alias: tuple[int | None, ...]) -> Any:
    if _non_strided(out):
        return EAGER_ONLY
    if isinstance(out, _Tensor):
        alias = ret_alias[0] if ret_alias else None
        return alias if alias is not None else meta_of(out)
    if type(out) is tuple:
        return tuple(i if i is not None else _spec_of(o)
                     for i, o in zip(ret_alias or (None,) * len(out), out))
    return _spec_of(out)


def _non_strided(out: Any) -> bool:
    if isinstance(out, _Tensor):
        return out.layout is not torch.strided or out.is_quantized or out.is_nested
    if type(out) is list or type(out) is tuple:
        return any(_non_strided(o) for o in out)
    return False


def _spec_of(out: Any) -> Any:
    if isinstance(out, _Tensor):
        return meta_of(out)
    if out is None:
        return None
    if type(out) is list or type(out) is tuple:
        return type(out)(_spec_of(o) for o in out)
    raise Unsupported(f"op returned {type(out).__name__}")


def refresh_wrapper(w: LazyTensor) -> None:
    """Make a wrapper follow its value's new sizes, strides and offset (trap 3)."""
    real = w._ae_real
    assert real is not None
    with _DisableDispatch(), _DisableFunction():
        meta = meta_of(real)
        try:
            torch.ops.aten.as_strided_.default(w, meta.size, meta.stride, meta.offset)
        except RuntimeError:
            # Grown past the wrapper's own (empty) storage, made for its first sizes (``resize_``
            # or ``resize_as_`` to more elements): the wrapper takes its value's storage, which
            # the resize reallocated; ops on it still reach the engine (its dispatch keys stay)
            torch.ops.aten.set_.source_Storage_storage_offset(
                w, _storage(real), meta.offset, meta.size, meta.stride)
    w._ae_meta = meta
