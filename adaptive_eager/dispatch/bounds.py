"""Value checks at record time: ops whose eager kernel raises on index values.

Note [value checks]
Eager raises an out-of-bounds index (``x[idx]``, ``gather``, ``embedding``, ``nll_loss``'s target)
at the line that made it. Deferred, the kernel ran at the next flush, so the error surfaced at a
later statement, or in a later test, and everything recorded after it had been handed out as if
it would run (DESIGN trap 8). These ops have the CHECKED policy: when their index tensor is
already real (the common case: token ids, labels, a literal) and on the CPU, the handler reads
its smallest and largest value before recording; where they might be out of bounds the op flushes
and runs at once, so eager's own kernel raises eager's own error at the user's line (or, where
the check was only conservative, computes what eager computes). The check is one ``aminmax``
over the index, a few microseconds for the index sizes of training and inference, paid only by
these ops, never by the ops the C accelerator records. Not checked, and so still raised at the
next flush with the op named: an index that is itself pending (computed in the same trace, such
as an ``argmax``), and indices on accelerators, where eager does not raise at the line either
(device-side asserts are asynchronous, and reading the values there would cost a device sync).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adaptive_eager.dispatch.lazy import LazyTensor

_aten = torch.ops.aten
_aminmax = _aten.aminmax.default
_NoTorchFunction = torch._C.DisableTorchFunction
_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def _real_index(t: Any) -> torch.Tensor | None:
    """The index's value when it can be read now without a flush (a real CPU integer tensor)."""
    if type(t) is LazyTensor:
        t = t._ae_real
        if t is None:
            return None  # pending: computed in this trace (Note [value checks])
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in _INDEX_DTYPES:
        return None
    return t


def _within(t: Any, n: int, negative: bool) -> bool:
    """Whether every value of ``t`` lies in [0, n), or in [-n, n) where eager wraps negatives."""
    real = _real_index(t)
    if real is None or real.numel() == 0:
        return True
    with _NoTorchFunction():
        lo, hi = _aminmax(real)
        lo, hi = int(lo), int(hi)
    return hi < n and lo >= (-n if negative else 0)


def _size(t: Any, dim: int) -> int:
    shape = t.shape
    if not shape:
        return 1  # a 0-d tensor indexes like a 1-element one
    return shape[dim]


def _along(negative: bool, index_at: int = 2) -> Callable[[tuple, dict], bool]:
    """Ops of the form ``op(self, dim, index, ...)``: the index runs along ``self``'s ``dim``."""
    def check(args: tuple, kwargs: dict) -> bool:
        if len(args) <= index_at or type(args[1]) is not int:
            return True  # a named dimension or keyword call: the kernel checks it at the flush
        return _within(args[index_at], _size(args[0], args[1]), negative)
    return check


def _flat(args: tuple, kwargs: dict) -> bool:
    """``take``/``put``: the index runs over the flattened tensor; negatives wrap."""
    return len(args) < 2 or _within(args[1], args[0].numel(), True)


def _indices(args: tuple, kwargs: dict) -> bool:
    """``x[i, j]`` and its writes: entry k of the list indexes dim k; negatives wrap. Boolean
    masks shift the dims that follow and are synced anyway (opspec ``bool_index``)."""
    if len(args) < 2:
        return True
    shape = args[0].shape
    ok = True
    for k, idx in enumerate(args[1]):
        if idx is None:
            continue
        if idx.dtype is torch.bool or idx.dtype is torch.uint8:
            return True
        if k >= len(shape):
            return True  # too many indices: a metadata error, raised when recording
        ok = ok and _within(idx, shape[k], True)
    return ok


def _embedding(args: tuple, kwargs: dict) -> bool:
    return len(args) < 2 or _within(args[1], _size(args[0], 0), False)


def _classes(inp: Any) -> int:
    return inp.shape[0] if inp.dim() == 1 else inp.shape[1]


def _target(args: tuple, kwargs: dict) -> bool:
    """``nll_loss``/``cross_entropy``: targets lie in [0, C) or equal ``ignore_index``."""
    if len(args) < 2:
        return True
    target = _real_index(args[1])
    if target is None or target.numel() == 0:
        return True  # also class probabilities (a float target)
    n = _classes(args[0])
    if _within(target, n, False):
        return True
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    with _NoTorchFunction():
        return bool(((target >= 0) & (target < n) | (target == ignore)).all())


def _margin_target(args: tuple, kwargs: dict) -> bool:
    return len(args) < 2 or _within(args[1], args[0].shape[-1] if args[0].dim() else 1, False)


_ALONG = ("index_select.default", "gather.default", "index_add.default", "index_add_.default",
          "index_copy.default", "index_copy_.default", "index_reduce.default",
          "index_reduce_.default", "scatter.src", "scatter.value", "scatter.reduce",
          "scatter.value_reduce", "scatter_.src", "scatter_.value", "scatter_.reduce",
          "scatter_.value_reduce", "scatter_add.default", "scatter_add_.default",
          "scatter_reduce.two", "scatter_reduce_.two")
_ALONG_WRAPPING = ("index_fill.int_Scalar", "index_fill.int_Tensor", "index_fill_.int_Scalar",
                   "index_fill_.int_Tensor")


def _table() -> dict[Any, Callable[[tuple, dict], bool]]:
    table: dict[Any, Callable[[tuple, dict], bool]] = {}

    def add(names: tuple[str, ...], check: Callable[[tuple, dict], bool]) -> None:
        for name in names:
            packet, overload = name.split(".")
            op = getattr(getattr(_aten, packet, None), overload, None)
            if op is not None:  # an op this torch does not have
                table[op] = check

    add(_ALONG, _along(False))
    add(_ALONG_WRAPPING, _along(True))
    add(("take.default", "put.default", "put_.default"), _flat)
    add(("index.Tensor", "index_put.default", "index_put_.default",
         "_index_put_impl_.default"), _indices)
    add(("embedding.default", "_embedding_bag.default", "_embedding_bag_forward_only.default",
         "embedding_bag.default", "embedding_bag.padding_idx"), _embedding)
    add(("nll_loss_forward.default", "nll_loss2d_forward.default", "nll_loss.default",
         "nll_loss_nd.default", "nll_loss2d.default", "cross_entropy_loss.default"), _target)
    add(("multi_margin_loss.default",), _margin_target)
    return table


CHECKS: dict[Any, Callable[[tuple, dict], bool]] = _table()


def in_bounds(op: Any, args: tuple, kwargs: dict) -> bool:
    """False where the op's index values may be out of bounds: it must run now (Note [value
    checks]). An argument of an unexpected form counts as in bounds: the kernel checks it."""
    try:
        return CHECKS[op](args, kwargs)
    except (AttributeError, IndexError, TypeError):
        return True
