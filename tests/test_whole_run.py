"""benchmarks/whole_run: the driver's quick path on the tiny program, every mode in its own fresh
process; the report has a row per mode with the run's figures and its check against eager."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import whole_run as W
from benchmarks.graph_breaks import PROGRAMS

COMPILE_SERVICE = True  # engine runs compile (if at all) through the service, as users' do


def test_quick_run_reports_every_mode(tmp_path: Path) -> None:
    # eager backend for torch.compile: the driver is under test, not Inductor's compile time
    code = W.main(["--quick", "--programs", "tiny", "--steps", "3", "--threads", "1",
                   "--compile-backend", "eager", "--timeout", "120", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "whole_run.json").read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert sorted(rows) == sorted(W.MODES) and len(data["rows"]) == len(W.MODES)
    for mode, row in rows.items():
        assert row["status"] == "ok", (mode, row.get("error"), row.get("stderr_tail"))
        assert row["steps"] == 3 and len(row["times_s"]) == len(row["losses"]) == 3
        assert row["whole_s"] >= sum(row["times_s"]) and row["first_step_s"] == row["times_s"][0]
        assert row["load_before"] >= 0 and row["load_after"] >= 0
    for mode in ("engine", "engine_warm"):  # the engine was on, and counted the steps' flushes
        assert rows[mode]["counters"]["flushes"] >= 3 and "service_tail_s" in rows[mode]
        assert rows[mode]["vs_eager"] in ("=", "ok")
    assert rows["torch_compile"]["counters"]["unique_graphs"] >= 1
    assert "counters" not in rows["eager"]
    assert set(data["whole"]["programs"]["tiny"]["ratios"]) == {
        f"{a}/{b}" for a, b in W.RATIOS}
    md = (tmp_path / "whole_run.md").read_text()
    assert md.count("| tiny |") == 2 + len(W.MODES)  # two summary tables, one row per run


def test_plan_runs_cold_before_warm_and_rotates() -> None:
    runs = W.plan(["a", "b"], list(W.MODES), repeats=2)
    assert len(runs) == 2 * 2 * len(W.MODES)
    for repeat in range(2):
        for program in "ab":
            order = [m for r, p, m, _ in runs if (r, p) == (repeat, program)]
            assert order.index("engine") < order.index("engine_warm")
            assert order.index("torch_compile") < order.index("torch_compile_warm")
    first = [m for r, p, m, _ in runs if (r, p) == (0, "a")]
    second = [m for r, p, m, _ in runs if (r, p) == (1, "b")]
    assert first != second and sorted(first) == sorted(second)
    assert [p for r, p, m, _ in runs if m == "eager"] == ["a", "b", "b", "a"]


def test_a_warm_mode_alone_gets_its_cold_run_as_a_primer() -> None:
    runs = W.plan(["a"], ["engine_warm"], repeats=1)
    assert [(m, reported) for _, _, m, reported in runs] == [("engine", False),
                                                            ("engine_warm", True)]


def test_results_unlike_eager_are_reported_not_raised() -> None:
    base = {"repeat": 0, "program": "tiny", "status": "ok", "state_checksum": 1.0,
            "whole_s": 1.0, "steady_s": 0.1}

    def run(mode: str, *losses: float) -> dict:
        return {**base, "mode": mode, "losses": list(losses), "final_loss": losses[-1]}

    rows = [run("eager", 1.0, 1.0, 1.0, 1.0), run("engine", 1.5, 1.0, 1.0, 1.5),
            run("torch_compile", 1.0, 1.0, 1.0, 1.0 + 1e-6),
            run("engine_warm", 1.0, 1.0, 1.0 + 1e-6, 1.2),
            {"repeat": 0, "program": "tiny", "mode": "torch_compile_warm", "status": "error",
             "error": "RuntimeError: boom"}]
    W.check_results(rows, {"tiny": PROGRAMS["tiny"].rtol})
    assert rows[1]["vs_eager"] == "DIFFERS" and rows[2]["vs_eager"] == "ok"
    assert rows[3]["vs_eager"] == "drift" and rows[3]["beyond_rtol_at"] == 4
    assert "vs_eager" not in rows[4]
    md = W.markdown({"steps": 4, "command": "c", "started": "d", "machine": {"git_commit": "x"},
                     "machine_line": "m", "compile_backend": "inductor", "threads": 1,
                     "threads_why": "t", "load_before": (1, 1, 1), "load_after": (1, 1, 1),
                     "wall_s": 1}, rows, ["tiny"])
    assert "DIFFERS (3.3e-01, from step 1)" in md and "drift (1.7e-01, from step 4)" in md
    assert "RuntimeError: boom" in md


def test_bad_program_name_is_one_clear_error(capsys) -> None:
    assert W.main(["--programs", "nope"]) == 2
    assert "unknown program(s) nope; known:" in capsys.readouterr().err
