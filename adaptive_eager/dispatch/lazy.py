"""Lazy tensors: wrapper tensors whose metadata is known and whose value arrives at a flush.

A ``LazyTensor`` is a ``_make_wrapper_subclass`` tensor: shape, stride, dtype and device are real
(autograd, ``.shape``, ``is_contiguous()`` all work without running anything); the value lives in
``_ae_real`` once the trace that produces it has run. Until then ``_ae_trace`` names that trace.
Python-level reads of the data (print, numpy, tolist, data_ptr, pickling) are overridden here to
flush first; reads through aten ops are deferred like any other op.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from adaptive_eager.core import hooks
from adaptive_eager.core.meta import CONJ, NEG, Meta

_DisableDispatch = torch._C._DisableTorchDispatch
_DisableFunction = torch._C.DisableTorchFunction
_get_ident = threading.get_ident


class ValueUnavailable(RuntimeError):
    """A lazy tensor whose producing op failed when its trace ran."""


class LazyTensor(torch.Tensor):
    _ae_trace: Any
    _ae_slot: int
    _ae_meta: Meta
    # Class defaults: a new lazy tensor has neither, and two instance stores fewer per op.
    _ae_real: torch.Tensor | None = None
    _ae_error: BaseException | None = None

    # Subclass torch-function handling would add a Python call to every op; reads are overridden
    # below instead, and the engine's TorchFunctionMode guards real tensors while they have
    # pending writes (Note [read guard] in mode.py).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, meta: Meta, trace: Any, slot: int) -> LazyTensor:
        # engine.record makes its outputs the same way, inlined
        t = torch.Tensor._make_wrapper_subclass(cls, *meta.wrapper_args)
        t._ae_trace = trace
        t._ae_slot = slot
        t._ae_meta = meta
        if meta.bits:
            _set_bits(t, meta)
        return t

    def __init__(self, *args: Any) -> None:  # everything happens in __new__
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        # Reached only outside an engine (e.g. a lazy tensor kept after the context closed):
        # run the op eagerly on the real values.
        kwargs = kwargs or {}
        out = func(*resolve_all(args), **{k: resolve_all(v) for k, v in kwargs.items()})
        assert hooks.spec_for is not None  # filled by dispatch/opspec.py at package import
        return rebind_aliases(hooks.spec_for(func).ret_alias, args, out)

    # ---- Python-level reads: flush, then read the real value ------------------------------
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return format_lazy(self)

    def __format__(self, format_spec: str) -> str:
        if format_spec and self.dim() == 0:
            return materialize(self).item().__format__(format_spec)
        return format_lazy(self)

    def __reduce_ex__(self, proto: Any) -> Any:  # pickling and torch.save
        return _with_grad(self).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return copy.deepcopy(_with_grad(self), memo)

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. "
                               "Use tensor.detach().numpy() instead.")
        return materialize(self).numpy(force=force)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:  # type: ignore[override]
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def tolist(self) -> Any:  # type: ignore[override]
        return materialize(self).tolist()

    def data_ptr(self) -> int:  # type: ignore[override]
        return materialize(self).data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        return materialize(self).untyped_storage()

    def storage(self) -> Any:  # type: ignore[override]
        return materialize(self).storage()

    def _typed_storage(self) -> Any:
        return materialize(self)._typed_storage()

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return materialize(self).__dlpack__(*args, **kwargs)


def _set_bits(t: torch.Tensor, meta: Meta) -> None:
    """A lazy conj/neg view must say so, as eager's would."""
    torch._C._set_conj(t, bool(meta.bits & CONJ))
    torch._C._set_neg(t, bool(meta.bits & NEG))


_swap_impl = torch._C._swap_tensor_impl
_LAZY_ATTRS = ("_ae_real", "_ae_trace", "_ae_slot", "_ae_meta", "_ae_error")


def become_real(w: LazyTensor, real: torch.Tensor) -> bool:
    """Note [lazy tensors become real]
    A lazy tensor the program keeps (optimizer state, a running statistic, a cached mask) would
    otherwise stay a Python subclass for the rest of the process: every later op on it, also
    outside the engine (stepped aside, after the context) pays a trip through
    ``__torch_dispatch__``. At publish, a lazy tensor that only its own Python object holds
    (``_use_count() == 1``: no autograd node saved it, no ``.grad`` slot points at it) and that
    needs no autograd metadata (``requires_grad`` False) swaps its TensorImpl with its value's, as
    ``torch.utils.swap_tensors`` does: the user's object is now a plain tensor, same identity.
    The value's old Python object gets the wrapper and stands for ``w`` from then on.
    A weak reference to either TensorImpl (the profiler's ``record_shapes``/``profile_memory``
    keep them) makes the swap refuse before it changes anything: ``w`` then stays lazy with its
    value set, and False says so."""
    try:
        _swap_impl(w, real)
    except RuntimeError:
        return False
    w.__class__, real.__class__ = torch.Tensor, LazyTensor
    d = w.__dict__
    real._ae_trace, real._ae_slot, real._ae_meta = d["_ae_trace"], d["_ae_slot"], d["_ae_meta"]
    real._ae_error = None
    real._ae_real = w
    for k in _LAZY_ATTRS:
        d.pop(k, None)
    return True


def materialize(t: LazyTensor) -> torch.Tensor:
    """The real value of a lazy tensor, flushing its trace if it has not run yet (from any
    thread: Note [threads and lazy tensors] in engine.py)."""
    trace = getattr(t, "_ae_trace", None)
    if trace is None:  # it became a plain tensor meanwhile (its owner thread's publish)
        return t
    eng = trace.engine
    if eng.owner != _get_ident():  # another thread: under the owner's lock, never mid-flush
        with eng.lock:
            eng.shared = True  # from now on its owner swaps no impls (Note [threads ...])
            if type(t) is not LazyTensor:  # swapped before this thread took the lock
                return t
            return _materialize(t)
    return _materialize(t)


def _materialize(t: LazyTensor) -> torch.Tensor:
    real = t._ae_real
    if real is None:
        if t._ae_error is None:
            t._ae_trace.engine.flush("read")
            if type(t) is not LazyTensor:  # it became real (Note [lazy tensors become real])
                return t
            real = t._ae_real
            if real is not None:
                return real
        if t._ae_error is not None:
            raise ValueUnavailable(
                "adaptive_eager: this tensor has no value because a deferred op before it "
                f"failed when its trace ran: {t._ae_error!r}") from t._ae_error
        # Never expected: its trace ran (or is not its engine's pending one) and gave it nothing.
        raise RuntimeError("adaptive_eager: internal error: a lazy tensor got no value from its "
                           "trace; please report it (adaptive_eager.disable() avoids it)")
    return real


def resolve_all(a: Any) -> Any:
    t = type(a)
    if t is LazyTensor:
        return materialize(a)
    if t is list or t is tuple:
        return t(resolve_all(x) for x in a)
    return a


def rebind_aliases(ret_alias: tuple[int | None, ...], args: tuple, out: Any) -> Any:
    """In-place ops must return the very tensor they were given, not its real stand-in."""
    if not any(i is not None for i in ret_alias):
        return out
    if len(ret_alias) == 1:
        return args[ret_alias[0]]  # type: ignore[index]
    return tuple(o if i is None else args[i] for i, o in zip(ret_alias, out))


def _with_grad(t: LazyTensor) -> torch.Tensor:
    """A plain tensor with the lazy tensor's value and requires_grad, for pickling and copies."""
    real = materialize(t).detach()
    return real.requires_grad_(t.requires_grad) if t.requires_grad else real


def format_lazy(t: LazyTensor) -> str:
    """``repr`` as eager prints it: the real value, then eager's autograd suffix (trap 10)."""
    real = materialize(t)
    with _DisableDispatch(), _DisableFunction():
        text = torch.Tensor.__repr__(real)
    fn = t.grad_fn
    if fn is not None:
        name = type(fn).__name__
        if name == "CppFunction":
            name = fn.name().rsplit("::", 1)[-1]
        suffix = f"grad_fn=<{name}>"
    elif t.requires_grad:
        suffix = "requires_grad=True"
    else:
        return text
    return f"{text[:-1]}, {suffix})"


_patched = False


def install_parameter_patch() -> None:
    """``nn.Parameter(lazy)`` and ``nn.Buffer(lazy)`` take the real value.

    A parameter must be a plain tensor: one that stayed a wrapper would send every later op on it
    through Python, and ``type(p) in [Tensor, Parameter]`` checks (optimizers) would pick slow
    paths (DESIGN trap 13). Parameter's own subclass path would also reject a wrapper whose first
    ``detach()`` ran eagerly. Installed once, on the first engine start; a no-op for other data.
    """
    global _patched
    if _patched:
        return
    _patched = True
    for cls in (torch.nn.Parameter, torch.nn.Buffer):
        original = cls.__new__

        def __new__(cls_: type, data: Any = None, *args: Any, _orig: Any = original,
                    **kwargs: Any) -> Any:
            if type(data) is LazyTensor:
                data = materialize(data)
            return _orig(cls_, data, *args, **kwargs)

        cls.__new__ = staticmethod(__new__)  # type: ignore[method-assign]


# Note [Python callbacks on values]
# ``Tensor.apply_``, ``map_`` and ``map2_`` call a Python function on every element, in C++, on
# the tensor's memory (CPU only). A lazy tensor has no memory of its own: ``apply_`` segfaulted
# on one (``torch.ones(4)`` is deferred, so ``torch.ones(4).apply_(f)`` under the engine), and
# ``map_`` raised "not supported for tensor subclasses"; on a real tensor with pending writes
# they read the data before those writes. So they run on values: this thread's pending trace
# runs first, lazy arguments become their values, and the call returns the tensor it was given
# (its value was written in place), as in eager. Eager's own check comes first: a tensor that
# requires grad is refused with eager's message (the value of a lazy one does not require grad).
_CALLBACK_METHODS = ("apply_", "map_", "map2_")


def _on_values(orig: Any, name: str) -> Any:
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # eager refuses a tensor that requires grad, self or an argument (map_'s other,
        # map2_'s x and y); a lazy one's value does not, so ask the wrappers
        if any(type(t) is LazyTensor and t.requires_grad
               for t in (self, *args, *kwargs.values())):
            raise RuntimeError(f"Can't call {name}() on Variable that requires grad. "
                               f"Use var.detach().{name}() instead.")
        if hooks.flush_before_handoff is not None:  # Note [hook slots] in core/hooks.py
            hooks.flush_before_handoff(f"read:{name}")
        orig(resolve_all(self), *(resolve_all(a) for a in args),
             **{k: resolve_all(v) for k, v in kwargs.items()})
        return self

    method.__name__ = method.__qualname__ = name
    method.__doc__ = orig.__doc__
    method._ae_hook = True  # type: ignore[attr-defined]
    return method


def _install_callback_methods() -> None:
    for name in _CALLBACK_METHODS:
        orig = getattr(torch.Tensor, name, None)
        if orig is not None and not getattr(orig, "_ae_hook", False):
            setattr(torch.Tensor, name, _on_values(orig, name))


_install_callback_methods()
