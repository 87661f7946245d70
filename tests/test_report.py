"""The report's wording: counts that add up, faults shown, compiles cut off by the run's end."""

from __future__ import annotations

from adaptive_eager.report import _format_run, summarize_run


def _run(metrics: dict, misses: list[dict], traces: list[dict] | None = None) -> list[dict]:
    head = {"type": "run", "run_id": "r1", "start": 0.0, "end": 2.0, "argv": ["train.py"],
            "metrics": metrics}
    return [head, *({"type": "trace", **t} for t in traces or []),
            *({"type": "miss", **m} for m in misses)]


def test_departures_add_up_and_are_not_called_misses() -> None:
    rec = _run({"trace_hits": 79, "trace_misses": 1},
               [{"cause": "new", "count": 3, "op": "aten.mm.default"},
                {"cause": "shape", "count": 2, "op": "aten.addmm.default", "arg": 1, "dim": 0,
                 "old": 64, "new": 32, "values": [64, 32], "where": "train.py:21"}])
    text = "\n".join(_format_run(summarize_run(rec)))
    assert "(79 hits, 1 misses)" in text
    assert "left a known trace 5x: 3x at an op or shape seen for the first time, 2x where" in text
    assert "of them first sight" not in text


def test_faults_and_compiles_cut_off_by_the_end_of_the_run_are_shown() -> None:
    rec = _run({"trace_hits": 4, "trace_misses": 1, "fused_errors": 2, "compiles_pending": 1},
               [], [{"trace": "abc", "runs": 5, "hits": 4, "n_ops": 9, "state": "compiling"}])
    summary = summarize_run(rec)
    text = "\n".join(_format_run(summary))
    assert "2 fused errors" in text
    assert "1 still compiling when the run ended" in text
    assert summary["traces"][0]["state"] == "compiling when the run ended"
    clean = "\n".join(_format_run(summarize_run(_run({"trace_hits": 1}, []))))
    assert "faults" not in clean and "left a known trace never" in clean


def test_a_loaded_program_s_decision_reads_as_words() -> None:
    from adaptive_eager.report import decision_text

    # compiler._from_disk appends " (loaded)" to the stored decision, which may be empty
    assert decision_text(" (loaded)") == "program loaded from the disk cache, not measured yet"
    assert decision_text("fused: 1.000 ms vs op-by-op 2.000 ms (loaded)") == (
        "fused: 1.000 ms vs op-by-op 2.000 ms (program loaded from the disk cache)")
    assert decision_text("") == "" and decision_text(None) == ""
    rec = _run({"trace_hits": 3}, [], [{"trace": "abc", "runs": 4, "hits": 3, "n_ops": 9,
                                        "state": "measuring", "decision": " (loaded)",
                                        "replay_ms": 2.0, "fused_ms": 1.0, "fused_runs": 3}])
    text = "\n".join(_format_run(summarize_run(rec)))
    assert "not measured yet" in text and " (loaded)" not in text


def test_time_to_fused_and_compiles_that_went_on_in_the_service_are_shown() -> None:
    rec = _run({"trace_hits": 4, "trace_misses": 1, "compiles": 1, "compile_seconds": 8.5,
                "compile_queued_seconds": 12.25, "compile_load_seconds": 0.5,
                "compile_wait_seconds": 21.5, "service_compiles": 1, "compiles_pending": 1,
                "service_pending": 1, "program_waits": {"abc123": 21.5}}, [])
    text = "\n".join(_format_run(summarize_run(rec)))
    assert ("time to fused: queued 12.25 s, compiling 8.5 s, loading 0.5 s, waited 21.5 s"
            in text), text
    assert "compile service: 1 compiled for this run" in text
    assert "waited for its program: abc123 21.50 s" in text
    assert "1 compile(s) went on in the compile service after the run" in text
    assert "still compiling when the run ended" not in text  # not lost: it lands on disk
