"""torch.compile of code that calls modules, with the engine's module hooks on (Note [hooks under
Dynamo] in rounds.py): ``fullgraph=True`` compiles, no hook breaks the graph, results equal plain
eager's, and module calls outside compiled code still tick.

Dynamo backends ``eager``/``aot_eager`` (and ``CompileCounter``, which counts the graphs and runs
them as they are) run eager's own kernels, so results are compared bitwise; the Inductor case is
slow and compared within float tolerance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo.testing
from torch.nn.modules import module as nn_module

import adaptive_eager as ae
from adaptive_eager.compile import policy
from adaptive_eager.aside import Presence
from adaptive_eager.rounds import _AsideHook, _RootTick
from adaptive_eager.calibrate import calibrate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _x() -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


def _engine_global_hooks() -> int:
    return sum(isinstance(h, (_RootTick, _AsideHook))
               for h in (*nn_module._global_forward_hooks.values(),
                         *nn_module._global_forward_pre_hooks.values()))


def _fallbacks() -> dict[str, int]:
    return dict(ae.metrics()["fallback_ops"])


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_module_call_in_contexts(backend: str) -> None:
    """The issue's reproducer: ``torch.compile(lambda x: model(x) * 2, fullgraph=True)`` called
    inside contexts (the engine's global tick hooks on in the first) raised Unsupported
    ("Presence._before_call ... marked as skipped"); now it runs as a compiled region, equal to
    eager, beside plain module calls that are recorded."""
    model, x = _model(), _x()
    want = model(x) * 2
    want_plain = model(x).relu() + 1
    f = torch.compile(lambda x: model(x) * 2, fullgraph=True, backend=backend)
    got, plain = [], []
    for i in range(4):
        with ae.adaptive_eager(backend="replay"):
            if i == 0:
                assert _engine_global_hooks() == 2  # the hooks Dynamo used to trip on
            got.append(f(x))
            plain.append((model(x).relu() + 1).detach())
    for g, p in zip(got, plain):
        assert torch.equal(g, want)
        assert torch.equal(p, want_plain)
    assert _fallbacks()["torch.compile region"] == 4


def test_fullgraph_with_grad_while_enabled() -> None:
    """``enable()``: a fullgraph-compiled loss (aot_eager, its own backward graph) whose
    gradients reach the model's parameters: equal to eager's, as is the recorded part after it."""
    model, x = _model(), _x()
    loss = (model(x).square().sum() * 3)
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    f = torch.compile(lambda x: model(x).square().sum(), fullgraph=True, backend="aot_eager")
    ae.enable(backend="replay")
    try:
        got_loss = f(x) * 3
        got_loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
    finally:
        ae.disable()
    assert torch.equal(got_loss.detach(), loss.detach())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_ticks_count_outside_compiled_code_only() -> None:
    """With the global tick hooks on, a plain call of the model is an outermost call (a round
    in a program without an optimizer); the same model called inside compiled code is not
    (compiled code runs outside the engine), and neither call breaks anything."""
    model, x = _model(), _x()
    want = model(x)
    f = torch.compile(lambda x: model(x), fullgraph=True, backend="eager")
    with ae.adaptive_eager(backend="replay"):
        presence = ae.api._state.presence
        assert presence._tick_kind == "global"
        before = presence.calls_in_context
        assert torch.equal(f(x), want)
        assert presence.calls_in_context == before
        out = model(x)
        assert presence.calls_in_context == before + 1
        assert torch.equal(f(x), want)
        assert presence.calls_in_context == before + 1
    assert torch.equal(out, want)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def _compiled(model: torch.nn.Module, how: str, backend: Any) -> Any:
    if how == "torch.compile":
        return torch.compile(model, backend=backend)
    model.compile(backend=backend)
    return model


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_compiled_module_is_the_graph_compiled_outside(how: str) -> None:
    """A compiled module inside a context is the graph Dynamo makes outside the engine: its
    hooks trace to nothing (before, each was a graph break and the graph held one op of three:
    the rest ran eagerly between breaks). Equal to eager."""
    x = _x()
    ref_cnt = torch._dynamo.testing.CompileCounter()
    want = _compiled(_Net(), how, ref_cnt)(x)
    assert ref_cnt.frame_count >= 1
    model = _Net()
    assert torch.equal(model(x), want)
    cnt = torch._dynamo.testing.CompileCounter()
    compiled = _compiled(model, how, cnt)
    with ae.adaptive_eager(backend="replay"):
        assert _engine_global_hooks() == 2
        out = compiled(x)
        assert torch.equal(out, want)
    assert (cnt.frame_count, cnt.op_count) == (ref_cnt.frame_count, ref_cnt.op_count)
    assert torch.equal(compiled(x), want)


def test_recompiles_do_not_grow_with_contexts() -> None:
    """Dynamo guards on how many global hooks there are, not which: a fullgraph function called
    outside, then in many contexts (each context's hooks are new objects), compiles at most once
    per hook count."""
    model, x = _model(), _x()
    want = model(x) + 1
    cnt = torch._dynamo.testing.CompileCounter()
    f = torch.compile(lambda x: model(x) + 1, fullgraph=True, backend=cnt)
    assert torch.equal(f(x), want)
    for _ in range(6):
        with ae.adaptive_eager(backend="replay"):
            assert torch.equal(f(x), want)
            model(x)  # a recorded call beside it
        assert torch.equal(f(x), want)
    assert cnt.frame_count <= 2, cnt.frame_count


def _always_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    calibrate()  # measure first, then pin: recording "costs" a second per op
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)


@contextlib.contextmanager
def _aside(model: torch.nn.Module, x: torch.Tensor, cache_dir: Path,
           graph_backend: Any) -> Iterator[Presence]:
    """The engine on; enough calls of the model to step aside: its presence, the root ticks on
    the model."""
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           cache_dir=str(cache_dir), disk_cache=False, probe_every=1000):
        for _ in range(30):
            model(x).softmax(-1).argmax().item()
        presence = ae.api._state.presence
        assert presence.aside and presence._tick_kind == "roots"
        assert any(type(h) is _RootTick for h in model._forward_hooks.values())
        yield presence


def test_fullgraph_export_and_script_while_aside(monkeypatch: pytest.MonkeyPatch,
                                                 cache_dir: Path, graph_backend: Any) -> None:
    """Aside, the tick hooks sit on the model itself (Note [root ticks]): a fullgraph compile
    calling it (which raised on ``_RootTick.__call__``), torch.export (strict and not) and
    torch.jit.script of it work, equal to eager; none of them ticks, a plain call still does."""
    _always_aside(monkeypatch)
    model, x = _model(), _x()
    with torch.no_grad():
        want = model(x)
        f = torch.compile(lambda x: model(x) * 2, fullgraph=True, backend="aot_eager")
        with _aside(model, x, cache_dir, graph_backend) as presence:
            before = presence.steps_aside
            assert torch.equal(f(x), want * 2)
            for strict in (False, True):
                exported = torch.export.export(model, (x,), strict=strict)
                assert torch.equal(exported.module()(x), want)
            scripted = torch.jit.script(model)
            assert torch.equal(scripted(x), want)
            assert presence.steps_aside == before
            assert torch.equal(model(x), want)
            assert presence.steps_aside == before + 1


def test_export_between_contexts() -> None:
    """torch.export of a model that contexts ran (no engine hooks left between them)."""
    model, x = _model(), _x()
    want = model(x)
    for _ in range(2):
        with ae.adaptive_eager(backend="replay"):
            model(x)
    assert _engine_global_hooks() == 0
    assert torch.equal(torch.export.export(model, (x,)).module()(x), want)


def test_export_inside_an_active_context() -> None:
    """torch.export inside a context exports the graph made outside the engine (it flushed the
    pending ops, its example input is a lazy tensor's value), counted as a fallback."""
    model, x = _model(), _x()
    want = model(x * 2)
    outside = torch.export.export(model, (x * 2,))
    with ae.adaptive_eager(backend="replay"):
        y = x * 2  # pending: export must see its value
        exported = torch.export.export(model, (y,))
        assert ae.metrics()["fallback_ops"]["torch.export"] == 1
        got = model(y)  # the engine still records after the export
    assert torch.equal(got, want)
    assert torch.equal(exported.module()(x * 2), want)
    assert str(exported.graph) == str(outside.graph)


@pytest.mark.slow
def test_fullgraph_inductor_in_contexts() -> None:
    """The reproducer with the default Inductor backend (a C++ compile): within float
    tolerance of eager."""
    model, x = _model(), _x()
    want = model(x) * 2
    f = torch.compile(lambda x: model(x) * 2, fullgraph=True)
    for _ in range(3):
        with ae.adaptive_eager(backend="replay"):
            got = f(x)
            model(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compile_in_another_thread_does_not_stop_ticks() -> None:
    """``torch.compiler.is_compiling()`` is one process-wide flag, True for a whole Dynamo
    compile in any thread: hooks that returned on it lost this thread's rounds while another
    thread compiled, and a call whose pre-hook ran before and whose post-hook ran during that
    compile left the depth count at 1, so no outermost call ticked again in the context."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def slow_backend(gm: Any, example_inputs: Any) -> Any:
        entered.set()
        release.wait(30)
        return gm.forward

    def compile_elsewhere() -> None:
        torch.compile(lambda t: t * 2 + 1, backend=slow_backend)(torch.ones(3))

    inner, x = _model(), _x()

    class Starter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.thread: threading.Thread | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.inner(x)
            if self.thread is None:  # another thread starts compiling during this call
                self.thread = threading.Thread(target=compile_elsewhere)
                self.thread.start()
                assert entered.wait(30)
            return out

    model = Starter()
    want = inner(x)
    outs = []
    try:
        with ae.adaptive_eager(backend="replay"):
            presence = ae.api._state.presence
            assert presence._tick_kind == "global"
            outs.append(model(x))  # its post-hook runs while the other thread compiles
            assert torch.compiler.is_compiling()  # the flag this thread must not go by
            outs.append(model(x))
            assert presence.calls_in_context == 2
            release.set()
            model.thread.join(30)
            for _ in range(3):
                outs.append(model(x))
            assert presence.calls_in_context == 5
            assert presence._depth == 0
    finally:
        release.set()
        if model.thread is not None:
            model.thread.join(30)
    for out in outs:
        assert torch.equal(out, want)


def test_strict_export_inside_an_active_context() -> None:
    """Strict torch.export raises on any global module hook ("Attempted to inline function
    marked as skipped": ModuleToTrace.forward), and an active context has the engine's global
    tick hooks on: the export runs without them; its graph is the one made outside, the hooks
    are back afterwards and the context's calls still tick."""
    model, x = _model(), _x()
    want = model(x * 2)
    outside = torch.export.export(model, (x * 2,), strict=True)
    with ae.adaptive_eager(backend="replay"):
        presence = ae.api._state.presence
        assert _engine_global_hooks() == 2
        y = x * 2
        exported = torch.export.export(model, (y,), strict=True)
        assert _engine_global_hooks() == 2
        before = presence.calls_in_context
        got = model(y)
        assert presence.calls_in_context == before + 1
    assert torch.equal(got, want)
    assert torch.equal(exported.module()(x * 2), want)
    assert str(exported.graph) == str(outside.graph)
