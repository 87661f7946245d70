"""The learning budget (Note [learning budget] in budget.py): the engine spends at most a share of
the run's time beyond plain eager's until its programs pay. Rounds are timed on a clock the test
advances (as in test_aside.py), so what is asserted is the account's arithmetic, never a timing
of this machine; the subprocess tests run the real defaults and compare with eager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import train_steps

import adaptive_eager as ae
from adaptive_eager import aside
from adaptive_eager.budget import BUDGET_GUESS, BUDGET_PLAIN_MIN, Account
from adaptive_eager.compile import policy
from adaptive_eager.config import ConfigError, resolve

LEARNING_BUDGET = True  # conftest: this module's engines keep the budget their options give

PLAIN_S = 0.001  # a round of plain eager on the test's clock
ENGINE_S = 0.004  # a round in the engine: eager's plus 3 ms of recording and replay


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(aside, "time", fake)  # aside reads only time.perf_counter
    return fake


def _engine_on() -> bool:
    return torch._C._len_torch_dispatch_stack() > 0


def _loop(steps: int, options: dict | None, each_step: Callable[[bool], None] | None = None
          ) -> tuple[list[float], list[bool]]:
    """A small training loop; ``each_step(in_engine)`` runs before each optimizer step (the
    round's end). Returns the losses and, per step, whether it ran in the engine."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x, y = torch.randn(5, 6), torch.randn(5, 1)
    sides: list[bool] = []

    def before_step() -> None:
        sides.append(_engine_on())
        if each_step is not None:
            each_step(sides[-1])

    losses = train_steps(model, opt, x, y, steps, options, before_step=before_step)
    return losses, sides


def test_the_account_keeps_the_engine_within_its_share(clock: Clock) -> None:
    """Budget 10%: the run starts in plain eager, comes in once the allowance covers a round's
    guessed cost, and at every round end what the engine spent beyond eager's stays within the
    allowance plus one round in the engine; its values are eager's bit for bit."""
    ref, _ = _loop(400, None)
    spent = {"engine_rounds": 0}
    excess: list[float] = []

    def each_step(on: bool) -> None:
        clock.now += ENGINE_S if on else PLAIN_S
        spent["engine_rounds"] += on
        extra = spent["engine_rounds"] * (ENGINE_S - PLAIN_S)
        excess.append(extra - 0.10 * clock.now)

    losses, sides = _loop(400, dict(backend="replay", budget=10), each_step)
    assert losses == ref  # op by op and plain eager alike: bitwise
    assert not any(sides[:3]), sides[:10]  # it starts aside
    first = sides.index(True)
    # the first round in the engine: once 10% of the time covers BUDGET_GUESS eager rounds
    assert first >= BUDGET_GUESS / 0.10 - 2, first
    assert 0 < sum(sides) < 400 * 0.10 / ((ENGINE_S - PLAIN_S) / PLAIN_S) + 2, sum(sides)
    assert max(excess) <= ENGINE_S - PLAIN_S + 1e-9, max(excess)
    m = ae.metrics()
    assert m["budget_asides"] >= 1 and m["budget_rounds"] > 300, m


def test_the_account_prices_rounds_against_eagers_lower_quartile() -> None:
    """Eager's round is known once BUDGET_PLAIN_MIN clean plain rounds ended (the slow first
    rounds of a program do not make it look cheap); a new kind of rounds measures it anew and
    keeps what was spent; a round in the engine is affordable once the allowance covers it."""
    acc = Account(0.05)
    now = 0.0
    acc.round_ended(now, "step", False)  # the first round end starts the account
    for d in (0.020, 0.030, 0.001, 0.001, 0.001):  # two slow warm-up rounds, then eager's
        now += d
        acc.round_ended(now, "step", False)
    assert acc.base == pytest.approx(0.001) and BUDGET_PLAIN_MIN == 5
    assert not acc.affords_a_round(now)  # 5% of 53 ms < BUDGET_GUESS ms
    assert acc.due == pytest.approx(acc.started + BUDGET_GUESS * 0.001 / 0.05)
    due = acc.due
    while not acc.affords_a_round(now):  # plain rounds until the allowance covers one
        now += 0.001
        acc.round_ended(now, "step", False)
    assert now == pytest.approx(due, abs=0.0011)
    now += 0.004  # a round in the engine: 3 ms beyond eager's
    acc.round_ended(now, "step", True)
    assert acc.spent() == pytest.approx(0.003)
    now += 0.002
    acc.round_ended(now, "forward", False)  # another kind: eager's round unknown again
    assert acc.base is None
    for _ in range(BUDGET_PLAIN_MIN + 1):
        now += 0.002
        acc.round_ended(now, "forward", False)
    assert acc.base == pytest.approx(0.002) and acc.spent() == pytest.approx(0.003)


def test_no_budget_records_from_the_first_op(clock: Clock) -> None:
    ref, _ = _loop(20, None)
    losses, sides = _loop(20, dict(backend="replay", budget=0),
                          lambda on: setattr(clock, "now", clock.now + PLAIN_S))
    assert losses == ref and all(sides), sides
    assert ae.metrics()["budget_rounds"] == 0


def test_a_compile_waits_until_the_allowance_covers_it(clock: Clock, cache_dir: Path,
                                                        graph_backend: object) -> None:
    """A hot trace is not sent to the compiler while the expected cost of a compile beside the
    program (COMPILE_GUESS_S of a core) is over the allowance: counted as held; once the run has
    lasted long enough the same trace compiles and runs fused, with eager's values."""
    ref, _ = _loop(160, None)
    jumped: list[int] = []

    def each_step(on: bool) -> None:
        clock.now += ENGINE_S if on else PLAIN_S
        if len(seen) >= 100 and not on and not jumped:
            # an hour of plain rounds: the allowance now covers a compile
            clock.now += 3600.0
            jumped.append(len(seen))
        seen.append(on)

    seen: list[bool] = []
    losses, _ = _loop(160, dict(backend=graph_backend.name, budget=50, hot_after=2,
                                compile_async=False, cache_dir=str(cache_dir),
                                disk_cache=False), each_step)
    m = {k: v for k, v in ae.metrics().items() if v}
    assert m.get("compiles_held", 0) >= 1, str(m)  # hot before the jump, held
    assert m.get("compiles", 0) >= 1 and m.get("compiled_runs", 0) >= 1, str(m)  # fused after
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-7)


def test_a_held_compile_is_saved_for_not_spent_on_rounds(
        clock: Clock, cache_dir: Path, graph_backend: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a hot trace's compile was held, rounds in the engine teach nothing more: the engine
    comes back only when the allowance covers a round and the compile, and then compiles. (Coming
    back for every round it could afford spent the allowance as fast as it grew: never sent.)"""
    monkeypatch.setattr(policy, "_cores", 2)  # a compile is expected to cost 10 s / 2 cores
    ref, _ = _loop(1500, None)

    def each_step(on: bool) -> None:
        clock.now += 0.4 if on else 0.1  # rounds of 100 ms; 300 ms more in the engine

    losses, sides = _loop(1500, dict(backend=graph_backend.name, budget=5, hot_after=2,
                                     compile_async=False, cache_dir=str(cache_dir),
                                     disk_cache=False), each_step)
    m = {k: v for k, v in ae.metrics().items() if v}
    assert m.get("compiles_held", 0) >= 1 and m.get("compiles", 0) >= 1, str(m)
    assert m.get("compiled_runs", 0) >= 1, str(m)
    # 5% of the time pays for the rounds in the engine and the held compile's 5 s: the engine
    # came in for a few rounds before the compile, not for one in every 20
    first_fused = next(i for i in range(1, len(sides)) if sides[i] and sides[i - 1]
                       and i > 1000) if any(sides[1000:]) else len(sides)
    assert sum(sides[:first_fused]) < 12, sum(sides[:first_fused])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-7)


def test_the_hold_is_this_threads_own() -> None:
    policy.hold_compiles(True)
    other: list[bool] = []
    t = threading.Thread(target=lambda: other.append(policy.compiles_held()))
    t.start()
    t.join(timeout=30)
    assert policy.compiles_held() and other == [False]
    policy.hold_compiles(False)


def test_bad_budget_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="ADAPTIVE_EAGER_BUDGET"):
        resolve(environ={"ADAPTIVE_EAGER_BUDGET": "101"})
    with pytest.raises(ConfigError, match="budget"):
        resolve({"budget": -1}, environ={})
    assert resolve(environ={}).budget == 5


SCRIPT = textwrap.dedent("""
    import json, sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    losses = []
    for _ in range(int(sys.argv[1])):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {"losses": losses}
    if "adaptive_eager" in sys.modules:
        import adaptive_eager as ae
        ae.sync()
        out["metrics"] = {k: v for k, v in ae.metrics().items() if isinstance(v, (int, float))}
    print(json.dumps(out))
""")


def _script(tmp_path: Path, steps: int, engine: bool, **env: str) -> dict:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    e = dict(os.environ)
    e.pop("ADAPTIVE_EAGER_BUDGET", None)  # the product's default
    e.pop("ADAPTIVE_EAGER", None)
    if engine:
        e["ADAPTIVE_EAGER"] = "1"
    e.update(env)
    out = subprocess.run([sys.executable, str(path), str(steps)], env=e, capture_output=True,
                         text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_default_run_of_an_unmodified_script_starts_plain_and_equals_eager(
        tmp_path: Path) -> None:
    """``ADAPTIVE_EAGER=1`` with default options: a short run starts in plain eager and sends no
    compile it could not pay for; every loss is eager's."""
    eager = _script(tmp_path, 300, False)
    run = _script(tmp_path, 300, True)
    m = run["metrics"]
    assert run["losses"] == eager["losses"]
    assert m["budget_rounds"] > 0, m
    assert m["flushes"] < 300, m  # not every step in the engine
    assert m["compiles"] == 0 and m["service_compiles"] == 0 and m["compiles_pending"] == 0, m


@pytest.mark.slow  # two processes, one of them an Inductor compile
def test_a_script_with_stored_programs_starts_in_the_engine(tmp_path: Path) -> None:
    """Note [learning budget]: where an earlier run of the script stored programs, loading them
    costs little, so the next run starts in the engine without an account and runs fused."""
    first = _script(tmp_path, 12, True, ADAPTIVE_EAGER_BUDGET="0",
                    ADAPTIVE_EAGER_COMPILE_ASYNC="0")  # compiles and stores at its hot run
    assert first["metrics"]["compiles"] + first["metrics"]["service_compiles"] >= 1, first
    again = _script(tmp_path, 12, True)
    m = again["metrics"]
    assert m["budget_rounds"] == 0 and m["disk_hits"] >= 1 and m["compiled_runs"] >= 1, m
    torch.testing.assert_close(torch.tensor(again["losses"]), torch.tensor(first["losses"]),
                               rtol=1e-4, atol=1e-6)
