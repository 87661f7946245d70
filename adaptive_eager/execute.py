"""Run a trace op by op with eager's own kernels and hand the real values to the lazy tensors.

Replay runs below autograd and ADInplaceOrView: the user's ops already went through autograd (graph
built, version counters bumped) when they were recorded, and doing it again would bump version
counters twice (DESIGN trap 1). Python dispatch, torch-function modes and autocast are off too: the
recorded ops are what eager ran after autocast, and they must not be intercepted again.
"""

from __future__ import annotations

from typing import Any

import torch

from adaptive_eager.dispatch.lazy import LazyTensor, meta_of
from adaptive_eager.trace import Trace


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


def _real(a: Any) -> Any:
    t = type(a)
    if t is LazyTensor:
        r = a._ae_real
        if r is None:
            raise RuntimeError(f"adaptive_eager: internal error: slot {a._ae_slot} used before set")
        return r
    if t is list or t is tuple:
        return t(_real(x) for x in a)
    return a


def _bind(out: Any, res: Any, check: bool) -> None:
    t = type(out)
    if t is LazyTensor:
        if out._ae_real is None:
            if check:
                _check(out, res)
            out._ae_real = res
    elif t is tuple or t is list:
        for o, r in zip(out, res):
            _bind(o, r, check)


def _check(lazy: LazyTensor, real: torch.Tensor) -> None:
    got = meta_of(real)
    if got is not lazy._ae_meta:
        raise MetadataMismatch(f"adaptive_eager: replay produced {got}, the lazy tensor said "
                               f"{lazy._ae_meta}")


def _poison(out: Any, err: BaseException) -> None:
    t = type(out)
    if t is LazyTensor:
        if out._ae_real is None:
            out._ae_error = err
    elif t is tuple or t is list:
        for o in out:
            _poison(o, err)


def replay(trace: Trace, check: bool) -> None:
    """Execute every op of ``trace`` in order; on an error, poison what was not computed."""
    ops = trace.ops
    n = len(ops)
    i = 0
    with ReplayGuard():
        try:
            while i < n:
                op, args, kwargs, out, lazy_args = ops[i]
                ops[i] = None  # type: ignore[call-overload]  # let dead intermediates go early
                if lazy_args:
                    res = op(*_real(args), **{k: _real(v) for k, v in kwargs.items()})
                else:
                    res = op(*args, **kwargs)
                if out is not None:
                    _bind(out, res, check)
                i += 1
        except BaseException as err:
            _poison(out, err)
            for rec in ops[i + 1:]:
                _poison(rec[3], err)
            err.add_note(f"adaptive_eager: raised by deferred op {op} (op {i} of a trace of {n}) "
                         "when the trace ran; run with adaptive_eager disabled to see the line "
                         "that recorded it")
            raise
        finally:
            ops.clear()
            trace.ext.clear()
