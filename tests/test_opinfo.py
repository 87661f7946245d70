"""OpInfo fidelity: ops under adaptive_eager must match plain eager bitwise (see tests/fidelity.py).

The default suite checks a fixed subset of representative ops (``fidelity.QUICK_OPS``); the full
sweep over every OpInfo op is marked slow (``pytest -m slow tests/test_opinfo.py``). Both run the
ops in worker subprocesses, so a crash or a hang in one op is reported as that op's failure.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("expecttest")
pytest.importorskip("hypothesis")

import fidelity  # tests/ is on sys.path, as for helpers.py

JOBS = max(1, min(2, os.cpu_count() or 1))

def _failure_text(results: list[fidelity.OpResult]) -> str:
    lines = []
    for r in results:
        if r.status == "fail":
            lines.append(f"{r.name}:")
            lines += [f"    {d[:600]}" for d in r.details]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def quick_results() -> dict[str, fidelity.OpResult]:
    results = fidelity.run_ops(list(fidelity.QUICK_OPS), jobs=JOBS)
    return {r.name: r for r in results}


@pytest.mark.parametrize("name", fidelity.QUICK_OPS)
def test_opinfo_quick(name: str, quick_results: dict[str, fidelity.OpResult]) -> None:
    res = quick_results[name]
    assert res.status != "skipped", f"{name} skipped: {res.skip_reason}"
    assert res.status != "fail", _failure_text([res])
    assert res.samples > 0, f"{name}: no samples ran"


def test_quick_subset_exercises_deferral(quick_results: dict[str, fidelity.OpResult]) -> None:
    """The checked runs must really defer, not silently run everything eagerly."""
    t = fidelity.totals(quick_results.values())
    assert t["samples_deferred"] > 0.8 * t["samples"], t


@pytest.mark.xfail(strict=False, reason=(
    "a few chains (3 of the quick ops: sum, amax, linalg.vector_norm backward) meet a pending "
    "input whose metadata differs from the real one of the warm-up (a storage offset, which "
    "pending tensors are keyed by), so their first checked run learns once more"))
def test_second_run_is_fully_deferred(quick_results: dict[str, fidelity.OpResult]) -> None:
    """Documented behaviour: only the first sight of (op, input metadata) runs eagerly."""
    leftover = {n: r.meta_misses_checked for n, r in quick_results.items() if r.meta_misses_checked}
    assert not leftover, f"first-sight metadata misses in checked runs: {leftover}"


@pytest.mark.slow
def test_opinfo_full_sweep() -> None:
    names = [fidelity.op_name(o) for o in fidelity.op_db()]
    results = fidelity.run_ops(names, jobs=JOBS)
    t = fidelity.totals(results)
    failing = [r for r in results if r.status == "fail"]
    assert not failing, f"totals {t}\n" + _failure_text(failing)
