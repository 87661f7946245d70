"""Note [syncs are rounds]: a program with no optimizer, no module call and one context gets
its rounds from its syncs (waiting aside while compiling, probes, trials); results stay eager's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import aside, compiler, trial
from adaptive_eager.compile import policy
from adaptive_eager.compile import programs
from adaptive_eager.calibrate import calibrate


def _solver(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    a = torch.eye(n) + 0.01 * torch.randn(n, n)
    return a, torch.randn(n)


def _iterate(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> float:
    r = b - a @ x
    res = r.norm().item()  # the sync: one per iteration
    x.add_(r, alpha=0.5 if res > 1.0 else 0.1)
    return res


def _eager(steps: int) -> list[float]:
    a, b = _solver()
    x = torch.zeros(16)
    return [_iterate(a, b, x) for _ in range(steps)]


def _wrapped() -> bool:
    return "item" in torch.Tensor.__dict__


def test_probes_come_back_through_syncs(monkeypatch: pytest.MonkeyPatch,
                                        graph_backend: object) -> None:
    """Aside, a round-less loop used to stay aside for good (no rounds: no probe); with sync
    rounds it probes after ``probe_every`` of them and steps aside again."""
    calibrate()  # measure first, then pin: recording "costs" a second per op
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    ref = _eager(600)
    a, b = _solver()
    x = torch.zeros(16)
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           compile_process=False, disk_cache=False, probe_every=2):
        got = [_iterate(a, b, x) for _ in range(600)]
        assert _wrapped()  # the syncs are this context's rounds
    assert not _wrapped()  # off outside the context
    assert got == ref
    m = ae.metrics()
    assert m["step_asides"] >= 2, m  # aside, a probe, aside again


def test_sync_rounds_need_steps_aside_on(graph_backend: object) -> None:
    ref = _eager(200)
    a, b = _solver()
    x = torch.zeros(16)
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           compile_process=False, disk_cache=False, step_aside=False):
        got = [_iterate(a, b, x) for _ in range(200)]
        assert not _wrapped()
    assert got == ref


def test_an_optimizer_step_replaces_sync_rounds(monkeypatch: pytest.MonkeyPatch,
                                                graph_backend: object) -> None:
    monkeypatch.setattr(compiler.CompileManager, "step_aside_reason", lambda self: None)
    monkeypatch.setattr(trial, "TRIAL_TICKS", 10_000)  # no trial in this test
    a, b = _solver()
    x = torch.zeros(16)
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    ref_x = x.clone()
    ref = [_iterate(a, b, ref_x) for _ in range(100)]
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           compile_process=False, disk_cache=False):
        got = [_iterate(a, b, x) for _ in range(100)]
        assert _wrapped()
        (w * 2.0).sum().backward()
        opt.step()
        assert not _wrapped()  # optimizer steps are the rounds now
        got += [_iterate(a, b, x) for _ in range(5)]
    ref += [_iterate(a, b, ref_x) for _ in range(5)]
    assert got == ref
    assert torch.equal(w.detach(), torch.full((4,), -0.2))


def test_waiting_aside_while_compiling(monkeypatch: pytest.MonkeyPatch,
                                       cache_dir: Path) -> None:
    """Note [waiting aside] through sync rounds: while the compile is in flight the loop runs
    plain eager (no op intercepted), then the engine comes back and uses the program."""
    real_store = programs.Programs.store

    def slow_store(self: programs.Programs, *args: object, **kwargs: object) -> object:
        time.sleep(1.5)  # in the worker, the compile in flight (a warm Inductor cache is quick)
        return real_store(self, *args, **kwargs)

    monkeypatch.setattr(programs.Programs, "store", slow_store)
    monkeypatch.setattr(compiler.CompileManager, "step_aside_reason", lambda self: None)
    monkeypatch.setattr(trial, "TRIAL_TICKS", 10_000)  # no trial in this test
    a, b = _solver()
    x = torch.zeros(16)
    ref_x = torch.zeros(16)
    seen: list[tuple[int, int]] = []
    got: list[float] = []
    ref: list[float] = []
    with ae.adaptive_eager(hot_after=2, cache_dir=cache_dir):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and (len(got) < 200
                                               or ae.metrics()["compiled_runs"] < 3):
            got.append(_iterate(a, b, x))
            m = ae.metrics()
            seen.append((m["ops_intercepted"], m["compile_waits"]))
    with torch.no_grad():
        ref = [_iterate(a, b, ref_x) for _ in range(len(got))]
    m = ae.metrics()
    assert m["compile_waits"] >= 1 and m["compiled_runs"] >= 3, m
    waiting = [q[0] - p[0] for p, q in zip(seen, seen[1:]) if p[1] >= 1 and q[1] == p[1]]
    assert 0 in waiting  # iterations while waiting reached no engine
    # op by op and aside: eager's bits; fused runs within float tolerance of them
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def _rounds_aside(monkeypatch: pytest.MonkeyPatch, graph_backend: object, count_only: int,
                  syncs: int) -> int:
    """Rounds a presence aside counts over ``syncs`` syncs, with the wrapper counting itself up
    to ``count_only`` (Note [counting syncs]; 0: every sync takes ``sync_point``)."""
    import threading

    monkeypatch.setattr(aside, "_SYNC_COUNT_ONLY", count_only)
    ae.clear_caches()  # a fresh presence: the last context's stays standing, quiet aside
    calibrate()
    monkeypatch.setattr(policy, "RECORD_S", 1.0)  # recording "costs" a second: aside soon
    a, b = _solver()
    x = torch.zeros(16)
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           compile_process=False, disk_cache=False, probe_every=10**6):
        for _ in range(200):
            _iterate(a, b, x)
        presence = aside._PENDING[threading.get_ident()]()
        assert presence.aside and presence.ticks_from == "sync"
        before = presence.steps_aside
        t = torch.tensor(0.5)
        for _ in range(syncs):
            t.item()
        return presence.steps_aside - before


def test_counting_syncs_ends_rounds_as_sync_point(monkeypatch: pytest.MonkeyPatch,
                                                  graph_backend: object) -> None:
    """The wrapper's own count (Note [counting syncs]) ends a round at the same sync as
    ``sync_point`` does for every sync."""
    n = 5 * aside.SYNC_ROUND + 3
    fast = _rounds_aside(monkeypatch, graph_backend, aside.SYNC_ROUND - 1, n)
    full = _rounds_aside(monkeypatch, graph_backend, 0, n)
    assert fast == full
    assert fast in (5, 6)  # the round under way when the loop began may end within it
