"""The per-op hot path: what its shortcuts must keep equal to eager and to the slow path.

Shortcuts under test: trace keys start with the op's OpSpec (digests unchanged), the dispatch mode
reads the spec off the op, lazy tensors take class defaults, ops without kwargs share one empty
dict, and replay runs a per-entry call plan (Note [replay call plan] in execute.py) whose argument
positions hold whatever the next hit passes there (real tensors, lazy tensors with values).
"""

from __future__ import annotations

import ctypes

from typing import Any

import numpy as np
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.cache.memory import TRIE, stable_repr
from adaptive_eager.dispatch import mode
from adaptive_eager.dispatch.opspec import spec_for
from adaptive_eager.execute import call_plan
from helpers import assert_equal_tree, eager_and_engine, to_plain

aten = torch.ops.aten


def test_spec_keys_give_the_digests_op_keys_gave() -> None:
    """Disk caches are keyed by trie digests: a spec in a key must print as its op."""
    op = aten.add.Tensor
    spec = spec_for(op)
    assert op._ae_spec is spec
    key_old = (op, 0, ("x", 3, 0), float)
    key_new = (spec, 0, ("x", 3, 0), float)
    assert stable_repr(key_new) == stable_repr(key_old)
    assert str(spec) == str(op)
    root = TRIE.root(torch.float32)
    assert root.child(key_new, None).digest == TRIE.root(torch.float32).child(key_new, None).digest


def test_trie_paths_hold_specs_and_hit() -> None:
    x, y = torch.randn(8), torch.randn(8)
    with ae.adaptive_eager(backend="replay", check=True):
        for _ in range(4):
            z = torch.add(x, y).sin()
            ae.sync()
    assert ae.metrics()["trace_hits"] >= 1
    node = TRIE.root(torch.get_default_dtype())
    firsts = [k[0] for k in node.children]
    assert spec_for(aten.add.Tensor) in firsts
    assert torch.equal(z, torch.add(x, y).sin())


def test_shared_empty_kwargs_stay_empty() -> None:
    def fn() -> list:
        a = torch.randn(4, 4)
        b = a.sum(dim=1, keepdim=True) * 2
        c = torch.cat([a, b], dim=1).softmax(-1)
        return [to_plain(c)]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)
    assert mode._NO_KWARGS == {}


def test_replay_plan_reused_when_inputs_switch_between_real_and_lazy() -> None:
    """The same trace (a hit) sees a real tensor, then a lazy tensor that holds its value (it
    stays a wrapper: it requires grad), at the same argument position; list arguments holding
    pending values and kwargs take the general walk. Bitwise equal to eager each time."""
    w = torch.randn(6, requires_grad=True)
    b = torch.randn(6)

    def step(a: torch.Tensor) -> torch.Tensor:
        h = torch.add(a, b, alpha=0.5).sin()
        s = torch.stack([h, h * 2]).sum(dim=0)
        return torch.where(s > 0, s, b).mul(3)

    def fn() -> list:
        outs = []
        lazy = w * 1.5  # a lazy tensor with a grad_fn: it keeps its wrapper after a flush
        for i in range(6):
            with torch.no_grad():
                a = lazy if i % 2 else w.detach()
                if i % 2:
                    ae.sync()  # now it holds a value: an external of the next trace
                outs.append(to_plain(step(a)))
                ae.sync()
        return outs

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)
    assert ae.metrics()["trace_hits"] >= 2
    entries = [e for e in TRIE.entry_list if e.replay_plan is not None]
    assert entries and all(len(e.replay_plan) == e.n_ops for e in entries)


def test_replay_plan_keeps_values_when_live_slots_change() -> None:
    """The release plan (which dead values to drop, and when) is cached per entry with the live
    set it was made for: a hit that keeps another intermediate gets a new one."""
    x = torch.randn(5)

    def fn() -> list:
        kept = []
        for i in range(6):
            a = x.exp()
            b = a * 3
            c = b.cos()
            if i % 3 == 0:
                kept.append(a)  # one run in three keeps an intermediate
            ae.sync()
            kept.append(c)
        return [to_plain(t) for t in kept]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)


def test_call_plan_marks_positions() -> None:
    x = torch.randn(3)
    with ae.adaptive_eager(backend="replay"):
        for _ in range(3):  # first sight runs eagerly (metadata by running), then records
            a = x.cos()
            b = torch.add(a, x, alpha=2)
            y = torch.cat([a, x], dim=0)
            plan = call_plan(ae.api._state.engine.trace)
            ae.sync()
    assert torch.equal(b, torch.add(x.cos(), x, alpha=2))
    assert torch.equal(y, torch.cat([x.cos(), x], dim=0))
    # slot markers and outside tensors are positions; a list holding a slot takes the walk
    assert [(p[1], p[2]) for p in plan] == [((0,), True), ((0, 1), True), ((), False)]


def test_lazy_tensor_class_defaults() -> None:
    x = torch.randn(4)
    with ae.adaptive_eager(backend="replay"):
        for _ in range(3):
            y = x * 2
            if type(y) is ae.LazyTensor:
                assert y._ae_real is None and y._ae_error is None
                assert "_ae_real" not in y.__dict__ and "_ae_error" not in y.__dict__
            ae.sync()
        assert torch.equal(y, x * 2)


# ---- the read guard, armed only while needed (Note [read guard] in dispatch/mode.py) ---------

def _guard_on_stack() -> bool:
    n = torch._C._len_torch_function_stack()
    return any(type(torch._C._get_function_stack_at(i)) is mode.ReadGuardMode for i in range(n))


def _readers() -> dict:
    """Every Python-level way of reading a tensor's value the engine must see first."""
    import contextlib
    import io

    def printed(t: torch.Tensor) -> str:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            print(t)
        return buf.getvalue()

    return {
        "tolist": lambda t: t.tolist(),
        "item": lambda t: t[1].item(),
        "numpy": lambda t: t.numpy().tolist(),
        "array": lambda t: np.asarray(t).tolist(),
        "print": printed,
        "repr": repr,
        "format": lambda t: f"{t[2]:.4f}",
        "equal": lambda t: torch.equal(t, torch.full((4,), 2.5)),
        "index": lambda t: t[1:3].tolist(),
        "float": lambda t: float(t.sum()),
        "storage": lambda t: bytes(t.untyped_storage()),
        "bool": lambda t: bool((t > 2).all()),
    }


def _stale_read_program(read: Any, steps: int = 4) -> tuple[list, list]:
    """A real tensor mutated in place by deferred ops (after warm-up: recorded, not run), then
    read from Python. Returns the reads and, per step, whether the guard was on the stack
    before the write and after it."""
    p = torch.arange(4, dtype=torch.float32)
    other = torch.ones(4)
    outs, states = [], []
    for i in range(steps):
        before = _guard_on_stack()
        q = other * 0.5  # a deferred op that does not write p
        p.mul_(1.5).add_(q)  # deferred writes to a real tensor
        states.append((before, _guard_on_stack()))
        outs.append(read(p))
        ae.sync()  # disarms (a flush outside the guard's own handler)
    return outs, states


@pytest.mark.parametrize("reader", sorted(_readers()))
def test_no_stale_read_with_the_guard_disarmed(reader: str) -> None:
    read = _readers()[reader]
    expected, _ = _stale_read_program(read)
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        got, states = _stale_read_program(read)
    assert got == expected
    m = ae.metrics()
    assert m["ops_deferred"] > 0
    # the deferred writes left the function-mode stack alone: the reader's own method flushed
    # first (Note [reads of pending writes])
    assert not any(before or after for before, after in states), states


def test_pending_writes_leave_the_guard_off() -> None:
    """Note [reads of pending writes]: neither recording nor a pending write to a real tensor
    puts the guard on the stack."""
    x, y = torch.zeros(16), torch.ones(16)
    p = torch.zeros(4)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            z = x
            for _ in range(20):
                z = torch.add(z, y)
            assert not _guard_on_stack()  # pure recording: no guard on any op
            ae.sync()
        assert ae.metrics()["guard_arms"] == 0
        for i in range(3):
            p.add_(z[:4])
            if i:  # recorded (the first sight ran eagerly): pending
                assert ae.api._state.engine.ext_writes and not _guard_on_stack()
            ae.sync()
            assert not _guard_on_stack()
        m = ae.metrics()
        assert m["guard_arms"] == 0 and m["guard_disarms"] == 0
    assert not _guard_on_stack()
    assert p.tolist() == [60.0] * 4


def test_grad_accumulated_in_a_backward_node_is_read_fresh() -> None:
    """AccumulateGrad writes a kept ``.grad`` in place inside an autograd node; a read of it
    after backward sees the write (the reader flushes first), with no guard on the stack."""
    def run(stacks: list | None) -> list:
        torch.manual_seed(0)
        w = torch.randn(4, requires_grad=True)
        x = torch.randn(4)
        outs = []
        for i in range(5):
            (w * x * (i + 1)).sum().backward()
            if stacks is not None:
                stacks.append(_guard_on_stack())
            outs.append(w.grad.tolist())
            if stacks is not None:
                ae.sync()
        return outs

    expected = run(None)
    stacks: list = []
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        got = run(stacks)
    assert got == expected
    assert not any(stacks), stacks


def test_func_transforms_with_the_guard_disarmed_at_entry() -> None:
    from torch.func import grad, jacrev, vmap

    x0 = torch.randn(3, 5)

    def run(check: bool) -> list:
        outs = []
        for _ in range(3):
            x = x0 * 1.0  # lazy under the engine
            if check:
                assert not _guard_on_stack()
            outs.append(vmap(lambda r: (r.sin() * 2).sum())(x))
            if check:
                assert not _guard_on_stack()  # the transform's exit disarmed it
            outs.append(grad(lambda a: (a.exp() * a).sum())(x))
            outs.append(jacrev(lambda a: a.sin() * a.cos())(x[0]))
            outs.append(vmap(grad(lambda a: (a ** 3).sum()))(x + 1))
            outs.append(x * 3)
        return to_plain(outs)

    expected = run(False)
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        got = run(True)
    assert_equal_tree(expected, got)
    m = ae.metrics()
    assert m["fallback_ops"]["functorch"] > 0 and m["ops_deferred"] > 0
    assert m["guard_arms"] > 0 and m["engine_errors"] == 0


def test_data_assignment_of_a_lazy_value_with_the_guard_disarmed() -> None:
    def run(check: bool) -> list:
        p = torch.nn.Parameter(torch.zeros(3))
        w = torch.arange(3, dtype=torch.float32)
        outs = []
        for i in range(4):
            old = p.data  # a real alias of the storage p has now
            with torch.no_grad():
                p.add_(w)  # a deferred write to p's current storage
            if check:
                assert not _guard_on_stack()
            p.data = w * (i + 2.0)  # a lazy value (trap 2): stored as its real value
            assert type(p) is torch.nn.Parameter and type(p.data) is torch.Tensor
            outs += [(p * 1).tolist(), old.tolist()]
        return outs

    expected = run(False)
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        got = run(True)
        assert not _guard_on_stack()
        q = torch.zeros(2)
        q.data = torch.ones(2) * 7  # not in any trace: no guard needed, still no wrapper
        assert type(q.data) is torch.Tensor and q.tolist() == [7.0, 7.0]
    assert got == expected
    assert ae.metrics()["flush_reasons"].get("read:data_set", 0) > 0


def test_prod_and_ormqr_eager_backward_with_the_guard_disarmed() -> None:
    """Note [eager backward] by function wrappers: prod/ormqr nodes give eager's gradients while
    the guard is off the stack."""
    x0 = torch.randn(4, 5, 3)
    a0, tau0, c0 = torch.randn(5, 5).t(), torch.randn(5), torch.randn(5, 5)

    def fn() -> list:
        outs = []
        for _ in range(3):
            x = x0.clone().requires_grad_()
            a = a0.clone().requires_grad_()
            y = torch.prod(x * 1.5, 1) + x.prod(0, keepdim=True).squeeze(0).sum()
            z = torch.ormqr(a, tau0, c0, left=True, transpose=True)
            m = torch.masked.prod(x, 2, mask=x > 0)
            gx, ga = torch.autograd.grad((y * 2).sum() + z.sum() + m.sum(), (x, a))
            outs += [to_plain(gx), to_plain(ga), ga.stride(), gx.stride()]
        return outs

    expected = fn()
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        assert not _guard_on_stack()
        got = fn()
        assert ae.metrics()["guard_arms"] == 0
    assert_equal_tree(expected, got)


def test_device_move_of_a_lazy_tensor_flushes_with_the_guard_disarmed() -> None:
    x = torch.randn(6)
    pending = 0
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            y = x.sin() * 2
            assert not _guard_on_stack()
            pending += type(y) is ae.LazyTensor  # the first pass ran its new ops at once
            m = y.to("meta")
            assert type(y) is not ae.LazyTensor or y._ae_real is not None  # it ran first
            assert m.device.type == "meta" and m.shape == y.shape
            assert torch.equal(y, x.sin() * 2)
    assert pending >= 2 and ae.metrics()["flush_reasons"]["read:to"] == pending


def _always_vs_lazy_suite() -> list:
    out: list = []
    for reader in ("tolist", "print", "numpy", "storage"):
        out += _stale_read_program(_readers()[reader], steps=3)[0]
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(16, 6)
    for _ in range(4):
        loss = model(data).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
        out.append(model[0].weight.tolist())
    from torch.func import grad

    out.append(grad(lambda a: (a.sin() * a).sum())(data[0] * 1.0).tolist())
    return out


def test_always_armed_guard_option_gives_the_same_results() -> None:
    """``lazy_guard=False`` (ADAPTIVE_EAGER_LAZY_GUARD=0): the guard is on the stack whenever the
    engine's modes are, as before; both settings equal eager."""
    torch.manual_seed(0)
    expected = _always_vs_lazy_suite()
    results = {}
    for lazy in (True, False):
        ae.clear_caches()
        torch.manual_seed(0)
        with ae.adaptive_eager(backend="replay", step_aside=False, check=True, lazy_guard=lazy):
            assert _guard_on_stack() is (not lazy)
            results[lazy] = _always_vs_lazy_suite()
            assert _guard_on_stack() is (not lazy)
        assert not _guard_on_stack()
    assert results[True] == expected
    assert results[False] == expected


def test_lazy_guard_option_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTIVE_EAGER_LAZY_GUARD", "0")
    with ae.adaptive_eager(backend="replay"):
        assert _guard_on_stack()
    monkeypatch.setenv("ADAPTIVE_EAGER_LAZY_GUARD", "bad")
    with pytest.raises(ae.ConfigError, match="ADAPTIVE_EAGER_LAZY_GUARD"):
        ae.adaptive_eager()


def test_memory_handed_out_after_a_pending_read_is_written_in_order() -> None:
    """numpy/__array__/data_ptr/storages hand out memory the caller may write outside torch:
    ops recorded before that read the old values (the pending trace runs first), also while
    the read guard is off the stack (no pending writes, so it is not armed)."""
    def run(check: bool) -> list:
        x = torch.arange(4.0)
        outs = []
        for i in range(4):
            y = x * 2  # a deferred read of x
            if check:
                assert not _guard_on_stack()
            x.numpy()[0] = 10 + i  # a write through numpy
            outs.append(y.tolist())
            z = x + 1
            np.asarray(x)[1] = -i  # through __array__
            w = x - 1
            x.untyped_storage()[8] = 3  # a byte of element 2, through the storage
            v = x * 3
            ctypes.c_float.from_address(x.data_ptr() + 12).value = 7.0 + i  # through data_ptr
            outs += [z.tolist(), w.tolist(), v.tolist(), x.tolist()]
        return outs

    expected = run(False)
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        got = run(True)
    assert got == expected
    reasons = ae.metrics()["flush_reasons"]
    assert reasons["read:numpy"] >= 2 and reasons["read:untyped_storage"] >= 2, reasons
    assert reasons["read:data_ptr"] >= 2, reasons
