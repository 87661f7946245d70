"""Stepping aside: the engine leaves the mode stack when measurements say nothing gains.

The decision itself is a timing comparison; these tests pin the measured costs (or the counts)
so they check the mechanics deterministically, never a machine's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import compiler
from adaptive_eager.calibrate import calibrate
from helpers import train_steps


def _train(steps: int, **options) -> tuple[list[float], list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(5, 6), torch.randn(5, 1)
    intercepted: list[int] = []
    losses = train_steps(model, opt, x, y, steps, options or None,
                         lambda: intercepted.append(ae.metrics()["ops_intercepted"]))
    return losses, intercepted


def test_steps_aside_when_recording_costs_more_than_fusion_saves(
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    calibrate()  # measure first, then pin: recording "costs" a second per op
    monkeypatch.setattr(compiler, "RECORD_S", 1.0)
    monkeypatch.setattr(compiler, "MIN_DECISIONS", 1)
    ref, _ = _train(30)
    losses, intercepted = _train(30, hot_after=2, compile_async=False, cache_dir=cache_dir,
                                 probe_every=10)
    m = ae.metrics()
    assert m["step_asides"] >= 1, m
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-6)
    flat = [b - a for a, b in zip(intercepted, intercepted[1:])]
    assert 0 in flat  # while aside, no op reaches the engine
    assert flat[-1] > 0  # after probe_every optimizer steps it is back, measuring again


def test_steps_aside_when_traces_never_repeat(monkeypatch: pytest.MonkeyPatch,
                                              cache_dir: Path) -> None:
    monkeypatch.setattr(compiler, "NO_REPEAT_FLUSHES", 40)
    monkeypatch.setattr(compiler, "NO_REPEAT_OPS", 200)
    lin = torch.nn.Linear(3, 3)
    with ae.adaptive_eager(cache_dir=cache_dir):
        for n in range(1, 120):
            lin(torch.ones(n, 3)).sum().item()  # a new shape every step: nothing repeats
    m = ae.metrics()
    assert m["step_asides"] == 1, m


def test_replay_backend_never_steps_aside(monkeypatch: pytest.MonkeyPatch,
                                          cache_dir: Path) -> None:
    monkeypatch.setattr(compiler, "NO_REPEAT_FLUSHES", 40)
    monkeypatch.setattr(compiler, "NO_REPEAT_OPS", 200)
    lin = torch.nn.Linear(3, 3)
    with ae.adaptive_eager(cache_dir=cache_dir, backend="replay"):
        for n in range(1, 80):
            lin(torch.ones(n, 3)).sum().item()
    assert ae.metrics()["step_asides"] == 0


def _no_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave the decision to the measured trial alone (Note [measured trial])."""
    monkeypatch.setattr(compiler.CompileManager, "step_aside_reason", lambda self: None)


def _slow_on(side: str) -> Callable[[], None]:
    def pause() -> None:  # a round on the slow side takes 20 ms longer
        in_engine = torch._C._len_torch_dispatch_stack() > 0
        if in_engine == (side == "engine"):
            time.sleep(0.02)
    return pause


@pytest.mark.parametrize("slow_side", ["engine", "eager"])
def test_trial_keeps_the_faster_side(monkeypatch: pytest.MonkeyPatch, cache_dir: Path,
                                     slow_side: str) -> None:
    _no_estimate(monkeypatch)
    ref, _ = _train(60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(5, 6), torch.randn(5, 1)
    intercepted: list[int] = []
    pause = _slow_on(slow_side)

    def each_step() -> None:
        intercepted.append(ae.metrics()["ops_intercepted"])
        pause()

    losses = train_steps(model, opt, x, y, 60, dict(hot_after=2, compile_async=False,
                                                     cache_dir=cache_dir), each_step)
    m = ae.metrics()
    assert m["trials"] == 1 and m["kept_fused"] + m["kept_replay"] >= 1, m
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-6)
    last = intercepted[-1] - intercepted[-2]
    if slow_side == "engine":
        assert m["step_asides"] == 1 and last == 0, m  # plain eager from the trial on
    else:
        assert m["step_asides"] == 0 and last > 0, m  # back in the engine after the trial


def test_trial_without_an_optimizer_times_outermost_module_calls(
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    _no_estimate(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    x = torch.randn(5, 6)
    expected = [model(x).sum().item() for _ in range(3)]
    pause = _slow_on("engine")
    seen = []
    with ae.adaptive_eager(hot_after=2, compile_async=False, cache_dir=cache_dir):
        for _ in range(60):
            out = model(x).sum()
            seen.append(out.item())
            pause()
    m = ae.metrics()
    assert m["trials"] == 1 and m["step_asides"] == 1, m
    torch.testing.assert_close(torch.tensor(seen[-3:]), torch.tensor(expected))


def test_plain_eager_while_a_compile_is_in_flight(monkeypatch: pytest.MonkeyPatch,
                                                  cache_dir: Path) -> None:
    """Note [waiting aside]: rounds run plain eager until the compile finishes, then the engine
    is back and uses the program."""
    from adaptive_eager.backends.inductor import InductorBackend

    # Compiles run in the helper process (in-process ones run at the flush, Note [in-process
    # compiles]); loading its answer, in the worker thread here, is made slow too, so the
    # compile is in flight for a while however fast the helper is.
    real_load = InductorBackend.load

    def slow_load(self: InductorBackend, data: bytes, graph: object) -> object:
        time.sleep(1.5)
        return real_load(self, data, graph)

    monkeypatch.setattr(InductorBackend, "load", slow_load)
    _no_estimate(monkeypatch)
    monkeypatch.setattr("adaptive_eager.aside.TRIAL_TICKS", 10_000)  # no trial in this test
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(5, 6), torch.randn(5, 1)
    ref, _ = _train(40)
    seen: list[tuple[int, int]] = []
    with ae.adaptive_eager(hot_after=2, cache_dir=cache_dir):
        losses = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and (len(losses) < 40
                                               or ae.metrics()["compiled_runs"] < 3):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            m = ae.metrics()
            seen.append((m["ops_intercepted"], m["compile_waits"]))
    m = ae.metrics()
    assert m["compile_waits"] >= 1 and m["compiled_runs"] >= 3, m
    waiting = [b[0] - a[0] for a, b in zip(seen, seen[1:]) if a[1] >= 1 and b[1] == a[1]]
    assert 0 in waiting  # rounds while waiting reached no engine
    torch.testing.assert_close(torch.tensor(losses[:40]), torch.tensor(ref), rtol=1e-4,
                               atol=1e-6)
