"""Differential fuzzing: random eager programs must give the same results under adaptive_eager.

The programs (tests/fuzz_programs.py) mix OpInfo ops on their sample inputs, views, in-place
writes through aliases, numpy round trips, RNG draws, ``.item()`` branches and errors, and run
their body several rounds so traces repeat, hit and fuse. Each runs plainly and under the engine:
replay must equal eager bitwise (values, dtype, shape, strides, exceptions at the same statement);
fused programs are held to ``fuzz_programs.FUSED_TOL``.

Default suite: a bounded, derandomized run (the same programs every time). The long runs are
marked slow; their sizes come from the environment:

    FUZZ_REPLAY_EXAMPLES=10000 FUZZ_FUSED_EXAMPLES=300 pytest -m slow tests/test_fuzz.py

A failure prints the program as a standalone script (``python it.py`` prints OK or DIFF), ready to
become a regression test. ``python tests/fuzz_programs.py --mode replay --n 1000`` sweeps seeded
programs and logs every mismatch instead of stopping at the first.

Statement kinds that still meet known engine gaps are left out (``fuzz_programs.KNOWN``); each
has its minimal program as a strict xfail in tests/test_fuzz_regressions.py. Remove a kind from
``KNOWN`` when its regression test passes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import torch  # noqa: E402

import fuzz_programs as fp  # noqa: E402  (tests/ is on sys.path)

KNOWN = fp.KNOWN  # known gaps left out of the programs (see the module doc)

BOUNDED_REPLAY = 30
BOUNDED_FUSED = 3


class HypothesisChooser(fp.Chooser):
    """The generator's choices drawn from Hypothesis (so it can shrink a failing program)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, seq: Any) -> Any:
        return seq[self.data.draw(st.integers(0, len(seq) - 1))]


def _settings(n: int, shrink: bool = True) -> settings:
    phases = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if shrink else ())
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    phases=phases, print_blob=False,
                    suppress_health_check=list(HealthCheck))


def _check(data: Any, mode: str, small: bool, opinfo_ops: bool) -> None:
    p = fp.generate(HypothesisChooser(data), mode, KNOWN, opinfo_ops,
                    max_statements=6 if small else 10, small=small)
    diffs = fp.check(p, mode)
    assert not diffs, fp.report(p, mode, diffs)


@_settings(BOUNDED_REPLAY)
@given(st.data())
def test_fuzz_replay(data: Any) -> None:
    _check(data, "replay", small=False, opinfo_ops=True)


@_settings(BOUNDED_FUSED, shrink=False)
@given(st.data())
def test_fuzz_fused(data: Any) -> None:
    _check(data, "fused", small=True, opinfo_ops=False)


@pytest.mark.slow
@_settings(int(os.environ.get("FUZZ_REPLAY_EXAMPLES", "10000")))
@given(st.data())
def test_fuzz_replay_long(data: Any) -> None:
    _check(data, "replay", small=False, opinfo_ops=True)


@pytest.mark.slow
@_settings(int(os.environ.get("FUZZ_FUSED_EXAMPLES", "300")), shrink=False)
@given(st.data())
def test_fuzz_fused_long(data: Any) -> None:
    _check(data, "fused", small=os.environ.get("FUZZ_FUSED_FULL", "0") != "1",
           opinfo_ops=True)


# -- the harness itself -----------------------------------------------------------------------

def test_generation_is_reproducible() -> None:
    """A seed names one program: the same source every time (and a different one per seed)."""
    a = [fp.generate(fp.Chooser(s)).source() for s in range(6)]
    b = [fp.generate(fp.Chooser(s)).source() for s in range(6)]
    assert a == b
    assert len(set(a)) == 6


def test_compare_sees_every_kind_of_difference() -> None:
    """The comparison flags a value, a stride, a dtype and an exception site, and holds fused
    results to a tolerance only."""
    t = torch.arange(6.0).view(2, 3)
    eager = fp.Outcome({"t1": fp._snapshot(t)}, None)
    assert fp.compare(eager, fp.Outcome({"t1": fp._snapshot(t.clone())}, None), False) == []
    off = fp.Outcome({"t1": fp._snapshot(t + 1e-7)}, None)
    assert fp.compare(eager, off, fused=False) and not fp.compare(eager, off, fused=True)
    strided = fp.Outcome({"t1": fp._snapshot(t.t().contiguous().t())}, None)
    assert "stride" in fp.compare(eager, strided, fused=False)[0]
    assert "dtype" in fp.compare(eager, fp.Outcome({"t1": fp._snapshot(t.double())}, None),
                                 False)[0]
    raised = fp.Outcome({}, ("RuntimeError", 0, 2, "x"))
    later = fp.Outcome({}, ("RuntimeError", 0, "exit", "x"))
    assert fp.compare(raised, later, False) and not fp.compare(raised, raised, False)


def test_printed_program_runs_standalone() -> None:
    """What a failure prints is a script that reruns the comparison (run here as a module)."""
    p = fp.generate(fp.Chooser(3), opinfo_ops=False)
    ns: dict[str, Any] = {"__name__": "fuzz_printed"}
    exec(compile(p.source("replay"), "<printed>", "exec"), ns)
    assert fp.check_callable(ns["run"], "replay") == "OK"
