"""A fused program's outputs keep eager's dtypes, shapes and devices.

Note [clamp of lifted numbers] (graph.py): Inductor once kept a bool or int dtype where eager
promotes a clamp with float bounds; Note [outputs unlike eager's] (fused.py): whatever a program
returns that eager's kernels did not promise is refused, not converted.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import adaptive_eager as ae
from helpers import GraphProgramBackend, registered

RUNS = 6  # hot after 2, then fused runs with new bounds each time (lifted numbers)


def _bounds(i: int) -> tuple[float, float, int, int]:
    rng = random.Random(i)
    return rng.uniform(-1, 1), rng.uniform(-1, 1), rng.randint(-3, 3), rng.randint(-3, 3)


def _clamps(x: torch.Tensor, lo: float, hi: float, ilo: int, ihi: int) -> list[torch.Tensor]:
    """Every way a clamp takes Python numbers: both bounds, one, keywords, ints, lo > hi."""
    return [torch.clamp(x, lo, hi), torch.clamp(x, min=lo), torch.clamp(x, max=hi),
            torch.clamp(x, ilo, ihi), torch.clamp(x, hi, lo), x.clamp(min=ilo, max=hi),
            torch.clamp(x.to(torch.float32), lo, hi)]


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return [torch.randint(2, (5,), generator=g, dtype=torch.bool) for _ in range(RUNS)]
    if not dtype.is_floating_point:
        return [torch.randint(-4, 5, (5,), generator=g, dtype=dtype) for _ in range(RUNS)]
    return [torch.randn(5, generator=g).to(dtype) for _ in range(RUNS)]


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32], ids=str)
def test_clamp_with_lifted_bounds_keeps_eager_dtype_and_values(cache_dir: Path,
                                                              dtype: torch.dtype) -> None:
    xs = _inputs(dtype)
    ref = [_clamps(x, *_bounds(i)) for i, x in enumerate(xs)]
    got = []
    with ae.adaptive_eager(hot_after=2, compile_async=False, step_aside=False):
        for i, x in enumerate(xs):
            outs = _clamps(x, *_bounds(i))
            torch.stack([o.double().sum() for o in outs]).sum().item()  # one flush per run
            got.append(outs)
    m = ae.metrics()
    assert m["compiled_runs"] >= 2 and m["quarantined"] == 0, m
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


class WrongDtypeBackend(GraphProgramBackend):
    """A compiler that gets one output's dtype wrong: what the engine must never pass on."""

    name = "test-wrong-dtype"

    def options_key(self) -> str:
        return "test-wrong-dtype:1"

    def compile(self, graph: Any) -> Any:
        gm = graph.gm

        def program(*inputs: Any) -> Any:
            outs = list(gm(*inputs))
            outs[0] = outs[0].to(torch.float64) + 1
            return tuple(outs)

        return program


@pytest.fixture
def wrong_backend() -> Iterator[WrongDtypeBackend]:
    with registered(WrongDtypeBackend()) as backend:
        yield backend


def _run(step: Callable[[int], list[torch.Tensor]], backend: str | None) -> list[list]:
    out = []
    ctx = ae.adaptive_eager(backend=backend, hot_after=2, compile_async=False,
                            step_aside=False, disk_cache=False) if backend else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for i in range(RUNS):
            out.append(step(i))
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return out


def test_outputs_unlike_eager_are_refused_and_the_run_is_replayed(
        cache_dir: Path, wrong_backend: WrongDtypeBackend) -> None:
    x = torch.randn(4)

    def step(i: int) -> list[torch.Tensor]:
        y = (x * (i + 1.5)).sin()
        z = y + 1
        z.sum().item()  # one flush per step
        return [y, z]

    ref = _run(step, None)
    got = _run(step, wrong_backend.name)
    m = ae.metrics()
    assert m["quarantined"] == 1 and m["fused_errors"] >= 1, m
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_outputs_unlike_eager_after_an_input_write_stop_fusing_and_say_so(
        cache_dir: Path, wrong_backend: WrongDtypeBackend,
        caplog: pytest.LogCaptureFixture) -> None:
    def make() -> Callable[[int], list[torch.Tensor]]:
        state = torch.zeros(4)

        def step(i: int) -> list[torch.Tensor]:
            y = state * 2 + i
            state.add_(1.0)  # the program writes an external tensor
            seen = state.clone()
            y.sum().item()  # one flush per step
            return [y, seen]

        return step

    ref = _run(make(), None)
    with caplog.at_level(logging.ERROR, logger="adaptive_eager"):
        got = _run(make(), wrong_backend.name)
    m = ae.metrics()
    assert m["quarantined"] == 1, m
    assert any("where eager gives" in r.getMessage() for r in caplog.records)
    bad = [k for k, (r, g) in enumerate(zip(ref, got))
           if not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(r, g))]
    assert len(bad) == 1, bad  # the one run that wrote first; every later run is op by op
    assert torch.equal(got[-1][1], ref[-1][1])  # the written state stayed eager's throughout
