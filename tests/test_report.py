"""The report's wording: counts that add up, faults shown, compiles cut off by the run's end."""

from __future__ import annotations

from pathlib import Path

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


def _rank_run(run_id: str, rank: int, job: str, start: float, end: float, kind: str = "store",
              remote: dict | None = None, **dist: int) -> list[dict]:
    head = {"type": "run", "run_id": run_id, "start": start, "end": end, "argv": ["train.py"],
            "metrics": {"compiles": 2 - rank, "disk_hits": rank, "compiled_runs": 9},
            "dist": {"rank": rank, "world": 2, "job": job, "job_kind": kind, "host": "h1",
                     **dist}}
    if remote is not None:
        head["remote"] = remote
    return [head]


def test_job_groups_ranks_with_compiles_peer_waits_and_remote_hits() -> None:
    """Runs of one job (the id the ranks agreed on) are one block, a row per rank; the remote
    store's hits, misses and refused entries and the waits for peers' programs are shown."""
    from adaptive_eager.report import format_job, group_jobs

    runs = [summarize_run(_rank_run("r-b", 1, "job-1", 0.5, 9.0, peer_waits=1, peer_wait_ms=2500,
                                    agreed=4, remote={"hits": 1, "misses": 2, "refused": 1})),
            summarize_run(_rank_run("r-a", 0, "job-1", 0.0, 9.0, compiled_for_peers=1,
                                    agreed=4, overruled=1, remote={"published": 1})),
            summarize_run(_rank_run("r-c", 0, "job-2", 20.0, 30.0, diverged=1))]
    jobs = group_jobs(runs)
    assert [j["job"] for j in jobs] == ["job-1", "job-2"]
    one = jobs[0]
    assert [k["rank"] for k in one["ranks"]] == [0, 1] and one["missing_ranks"] == []
    assert one["compiles"] == 3 and one["remote_hits"] == 1
    assert one["ranks"][1]["peer_wait_s"] == 2.5 and one["ranks"][1]["remote_refused"] == 1
    text = "\n".join(format_job(one))
    assert "job job-1: 2 run(s) of 2 ranks on 1 host(s), 3 compiles, 1 remote hits" in text
    assert "1/2/1" in text.splitlines()[3] and "2.5" in text.splitlines()[3]
    assert jobs[1]["missing_ranks"] == [1]
    assert "no run log from rank(s) 1" in "\n".join(format_job(jobs[1]))
    lines = "\n".join(_format_run(runs[0]))
    assert "rank 1 of 2 in job job-1 on h1: 4 decisions agreed (0 overruled), waited for peers' " \
           "programs 1x (2.5 s)" in lines
    assert "remote store: 1 hits, 2 misses, 1 refused (failed verification)" in lines
    assert "DIVERGED 1x" in "\n".join(_format_run(runs[2]))


def test_jobs_known_by_address_split_where_their_times_do_not_overlap() -> None:
    """Two jobs on the same MASTER_ADDR:PORT one after the other are two jobs, not one."""
    from adaptive_eager.report import group_jobs

    runs = [summarize_run(_rank_run(i, r, "127.0.0.1:29500", s, e, kind="address"))
            for i, r, s, e in (("a0", 0, 0.0, 10.0), ("a1", 1, 0.2, 10.1),
                               ("b0", 0, 50.0, 60.0), ("b1", 1, 50.3, 60.2))]
    jobs = group_jobs(runs)
    assert [[k["run_id"] for k in j["ranks"]] for j in jobs] == [["a0", "a1"], ["b0", "b1"]]
    assert jobs[0]["job"] != jobs[1]["job"]


def test_payback_ledger_of_a_real_run(cache_dir: Path) -> None:
    """A compiled chain's row: its compile time, what each fused run saved against op by op
    (both measured in the run), and the fused runs needed to win the compile back."""
    import math

    import torch

    import adaptive_eager as ae
    from adaptive_eager.report import build_report, format_report

    x = torch.randn(1 << 16)
    with ae.adaptive_eager(hot_after=2, compile_async=False, step_aside=False,
                           cache_dir=str(cache_dir)):
        for _ in range(30):
            y = x
            for _ in range(8):
                y = torch.tanh(y * 0.9) + 0.1
            y.sum().item()
    run = build_report(cache_dir, last=True)["runs"][0]
    rows = {t["trace"]: t for t in run["traces"]}
    assert run["ledger"], run["traces"]
    for row in run["ledger"]:
        t = rows[row["trace"]]
        assert row["compile_s"] == round(t["compile_s"], 3) > 0
        if t["replay_ms"] is None or t["fused_ms"] is None:
            assert row["break_even_runs"] is None and row["saved_s"] == 0
            continue
        per_run = t["replay_ms"] - t["fused_ms"]
        assert row["saved_ms_per_run"] == round(per_run, 3)
        assert row["fused_runs"] == t["fused_runs"]
        assert row["saved_s"] == round(per_run * t["fused_runs"] / 1000, 3)
        want = math.ceil(t["compile_s"] * 1000 / per_run) if per_run > 0 else None
        assert row["break_even_runs"] == want
        assert row["paid_back"] == (want is not None and t["fused_runs"] >= want)
    assert "payback ledger" in format_report(build_report(cache_dir, last=True))
