"""Foreach ops with lists of numbers in fused programs (Note [foreach scalar lists] in graph.py).

Inductor lowers no ``ScalarList`` foreach op: AdamW(foreach=True)'s per-parameter bias
corrections (``_foreach_div_``, ``_foreach_addcdiv_``, numbers that change every step and are
lifted to program inputs) ran as aten calls inside the engine's programs. The graph now hands
them over as ``List`` overloads of 0-d tensors. Programs of the test graph backend (the trace
graph run with eager's aten kernels) must equal eager bitwise; Inductor's within float32
tolerance.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import backends
from adaptive_eager import graph as graph_mod
from helpers import train_steps
from adaptive_eager.backends.inductor import InductorBackend
from conftest import assert_same

RTOL, ATOL = 1e-4, 1e-5  # Inductor's float32 programs against eager
SHAPES = ((16, 8), (16,), (4, 16), (4,))
FAST = {"hot_after": 2, "step_aside": False, "compile_async": False, "compile_process": False,
        "disk_cache": False}


class _Recording(InductorBackend):
    """The real Inductor backend, compiled in this process, keeping the graphs it was given."""

    name = "test-inductor-rec"
    separate_process = False

    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[Any] = []

    def options_key(self) -> str:
        return "test-inductor-rec:1"

    def compile(self, graph: Any) -> Any:
        self.graphs.append(graph)
        return super().compile(graph)


class _Graphs:
    """The graph program backend of tests/helpers.py, keeping the graphs it was given."""

    name = "test-fxgraph-rec"
    compiles = True

    def __init__(self) -> None:
        self.graphs: list[Any] = []

    def options_key(self) -> str:
        return "test-fxgraph-rec:1"

    def compile(self, graph: Any) -> Any:
        self.graphs.append(graph)
        return graph.gm

    def serialize(self, program: Any) -> bytes:
        raise RuntimeError("not stored")

    def load(self, data: bytes, graph: Any) -> Any:
        raise RuntimeError("never stored")


@pytest.fixture
def graphs() -> Any:
    backend = _Graphs()
    backends._instances[backend.name] = backend
    yield backend
    backends._instances.pop(backend.name, None)


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2, foreach=True)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=True)
    if kind == "nadam":
        return torch.optim.NAdam(params, lr=1e-2, foreach=True)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2, lr_decay=1e-2, foreach=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True)


def _train(kind: str, options: dict[str, Any] | None, steps: int = 10) -> list[torch.Tensor]:
    """A model's training loop (forward, backward, a foreach optimizer): the step trace holds
    the gradients as pending values and the bias corrections change every step."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = _optimizer(kind, list(net.parameters()))
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    train_steps(net, opt, x, y, steps, options)
    return [p.detach().clone() for p in net.parameters()] + [
        t.clone() for st in opt.state.values() for t in st.values() if t.dim()]


def _scalar_list_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if "ScalarList" in str(n.target)]


def _lifted_into_scalar_lists(gm: torch.fx.GraphModule) -> list[str]:
    """ScalarList ops that read a lifted number (an ``item`` of a placeholder)."""
    out = []
    for n in gm.graph.nodes:
        if "ScalarList" in str(n.target):
            for a in n.args:
                if isinstance(a, (list, tuple)) and any(
                        isinstance(x, torch.fx.Node) and x.target is torch.ops.aten.item.default
                        for x in a):
                    out.append(str(n.target))
    return out


@pytest.mark.parametrize("kind", ["adamw", "adam", "nadam", "adagrad", "sgd"])
def test_foreach_optimizers_fused_equal_eager_bitwise(kind: str, graphs: _Graphs,
                                                      cache_dir: Path) -> None:
    """With eager's kernels running the rewritten graph, every step's values are eager's bit
    for bit: 0-d float64 tensors promote and compute as the Python floats did, and addcdiv is
    ``self + (s * t1) / t2`` in eager's order."""
    want = _train(kind, None)
    got = _train(kind, {"backend": graphs.name, "cache_dir": cache_dir, **FAST})
    m = ae.metrics()
    assert m["compiled_runs"] >= 3 and m["fused_errors"] == 0 and m["compile_errors"] == 0, m
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)
    assert graphs.graphs
    for g in graphs.graphs:
        assert _scalar_list_ops(g.gm) == [], g.gm.code
    if kind != "sgd":  # its lr and momentum are constants: nothing lifted
        assert any(g.lifted for g in graphs.graphs)


def _foreach_calls(xs: list[torch.Tensor], k: float) -> list[torch.Tensor]:
    """Out-of-place and in-place ScalarList ops of every kind, numbers changing per call."""
    floats = [k, 2.0 * k, 0.5 + k, -k]
    ints = [1, 2, 3, 4]
    a = torch._foreach_mul(xs, floats)
    b = torch._foreach_div(a, floats)
    c = torch._foreach_add(xs, ints)
    d = torch._foreach_mul(xs, [True, False, True, False])
    e = torch._foreach_addcmul(xs, a, b, floats)
    f = [t.clone() for t in xs]
    torch._foreach_sub_(f, floats)
    torch._foreach_addcdiv_(f, a, [t.abs() + 1 for t in b], floats)
    return [*a, *b, *c, *d, *e, *f]


def _run_calls(make: Callable[[], list[torch.Tensor]], options: dict[str, Any] | None
               ) -> list[list[torch.Tensor]]:
    xs = make()
    out = []
    ctx = ae.adaptive_eager(**options) if options is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for i in range(8):
            held = _foreach_calls(xs, 0.25 + i / 8)  # held at the flush: their dtypes known
            ae.sync()
            out.append([t.clone() for t in held])
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_scalar_list_promotion_as_eager(dtype: torch.dtype, graphs: _Graphs,
                                        cache_dir: Path) -> None:
    """dtypes of every op's results are eager's: a float list on float32 stays float32 (a 0-d
    float64 tensor does not promote), on float64 keeps float64's precision, and on integers
    gives the default dtype (where a float64 0-d tensor would give float64: those ops keep the
    aten call)."""
    def make() -> list[torch.Tensor]:
        torch.manual_seed(0)
        if dtype.is_floating_point:
            return [torch.randn(s, dtype=dtype) for s in SHAPES]
        return [torch.randint(-5, 5, s, dtype=dtype) for s in SHAPES]

    if not dtype.is_floating_point:  # the in-place float ops cannot write integers in eager
        with pytest.raises(RuntimeError):
            _foreach_calls(make(), 0.5)
        return
    want = _run_calls(make, None)
    got = _run_calls(make, {"backend": graphs.name, "cache_dir": cache_dir, **FAST})
    assert ae.metrics()["compiled_runs"] >= 3, ae.metrics()
    for run_a, run_b in zip(got, want, strict=True):
        for a, b in zip(run_a, run_b, strict=True):
            assert_same(a, b)
    assert graphs.graphs and all(_lifted_into_scalar_lists(g.gm) == [] for g in graphs.graphs)


def test_integral_out_of_place_float_list_keeps_aten_call(graphs: _Graphs,
                                                          cache_dir: Path) -> None:
    """``_foreach_mul(int64 tensors, [floats])`` is float32 in eager; the same with 0-d float64
    tensors would be float64, so the op stays as recorded (and matches eager)."""
    def make() -> list[torch.Tensor]:
        torch.manual_seed(0)
        return [torch.randint(-5, 5, s) for s in SHAPES]

    def calls(xs: list[torch.Tensor], k: float) -> list[torch.Tensor]:
        return [*torch._foreach_mul(xs, [k, 2 * k, 3 * k, 4 * k]),
                *torch._foreach_add(xs, [1, 2, 3, 4])]

    def run(options: dict[str, Any] | None) -> list[torch.Tensor]:
        xs = make()
        out: list[torch.Tensor] = []
        ctx = ae.adaptive_eager(**options) if options is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            for i in range(8):
                out.extend(t.clone() for t in calls(xs, 0.25 + i / 8))
                ae.sync()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        return out

    want = run(None)
    got = run({"backend": graphs.name, "cache_dir": cache_dir, **FAST})
    assert ae.metrics()["compiled_runs"] >= 3
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)
    kept = [_scalar_list_ops(g.gm) for g in graphs.graphs]
    assert kept and all(k == ["aten._foreach_mul.ScalarList"] for k in kept), kept


def test_scalar_list_rewrite_is_only_for_the_listed_ops() -> None:
    """Every rewritten overload and its target exist with the argument shapes the rewrite
    assumes (a torch that renames one would make the table wrong, not the programs)."""
    for src, dst in graph_mod._FOREACH_LIST.items():
        names = [a.name for a in src._schema.arguments]
        assert names[1] == "scalars" and [a.name for a in dst._schema.arguments][1] == "other"
    for src, dst in graph_mod._FOREACH_ADDC.items():
        assert [a.name for a in src._schema.arguments][3] == "scalars"
        assert [a.name for a in dst._schema.arguments][3] == "value"


@pytest.mark.slow
def test_adamw_foreach_inductor_program_has_no_aten_scalar_lists(cache_dir: Path) -> None:
    """The real backend: an AdamW(foreach=True) training loop compiled by Inductor equals eager
    within tolerance over steps whose bias corrections change, and the graph it was handed has
    no ScalarList op (so no aten call over the parameters)."""
    backend = _Recording()
    backends._instances[backend.name] = backend
    try:
        want = _train("adamw", None, steps=8)
        got = _train("adamw", {"backend": backend.name, "cache_dir": cache_dir, **FAST},
                     steps=8)
    finally:
        backends._instances.pop(backend.name, None)
    m = ae.metrics()
    assert m["compiled_runs"] >= 3 and m["fused_errors"] == 0 and m["compile_errors"] == 0, m
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert backend.graphs and any(g.lifted for g in backend.graphs)
    for g in backend.graphs:
        assert _scalar_list_ops(g.gm) == [], g.gm.code
        targets = {str(n.target) for n in g.gm.graph.nodes}
        assert "aten._foreach_div_.List" in targets and "aten._foreach_addcdiv_.Scalar" in targets


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a helper's default is one thread too")
def test_helper_compiles_for_the_programs_thread_count(cache_dir: Path) -> None:
    """Note [compile threads] (backends/inductor.py): a program running one torch thread gets
    kernels compiled for one thread (serial loops, as torch.compile would make them here), not
    for the helper process's default of every core (``#pragma omp parallel``)."""
    import time

    old = torch.get_num_threads()
    start = time.time() - 1
    torch.set_num_threads(1)
    x = torch.randn(512, 1024)
    try:
        with ae.adaptive_eager(hot_after=2, step_aside=False, cache_dir=cache_dir):
            for i in range(6):
                y = (x * 3.0 + 1.0).relu().sum(0)
                ae.sync()
                if i == 3:
                    ae.wait_for_compiles(timeout=600)
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)
    m = ae.metrics()
    assert m["compiled_runs"] >= 1 and m["compile_errors"] == 0, m
    torch.testing.assert_close(y, (x * 3.0 + 1.0).relu().sum(0), rtol=RTOL, atol=ATOL)
    folders = {cache_dir / "inductor", Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "."))}
    kernels = [p.read_text() for d in folders if d.is_dir() for p in d.rglob("*.cpp")
               if p.stat().st_mtime >= start]
    assert kernels, folders
    assert not any("omp parallel" in k for k in kernels), kernels[0][:2000]
