"""The per-op hot path (issue 13): what its shortcuts must keep equal to eager and to the slow path.

Shortcuts under test: trace keys start with the op's OpSpec (digests unchanged), the dispatch mode
reads the spec off the op, lazy tensors take class defaults, ops without kwargs share one empty
dict, and replay runs a per-entry call plan (Note [replay call plan] in execute.py) whose argument
positions hold whatever the next hit passes there (real tensors, lazy tensors with values).
"""

from __future__ import annotations

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
