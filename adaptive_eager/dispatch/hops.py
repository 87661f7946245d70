"""Higher-order operators (``torch._higher_order_ops``) under the engine.

Note [higher-order operators]
A HigherOrderOperator (flex_attention, cond, while_loop, scan, invoke_subgraph, checkpoint's
tag_activation_checkpoint, auto_functionalized, with_effects, ...) takes callables and subgraphs,
not just tensors, and has no schema a trace key could be built from. Under a TorchDispatchMode,
torch looks the mode's type up in the HOP's ``python_key_table`` and raises NotImplementedError
when it finds no rule. Every HOP known when an engine starts gets one rule for ``DeferMode``: flush
the pending trace, take real values for lazy arguments (nested in tuples and lists too: block
masks, captured buffers), and run the HOP with the engine's modes off, exactly as eager runs it;
counted as a fallback named ``hop:<name>``. The rule runs below autograd (the HOP's own autograd
rule, where it has one, sits above the Python key), so its outputs are plain tensors and autograd
wraps them as in eager; a HOP's backward (flex_attention_backward) takes the same rule.
``LazyTensor`` gets a rule too, for lazy tensors that reach a HOP after their engine is gone.

Most of these HOPs, called from eager code, run through ``torch.compile`` internally
(``flex_attention``, ``torch.cond``, ``while_loop``): those calls take the compiled-region path
first (Note [compiled regions] in regions.py) and reach the HOP with no engine mode active.
Deferring a HOP into the trace (and fusing it) where it has a decomposition is not done: the
subgraph arguments are Python callables a trace key cannot name.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch._ops import HigherOrderOperator

from adaptive_eager.dispatch.lazy import LazyTensor, materialize
from adaptive_eager.dispatch.regions import engine_modes_off
from adaptive_eager.metrics import METRICS as M


def _real(x: Any) -> Any:
    t = type(x)
    if t is LazyTensor:
        return materialize(x)
    if t is tuple or t is list:
        return t(_real(v) for v in x)
    if t is dict:
        return {k: _real(v) for k, v in x.items()}
    return x


def _rule_for_mode(hop: HigherOrderOperator) -> Any:
    name = f"hop:{hop.name()}"

    def rule(mode: Any, *args: Any, **kwargs: Any) -> Any:
        # torch popped ``mode`` (our DeferMode) for this call; ReadGuardMode may be on.
        engine = mode.engine
        engine.flush(f"fallback:{name}")
        M.fallbacks += 1
        M.fallback_ops[name] += 1
        M.ops_eager += 1
        rargs, rkwargs = _real(args), _real(kwargs)
        with engine_modes_off():
            return hop(*rargs, **rkwargs)

    return rule


def _rule_for_lazy(hop: HigherOrderOperator) -> Any:
    def rule(*args: Any, **kwargs: Any) -> Any:
        with engine_modes_off():
            return hop(*_real(args), **_real(kwargs))

    return rule


_done: set[int] = set()
_lock = threading.Lock()


def install() -> int:
    """Give every HOP known now a rule for the engine's mode (idempotent; new HOPs made since
    the last call are picked up). Returns how many HOPs got rules."""
    from adaptive_eager.dispatch.mode import DeferMode

    with _lock:
        return _install(DeferMode)


def _install(DeferMode: type) -> int:
    added = 0
    for hop in list(torch._ops._higher_order_ops.values()):
        if id(hop) in _done:
            continue
        _done.add(id(hop))
        table = hop.python_key_table
        if DeferMode not in table:
            hop.py_impl(DeferMode)(_rule_for_mode(hop))
            added += 1
        if LazyTensor not in table:
            hop.py_impl(LazyTensor)(_rule_for_lazy(hop))
    return added
