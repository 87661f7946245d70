"""While the engine waits aside for its compile, its thread runs one intra-op thread fewer than
the cores, inside its context only (Note [compile cores] in cores.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import compiler, trial
from adaptive_eager.compile import programs
from adaptive_eager.cores import CoreLoan, usable_cores

CORES = usable_cores()
needs_two = pytest.mark.skipif(CORES < 2, reason="a core can be lent only with two or more")


@pytest.fixture
def threads_per_core() -> int:
    """The program's pool with a thread on every usable core, as torch's default; restored."""
    old = torch.get_num_threads()
    torch.set_num_threads(CORES)
    yield CORES
    torch.set_num_threads(old)


@needs_two
def test_a_loan_lends_one_core_and_gives_it_back(threads_per_core: int) -> None:
    loan = CoreLoan()
    loan.lend()
    assert torch.get_num_threads() == threads_per_core - 1
    loan.lend()  # once
    assert torch.get_num_threads() == threads_per_core - 1
    loan.give_back()
    assert torch.get_num_threads() == threads_per_core
    loan.give_back()
    assert torch.get_num_threads() == threads_per_core


@needs_two
def test_a_count_the_program_set_meanwhile_stays(threads_per_core: int) -> None:
    loan = CoreLoan()
    loan.lend()
    torch.set_num_threads(1 if threads_per_core > 2 else 3)
    mine = torch.get_num_threads()
    loan.give_back()
    assert torch.get_num_threads() == mine


def test_no_loan_when_a_core_is_free_already() -> None:
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(max(CORES - 1, 1))
        loan = CoreLoan()
        loan.lend()
        assert torch.get_num_threads() == max(CORES - 1, 1) and loan.saved is None
    finally:
        torch.set_num_threads(old)


def _step(w: torch.Tensor, x: torch.Tensor) -> float:
    y = (x @ w).tanh() * 0.5 + 0.1
    return float(y.sum())


@needs_two
@pytest.mark.parametrize("lend", [True, False])
def test_waiting_aside_lends_a_core_inside_the_context_only(
        monkeypatch: pytest.MonkeyPatch, cache_dir: Path, threads_per_core: int,
        lend: bool) -> None:

    real_store = programs.Programs.store

    def slow_store(self: programs.Programs, *args: object, **kwargs: object) -> object:
        time.sleep(1.5)  # in the worker: the compile stays in flight for a while
        return real_store(self, *args, **kwargs)

    monkeypatch.setattr(programs.Programs, "store", slow_store)
    monkeypatch.setattr(compiler.CompileManager, "step_aside_reason", lambda self: None)
    monkeypatch.setattr(trial, "TRIAL_TICKS", 10_000)  # no trial in this test
    w, x = torch.randn(32, 32), torch.randn(8, 32)
    ref = _step(w, x)
    inside: list[tuple[int, int]] = []  # (compile_waits, threads) per step, in the context
    outside: list[int] = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and (len(inside) < 60 or ae.metrics()["compiled_runs"] < 3):
        with ae.adaptive_eager(hot_after=2, cache_dir=cache_dir, lend_core=lend):
            got = _step(w, x)
            inside.append((ae.metrics()["compile_waits"], torch.get_num_threads()))
        outside.append(torch.get_num_threads())
        assert got == pytest.approx(ref, rel=1e-5)
    m = ae.metrics()
    assert m["compile_waits"] >= 1 and m["compiled_runs"] >= 3, m
    if lend:
        assert m["cores_lent"] >= 1 and threads_per_core - 1 in {t for _, t in inside}
    else:  # the program's own count throughout
        assert m["cores_lent"] == 0 and {t for _, t in inside} == {threads_per_core}
    assert inside[-1][1] == threads_per_core  # given back once the program was ready
    assert set(outside) == {threads_per_core}  # never outside the context
