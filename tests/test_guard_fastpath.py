"""The read guard's cheaper paths never let a stale read through (Note [guard off while a trace
runs] and Note [item under the armed guard] in dispatch/mode.py).

Python-level reads of parameters whose optimizer update is still pending (a per-optimizer step
post hook runs before the engine's own flushing hook) and after hand-written in-place updates
are compared bitwise with plain eager on identical inputs; training with AdamW and SGD stays
bitwise equal to eager with the replay backend; and no guard call is made while a trace runs."""

from __future__ import annotations

import copy
import pickle
from typing import Any, Callable

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.dispatch import mode
from adaptive_eager.engine import owned_engine

_ENGINE = dict(backend="replay", step_aside=False, check=True)


def _armed() -> bool:
    n = torch._C._len_torch_function_stack()
    return any(type(torch._C._get_function_stack_at(i)) is mode.ReadGuardMode for i in range(n))


def _pending() -> int:
    eng = owned_engine()
    return 0 if eng is None else len(eng.trace.ops)


# Each read turns a parameter into plain Python values (or a fresh tensor clone), so eager's and
# the engine's answers can be compared exactly.
_READS: dict[str, Callable[[torch.Tensor], Any]] = {
    "item_element": lambda p: p.reshape(-1)[0].item(),
    "item_sum": lambda p: p.sum().item(),
    "float": lambda p: float(p.detach().reshape(-1)[-1]),
    "tolist": lambda p: p.tolist(),
    "numpy": lambda p: p.detach().numpy().tolist(),
    "array": lambda p: __import__("numpy").asarray(p.detach()).tolist(),
    "repr": lambda p: repr(p.detach()),
    "str": lambda p: str(p.detach()),
    "format": lambda p: f"{p.reshape(-1)[0].detach():.9f}",
    "equal": lambda p: torch.equal(p, p.detach().clone()),
    "clone": lambda p: p.detach().clone().tolist(),
    "to_double": lambda p: p.detach().to(torch.float64).tolist(),
    "pickle": lambda p: pickle.loads(pickle.dumps(p.detach())).tolist(),
    "deepcopy": lambda p: copy.deepcopy(p.detach()).tolist(),
    "data": lambda p: p.data.tolist(),
    "storage": lambda p: p.untyped_storage().tolist(),
}


def _model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return model, torch.randn(9, 5), torch.randn(9, 3)


def _post_hook_reads(read: Callable[[torch.Tensor], Any], steps: int = 4) -> tuple[list, list]:
    """AdamW steps; a per-optimizer post hook reads every parameter while (under the engine)
    the update is still pending. Returns the reads and (pending ops, armed) at each read."""
    model, x, y = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    outs: list = []
    states: list = []

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        states.append((_pending(), _armed()))
        outs.extend(read(p) for p in model.parameters())

    opt.register_step_post_hook(hook)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        (model(x) - y).square().mean().backward()
        opt.step()
    outs.extend(p.detach().clone().tolist() for p in model.parameters())
    return outs, states


@pytest.mark.parametrize("reader", sorted(_READS))
def test_reads_of_a_pending_optimizer_update_equal_eager(reader: str) -> None:
    expected, _ = _post_hook_reads(_READS[reader])
    with ae.adaptive_eager(**_ENGINE):
        got, states = _post_hook_reads(_READS[reader])
    assert got == expected
    # the reads after warm-up did see a pending update (the test is not vacuous): the update
    # was recorded, not yet run; the guard stayed off the stack (Note [reads of pending writes])
    assert any(n > 0 for n, _ in states[1:]) and not any(a for _, a in states), states
    assert ae.metrics()["engine_errors"] == 0


def _hand_sgd(reads: list[str], steps: int = 4) -> list:
    """Hand-written in-place updates of real tensors (deferred, so pending), each followed by
    every read in ``reads``, twice (the first read may flush from inside the guard)."""
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(3, 4))
    buf = torch.zeros(3, 4)
    g = torch.randn(3, 4)
    outs: list = []
    for i in range(steps):
        with torch.no_grad():
            buf.mul_(0.9).add_(g * (i + 1.0))
            w.add_(buf, alpha=-0.125)
        for name in reads:
            outs.append(_READS[name](w))
            outs.append(_READS[name](buf))
        with torch.no_grad():
            w.mul_(1.0 - 1e-3)  # another pending write after the reads' flushes
        outs.append(_READS[reads[0]](w))
    return outs


@pytest.mark.parametrize("lazy_guard", [True, False])
@pytest.mark.parametrize("reader", sorted(_READS))
def test_reads_after_hand_written_updates_equal_eager(reader: str, lazy_guard: bool) -> None:
    reads = [reader, "item_sum"]  # each read first, where it alone must see the writes
    expected = _hand_sgd(reads)
    with ae.adaptive_eager(lazy_guard=lazy_guard, **_ENGINE):
        got = _hand_sgd(reads)
    assert got == expected


def _train(make_opt: Callable[[Any], Any], steps: int = 6) -> list:
    model, x, y = _model()
    opt = make_opt(model.parameters())
    out: list = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (model(x * (1.0 + 0.1 * i)) - y).square().mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    out += [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() if isinstance(v, torch.Tensor) else v for v in opt.state[p].values()]
    return out


_OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "sgd_loop": lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=1e-3, foreach=False),
}


@pytest.mark.parametrize("opt", sorted(_OPTIMIZERS))
def test_training_is_bitwise_eager(opt: str) -> None:
    expected = _train(_OPTIMIZERS[opt])
    with ae.adaptive_eager(**_ENGINE):
        got = _train(_OPTIMIZERS[opt])
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
        else:
            assert a == b
    assert not _armed()  # nothing pending after the context: the guard is off the stack


def test_pending_writes_make_no_guard_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [reads of pending writes]: an optimizer's pending update of its parameters puts
    nothing on the function-mode stack, so no torch call of the program or of the engine (a
    trace's run, publish's metadata reads) pays the guard's round trip."""
    calls: list = []
    orig = mode.ReadGuardMode.__torch_function__

    def counting(self: Any, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        calls.append((func, self.engine.flushing))
        return orig(self, func, types, args, kwargs)

    monkeypatch.setattr(mode.ReadGuardMode, "__torch_function__", counting)
    expected = _train(_OPTIMIZERS["adamw_foreach"])
    with ae.adaptive_eager(**_ENGINE):
        got = _train(_OPTIMIZERS["adamw_foreach"])
    assert [float(v) if not isinstance(v, torch.Tensor) else v.tolist() for v in got] == \
        [float(v) if not isinstance(v, torch.Tensor) else v.tolist() for v in expected]
    assert ae.metrics()["ops_deferred"] > 0  # the updates were recorded, so pending a while
    assert not calls, calls[:10]
