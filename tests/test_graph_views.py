"""Views in fused programs whose compiler-side strides differ from eager's (Note [views as
reshapes] in graph.py). Hugging Face GPT-2's training step (its cache ``cat`` of a legacy empty
tensor) failed every compile with "Cannot view a tensor with shape ... as ..." and ran op by op.
Inductor's programs must equal eager within float32 tolerance; the graphs given to the backend
must keep a ``view`` wherever a copy could be seen (a write into its alias family, an output)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import backends
from adaptive_eager.backends.inductor import InductorBackend

aten = torch.ops.aten
RTOL, ATOL = 1e-4, 1e-5
FAST = {"hot_after": 2, "step_aside": False, "compile_async": False, "compile_process": False,
        "disk_cache": False}


class _Recording(InductorBackend):
    """The real Inductor backend, in this process, keeping the graphs it was given."""

    name = "test-inductor-views"
    separate_process = False

    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[Any] = []

    def options_key(self) -> str:
        return "test-inductor-views:1"

    def compile(self, graph: Any) -> Any:
        self.graphs.append(graph)
        return super().compile(graph)


@pytest.fixture
def inductor() -> Any:
    backend = _Recording()
    backends._instances[backend.name] = backend
    yield backend
    backends._instances.pop(backend.name, None)


def _targets(backend: _Recording) -> list[Any]:
    return [n.target for g in backend.graphs for n in g.gm.graph.nodes]


def _attention_scores(qkv: torch.Tensor) -> torch.Tensor:
    """GPT-2's attention scores with an empty key cache: ``cat`` gives a contiguous key in
    eager and a transposed layout under the compiler's meta functions."""
    q, k, _v = qkv.split(32, dim=2)
    q = q.view(2, 9, 4, 8).transpose(1, 2)
    k = torch.cat([torch.tensor([]), k.view(2, 9, 4, 8).transpose(1, 2)], dim=-2)
    return torch.matmul(q * 0.5, k.transpose(-2, -1) * 0.5).softmax(-1).sum((1, 2))


def test_view_after_cat_compiles_and_equals_eager(inductor: _Recording, cache_dir: Path) -> None:
    torch.manual_seed(0)
    qkv = torch.randn(2, 9, 96)
    want = _attention_scores(qkv)
    with ae.adaptive_eager(backend=inductor.name, cache_dir=cache_dir, **FAST):
        got = []
        for _ in range(4):
            got.append(_attention_scores(qkv))
            ae.sync()  # one trace per call: the second call is a hit, the third runs fused
    m = ae.metrics()
    assert m["compile_errors"] == 0 and m["compiled_runs"] >= 2, m
    assert aten.reshape.default in _targets(inductor)
    for g in got:
        torch.testing.assert_close(g, want, rtol=RTOL, atol=ATOL)


def _written_after_view(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    v = y.view(-1)  # a view of y: the write below must show through it
    y.add_(1)
    return v.sum() + y.sum()


def _returned_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * 2
    return y, y.view(-1)  # the caller writes y and reads the view


def test_views_that_a_copy_would_change_stay_views(inductor: _Recording,
                                                   cache_dir: Path) -> None:
    x = torch.randn(4, 4)
    want_w = _written_after_view(x)
    y, v = _returned_view(x)
    y.add_(3)
    want_r = v.clone()
    got_w, got_r = [], []
    with ae.adaptive_eager(backend=inductor.name, cache_dir=cache_dir, **FAST):
        for _ in range(4):
            got_w.append(_written_after_view(x))
            ae.sync()
            y, v = _returned_view(x)
            ae.sync()
            y.add_(3)
            got_r.append(v.clone())
    m = ae.metrics()
    assert m["compile_errors"] == 0 and m["compiled_runs"] >= 2, m
    assert aten.reshape.default not in _targets(inductor)
    for a in got_w:
        torch.testing.assert_close(a, want_w, rtol=RTOL, atol=ATOL)
    for a in got_r:
        torch.testing.assert_close(a, want_r, rtol=RTOL, atol=ATOL)
