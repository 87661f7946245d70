"""Stepping aside: the engine leaves the mode stack when measurements say nothing gains.

The decision itself is a timing comparison; these tests pin the measured costs (or the counts)
so they check the mechanics deterministically, never a machine's speed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import compiler
from adaptive_eager.compile import policy
from adaptive_eager.compile import programs
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
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)
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
    monkeypatch.setattr(policy, "NO_REPEAT_FLUSHES", 40)
    monkeypatch.setattr(policy, "NO_REPEAT_OPS", 200)
    lin = torch.nn.Linear(3, 3)
    # Symbolic dims off: learnt, one trace would serve every n (Note [symbolic dims]).
    with ae.adaptive_eager(cache_dir=cache_dir, symbolic_dims=False):
        for n in range(1, 120):
            lin(torch.ones(n, 3)).sum().item()  # a new shape every step: nothing repeats
    m = ae.metrics()
    assert m["step_asides"] == 1, m


def test_replay_backend_never_steps_aside(monkeypatch: pytest.MonkeyPatch,
                                          cache_dir: Path) -> None:
    monkeypatch.setattr(policy, "NO_REPEAT_FLUSHES", 40)
    monkeypatch.setattr(policy, "NO_REPEAT_OPS", 200)
    lin = torch.nn.Linear(3, 3)
    with ae.adaptive_eager(cache_dir=cache_dir, backend="replay"):
        for n in range(1, 80):
            lin(torch.ones(n, 3)).sum().item()
    assert ae.metrics()["step_asides"] == 0


def _no_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave the decision to the measured trial alone (Note [measured trial])."""
    monkeypatch.setattr(compiler.CompileManager, "step_aside_reason", lambda self: None)


class TrialClock:
    """The clock a trial times its rounds with, advanced by the test: a round lasts exactly
    what the test says, whatever the machine's load (a 40 ms pause in a plain round on a
    loaded CI machine once made a clear trial look unclear)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> TrialClock:
    from adaptive_eager import aside

    fake = TrialClock()
    monkeypatch.setattr(aside, "time", fake)  # aside reads only time.perf_counter
    return fake


def _slow_on(side: str, clock: TrialClock) -> Callable[[], None]:
    def pause() -> None:  # a round on the slow side takes 20 ms, the other 1 ms
        in_engine = torch._C._len_torch_dispatch_stack() > 0
        clock.advance(0.02 if in_engine == (side == "engine") else 0.001)
    return pause


@pytest.mark.parametrize("slow_side", ["engine", "eager"])
def test_trial_keeps_the_faster_side(clock: TrialClock, monkeypatch: pytest.MonkeyPatch,
                                     cache_dir: Path,
                                     slow_side: str) -> None:
    _no_estimate(monkeypatch)
    ref, _ = _train(60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(5, 6), torch.randn(5, 1)
    intercepted: list[int] = []
    pause = _slow_on(slow_side, clock)

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


def _trial_run(steps: int, cache_dir: Path, backend: str,
               each_step: Callable[[bool, int], None], extra_from: int | None = None
               ) -> tuple[list[float], list[str]]:
    """A training loop whose steps call ``each_step(in_engine, trial_round)``; the sides of the
    trial's rounds come back ("E" engine, "G" plain eager). From step ``extra_from`` on, each
    step computes one more thing (a new step trace, compiled and decided anew)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(5, 6), torch.randn(5, 1)
    sides: list[str] = []
    losses: list[float] = []
    with ae.adaptive_eager(backend=backend, hot_after=2, compile_async=False,
                           cache_dir=str(cache_dir), disk_cache=False):
        for i in range(steps):
            opt.zero_grad()
            out = model(x)
            if extra_from is not None and i >= extra_from:
                out = out + 0.0 * torch.tanh(out)  # same values, a different trace
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            in_engine = torch._C._len_torch_dispatch_stack() > 0
            if ae.metrics()["trials_running"]:
                sides.append("E" if in_engine else "G")
            each_step(in_engine, len(sides))
    return losses, sides


def test_trial_alternates_rounds_so_a_load_change_cannot_decide(clock: TrialClock,
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path, graph_backend: object) -> None:
    """Note [measured trial]: rounds alternate between the engine and plain eager. Here the
    engine is the faster side (eager rounds take 10 ms longer) and a passing load adds 40 ms to
    each of the trial's first TRIAL_TICKS rounds: timed in two phases (engine rounds first) the
    engine would have lost; paired rounds see the same load and keep it."""
    from adaptive_eager.trial import TRIAL_CLEAR_PAIRS, TRIAL_TICKS

    _no_estimate(monkeypatch)
    ref, _ = _train(60)

    def each_step(in_engine: bool, trial_round: int) -> None:
        clock.advance(0.001)
        if 0 < trial_round <= TRIAL_TICKS:
            clock.advance(0.04)  # the load, on whichever side runs this round
        if not in_engine:
            clock.advance(0.01)

    losses, sides = _trial_run(60, cache_dir, graph_backend.name, each_step)
    m = ae.metrics()
    assert m["trials"] == 1 and m["step_asides"] == 0, m
    # alternating; a loaded machine may make every early pair clear (Note [clear trials])
    assert sides in [["E", "G"] * k for k in range(TRIAL_CLEAR_PAIRS, TRIAL_TICKS + 1)], sides
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-6)


def test_a_new_decision_after_the_verdict_times_the_engine_again(clock: TrialClock,
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path, graph_backend: object) -> None:
    """The engine a trial kept changes when another trace is compiled and decided later (here
    the step's trace changes at step 40): the trial runs again."""
    _no_estimate(monkeypatch)

    def each_step(in_engine: bool, trial_round: int) -> None:
        clock.advance(0.001 if in_engine else 0.011)  # the engine stays the faster side

    _trial_run(90, cache_dir, graph_backend.name, each_step, extra_from=40)
    m = ae.metrics()
    assert m["trials"] == 2 and m["step_asides"] == 0, m
    assert m["kept_fused"] + m["kept_replay"] >= 2, m


@pytest.mark.parametrize("slow_side", ["engine", "eager"])
def test_a_clear_trial_ends_after_a_few_pairs(clock: TrialClock, monkeypatch: pytest.MonkeyPatch,
                                              cache_dir: Path,
                                              graph_backend: object, slow_side: str) -> None:
    """Note [clear trials]: when every pair of rounds says the same by 2x or more, the trial
    ends after TRIAL_CLEAR_PAIRS pairs, not TRIAL_TICKS, with the verdict the full trial gives."""
    from adaptive_eager.trial import TRIAL_CLEAR_PAIRS

    _no_estimate(monkeypatch)
    ref, _ = _train(40)

    def each_step(in_engine: bool, trial_round: int) -> None:
        clock.advance(0.08 if in_engine == (slow_side == "engine") else 0.001)

    losses, sides = _trial_run(40, cache_dir, graph_backend.name, each_step)
    m = ae.metrics()
    assert m["trials"] == 1 and m["step_asides"] == (slow_side == "engine"), m
    assert sides == ["E", "G"] * TRIAL_CLEAR_PAIRS, sides
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-6)


def test_clear_ratio_needs_every_pair_to_agree() -> None:
    from adaptive_eager.trial import clear_ratio

    assert clear_ratio([1.0, 1.0], [3.0, 3.0]) is None  # too few pairs
    assert clear_ratio([1.0, 1.0, 1.0], [3.0, 3.0, 3.0]) == pytest.approx(1 / 3)
    assert clear_ratio([3.0, 3.0, 3.0, 3.0], [1.0, 1.0, 1.0]) == pytest.approx(3.0)
    assert clear_ratio([1.0, 1.0, 2.9], [3.0, 3.0, 3.0]) is None  # one pair is not clear
    assert clear_ratio([1.0, 1.0, 1.0], [3.0, 0.0, 3.0]) is None


def test_trial_without_an_optimizer_times_outermost_module_calls(clock: TrialClock,
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    _no_estimate(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    x = torch.randn(5, 6)
    expected = [model(x).sum().item() for _ in range(3)]
    pause = _slow_on("engine", clock)
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
    # Compiles run in the helper process (in-process ones run at the flush, Note [in-process
    # compiles]); storing its answer, in the worker thread, is made slow too, so the compile is
    # in flight for a while however fast the helper is.
    real_store = programs.Programs.store

    def slow_store(self: programs.Programs, *args: object, **kwargs: object) -> object:
        time.sleep(1.5)  # in the worker: the compile stays in flight for a while
        return real_store(self, *args, **kwargs)

    monkeypatch.setattr(programs.Programs, "store", slow_store)
    _no_estimate(monkeypatch)
    monkeypatch.setattr("adaptive_eager.trial.TRIAL_TICKS", 10_000)  # no trial in this test
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


# ---- Note [contexts are rounds]: a context around each call -----------------------------------
def _small(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = torch.tanh(x * 0.9 + w) - 0.1 * x
    return x


def _context_calls(calls: int, options: dict, pause: Callable[[], None] | None = None
                   ) -> tuple[list[torch.Tensor], list[int]]:
    """Each call of a small function in its own ``with adaptive_eager():`` (no module, no
    optimizer); returns every result and the ops intercepted so far after each call."""
    torch.manual_seed(0)
    x, w = torch.randn(8), torch.randn(8)
    outs, intercepted = [], []
    for _ in range(calls):
        with ae.adaptive_eager(**options):
            out = _small(x, w)
            if pause is not None:
                pause()
        outs.append(out)
        intercepted.append(ae.metrics()["ops_intercepted"])
    return outs, intercepted


def _eager_calls(calls: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x, w = torch.randn(8), torch.randn(8)
    return [_small(x, w) for _ in range(calls)]


def _assert_bitwise(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert type(a) is torch.Tensor or a.dtype == b.dtype  # a value, not a stale wrapper
        assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("slow_side", ["engine", "eager"])
def test_contexts_are_the_rounds_of_a_trial(clock: TrialClock, monkeypatch: pytest.MonkeyPatch,
                                            cache_dir: Path,
                                            graph_backend: object, slow_side: str) -> None:
    """A program that only enters the context around each call is timed per context and keeps
    the faster side; results stay eager's, bitwise (the program runs eager's kernels)."""
    _no_estimate(monkeypatch)
    options = dict(backend=graph_backend.name, hot_after=2, compile_async=False,
                   cache_dir=str(cache_dir), disk_cache=False)
    outs, intercepted = _context_calls(60, options, _slow_on(slow_side, clock))
    m = ae.metrics()
    assert m["trials"] == 1 and m["kept_fused"] + m["kept_replay"] >= 1, m
    _assert_bitwise(outs, _eager_calls(60))
    last = intercepted[-1] - intercepted[-2]
    if slow_side == "engine":
        assert m["step_asides"] == 1 and last == 0, m  # later contexts push no modes
    else:
        assert m["step_asides"] == 0 and last > 0, m


def test_aside_between_contexts_then_probes_again(monkeypatch: pytest.MonkeyPatch,
                                                  cache_dir: Path, graph_backend: object) -> None:
    """The estimate asks to step aside; the next context end is the safe point. Aside, contexts
    reach no engine; after probe_every contexts the engine is back, measuring again."""
    calibrate()
    monkeypatch.setattr(policy, "RECORD_S", 1.0)  # recording "costs" a second per op
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)
    monkeypatch.setattr(policy, "PROBE_FLUSHES", 5)
    options = dict(backend=graph_backend.name, hot_after=2, compile_async=False,
                   cache_dir=str(cache_dir), disk_cache=False, probe_every=10)
    # 60 calls: measuring takes 1 + 2 * MEASURE_RUNS runs (Note [paired timing]), a probe ends
    # at the next step-aside check (every 16 flushes)
    outs, intercepted = _context_calls(60, options)
    m = ae.metrics()
    assert m["step_asides"] >= 2, m  # aside, probed, aside again
    _assert_bitwise(outs, _eager_calls(60))
    per_call = [b - a for a, b in zip(intercepted, intercepted[1:])]
    first_aside = per_call.index(0)
    assert per_call[first_aside:first_aside + 9] == [0] * 9, per_call  # 10 contexts aside
    assert any(n > 0 for n in per_call[first_aside + 9:]), per_call  # then a probe


def test_standing_engine_is_per_options_and_forgotten_by_clear_caches(cache_dir: Path) -> None:
    from adaptive_eager import api

    with ae.adaptive_eager(backend="replay"):
        first = api._state.engine
    with ae.adaptive_eager(backend="replay"):
        assert api._state.engine is first  # kept between contexts with the same options
        with ae.adaptive_eager(backend="replay", check=True):  # nested: the outer engine
            assert api._state.engine is first
    with ae.adaptive_eager(backend="replay", check=True):
        other = api._state.engine
        assert other is not first
    assert not ae.is_enabled() and torch._C._len_torch_dispatch_stack() == 0
    ae.clear_caches()
    with ae.adaptive_eager(backend="replay", check=True):
        assert api._state.engine is not other
    x = torch.ones(3)
    with ae.adaptive_eager(backend="replay"):
        y = x * 2
    assert torch.equal(y, torch.full((3,), 2.0))


def test_run_log_of_many_contexts_is_written_at_exit(tmp_path: Path) -> None:
    """Contexts write the run log at most every few seconds (Note [cheap contexts]); the rest
    is written at process exit: the log counts every context's ops."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "loop.py"
    script.write_text(
        "import torch, adaptive_eager as ae\n"
        "x = torch.ones(4)\n"
        "for _ in range(300):\n"
        "    with ae.adaptive_eager(backend='replay'):\n"
        "        y = (x + 1) * 2\n")
    env = {**os.environ, "ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path / "c")}
    env.pop("ADAPTIVE_EAGER", None)
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
    logs = list((tmp_path / "c" / "runs").glob("*.jsonl"))
    assert len(logs) == 1, logs
    run = json.loads(logs[0].read_text().splitlines()[0])
    assert run["metrics"]["ops_intercepted"] == 600, run["metrics"]


def _solve(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, iters: int,
           residuals: list[float]) -> None:
    """benchmarks' item_loop: no module, no optimizer, a ``.item()`` and a branch each
    iteration (Note [sync points are safe points] in aside.py)."""
    for _ in range(iters):
        r = b - a @ x
        res = r.norm().item()
        residuals.append(res)
        x.add_(r, alpha=0.5 if res > 1.0 else 0.1)


def _system() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    m = torch.randn(16, 16)
    return torch.eye(16) + 0.05 * (m + m.T), torch.randn(16)


def test_a_sync_point_is_a_safe_point(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    calibrate()
    monkeypatch.setattr(policy, "RECORD_S", 1.0)  # recording "costs" a second per op
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)
    a, b = _system()
    want: list[float] = []
    x_want = torch.zeros(16)
    _solve(a, b, x_want, 80, want)
    got: list[float] = []
    x = torch.zeros(16)
    deferred = []
    with ae.adaptive_eager(hot_after=2, compile_async=False, cache_dir=cache_dir):
        for _ in range(80):
            _solve(a, b, x, 1, got)
            deferred.append(ae.metrics()["ops_deferred"])
    m = ae.metrics()
    assert m["step_asides"] == 1, m
    assert deferred[-1] == deferred[-30] > 0  # aside inside the one context, for good
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, x_want, rtol=1e-5, atol=1e-6)
    # the sync wrappers are off again (``tolist`` is a permanent reading hook: Note [reads of
    # pending writes])
    assert not any(n in torch.Tensor.__dict__ for n in ("item", "__bool__", "__float__"))


class _Counting(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_no_step_aside_under_a_users_mode(monkeypatch: pytest.MonkeyPatch,
                                          cache_dir: Path) -> None:
    """A pending step-aside waits while a user's dispatch mode sits above the engine's (leaving
    then would pop the user's mode), and happens at the first sync after it left."""
    calibrate()
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)
    a, b = _system()
    want: list[float] = []
    _solve(a, b, torch.zeros(16), 60, want)
    got: list[float] = []
    x = torch.zeros(16)
    user = _Counting()
    with ae.adaptive_eager(hot_after=2, compile_async=False, cache_dir=cache_dir):
        with user:  # hot, compiled, decided: the step-aside is asked for, and waits
            _solve(a, b, x, 40, got)
            assert ae.metrics()["step_asides"] == 0
            assert torch.utils._python_dispatch._get_current_dispatch_mode() is user
            assert "item" in torch.Tensor.__dict__  # pending: the sync methods are wrapped
        _solve(a, b, x, 20, got)
    assert ae.metrics()["step_asides"] == 1
    assert user.calls > 0
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _lstm_train(steps: int, options: dict | None) -> list[float]:
    """An LSTM language model's step: every hot trace holds mkldnn_rnn_layer, which the graph
    builder declines (Unfusable), so nothing can ever be fused."""
    torch.manual_seed(0)
    rnn = torch.nn.LSTM(8, 8, num_layers=1)
    head = torch.nn.Linear(8, 4)
    params = [*rnn.parameters(), *head.parameters()]
    x, y = torch.randn(5, 3, 8), torch.randint(0, 4, (15,))
    losses = []
    with ae.adaptive_eager(**options) if options is not None else contextlib.nullcontext():
        for _ in range(steps):
            out, _ = rnn(x)
            loss = torch.nn.functional.cross_entropy(head(out).reshape(15, 4), y)
            loss.backward()
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=-0.1)
                    p.grad = None
            losses.append(loss.item())
    return losses


def test_traces_that_cannot_fuse_count_as_decided(cache_dir: Path) -> None:
    """Note [failed means decided] in compiler.py: with every hot trace declined, the engine
    had no decision to weigh and replayed op by op for good (lstm_lm: 0.63x eager); now it
    steps aside, in the process that found out and in the next one (decision from disk)."""
    want = _lstm_train(40, None)
    opts = {"hot_after": 2, "compile_async": False, "cache_dir": cache_dir}
    got = _lstm_train(40, opts)
    assert ae.metrics()["step_asides"] == 1, ae.metrics()
    assert got == want  # op by op, then plain eager: bitwise
    ae.clear_caches()
    ae.reset_metrics()
    got = _lstm_train(40, opts)
    m = ae.metrics()
    assert m["step_asides"] == 1 and m["compiles"] == 0, m
    assert got == want


def _request_aside() -> Any:
    from adaptive_eager import api

    presence = api._state.presence
    presence.request_aside("asked for by the test")
    return presence


def test_pending_step_aside_keeps_reads_and_mode_stack_right(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a step-aside pending, ``tolist`` of a real tensor with a pending
    write must see the write (the read guard knows tolist by identity), and a sync inside an
    autograd node must not step aside there (autograd puts the mode stack back after it). The
    syncs are the only safe points here (tests/test_profile_point.py has the other)."""
    from adaptive_eager.aside import Presence

    monkeypatch.setattr(Presence, "_install_profile_point", lambda self: None)
    w = torch.zeros(3)
    with ae.adaptive_eager(backend="replay", cache_dir=cache_dir):
        _request_aside()
        w.add_(1)
        assert w.tolist() == [1.0, 1.0, 1.0]
    assert not torch._C._len_torch_dispatch_stack()
    p = torch.randn(4, 4, requires_grad=True)
    seen: list[float] = []
    with ae.adaptive_eager(backend="replay", cache_dir=cache_dir, hot_after=7):  # a new engine
        presence = _request_aside()
        assert presence.active and not presence.aside
        p.register_hook(lambda g: seen.append(g.sum().item()))
        (torch.randn(4, 4) @ p).sum().backward()
        assert not presence.aside  # not inside the node
        float(p.sum())  # a sync in plain Python: steps aside now
        assert presence.aside
    assert seen and not torch._C._len_torch_dispatch_stack()
    assert not any(n in torch.Tensor.__dict__ for n in ("item", "__bool__"))
    before = ae.metrics()["ops_intercepted"]
    torch.ones(3) * 2
    assert ae.metrics()["ops_intercepted"] == before


def test_sync_wrappers_go_with_a_thread_that_ends(cache_dir: Path) -> None:
    import gc
    import threading

    def worker() -> None:
        with ae.adaptive_eager(backend="replay", cache_dir=cache_dir):
            _request_aside()
            assert "item" in torch.Tensor.__dict__
            torch.ones(2).add(1)

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    gc.collect()
    assert not any(n in torch.Tensor.__dict__ for n in ("item", "__bool__"))


def test_a_small_decided_trace_does_not_speak_for_the_whole_program(
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path, graph_backend: object) -> None:
    """Note [coverage]: a 2-op trace that runs a dozen times a step is decided before the
    step's own trace has run twice; the estimate (here: recording "costs" a second an op, so
    it says step aside as soon as it is consulted) waits until decided traces are most of the
    ops, so the step's trace is compiled and decided first."""
    calibrate()
    monkeypatch.setattr(policy, "RECORD_S", 1.0)
    monkeypatch.setattr(policy, "MIN_DECISIONS", 1)
    x = torch.randn(64)
    counters = [torch.zeros(4) for _ in range(12)]

    def step() -> float:
        for c in counters:  # 12 flushes of one 2-op trace a step
            c.add_(1)
            c.sum().item()
        y = x
        for _ in range(20):  # the step's own trace: 60 ops
            y = torch.tanh(y * 0.9) + 0.1
        return y.sum().item()

    ref = [step() for _ in range(12)]
    for c in counters:
        c.zero_()
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, compile_async=False,
                           cache_dir=str(cache_dir), disk_cache=False, probe_every=2000):
        got = [step() for _ in range(12)]
    m = ae.metrics()
    assert m["compiles"] >= 2, m  # the step's trace was compiled before any step aside
    assert got == ref
