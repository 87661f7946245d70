"""The armed read guard's answer to ``.item()`` (Note [item under the armed guard] in
dispatch/mode.py): a real tensor whose storage the pending trace does not touch is read at the
guard, without the trip through the dispatch mode; one with a pending write is never read stale.
The guard is armed for pending writes only with ``lazy_guard=False``; by default such writes
leave the function-mode stack alone (Note [reads of pending writes]). Every program is compared
with plain eager, bitwise."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager as ae
from adaptive_eager.dispatch import mode
from adaptive_eager.engine import Engine


def _armed() -> bool:
    n = torch._C._len_torch_function_stack()
    return any(type(torch._C._get_function_stack_at(i)) is mode.ReadGuardMode for i in range(n))


def _count_run_sync(monkeypatch: pytest.MonkeyPatch) -> list:
    """Calls that reached Engine.run_sync (the dispatch mode's answer to ``.item()``)."""
    seen: list = []
    orig = Engine.run_sync

    def run_sync(self: Engine, op: Any, spec: Any, args: tuple, kwargs: dict) -> Any:
        seen.append(spec.name)
        return orig(self, op, spec, args, kwargs)

    monkeypatch.setattr(Engine, "run_sync", run_sync)
    return seen


def _program(reads: Callable[[dict], list], steps: int = 4) -> tuple[list, list]:
    """Per step: deferred in-place writes to real tensors (after the first step: recorded, not
    run, so the guard is armed), then ``reads``. Returns the reads and whether the guard was
    armed when they ran."""
    torch.manual_seed(0)
    t = {
        "p": torch.nn.Parameter(torch.zeros(())),  # a 0-d parameter, written
        "s": torch.tensor(3.0),  # a real CPU scalar, written by a deferred op
        "counter": torch.tensor(1.0),  # a real CPU scalar nothing pending touches
        "buf": torch.arange(4.0),  # written; its element views are read
        "x": torch.randn(4),
    }
    t["view"] = t["buf"][2]  # a real view of the written storage (a different tensor object)
    outs, armed = [], []
    for i in range(steps):
        with torch.no_grad():
            lazy = (t["x"] * (i + 1.5)).sum()  # deferred (lazy under the engine)
            t["p"].add_(lazy)  # deferred writes to real tensors: arm the guard
            t["s"].mul_(lazy)
            t["buf"].add_(t["x"] * 0.25)
            t["counter"].add_(1)  # a host-scalar op: runs at once (nothing pending on it)
        armed.append(_armed())
        outs.append(reads(t))
        ae.sync()
    return outs, armed


_READS: dict[str, Callable[[dict], list]] = {
    "untouched": lambda t: [t["counter"].item(), t["counter"].item() * 2],
    "parameter": lambda t: [t["p"].item()],
    "scalar": lambda t: [t["s"].item()],
    "view_of_written": lambda t: [t["view"].item()],
    "element_of_written": lambda t: [t["buf"][1].item()],
    "mixed": lambda t: [t["counter"].item(), t["s"].item(), t["counter"].item(), t["p"].item(),
                        t["view"].item()],
}


@pytest.mark.parametrize("lazy_guard", [True, False])
@pytest.mark.parametrize("reader", sorted(_READS))
def test_item_under_the_armed_guard_equals_eager(reader: str, lazy_guard: bool) -> None:
    expected, _ = _program(_READS[reader])
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True,
                           lazy_guard=lazy_guard):
        got, armed = _program(_READS[reader])
    assert got == expected  # Python floats: bitwise
    if lazy_guard:  # Note [reads of pending writes]: the writes left the stack alone
        assert not any(armed), armed
    else:  # the reads ran under the armed guard (after the first step)
        assert all(armed[1:]), armed
    m = ae.metrics()
    assert m["ops_deferred"] > 0 and m["engine_errors"] == 0


def test_untouched_scalar_is_answered_at_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast case is taken (no trip to run_sync), and a written tensor's read still flushes."""
    seen = _count_run_sync(monkeypatch)
    expected, _ = _program(_READS["mixed"])
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True, lazy_guard=False):
        seen.clear()
        flushes0 = ae.metrics()["flush_reasons"].copy()
        got, armed = _program(_READS["mixed"])
        reasons = ae.metrics()["flush_reasons"]
    assert got == expected and all(armed[1:])
    # steps 1..3 (recorded): of the five reads, the counter's first was answered at the guard;
    # the written scalar's read flushed (run_sync's "sync:" flush), so the guard left the stack
    # (Note [a stale guard leaves at the next call]) and the rest reached the dispatch mode
    name = mode._ITEM_NAME
    assert seen.count(name) <= 5 * 4 - 1 * 3, seen
    assert reasons[f"sync:{name}"] - flushes0.get(f"sync:{name}", 0) >= 3


def _adamw_run(steps: int = 5) -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    data, target = torch.randn(10, 6), torch.randn(10, 3)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (model(data) - target).square().mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    out += [p.detach().clone() for p in model.parameters()]
    out += [opt.state[p]["step"].item() for p in model.parameters()]
    out += [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    return out


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, torch.as_tensor(y)) and x.dtype == y.dtype, (x, y)
        else:
            assert x == y, (x, y)


def test_adamw_step_counters_read_at_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """AdamW foreach reads its step counters while its update of the parameters is pending:
    the reads are answered at the guard, the results are eager's."""
    seen = _count_run_sync(monkeypatch)
    expected = _adamw_run()
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True, lazy_guard=False):
        seen.clear()
        got = _adamw_run()
    _same(expected, got)
    n_params = 4
    # per step 2 reads per parameter (bias corrections) + the loss; the step counters' reads
    # after warm-up never reached run_sync (they did before: one per read)
    assert len(seen) < 5 * (2 * n_params + 1), seen


def test_same_counters_as_the_dispatch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's answer counts what run_sync counted (fallbacks, fallback_ops, ops_eager,
    ops_intercepted): the metrics are those of the way it replaced."""
    keys = ("fallbacks", "ops_eager", "ops_intercepted", "flushes", "ops_deferred")

    def run() -> tuple[list, dict]:
        ae.clear_caches()
        ae.reset_metrics()
        with ae.adaptive_eager(backend="replay", step_aside=False, check=True,
                               lazy_guard=False):
            got = _adamw_run() + _program(_READS["mixed"])[0]
        m = ae.metrics()
        return got, {k: m[k] for k in keys} | {"fallback_ops": dict(m["fallback_ops"]),
                                               "flush_reasons": dict(m["flush_reasons"])}

    fast_out, fast_m = run()
    monkeypatch.setattr(mode.ReadGuardMode, "_item", lambda self, t: mode._ITEM(t))
    slow_out, slow_m = run()
    _same(fast_out, slow_out)
    assert fast_m == slow_m


class _Log(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_user_dispatch_mode_on_top_still_sees_the_read() -> None:
    """With a user's dispatch mode above the engine's, ``_local_scalar_dense`` is the user
    mode's to see first, as without the guard's answer."""
    c = torch.tensor(2.0)

    def prog(log: _Log | None) -> list:
        p = torch.zeros(3)
        x = torch.ones(3)
        outs = []
        for i in range(3):
            p.add_(x * (i + 1.0))
            if log is None:
                outs.append(c.item())
            else:
                with log:
                    outs.append(c.item())
            outs.append(p.tolist())
            ae.sync()
        return outs

    expected = prog(None)
    log = _Log()
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        got = prog(log)
    assert got == expected
    assert log.ops.count("aten._local_scalar_dense.default") == 3, log.ops


def test_lazy_and_subclass_tensors_take_the_dispatch_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy tensor (pending, or holding its value) is not answered at the guard."""
    seen = _count_run_sync(monkeypatch)

    def prog() -> list:
        p = torch.zeros(2)
        x = torch.arange(2.0)
        outs = []
        for i in range(3):
            y = (x * (i + 2.0)).sum()  # lazy under the engine
            p.add_(y)  # a deferred write: arms the guard
            outs.append(y.item())  # pending lazy: flushes through the dispatch mode
            outs.append(y.item())  # lazy holding its value
            outs.append(p[0].item())
            ae.sync()
        return outs

    expected = prog()
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        seen.clear()
        got = prog()
    assert got == expected
    assert seen.count(mode._ITEM_NAME) >= 3  # the lazy reads went to the dispatch mode
