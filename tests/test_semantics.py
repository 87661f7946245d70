"""Eager semantics under the engine: views, in-place ops, RNG, errors, reads, threads, contexts."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import sys
import threading
import traceback

import numpy as np
import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal_tree, eager_and_engine, to_plain


def pending(t: torch.Tensor) -> bool:
    """Whether ``t`` still waits for its trace to run."""
    return type(t) is ae.LazyTensor and t._ae_real is None


def test_views_and_inplace_on_views() -> None:
    def fn() -> list:
        base = torch.arange(24.0).reshape(4, 6)
        v = base[1:3, ::2]
        v.mul_(10)  # in-place through a view of a real tensor
        t = base.t()
        t[0].add_(100)  # in-place through a view of a view
        lazy = base * 2
        lv = lazy.view(6, 4)[:, 1]
        lv.sub_(7)  # in-place through a view of a lazy tensor
        lazy.unsqueeze(0).squeeze(0)[0, 0] = -1.0
        return [to_plain(base), to_plain(lazy), to_plain(lv), to_plain(v)]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)


def test_inplace_on_leaf_parameter_under_no_grad(engine) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    ref = torch.nn.Parameter(torch.ones(3))
    with torch.no_grad():
        p.add_(torch.full((3,), 2.0))
        p.mul_(3)
    with torch.no_grad():  # outside the engine, for the expected values (same ops)
        pass
    assert p.tolist() == [9.0, 9.0, 9.0]
    assert p.requires_grad and p.is_leaf and type(p) is torch.nn.Parameter
    (p * 2).sum().backward()  # version counters still consistent for autograd
    assert p.grad.tolist() == [2.0, 2.0, 2.0]
    assert ref.tolist() == [1.0, 1.0, 1.0]


def test_inplace_view_ops_on_lazy_tensors_update_shape() -> None:
    def fn() -> list:
        x = torch.randn(3, 4) + 1  # lazy under the engine
        x.t_()
        shape_after_t = tuple(x.shape)
        x.unsqueeze_(0)
        x.squeeze_(0)
        y = (torch.randn(2, 5) * 2).as_strided_((5, 2), (1, 5))
        return [shape_after_t, tuple(x.shape), x.stride(), to_plain(x), to_plain(y), y.stride()]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)


def test_dropout_and_random_init_under_seed() -> None:
    def fn() -> list:
        torch.manual_seed(7)
        lin = torch.nn.Linear(16, 16)  # kaiming_uniform_ init: in-place random on real params
        x = torch.randn(8, 16)
        drop = torch.nn.functional.dropout(lin(x), p=0.3, training=True)
        y = drop * 2
        z = torch.nn.functional.dropout(y.tanh(), p=0.5, training=True)
        return [to_plain(lin.weight), to_plain(drop), to_plain(z)]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)


def test_random_ops_generators_and_rng_state() -> None:
    def fn() -> list:
        out = []
        a = torch.randn(5) * 2  # lazy consumer of a random factory
        out.append(to_plain(a))
        out.append(to_plain(torch.randint(0, 10, (6,))))
        state = torch.get_rng_state()
        b = torch.rand(4) + a[:4]
        torch.set_rng_state(state)
        c = torch.rand(4) + a[:4]  # the same numbers again, as in eager
        out += [to_plain(b), to_plain(c)]
        probs = (torch.arange(6.0) + 1).softmax(0)  # lazy input to a random op
        out.append(to_plain(torch.multinomial(probs, 4, replacement=False)))
        g = torch.Generator().manual_seed(99)
        out.append(to_plain(torch.randn(3, generator=g) * 3))
        out.append(to_plain(torch.empty(5).uniform_(-1, 1, generator=g)))
        out.append(to_plain(torch.bernoulli(torch.full((6,), 0.5) * a.abs().clamp(max=1)[0])))
        return out

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)


def test_print_inside_loop(capsys: pytest.CaptureFixture[str]) -> None:
    def fn() -> None:
        w = torch.randn(3, 3, requires_grad=True)
        x = torch.randn(2, 3)
        for i in range(3):
            y = (x @ w).relu() + i
            print(y)
            print(f"step {i}: {y.sum():.4f}", y.sum().item())
            print(w.detach() * 0 + i, x.tolist()[0][:1])

    eager_and_engine(lambda: fn() or [])
    out = capsys.readouterr().out
    half = len(out) // 2
    assert out[:half] == out[half:], out
    assert "grad_fn=<AddBackward0>" in out and "LazyTensor" not in out


def test_repr_of_leaf_that_requires_grad(engine) -> None:
    w = torch.ones(2, requires_grad=True)
    z = w.detach() * 2
    z.requires_grad_(True)
    assert repr(z) == "tensor([2., 2.], requires_grad=True)"
    assert format(z.sum(), ".1f") == "4.0"


def test_numpy_and_tolist_reads(engine) -> None:
    x = torch.arange(6.0).reshape(2, 3)
    y = x * 2 + 1
    x.add_(1)  # pending in-place write on a real tensor
    assert y.tolist() == [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]]
    np.testing.assert_array_equal(x.numpy(), np.arange(6.0).reshape(2, 3) + 1)
    np.testing.assert_array_equal(np.asarray(y), [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]])
    g = (x * 1).requires_grad_()
    with pytest.raises(RuntimeError, match="requires grad"):
        g.numpy()


def test_data_ptr_storage_and_pickle_see_pending_writes(engine) -> None:
    x = torch.zeros(4)
    x.add_(5)
    assert x.untyped_storage().tolist()[:1]  # flushed before reading raw bytes
    assert x.data_ptr() != 0
    buf = io.BytesIO()
    lazy = x * 2
    torch.save({"x": x, "lazy": lazy}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["x"].tolist() == [5.0] * 4 and loaded["lazy"].tolist() == [10.0] * 4
    assert type(loaded["lazy"]) is torch.Tensor
    assert pickle.loads(pickle.dumps(lazy)).tolist() == [10.0] * 4
    assert copy.deepcopy(lazy).tolist() == [10.0] * 4


def test_param_data_assignment_of_lazy_tensor(engine) -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.data = torch.ones(3) * 4  # trap 2: a wrapper must never land in .data
    assert type(p) is torch.nn.Parameter
    assert (p + 1).tolist() == [5.0, 5.0, 5.0]


def test_shape_error_raised_at_the_line_of_the_op() -> None:
    a, b = torch.randn(3, 4), torch.randn(5, 6)
    with ae.adaptive_eager(backend="replay"):
        c = a * 2  # noqa: F841 (a pending op before the bad one)
        with pytest.raises(RuntimeError) as info:
            line = sys._getframe().f_lineno + 1
            torch.mm(a, b)
    with pytest.raises(RuntimeError) as eager_info:
        torch.mm(a, b)
    assert str(info.value) == str(eager_info.value)
    frames = traceback.extract_tb(info.tb)
    assert any(f.filename == __file__ and f.lineno == line for f in frames)


def test_shape_error_after_warmup_still_eager_message() -> None:
    a = torch.randn(3, 4)
    with ae.adaptive_eager(backend="replay"):
        for _ in range(3):
            (a @ torch.randn(4, 2)).sum()  # known op, known metadata
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            a @ torch.randn(5, 2)  # same op, new metadata: runs eagerly, eager's message


def test_value_dependent_error_surfaces_at_flush_and_poisons_later_values() -> None:
    """An index computed in the pending trace is not checked when recorded (Note [value
    checks]): its error rises at the flush, named, and what depends on it is unavailable."""
    table = torch.randn(5, 3)

    def rows(shift: int) -> torch.Tensor:  # pending: computed from a deferred product
        return (table[:2, 0] * 0).long() + torch.tensor([shift, shift + 1])

    with ae.adaptive_eager(backend="replay"):
        for _ in range(2):  # warm up: every op below is then deferred
            (torch.index_select(table, 0, rows(0)) * 2).sum().item()
        bad = torch.index_select(table, 0, rows(7))  # deferred: indices unknown
        later = bad * 2
        with pytest.raises(IndexError) as info:
            later.sum().item()
        assert any("adaptive_eager" in n for n in getattr(info.value, "__notes__", []))
        with pytest.raises(ae.ValueUnavailable):
            later.tolist()
        assert (table[:1] * 1).shape == (1, 3)  # the engine keeps working
    assert ae.metrics()["replay_errors"] == 1


def test_boolean_mask_and_integer_index() -> None:
    def fn() -> list:
        x = torch.randn(6, 3) * 2
        masked = x[x > 0]  # value-dependent shape: a sync point
        picked = x[torch.tensor([0, 2, 2])] + 1  # integer index: deferred
        x[x < 0] = 0.0
        return [to_plain(masked), to_plain(picked), to_plain(x), to_plain(x.nonzero())]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)


def test_scalar_types_are_part_of_the_key(engine) -> None:
    i = torch.arange(4)
    a = i + 1  # int64
    b = i + 1.0  # float32 (trap 6: 1 == 1.0 must not share a key)
    c = i + True
    assert (a.dtype, b.dtype, c.dtype) == (torch.int64, torch.float32, torch.int64)
    assert b.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_other_threads_are_unaffected(engine) -> None:
    seen = {}

    def worker() -> None:
        y = torch.ones(3) * 2
        seen["type"] = type(y)
        seen["value"] = y.tolist()

    for _ in range(2):  # the second time, this thread defers the same op
        mine = torch.ones(3) * 2
    assert type(mine) is ae.LazyTensor
    t = threading.Thread(target=worker)
    t.start()  # a sync point of this thread (Note [threads and lazy tensors])
    t.join()
    assert seen == {"type": torch.Tensor, "value": [2.0, 2.0, 2.0]}
    assert mine.tolist() == [2.0, 2.0, 2.0]


def test_nested_and_reentered_contexts() -> None:
    ctx = ae.adaptive_eager(backend="replay")
    x = torch.ones(3)
    with ctx:
        with ae.adaptive_eager(backend="replay"):
            x * 3  # first sight runs eagerly; the next one is deferred
            y = x * 3
            assert pending(y)
        assert not pending(y)  # leaving the inner context is a sync point
        with ctx:  # re-entering the same object
            z = y + 1
    assert z.tolist() == [4.0, 4.0, 4.0]
    assert not ae.is_enabled()
    with ctx:  # reusable after exit
        assert ae.is_enabled()
    assert not ae.is_enabled()


def test_exception_inside_context_leaves_no_pending_work() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="boom"):
        with ae.adaptive_eager(backend="replay"):
            x.add_(1)
            raise ValueError("boom")
    assert not ae.is_enabled()
    assert x.tolist() == [1.0, 1.0, 1.0]  # the write before the exception happened


def test_enable_disable_and_sync() -> None:
    ae.enable(backend="replay")
    try:
        assert ae.is_enabled()
        torch.ones(2) + 1
        y = torch.ones(2) + 1
        assert pending(y)
        ae.sync()
        assert not pending(y)
    finally:
        ae.disable()
    assert not ae.is_enabled()
    assert (y * 2).tolist() == [4.0, 4.0]  # lazy tensors keep working after the engine is off


def test_neuron_spelling() -> None:
    from adaptive_eager import neuron

    with neuron.adaptive_eager():
        y = torch.ones(2) * 5
    assert y.tolist() == [5.0, 5.0]


def test_metrics_keys_and_reset(engine) -> None:
    (torch.ones(3) * 2).sum().item()
    m = engine()
    for key in ("ops_intercepted", "ops_deferred", "flushes", "trace_hits", "trace_misses",
                "fallbacks", "flush_reasons", "fallback_ops"):
        assert key in m
    assert m["ops_intercepted"] > 0
    ae.reset_metrics()
    assert ae.metrics()["ops_intercepted"] == 0


def test_trace_length_cap_flushes() -> None:
    x = torch.zeros(2)
    with ae.adaptive_eager(max_trace_ops=4, backend="replay"):
        for _ in range(3):
            for _ in range(10):
                x = x + 1
        assert x.tolist() == [30.0, 30.0]
    assert ae.metrics()["flush_reasons"].get("trace_cap", 0) >= 2


def test_autocast_replay_matches_eager() -> None:
    def fn() -> list:
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x).relu()
        return [to_plain(y), y.dtype]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)


def test_parameter_from_lazy_tensor_is_a_plain_parameter(engine) -> None:
    for _ in range(2):  # the second time, torch.ones(...) * 2 is lazy
        data = torch.ones(3) * 2
    p = torch.nn.Parameter(data)
    assert type(p) is torch.nn.Parameter and p.requires_grad
    assert p.tolist() == [2.0, 2.0, 2.0]
    b = torch.nn.Buffer(torch.ones(2) * 3)
    assert type(b) is torch.Tensor and b.tolist() == [3.0, 3.0]


def test_backward_formulas_that_branch_on_modes_match_eager() -> None:
    """prod and ormqr pick other backward formulas while any dispatch mode is active (Note
    [eager backward]): their nodes must still give eager's gradients, bit for bit and stride for
    stride, and the ops around them must still be deferred."""
    x0 = torch.randn(5, 5, 5)
    a0, tau0, c0 = torch.randn(5, 5).t(), torch.randn(5), torch.randn(5, 5)

    def fn() -> list:
        x = x0.clone().requires_grad_()
        a = a0.clone().requires_grad_()
        y = torch.prod(x * 1.5, 1) + x.prod(0, keepdim=True).squeeze(0)
        z = torch.ormqr(a, tau0, c0, left=True, transpose=True)
        gx, ga = torch.autograd.grad((y * 2).sum() + z.sum(), (x, a))
        empty = torch.zeros(0, requires_grad=True)
        ge, = torch.autograd.grad(empty.prod(), empty)
        return [to_plain(gx * 3), to_plain(ga), ga.stride(), ge.stride(), to_plain(y)]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(2):  # the first pass runs new ops eagerly to learn their metadata
            ae.reset_metrics()
            x = x0.clone().requires_grad_()
            (torch.prod(x * 2, 0) + 1).sum().backward()
            assert torch._C._len_torch_dispatch_stack() == 1  # the mode is back after the node
            (x.grad * 2).sum().item()
    assert ae.metrics()["ops_deferred"] >= 6, ae.metrics()


def test_kept_lazy_tensors_become_plain_tensors() -> None:
    """Note [lazy tensors become real]: state the program keeps (optimizer moments, a running
    buffer) is a plain tensor after the flush, so later ops on it, also outside the engine, pay
    no subclass dispatch; tensors autograd still holds stay lazy and keep working."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    ref = [p.detach().clone().requires_grad_() for p in params]
    for p, r in zip(params, ref):
        p.grad = torch.randn(4, 4)
        r.grad = p.grad.clone()
    opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
    opt_ref = torch.optim.AdamW(ref, lr=0.1, foreach=True)
    w = torch.randn(4, 4, requires_grad=True)
    with ae.adaptive_eager(backend="replay"):
        for _ in range(3):
            opt.step()
        running = torch.zeros(4)
        for _ in range(2):
            running = running * 0.5 + 1  # rebound every time: the last value is kept
        for _ in range(2):  # the first pass runs new ops eagerly to learn their metadata
            act = w * 2  # saved by autograd for the next op
            loss = (act * act).sum()
            ae.sync()
        assert all(type(v) is torch.Tensor for s in opt.state.values() for v in s.values())
        assert type(running) is torch.Tensor
        assert type(act) is ae.LazyTensor  # requires grad: stays a (published) lazy tensor
        loss.backward()
    for _ in range(3):
        opt_ref.step()
    for p, r in zip(params, ref):
        assert torch.equal(p, r)
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt_ref.state[r]["exp_avg_sq"])
    assert running.tolist() == [1.5] * 4
    assert torch.equal(w.grad, 8 * w.detach())


def test_kept_gradients_become_plain_tensors_after_the_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    grads = []
    for m, use_engine in ((ref, False), (model, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        ctx = ae.adaptive_eager(backend="replay") if use_engine else contextlib.nullcontext()
        with ctx:
            for _ in range(4):
                opt.zero_grad(set_to_none=False)  # the same grad tensors every step
                m(x).square().sum().backward()
                opt.step()
        grads.append([p.grad for p in m.parameters()])
        if use_engine:
            assert all(type(g) is torch.Tensor for g in grads[-1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
