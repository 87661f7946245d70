"""Higher-order operators, user custom ops and torch.compile regions under the engine.

Each test compares with plain eager (or with torch.compile outside the engine) on the same inputs:
bitwise op by op (backend "replay"), within a stated tolerance for fused programs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal_tree, eager_and_engine, to_plain

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Compiled code from one test must not serve another (and recompile limits start over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def fallbacks() -> dict:
    return dict(ae.metrics()["fallback_ops"])


# ---- higher-order operators ---------------------------------------------------------------
def _flex_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(1, 2, 32, 16, generator=g), torch.randn(1, 2, 32, 16, generator=g),
            torch.randn(16, 16, generator=g))


def _score_mod(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return score + (q_idx - kv_idx) * 0.01


def test_flex_attention_matches_eager_and_leaves_eager_working() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    q, k, w = _flex_inputs()

    def fn() -> list:
        outs = []
        for i in range(3):
            qq = (q @ w) * (1.0 + i)  # lazy under the engine
            outs.append(to_plain(flex_attention(qq, k, k, score_mod=_score_mod)))
        return outs

    expected, got = eager_and_engine(fn, step_aside=False)
    assert_equal_tree(expected, got)
    # Plain eager flex_attention after the engine still works (Dynamo's state is untouched).
    assert_equal_tree(to_plain(flex_attention(q @ w, k, k, score_mod=_score_mod)), expected[0])


def test_hop_called_directly_runs_eagerly_as_a_counted_fallback(monkeypatch) -> None:
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # no torch.compile
    q, k, w = _flex_inputs()

    def fn() -> torch.Tensor:
        return to_plain(fa.flex_attention((q @ w).relu(), k, k))

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)
    assert fallbacks().get("hop:flex_attention") == 1


def test_cond_while_loop_scan_and_nested_region() -> None:
    from torch._higher_order_ops import while_loop
    from torch._higher_order_ops.scan import scan

    @torch.compiler.nested_compile_region
    def sub(t: torch.Tensor) -> torch.Tensor:
        return t.relu() * 3

    def fn() -> list:
        x = torch.randn(4, 4) + 0.5  # lazy under the engine
        out = [torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x * 2,))]
        out += list(while_loop(lambda i, t: i < 5, lambda i, t: (i + 1, t * 1.1),
                               (torch.tensor(0), x * 1.0)))
        out += list(scan(lambda c, xs: (c + xs, c * 2), torch.zeros(4), x * 1.0))
        out.append(sub(x - 1))
        return [to_plain(t) for t in out]

    expected, got = eager_and_engine(fn, step_aside=False)
    assert_equal_tree(expected, got)


def test_cond_with_gradients_and_a_compiled_function() -> None:
    @torch.compile(backend="aot_eager")  # the decorator form goes through the hooks too
    def g(t: torch.Tensor) -> torch.Tensor:
        return t.sin() + 1

    def fn() -> list:
        w = torch.randn(4, 4, requires_grad=True)
        h = (torch.randn(4, 4) @ w).tanh()  # lazy, with autograd history
        r = torch.cond(h.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos(), (h,))
        (r.sum() + g(h).sum()).backward()
        return [to_plain(r), to_plain(w.grad)]

    expected, got = eager_and_engine(fn, step_aside=False)
    assert_equal_tree(expected, got)
    assert fallbacks()["torch.compile region"] == 2  # cond's own torch.compile, and g


def test_every_known_hop_has_a_rule_for_the_engine() -> None:
    from adaptive_eager.dispatch.mode import DeferMode

    with ae.adaptive_eager(backend="replay"):
        pass
    hops = torch._ops._higher_order_ops
    assert {"flex_attention", "cond", "while_loop", "invoke_subgraph", "scan",
            "tag_activation_checkpoint", "auto_functionalized", "with_effects"} <= set(hops)
    missing = [name for name, hop in hops.items() if DeferMode not in hop.python_key_table]
    assert missing == []


# ---- user custom ops ------------------------------------------------------------------------
@torch.library.custom_op("ae_test::scale_add", mutates_args=())
def scale_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * alpha + y.sin()


@scale_add.register_fake
def _scale_add_fake(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scale_add_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[1])
    ctx.alpha = inputs[2]


def _scale_add_backward(ctx, grad):  # type: ignore[no-untyped-def]
    (y,) = ctx.saved_tensors
    return grad * ctx.alpha, grad * y.cos(), None


scale_add.register_autograd(_scale_add_backward, setup_context=_scale_add_setup)


@torch.library.custom_op("ae_test::accumulate", mutates_args=("acc",))
def accumulate(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.add_(x.tanh())


@accumulate.register_fake
def _accumulate_fake(acc: torch.Tensor, x: torch.Tensor) -> None:
    return None


@torch.library.custom_op("ae_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_custom_op_with_fake_impl_is_deferred_bitwise_with_autograd() -> None:
    x0 = torch.randn(4, 8)
    y0 = torch.randn(4, 8)

    def fn() -> list:
        x = x0.clone().requires_grad_()
        y = y0.clone().requires_grad_()
        out = []
        for i in range(4):
            b = scale_add((x * 2).relu(), y, 0.5 + i)  # a changing float: one trace, not four
            loss = (b * b).sum()
            loss.backward()
            out += [to_plain(b), to_plain(x.grad), to_plain(y.grad)]
        return out

    expected, got = eager_and_engine(fn, step_aside=False)
    assert_equal_tree(expected, got)
    m = ae.metrics()
    assert "ae_test.scale_add.default" not in m["fallback_ops"]
    assert not any("ae_test.scale_add" in r for r in m["flush_reasons"] if
                   not r.startswith("new_op:"))


def test_custom_op_appears_in_the_trace() -> None:
    x = torch.randn(4, 4)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            scale_add(x + 1, x, 2.0)
            ae.sync()
        before = ae.metrics()["ops_deferred"]
        out = scale_add(x + 1, x, 2.0)
        assert type(out) is ae.LazyTensor and out._ae_real is None  # recorded, not run
        assert ae.metrics()["ops_deferred"] == before + 2
        trace_ops = [str(op) for op, *_ in out._ae_trace.ops]
        assert trace_ops == ["aten.add.Tensor", "ae_test.scale_add.default"]
    assert torch.equal(out, x * 0 + scale_add(x + 1, x, 2.0))


def test_custom_op_that_mutates_its_input_keeps_eager_semantics() -> None:
    x0 = torch.randn(8, 8)

    def fn() -> list:
        acc = torch.zeros(8, 8)  # a real tensor written by the op, read by later ops
        lazy_acc = torch.ones(8, 8) * 0.5  # a lazy one written by it
        out = []
        for i in range(3):
            h = (x0 * (i + 1)).relu()
            accumulate(acc, h)
            accumulate(lazy_acc, acc)
            out += [to_plain(acc * 2), to_plain(lazy_acc)]
        out.append(to_plain(acc))
        return out

    expected, got = eager_and_engine(fn, step_aside=False)
    assert_equal_tree(expected, got)
    assert "ae_test.accumulate.default" not in ae.metrics()["fallback_ops"]


def test_custom_op_without_fake_impl_falls_back() -> None:
    def fn() -> list:
        x = torch.randn(3, 5) + 1
        return [to_plain(no_fake(x) * 3) for _ in range(2)]

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)
    assert fallbacks().get("ae_test.no_fake.default") == 2


@pytest.mark.slow
def test_custom_op_in_a_fused_program() -> None:
    x = torch.randn(64, 64)
    y = torch.randn(64, 64)

    def run(engine: bool) -> list:
        acc = torch.zeros(64, 64)
        outs = []
        for _ in range(6):
            b = scale_add((x * 2).relu() + 1, y, 0.5)
            accumulate(acc, b)
            outs.append(to_plain((b * 0.1).exp().sum(1)))
            if engine:
                ae.sync()
        return [*outs, to_plain(acc)]

    expected = run(False)
    # Default compile options: the trace calls user ops, so it compiles in this process (at the
    # flush that makes it hot) instead of being offered to the helper, which cannot import them.
    with ae.adaptive_eager(step_aside=False, hot_after=2):
        got = run(True)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    m = ae.metrics()
    assert m["compiles"] >= 1 and m["compiled_runs"] >= 1 and m["compile_errors"] == 0
    assert m["fused_errors"] == 0 and m["fallback_ops"] == {}
    assert m["helper_errors"] == 0  # compiled here, not offered to the isolated helper


# ---- torch.compile regions ------------------------------------------------------------------
def _f(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + x.cos()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _train(compiled: torch.nn.Module, params: list, x: torch.Tensor, y: torch.Tensor,
           engine: bool, pre: torch.nn.Module) -> list:
    opt = torch.optim.SGD(params, lr=0.1)
    ctx = ae.adaptive_eager(backend="replay", step_aside=False, check=True) if engine else None
    if ctx is not None:
        ctx.__enter__()
    try:
        out = []
        for _ in range(3):
            opt.zero_grad()
            h = pre(x).tanh()  # lazy input to the compiled region, with autograd history
            loss = torch.nn.functional.mse_loss(compiled(h), y)
            loss.backward()
            opt.step()
            out.append(loss.item())
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return out + [p.detach().clone() for p in params]


def test_compiled_function_runs_compiled_inside_the_engine() -> None:
    x = torch.randn(8, 16)
    cf = torch.compile(_f, backend="aot_eager")
    expected = cf(x)
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        got = [to_plain(cf(x * 1.0)) for _ in range(4)]  # lazy inputs too
        m = ae.metrics()
    for g in got:
        assert torch.equal(g, expected)
    # Recorded: only x * 1.0 and to_plain's clone, each deferred from its second call on (the
    # first call learns its metadata by running); nothing of the compiled code (sin, cos, ...).
    assert m["ops_deferred"] == 6
    assert not any(op in r for r in m["flush_reasons"] for op in ("sin", "cos"))
    assert fallbacks()["torch.compile region"] == 4


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_compiled_module_trains_inside_the_engine(how: str) -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    results = []
    for engine in (False, True):
        torch._dynamo.reset()
        net = _mlp()
        torch.manual_seed(1)
        pre = torch.nn.Linear(16, 16)
        if how == "torch.compile":
            compiled = torch.compile(net, backend="aot_eager")
        else:
            net.compile(backend="aot_eager")
            compiled = net
        params = [*net.parameters(), *pre.parameters()]
        results.append(_train(compiled, params, x, y, engine, pre))
    assert_equal_tree(results[0], results[1])


def test_backward_through_compiled_function_with_lazy_inputs() -> None:
    w0 = torch.randn(6, 6)
    x0 = torch.randn(6, 6)
    cf = torch.compile(lambda a, b: (a @ b).sin().sum(0), backend="aot_eager")

    def fn() -> list:
        w = w0.clone().requires_grad_()
        out = []
        for _ in range(2):
            a = (w * 2).tanh()  # lazy, requires grad
            s = cf(a, x0 + 1)
            (s * s).sum().backward()
            out += [to_plain(s), to_plain(w.grad)]
        return out

    expected, got = eager_and_engine(fn, step_aside=False)
    assert_equal_tree(expected, got)


def test_compiled_optimizer_step_inside_the_engine() -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    results = []
    for engine in (False, True):
        torch._dynamo.reset()
        net = _mlp()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
        step = torch.compile(opt.step, backend="aot_eager")  # reads lazy .grad through opt
        ctx = ae.adaptive_eager(backend="replay", step_aside=False, check=True) if engine else None
        if ctx is not None:
            ctx.__enter__()
        try:
            out = []
            for _ in range(3):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
                step()  # the engine's optimizer-step hook runs inside: Dynamo must skip it
                out.append(loss.item())
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        results.append(out + [p.detach().clone() for p in net.parameters()])
    assert_equal_tree(results[0], results[1])


@pytest.mark.slow
def test_inductor_compiled_module_training_matches_compile_outside() -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    results = []
    for engine in (False, True):
        torch._dynamo.reset()
        net = _mlp()
        torch.manual_seed(1)
        pre = torch.nn.Linear(16, 16)
        results.append(_train(torch.compile(net), [*net.parameters(), *pre.parameters()],
                              x, y, engine, pre))
    assert_equal_tree(results[0], results[1])  # same compiled code: bitwise


def test_compiled_function_made_before_the_hooks_still_leaves_the_engine() -> None:
    from torch._dynamo import eval_frame

    ctx = torch._dynamo.optimize("aot_eager")  # a fresh context, as torch.compile makes
    unwrapped = eval_frame._TorchDynamoContext.__call__.__wrapped__(ctx, _f)
    assert not getattr(unwrapped, "_ae_region", False)  # as if compiled before the import
    x = torch.randn(8, 16)
    expected = unwrapped(x)
    with ae.adaptive_eager(backend="replay", step_aside=False, check=True):
        got = [to_plain(unwrapped(x + 0.0)) for _ in range(3)]
    for g in got:
        assert torch.equal(g, expected)
    assert fallbacks()["torch.compile region (unwrapped)"] == 3


@pytest.mark.slow
def test_inductor_compiled_optimizer_step_and_a_lazy_closure() -> None:
    # Compiled kernels must never be handed a lazy tensor (they read its storage directly):
    # kept gradients read through the optimizer, and a lazy tensor captured by a closure.
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    base = torch.randn(8, 4)
    holder: dict = {}

    @torch.compile
    def shift(t: torch.Tensor) -> torch.Tensor:
        return t * holder["w"].sin() + 1

    results = []
    for engine in (False, True):
        torch._dynamo.reset()
        net = _mlp()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
        step = torch.compile(opt.step)
        ctx = ae.adaptive_eager(backend="replay", step_aside=False, check=True) if engine else None
        if ctx is not None:
            ctx.__enter__()
        try:
            out = []
            for _ in range(3):
                holder["w"] = base * 2
                keep = holder["w"]  # two references: stays a lazy tensor after the flush
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(shift(net(x)), y)
                loss.backward()
                step()
                out += [loss.item(), to_plain(keep)]
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        results.append(out + [p.detach().clone() for p in net.parameters()])
    assert_equal_tree(results[0], results[1])


@torch.library.custom_op("ae_test::positive", mutates_args=())
def positive(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0].clone()


@positive.register_fake
def _positive_fake(x: torch.Tensor) -> torch.Tensor:
    n = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(n)


def test_custom_op_with_data_dependent_output_shape_is_a_sync_point() -> None:
    x0 = torch.randn(64)

    def fn() -> list:
        out = []
        for i in range(4):
            x = x0 * (1 if i % 2 else -1)  # same input metadata, different output sizes
            p = positive(x)
            out += [p.shape, to_plain(p * 2)]
        return out

    expected, got = eager_and_engine(fn)
    assert_equal_tree(expected, got)
    assert expected[0] != expected[2]  # the sizes really differ
    from adaptive_eager.dispatch.opspec import SYNC, spec_for

    assert spec_for(torch.ops.ae_test.positive.default).policy == SYNC


@torch.library.custom_op("ae_test::jitter", mutates_args=())
def jitter(x: torch.Tensor) -> torch.Tensor:
    """Draws from the global generator but carries no nondeterministic_seeded tag."""
    return x + torch.rand_like(x)


@jitter.register_fake
def _jitter_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_custom_op_that_draws_random_numbers_keeps_program_order() -> None:
    """Deferred, its draws would move to the flush, after the user's own torch.rand calls."""

    def run(engine: bool) -> list:
        torch.manual_seed(7)
        x = torch.ones(16)
        outs = []
        for _ in range(5):
            y = jitter(x * 2)
            outs.append(to_plain(y + torch.rand(16)))
            if engine:
                ae.sync()
        return outs

    expected = run(False)
    with ae.adaptive_eager(backend="replay", check=True):
        got = run(True)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
