"""``adaptive-eager report`` and ``explain``: what the cache did in each run, and why it missed."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from adaptive_eager.events import read_runs
from adaptive_eager.explain import advice

_FIRST_SIGHT = ("new", "extended")


def _pct(num: float, den: float) -> float:
    return round(100.0 * num / den, 1) if den else 0.0


def summarize_run(records: list[dict]) -> dict:
    """One run's figures, from its run-log records."""
    head = records[0]
    m = head.get("metrics", {})
    traces = [r for r in records if r.get("type") == "trace"]
    misses = [r for r in records if r.get("type") == "miss"]
    hits, missed = m.get("trace_hits", 0), m.get("trace_misses", 0)
    saved = []
    for t in traces:
        if op_by_op_ms(t) is not None and t.get("fused_ms") is not None:
            per_run = op_by_op_ms(t) - t["fused_ms"]
            saved.append({**_trace_row(t), "saved_ms": round(per_run * t.get("fused_runs", 0), 3)})
    saved.sort(key=lambda r: r["saved_ms"], reverse=True)
    ledger = [row for row in (_ledger_row(t) for t in traces) if row is not None]
    ledger.sort(key=lambda r: r["compile_s"], reverse=True)
    causes = [_miss_row(r) for r in misses if r.get("cause") not in _FIRST_SIGHT]
    causes.sort(key=lambda r: r["count"], reverse=True)
    return {
        "run_id": head.get("run_id"), "argv": head.get("argv"),
        "seconds": round(head.get("end", 0) - head.get("start", 0), 3),
        "trace_hit_rate": _pct(hits, hits + missed), "trace_hits": hits, "trace_misses": missed,
        "ops_deferred": m.get("ops_deferred", 0), "ops_fused": m.get("ops_fused", 0),
        "fused_share": _pct(m.get("ops_fused", 0), m.get("ops_deferred", 0)),
        "ops_eager": m.get("ops_eager", 0), "compiles": m.get("compiles", 0),
        "compile_seconds": round(m.get("compile_seconds", 0.0), 3),
        "disk_hits": m.get("disk_hits", 0), "disk_errors": m.get("disk_errors", 0),
        "fused_errors": m.get("fused_errors", 0), "compile_errors": m.get("compile_errors", 0),
        "compiles_pending": m.get("compiles_pending", 0),
        "service_pending": m.get("service_pending", 0),
        "service_compiles": m.get("service_compiles", 0),
        "service_shared": m.get("service_shared", 0),
        "service_errors": m.get("service_errors", 0),
        "prefetched": m.get("prefetched", 0),
        "queued_seconds": round(m.get("compile_queued_seconds", 0.0), 3),
        "load_seconds": round(m.get("compile_load_seconds", 0.0), 3),
        "wait_seconds": round(m.get("compile_wait_seconds", 0.0), 3),
        "program_waits": dict(sorted((m.get("program_waits") or {}).items(),
                                     key=lambda kv: -kv[1])[:10]),
        "changed_misses": sum(r.get("count", 0) for r in misses
                              if r.get("cause") not in _FIRST_SIGHT),
        "accel_missing": m.get("accel_missing", ""),
        "fallbacks": m.get("fallbacks", 0), "step_asides": m.get("step_asides", 0),
        "compile_waits": m.get("compile_waits", 0),
        "budget_rounds": m.get("budget_rounds", 0), "budget_asides": m.get("budget_asides", 0),
        "compiles_held": m.get("compiles_held", 0),
        "top_traces": saved[:10],
        "ledger": ledger[:20],
        "traces": [_trace_row(t) for t in traces[:50]],
        "flush_reasons": dict(Counter(m.get("flush_reasons", {})).most_common(12)),
        "flush_causes": flush_causes(m.get("flush_sites") or {}, traces),
        "fallback_ops": dict(Counter(m.get("fallback_ops", {})).most_common(12)),
        "first_sight_misses": sum(r.get("count", 0) for r in misses
                                  if r.get("cause") in _FIRST_SIGHT),
        "miss_causes": causes[:30],
        # Note [job id] in distributed.py: a rank's job, and the remote store's counters
        "start": head.get("start"), "end": head.get("end"),
        "compiled_runs": m.get("compiled_runs", 0),
        "dist": head.get("dist"), "remote": head.get("remote"),
        # Note [symbolic dims]: which dims were made symbolic, where, traces served
        "sym": {k: m.get(k, 0) for k in ("sym_learned", "sym_loaded", "sym_hits", "sym_ops",
                                         "sym_left", "sym_mispredicted", "sym_programs",
                                         "sym_checked", "sym_sizes_loaded", "sym_trusted",
                                         "sym_guard_refused", "sym_specialized",
                                         "sym_unfusable", "sym_guards_unknown")},
        "sym_dims": dict(sorted((m.get("sym_dims") or {}).items(), key=lambda kv: -kv[1])[:8]),
        "flushes": m.get("flushes", 0), "replayed_runs": m.get("replayed_runs", 0),
        "timeline": head.get("timeline"),  # Note [run timeline] in events.py (report --html)
    }


_LOADED = "(loaded)"


def decision_text(decision: str | None) -> str:
    """The decision as a reader should see it. The compiler marks a program taken from the disk
    cache by appending " (loaded)" to the stored decision, which may be empty (an earlier run
    compiled it but never measured it): that is shown as words, not as a bare " (loaded)"."""
    text = (decision or "").strip()
    if text.endswith(_LOADED):
        base = text[:-len(_LOADED)].strip().rstrip(";,").strip()
        return (f"{base} (program loaded from the disk cache)" if base
                else "program loaded from the disk cache, not measured yet")
    return text


def _trace_row(t: dict) -> dict:
    row = {k: t.get(k) for k in ("trace", "runs", "hits", "n_ops", "state", "decision",
                                 "replay_ms", "fused_ms", "compile_s", "fused_runs")}
    row["replay_ms"] = op_by_op_ms(t)  # what the saving is weighed against
    row["decision"] = decision_text(row["decision"])
    if row["state"] == "compiling":  # the log is written at exit: that compile never finished
        row["state"] = "compiling when the run ended"
    return row


def op_by_op_ms(t: dict) -> float | None:
    """A trace's op-by-op time to weigh its fused runs against: the runs paired with fused
    ones (Note [paired timing]) where there are any; the median of all op-by-op runs is mostly
    the trace's first runs, cold and slower (it counted a 31 ms trace as 99 ms)."""
    paired = t.get("paired_ms")
    return paired if paired is not None else t.get("replay_ms")


def _ledger_row(t: dict) -> dict | None:
    """What a compiled trace cost and what it gave back in this run (the payback ledger).

    ``saved_ms_per_run``: its op-by-op time less its fused time, both measured in this process;
    ``break_even_runs``: fused runs needed to win back the compile (None: it never does, the
    program is not faster); ``saved_s``: what its fused runs saved so far."""
    compile_s = t.get("compile_s") or 0.0
    if compile_s <= 0:
        return None
    replay, fused = op_by_op_ms(t), t.get("fused_ms")
    per_run = replay - fused if replay is not None and fused is not None else None
    fused_runs = t.get("fused_runs") or 0
    saved_s = per_run * fused_runs / 1000.0 if per_run is not None else 0.0
    even = math.ceil(compile_s * 1000.0 / per_run) if per_run is not None and per_run > 0 \
        else None
    return {"trace": t.get("trace"), "n_ops": t.get("n_ops"), "compile_s": round(compile_s, 3),
            "saved_ms_per_run": None if per_run is None else round(per_run, 3),
            "runs": t.get("runs"), "fused_runs": fused_runs, "break_even_runs": even,
            "saved_s": round(saved_s, 3), "paid_back": even is not None and fused_runs >= even}


_DATA_DEPENDENT = "output shape depends on values"


def flush_kind(reason: str) -> tuple[str, str]:
    """(what ended the trace, what to do about it) for a flush reason (Note [flush causes])."""
    if reason.startswith("other_thread:"):
        reason = reason[len("other_thread:"):]
    if reason in ("sync:aten._local_scalar_dense.default", "read:item"):
        return (".item() (or float()/int()/bool() of a tensor)",
                "it waits for every pending op: read the value every N steps, or after "
                "optimizer.step(), so the step stays one fused program")
    if reason == "read":
        return ("a read of a pending tensor in Python (print, .tolist(), numpy, ...)",
                "it runs the pending ops first: do it every N steps, or after the step")
    if reason in ("read:__repr__", "read:__format__", "read:__str__"):
        return "print of a tensor", "print every N steps, or print a value read with .item()"
    if reason.startswith("read:"):
        return (f"a read of a tensor's memory ({reason[5:]})",
                "numpy/ctypes/DLPack reads run the pending ops first: do them outside the "
                "step loop, or less often")
    if reason.startswith("sync(") and _DATA_DEPENDENT in reason:
        op = reason.rsplit(":", 1)[-1]
        return (f"a data-dependent shape ({op})",
                "its size is known only once it runs: torch.where or a fixed-size mask keeps "
                "the step in one trace")
    if reason.startswith("sync("):
        why, _, op = reason[5:].rpartition("):")
        return f"{op} runs at once ({why})", "this op cannot be deferred"
    if reason.startswith("sync:"):
        return f"{reason[5:]} runs at once", "this op's result is needed in Python right away"
    if reason.startswith("fallback:"):
        return (f"{reason[9:]} has no deferred path",
                "it runs eagerly after the pending ops; an alternative op keeps the trace whole")
    if reason.startswith("new_op:"):
        return ("an op seen for the first time",
                "expected while the program settles in its first steps")
    if reason == "optimizer_step":
        return "the optimizer step", "expected: each iteration is one trace"
    if reason == "exit":
        return "the engine's context ended", "expected"
    if reason == "trace_cap":
        return ("the longest trace (max_trace_ops)",
                "raise ADAPTIVE_EAGER_MAX_TRACE_OPS if one step has more ops")
    return reason, ""


def flush_causes(sites: dict, traces: list[dict]) -> list[dict]:
    """Flushes by source line, ranked by time lost (Note [flush causes]): the seconds their ops
    ran op by op, less what fused programs took for the same work in this run (the ratio of
    fused to op-by-op time over every trace measured both ways; without one, the op-by-op
    seconds are shown and the loss is unknown)."""
    pairs = [(t["fused_ms"], op_by_op_ms(t)) for t in traces
             if t.get("fused_ms") is not None and op_by_op_ms(t)]
    ratio = sum(f for f, _ in pairs) / sum(r for _, r in pairs) if pairs else None
    rows = []
    for key, row in sites.items():
        if not isinstance(row, list) or len(row) != 4:
            continue
        reason, _, where = key.partition(" at ")
        flushes, ops, unfused, unfused_s = row
        kind, advice = flush_kind(reason)
        lost = None if ratio is None else max(0.0, unfused_s * (1.0 - ratio))
        rows.append({"where": where, "reason": reason, "kind": kind, "advice": advice,
                     "flushes": flushes, "ops": ops, "ops_op_by_op": unfused,
                     "op_by_op_s": round(unfused_s, 4),
                     "lost_s": None if lost is None else round(lost, 4)})
    rows.sort(key=lambda r: (r["lost_s"] or 0.0, r["op_by_op_s"], r["flushes"]), reverse=True)
    return rows


def _miss_row(r: dict) -> dict:
    values = r.get("values", [])
    info = dict(r)
    if r.get("cause") == "shape" and values:
        nums = [v for v in values if isinstance(v, int)]
        if nums:
            info["old"], info["new"] = min(nums), max(nums)
    return {"cause": r.get("cause"), "op": r.get("op"), "arg": r.get("arg"), "dim": r.get("dim"),
            "old": r.get("old"), "new": r.get("new"), "values": values, "where": r.get("where"),
            "count": r.get("count", 1), "index": r.get("index"), "traces": r.get("traces", []),
            "advice": advice(info, r.get("where") or "")}


def build_report(cache_dir: Path, run: str | None = None, last: bool = False,
                 job: str | None = None) -> dict:
    runs = read_runs(cache_dir)
    if run is not None:
        runs = [r for r in runs if r[0].get("run_id", "").startswith(run)]
        if not runs:
            raise LookupError(f"no run {run!r} in {cache_dir / 'runs'}")
    elif last:
        runs = runs[-1:]
    summaries = [summarize_run(r) for r in runs]
    jobs = group_jobs(summaries)
    if job is not None:  # one job's ranks: an id prefix, or "last" (the newest job)
        jobs = jobs[-1:] if job == "last" else [j for j in jobs if j["job"].startswith(job)]
        if not jobs:
            raise LookupError(f"no distributed job {job!r} in {cache_dir / 'runs'}")
        ids = {r["run_id"] for j in jobs for r in j["ranks"]}
        summaries = [r for r in summaries if r["run_id"] in ids]
    return {"cache_dir": str(cache_dir), "runs": summaries, "jobs": jobs,
            "overall": _overall(summaries)}


def _overall(runs: list[dict]) -> dict:
    hits = sum(r["trace_hits"] for r in runs)
    misses = sum(r["trace_misses"] for r in runs)
    deferred = sum(r["ops_deferred"] for r in runs)
    fused = sum(r["ops_fused"] for r in runs)
    return {"runs": len(runs), "trace_hit_rate": _pct(hits, hits + misses),
            "fused_share": _pct(fused, deferred), "compiles": sum(r["compiles"] for r in runs),
            "compile_seconds": round(sum(r["compile_seconds"] for r in runs), 3),
            "disk_hits": sum(r["disk_hits"] for r in runs)}


def format_report(rep: dict) -> str:
    lines = [f"adaptive_eager report ({rep['cache_dir']})"]
    if not rep["runs"]:
        lines.append("  no runs recorded yet: run a program under the engine first")
        return "\n".join(lines)
    for r in rep["runs"]:
        lines += _format_run(r)
    for j in rep.get("jobs", []):
        lines += format_job(j)
    o = rep["overall"]
    lines.append(f"overall: {o['runs']} runs, trace hit rate {o['trace_hit_rate']}%, "
                 f"{o['fused_share']}% of deferred ops fused, {o['compiles']} compiles "
                 f"({o['compile_seconds']} s), {o['disk_hits']} disk hits")
    return "\n".join(lines)


def _departures(r: dict) -> str:
    first, changed = r.get("first_sight_misses", 0), r.get("changed_misses", 0)
    if not first and not changed:
        return "never"
    return (f"{first + changed}x: {first}x at an op or shape seen for the first time, "
            f"{changed}x where something changed (below)")


def _format_run(r: dict) -> list[str]:
    argv = " ".join(r.get("argv") or [])
    out = [f"run {r['run_id']}  ({argv}, {r['seconds']} s)",
           f"  traces: hit rate {r['trace_hit_rate']}% ({r['trace_hits']} hits, "
           f"{r['trace_misses']} misses); left a known trace {_departures(r)}",
           f"  ops: {r['ops_deferred']} deferred, {r['ops_fused']} ran fused "
           f"({r['fused_share']}%), {r['ops_eager']} ran at once, {r['fallbacks']} fallbacks",
           f"  compiles: {r['compiles']} ({r['compile_seconds']} s), disk hits {r['disk_hits']}, "
           f"disk errors {r['disk_errors']}, stepped aside {r['step_asides']}x, "
           f"plain eager while compiling {r.get('compile_waits', 0)}x"]
    if r.get("budget_rounds") or r.get("compiles_held"):
        out.append(f"  learning budget: {r.get('budget_rounds', 0)} rounds in plain eager to stay "
                   f"within it (went aside on it {r.get('budget_asides', 0)}x), "
                   f"{r.get('compiles_held', 0)} hot runs whose compile it held back "
                   "(ADAPTIVE_EAGER_BUDGET; 0 learns from the first op)")
    if r.get("flush_causes"):
        out.append("  flush causes by time lost (your line, what ended the trace there, ops "
                   "that ran op by op):")
        for c in r["flush_causes"][:8]:
            cost = (f"~{c['lost_s']:.3f} s lost" if c["lost_s"] is not None
                    else f"{c['op_by_op_s']:.3f} s op by op")
            out.append(f"    {cost:>16}  {c['where']}: {c['kind']}, {c['flushes']}x, "
                       f"{c['ops_op_by_op']} of {c['ops']} ops op by op")
            if c["advice"]:
                out.append(f"      {c['advice']}")
    if r.get("compiles") or r.get("disk_hits") or r.get("service_pending"):
        # where the time to a fused program went
        line = (f"  time to fused: queued {r.get('queued_seconds', 0.0)} s, compiling "
                f"{r['compile_seconds']} s, loading {r.get('load_seconds', 0.0)} s, waited "
                f"{r.get('wait_seconds', 0.0)} s in all")
        if r.get("service_compiles") or r.get("service_shared"):
            line += (f"; compile service: {r.get('service_compiles', 0)} compiled for this run, "
                     f"{r.get('service_shared', 0)} shared with other processes")
        if r.get("prefetched"):
            line += f"; {r['prefetched']} prefetched at start"
        out.append(line)
        if r.get("program_waits"):
            out.append("  waited for its program: " + ", ".join(
                f"{k} {v:.2f} s" for k, v in r["program_waits"].items()))
    faults = [f"{r.get(k, 0)} {k.replace('_', ' ')}" for k in ("compile_errors", "fused_errors",
                                                               "service_errors") if r.get(k)]
    lost = r.get("compiles_pending", 0) - r.get("service_pending", 0)
    if lost > 0:
        faults.append(f"{lost} still compiling when the run ended "
                      "(not stored: the next run compiles them again)")
    if r.get("service_pending"):
        out.append(f"  {r['service_pending']} compile(s) went on in the compile service after "
                   "the run: their programs land in the cache for the next run")
    if faults:
        out.append("  faults (results unchanged, ran op by op): " + ", ".join(faults))
    if r.get("accel_missing"):
        out.append(f"  hot path: pure Python, the C accelerator is {r['accel_missing']}: "
                   "about 20% slower per op (reinstall where a C compiler is present)")
    sym = r.get("sym") or {}
    if sym.get("sym_learned") or sym.get("sym_loaded"):
        out.append(f"  symbolic dims: {sym['sym_learned']} learnt, {sym['sym_loaded']} from "
                   f"disk; {sym['sym_hits']} traces served for any size, {sym['sym_ops']} ops "
                   f"with predicted metadata, {sym['sym_left']} left a template, "
                   f"{sym['sym_mispredicted']} mispredicted")
        for label, n in (r.get("sym_dims") or {}).items():
            out.append(f"    {n:>5}x  {label}")
    if any(sym.get(k) for k in ("sym_programs", "sym_checked", "sym_specialized",
                                "sym_unfusable")):
        out.append(f"  symbolic programs: {sym.get('sym_checked', 0)} sizes checked, "
                   f"{sym.get('sym_sizes_loaded', 0)} from disk, {sym.get('sym_trusted', 0)} run "
                   f"unchecked by their guards, {sym.get('sym_guard_refused', 0)} refused by a "
                   f"guard; templates not compiled: {sym.get('sym_specialized', 0)} specialized, "
                   f"{sym.get('sym_unfusable', 0)} unfusable; {sym.get('sym_guards_unknown', 0)} "
                   f"with unreadable guards")
    d = r.get("dist")
    if d:
        out.append(f"  rank {d.get('rank')} of {d.get('world')} in job {d.get('job') or '?'} "
                   f"on {d.get('host')}: {_rank_text(d)}")
    if r.get("remote"):
        out.append("  remote store: " + _remote_text(r["remote"]))
    if r["top_traces"]:
        out.append("  top traces by time saved:")
        out.append(f"    {'trace':14} {'runs':>5} {'ops':>5} {'op-by-op ms':>12} {'fused ms':>9} "
                   f"{'saved ms':>9}  decision")
        for t in r["top_traces"]:
            out.append(f"    {t['trace'][:12]:14} {t['runs']:>5} {t['n_ops']:>5} "
                       f"{t['replay_ms'] or 0:>12.3f} {t['fused_ms'] or 0:>9.3f} "
                       f"{t['saved_ms']:>9.3f}  {t['decision']}")
    if r.get("ledger"):
        out.append("  payback ledger (compile seconds against seconds saved by fused runs):")
        out.append(f"    {'trace':14} {'ops':>5} {'compile s':>10} {'saved/run ms':>13} "
                   f"{'fused runs':>10} {'break-even':>10} {'saved s':>8}")
        for t in r["ledger"]:
            even = "never" if t["break_even_runs"] is None else t["break_even_runs"]
            per_run = "-" if t["saved_ms_per_run"] is None else f"{t['saved_ms_per_run']:.3f}"
            out.append(f"    {(t['trace'] or '')[:12]:14} {t['n_ops'] or 0:>5} "
                       f"{t['compile_s']:>10.3f} {per_run:>13} {t['fused_runs']:>10} "
                       f"{even:>10} {t['saved_s']:>8.3f}"
                       + ("  paid back" if t["paid_back"] else ""))
    if r["flush_reasons"]:
        out.append("  flush reasons: " + ", ".join(f"{k} x{v}" for k, v in
                                                    r["flush_reasons"].items()))
    if r["fallback_ops"]:
        out.append("  fallbacks by op: " + ", ".join(f"{k} x{v}" for k, v in
                                                      r["fallback_ops"].items()))
    if r["miss_causes"]:
        out.append("  misses by cause (diff against the nearest known trace):")
        for m in r["miss_causes"]:
            what = f"{m['arg']}" + (f" dim {m['dim']}" if m.get("dim") is not None else "")
            out.append(f"    {m['cause']:7} {m['op']} {what}: {m['old']} -> {m['new']} "
                       f"at op {m['index']} ({m['count']}x) at {m['where']}")
            out.append(f"      advice: {m['advice']}")
    return out


def explain_trace(cache_dir: Path, prefix: str) -> dict:
    """The ops of a trace (with source lines) and its history across runs."""
    found: dict | None = None
    history = []
    for run in read_runs(cache_dir):
        for rec in run:
            if rec.get("type") == "trace" and rec.get("trace", "").startswith(prefix):
                found = rec
                history.append({"run_id": rec.get("run_id"), **_trace_row(rec)})
    if found is None:
        raise LookupError(f"no trace starting with {prefix!r} in the run logs of {cache_dir}")
    return {"trace": found["trace"], "n_ops": found.get("n_ops"), "ops": found.get("ops", []),
            "history": history}


def format_explain(info: dict) -> str:
    lines = [f"trace {info['trace']} ({info['n_ops']} ops)"]
    for i, (op, where) in enumerate(info["ops"]):
        lines.append(f"  {i:4} {op:40} {where}")
    lines.append("history:")
    for h in info["history"]:
        lines.append(f"  run {h['run_id']}: {h['runs']} runs, {h['hits']} hits, state {h['state']}"
                     f", {h['decision'] or 'no decision'}")
    return "\n".join(lines)



# ---- distributed jobs: the runs of one job's ranks together (Note [job id] in distributed.py) ---
def group_jobs(runs: list[dict]) -> list[dict]:
    """Runs of one distributed job, oldest job first. Runs whose job is only an address
    (``job_kind`` "address") belong together while their times overlap."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        d = r.get("dist")
        if d and d.get("job"):
            groups.setdefault(d["job"], []).append(r)
    jobs = []
    for job, members in groups.items():
        if members[0]["dist"].get("job_kind") == "address":
            jobs += [_job_row(f"{job}@{c[0]['run_id']}", c) for c in _overlapping(members)]
        else:
            jobs.append(_job_row(job, members))
    jobs.sort(key=lambda j: j["start"] or 0.0)
    return jobs


def _overlapping(runs: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    end = None
    for r in sorted(runs, key=lambda r: r.get("start") or 0.0):
        if out and end is not None and (r.get("start") or 0.0) <= end:
            out[-1].append(r)
            end = max(end, r.get("end") or 0.0)
        else:
            out.append([r])
            end = r.get("end") or 0.0
    return out


def _job_row(job: str, runs: list[dict]) -> dict:
    ranks = []
    for r in sorted(runs, key=lambda r: (r["dist"].get("rank", 0), r.get("start") or 0.0)):
        d, rem = r["dist"], r.get("remote") or {}
        ranks.append({
            "rank": d.get("rank"), "run_id": r["run_id"], "host": d.get("host"),
            "seconds": r["seconds"], "compiles": r["compiles"], "disk_hits": r["disk_hits"],
            "compiled_runs": r.get("compiled_runs", 0),
            "remote_hits": rem.get("hits", 0), "remote_misses": rem.get("misses", 0),
            "remote_refused": rem.get("refused", 0), "remote_published": rem.get("published", 0),
            "peer_waits": d.get("peer_waits", 0),
            "peer_wait_s": round(d.get("peer_wait_ms", 0) / 1000.0, 3),
            "compiled_for_peers": d.get("compiled_for_peers", 0),
            "agreed": d.get("agreed", 0), "overruled": d.get("overruled", 0),
            "diverged": d.get("diverged", 0),
        })
    world = max((r["dist"].get("world") or 0) for r in runs)
    seen = {k["rank"] for k in ranks}
    return {"job": job, "world": world, "ranks": ranks,
            "hosts": sorted({k["host"] for k in ranks if k["host"]}),
            "missing_ranks": [i for i in range(world) if i not in seen],
            "start": min((r.get("start") or 0.0) for r in runs),
            "compiles": sum(k["compiles"] for k in ranks),
            "remote_hits": sum(k["remote_hits"] for k in ranks)}


def _rank_text(d: dict) -> str:
    text = (f"{d.get('agreed', 0)} decisions agreed ({d.get('overruled', 0)} overruled), "
            f"waited for peers' programs {d.get('peer_waits', 0)}x "
            f"({d.get('peer_wait_ms', 0) / 1000.0:.1f} s), compiled for peers "
            f"{d.get('compiled_for_peers', 0)}x")
    if d.get("diverged"):
        text += f", DIVERGED {d['diverged']}x (ran op by op where peers ran fused)"
    return text


def _remote_text(rem: dict) -> str:
    text = (f"{rem.get('hits', 0)} hits, {rem.get('misses', 0)} misses, "
            f"{rem.get('refused', 0)} refused (failed verification), "
            f"{rem.get('published', 0)} published")
    if rem.get("errors"):
        text += f", {rem['errors']} errors (store switched off)"
    return text


def format_job(j: dict) -> list[str]:
    ranks = j["ranks"]
    head = (f"job {j['job']}: {len(ranks)} run(s) of {j['world']} ranks on "
            f"{len(j['hosts'])} host(s), {j['compiles']} compiles, "
            f"{j['remote_hits']} remote hits")
    if j["missing_ranks"]:
        head += f"; no run log from rank(s) {', '.join(map(str, j['missing_ranks']))}"
    out = [head, f"  {'rank':>4}  {'run':24} {'compiles':>8} {'disk hits':>9} "
                 f"{'remote hit/miss/refused':>23} {'peer waits':>10} {'wait s':>7} "
                 f"{'fused runs':>10} {'seconds':>8}"]
    for k in ranks:
        rem = f"{k['remote_hits']}/{k['remote_misses']}/{k['remote_refused']}"
        out.append(f"  {k['rank']:>4}  {k['run_id']:24} {k['compiles']:>8} {k['disk_hits']:>9} "
                   f"{rem:>23} {k['peer_waits']:>10} {k['peer_wait_s']:>7.1f} "
                   f"{k['compiled_runs']:>10} {k['seconds']:>8.1f}")
    return out
