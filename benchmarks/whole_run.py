"""Whole runs as a user sees them: programs ``torch.compile`` handles badly, N steps each.

    python -m benchmarks.whole_run [--steps 200] [--quick] [--repeats 1] [--programs a,b]
                                   [--modes m1,m2] [--out DIR] [--timeout S] [--threads auto|N]

Every (program, mode) runs in a fresh subprocess (``--child``) that imports torch, builds the
program (seeded, ``benchmarks/graph_breaks.py``) and runs its steps back to back, as a training
script does: no warm-up, no waiting for compiles. It reports the whole run's wall time (from
before the first step to after the last one and a final ``adaptive_eager.sync()``; imports and
the build are timed apart), the first step, the median step over the last quarter of the steps,
the final loss and a checksum of the trained state, and the engine's or Dynamo's counters.

Modes: ``eager`` (``ADAPTIVE_EAGER`` removed); ``engine`` (``ADAPTIVE_EAGER=1``, default options,
a fresh engine cache folder and a fresh ``TORCHINDUCTOR_CACHE_DIR``); ``engine_warm`` (a second
fresh process on the same folders, after the compile service has gone idle); ``torch_compile``
(``torch.compile(step)``, fresh Inductor folder) and ``torch_compile_warm`` (same folder again).
The modes of a program run one after another (cold modes, then warm ones; the order rotates with
each repeat) so that a change of machine load hits them alike; the 1-minute load average is
recorded before and after every run. After an engine run the driver waits for the compile service
to go idle (reported as the service's tail: compiling the user does not wait for, but the next
run's cache gets) so that it does not slow the next run down.

Output: ``whole_run.json`` and ``whole_run.md`` in ``--out`` (``benchmarks/out``), written after
every run. A run that fails or times out becomes a row with its error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import USER_BUDGET

# Whole runs as a user has them: the learning budget as the caller's environment set it, in the
# driver and in its children (benchmarks/__init__.py turns it off for the other benchmarks).
if USER_BUDGET is None:
    os.environ.pop("ADAPTIVE_EAGER_BUDGET", None)
else:
    os.environ["ADAPTIVE_EAGER_BUDGET"] = USER_BUDGET

T_SCRIPT = time.perf_counter()  # before torch is imported (the child's import time)

MODES = ("eager", "engine", "torch_compile", "engine_warm", "torch_compile_warm")
COLD = ("eager", "engine", "torch_compile")
WARM = {"engine_warm": "engine", "torch_compile_warm": "torch_compile"}  # warm -> its cold run
DEFAULT_OUT = Path(__file__).parent / "out"
ENGINE_COUNTERS = ("compiles", "service_compiles", "compiles_pending", "disk_hits",
                   "compiled_runs", "replayed_runs", "kept_fused", "kept_replay", "step_asides",
                   "trials", "flushes", "compile_wait_seconds", "engine_errors", "fused_errors",
                   "quarantined", "ops_intercepted", "budget_rounds", "budget_asides",
                   "compiles_held")
FIRST_STEPS = 3  # a mode's first losses must match eager's within FIRST_RTOL
FIRST_RTOL = 1e-4
Row = dict[str, Any]
SERVICE_WAIT_S = 300.0  # longest wait for the compile service after an engine run


# ---- the child: one (program, mode) in a fresh process ---------------------------------------
def _engine_counters(ae: Any) -> dict[str, Any]:
    m = ae.metrics()
    out = {k: m.get(k) for k in ENGINE_COUNTERS}
    out["flush_reasons"] = m.get("flush_reasons")
    return out


def _dynamo_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": len(counters["graph_break"]),
            "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"]}


def steady_median(times: list[float]) -> float:
    """Median step time over the last quarter of the steps (at least one step)."""
    return statistics.median(times[-max(1, len(times) // 4):])


def child(spec: dict[str, Any]) -> Row:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    res: Row = {"status": "ok", "import_s": time.perf_counter() - T_SCRIPT,
                "threads": torch.get_num_threads()}
    ae = None
    if spec["mode"].startswith("engine"):
        import adaptive_eager as ae

        if not ae.is_enabled():
            raise RuntimeError("ADAPTIVE_EAGER=1 did not switch the engine on: is adaptive_eager "
                               "installed (its torch.backends entry point)?")
    from benchmarks.graph_breaks import PROGRAMS

    t0 = time.perf_counter()
    built = PROGRAMS[spec["program"]].build()
    step = built.step
    if spec["mode"].startswith("torch_compile"):  # building the wrapper imports Dynamo
        step = torch.compile(built.step, backend=spec.get("compile_backend", "inductor"))
    res["build_s"] = time.perf_counter() - t0
    batches, times, losses = built.batches, [], []
    t_begin = time.perf_counter()
    for i in range(spec["steps"]):
        t = time.perf_counter()
        losses.append(step(*batches[i % len(batches)]))  # kept as a script's loss log keeps it
        times.append(time.perf_counter() - t)
    if ae is not None:
        ae.sync()
    res["whole_s"] = time.perf_counter() - t_begin
    losses = [float(x) for x in losses]
    res.update(first_step_s=times[0], steady_s=steady_median(times), steps=len(times),
               times_s=times, losses=losses, final_loss=losses[-1],
               state_checksum=built.state_checksum())
    if ae is not None:
        res["counters"] = _engine_counters(ae)
    elif spec["mode"].startswith("torch_compile"):
        res["counters"] = _dynamo_counters()
    return res


def child_main(spec_text: str, result_path: str) -> int:
    spec = json.loads(spec_text)
    try:
        res = child(spec)
    except BaseException as err:  # noqa: BLE001  # a row with its error, never fatal to the suite
        res = {"status": "error", "error": f"{type(err).__name__}: {err}".strip()[:500],
               "traceback": traceback.format_exc()[-4000:]}
    with open(result_path, "w") as f:
        json.dump(res, f, default=repr)
    return 0 if res["status"] == "ok" else 1


# ---- the driver --------------------------------------------------------------------------------
def plan(programs: list[str], modes: list[str], repeats: int) -> list[tuple[int, str, str, bool]]:
    """(repeat, program, mode, reported) in run order: per repeat, programs in turn (rotated),
    each program's cold modes then its warm ones (each rotated). A warm mode whose cold mode was
    not asked for gets it as an unreported primer."""
    runs = []
    wanted = set(modes)
    cold = [m for m in COLD if m in wanted or any(WARM[w] == m for w in wanted & WARM.keys())]
    warm = [m for m in WARM if m in wanted]
    for r in range(repeats):
        for program in _rotate(programs, r):
            for mode in _rotate(cold, r) + _rotate(warm, r):
                runs.append((r, program, mode, mode in wanted))
    return runs


def _rotate(items: list[str], by: int) -> list[str]:
    return items[by % len(items):] + items[:by % len(items)] if items else []


def _dirs(root: Path, repeat: int, program: str, mode: str) -> tuple[Path, Path]:
    """(engine cache dir, Inductor dir): shared by a mode and its warm mode, fresh otherwise."""
    group = WARM.get(mode, mode)
    base = root / f"r{repeat}-{program}-{group}"
    engine, inductor = base / "engine", base / "inductor"
    for d in (base, inductor):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)  # the engine refuses shared folders
    return engine, inductor


def child_env(mode: str, engine_dir: Path, inductor_dir: Path, threads: int | None) -> dict:
    env = dict(os.environ)
    env.pop("ADAPTIVE_EAGER", None)
    if mode.startswith("engine"):
        env["ADAPTIVE_EAGER"] = "1"
    if threads:  # reaches Inductor's OpenMP kernels and the compile service too
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["ADAPTIVE_EAGER_CACHE_DIR"] = str(engine_dir)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    # Triton's cache follows Inductor's folder (triton_cache_dir); a variable of its own would
    # also be part of the compile service's identity, a service the driver could not ask about
    env.pop("TRITON_CACHE_DIR", None)
    return env


def run_one(root: Path, repeat: int, program: str, mode: str, steps: int, timeout: float,
            threads: int | None, compile_backend: str = "inductor") -> Row:
    from benchmarks.suite import exit_reason, load_average, run_worker

    engine_dir, inductor_dir = _dirs(root, repeat, program, mode)
    spec = {"program": program, "mode": mode, "steps": steps, "threads": threads,
            "compile_backend": compile_backend}
    result_path = root / f"result-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "benchmarks.whole_run", "--child", json.dumps(spec),
           str(result_path)]
    row: Row = {"repeat": repeat, "program": program, "mode": mode,
                "load_before": load_average()[0]}
    t0 = time.perf_counter()
    returncode, stderr, timed_out = run_worker(
        cmd, child_env(mode, engine_dir, inductor_dir, threads), timeout)
    row.update(process_s=time.perf_counter() - t0, load_after=load_average()[0])
    if result_path.exists():
        row.update(json.loads(result_path.read_text()))
        result_path.unlink()
    elif timed_out:
        row.update(status="timeout", error=f"killed after {timeout:.0f} s")
    else:
        tail = " | ".join(stderr.strip().splitlines()[-2:])
        row.update(status="error", error=f"child died ({exit_reason(returncode)}): {tail}"
                   [:500])
    if row.get("status") != "ok":
        row["stderr_tail"] = "\n".join(stderr.strip().splitlines()[-20:])
    if mode.startswith("engine"):
        row["service_tail_s"] = wait_service_idle(engine_dir, min(timeout, SERVICE_WAIT_S))
    return row


def wait_service_idle(engine_dir: Path, limit: float) -> float:
    """Seconds until the engine folder's compile service has nothing queued or compiling."""
    from adaptive_eager import service

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        st = service.status(engine_dir)
        if st is None or not (st.get("in_flight") or st.get("queued") or st.get("compiling")):
            break
        time.sleep(0.5)
    return time.perf_counter() - t0


def stop_service(engine_dir: Path) -> None:
    from adaptive_eager import service

    if engine_dir.exists():
        service.stop(engine_dir)


# ---- results -----------------------------------------------------------------------------------
def ok(row: Row | None) -> bool:
    return row is not None and row.get("status") == "ok"


def median_of(rows: list[Row], program: str, mode: str, key: str) -> float | None:
    vals = [r[key] for r in rows if r["program"] == program and r["mode"] == mode and ok(r)
            and not r.get("primer")]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def geomean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


RATIOS = (("engine", "eager"), ("engine", "torch_compile"), ("engine_warm", "eager"),
          ("engine_warm", "torch_compile_warm"))


def check_results(rows: list[Row], rtol: dict[str, float]) -> None:
    """Each ok row's losses and state checksum against eager's of the same repeat.

    ``=``: every loss and the checksum bitwise equal; ``ok``: the final loss and the checksum
    within the program's rtol; ``drift``: beyond it at the end, but the first steps' losses agree
    within FIRST_RTOL (rounding differences that training carries along and a branch on a loss
    can amplify: ``at`` names the first step beyond rtol); ``DIFFERS``: already the first steps
    disagree."""
    from benchmarks.graph_breaks import relative_difference

    for row in rows:
        if not ok(row) or row["mode"] == "eager":
            continue
        eager = next((r for r in rows if r["mode"] == "eager" and ok(r)
                      and (r["program"], r["repeat"]) == (row["program"], row["repeat"])), None)
        if eager is None:
            row["vs_eager"] = "no eager run"
            continue
        steps = list(zip(row["losses"], eager["losses"]))
        diffs = [relative_difference(a, b) for a, b in steps]
        dl = relative_difference(row["final_loss"], eager["final_loss"])
        ds = relative_difference(row["state_checksum"], eager["state_checksum"])
        row["loss_rel_diff"], row["state_rel_diff"] = dl, ds
        first = diffs[:FIRST_STEPS]
        row["first_rel_diff"] = max(first) if None not in first else None
        tol = rtol[row["program"]]
        beyond = [i for i, d in enumerate(diffs, 1) if d is None or d > tol]
        row["beyond_rtol_at"] = beyond[0] if beyond else None
        if all(d == 0 for d in diffs) and ds == 0:
            row["vs_eager"] = "="
        elif dl is not None and ds is not None and dl <= tol and ds <= tol:
            row["vs_eager"] = "ok"
        elif row["first_rel_diff"] is not None and row["first_rel_diff"] <= FIRST_RTOL:
            row["vs_eager"] = "drift"
        else:
            row["vs_eager"] = "DIFFERS"


def summary(rows: list[Row], programs: list[str], key: str) -> dict[str, Any]:
    table = {}
    for p in programs:
        med = {m: median_of(rows, p, m, key) for m in MODES}
        table[p] = {"median": med, "ratios": {f"{a}/{b}": ratio(med[a], med[b])
                                              for a, b in RATIOS}}
    geo = {f"{a}/{b}": geomean([table[p]["ratios"][f"{a}/{b}"] for p in programs])
           for a, b in RATIOS}
    return {"programs": table, "geomean": geo}


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(header: dict[str, Any], rows: list[Row], programs: list[str]) -> str:
    from benchmarks.graph_breaks import PROGRAMS

    out = [f"# Whole runs: {header['steps']} steps per program, fresh process per run", "",
           f"- command: `{header['command']}`",
           f"- date: {header['started']}; commit {header['machine']['git_commit']}",
           f"- machine: {header['machine_line']}",
           f"- torch.compile backend: {header['compile_backend']}",
           f"- threads per run: {header['threads'] or 'torch default'} ({header['threads_why']})",
           f"- load average (1 min) at start {header['load_before']}, at end "
           f"{header['load_after']}; runs' own before/after loads are in the last table",
           f"- wall time of the whole benchmark: {header['wall_s']} s", ""]
    for key, title, fmt, scale in (("whole_s", "Whole-run wall time, s", "{:.2f}", 1.0),
                                   ("steady_s", "Steady-state step (median of the last 25%), "
                                    "ms", "{:.1f}", 1e3)):
        s = summary(rows, programs, key)
        out += [f"## {title}", "",
                "Time ratios: < 1 means the engine took less time. Medians over repeats.", "",
                "| program | " + " | ".join(MODES) + " | " + " | ".join(
                    f"{a} / {b}" for a, b in RATIOS) + " |",
                "|---|" + "---:|" * (len(MODES) + len(RATIOS))]
        for p in programs:
            t = s["programs"][p]
            out.append(f"| {p} | " + " | ".join(
                _f(None if t["median"][m] is None else t["median"][m] * scale, fmt)
                for m in MODES) + " | " + " | ".join(
                _f(t["ratios"][f"{a}/{b}"]) for a, b in RATIOS) + " |")
        out.append("| geometric mean | " + " | ".join("" for _ in MODES) + " | " + " | ".join(
            _f(s["geomean"][f"{a}/{b}"]) for a, b in RATIOS) + " |")
        out.append("")
    out += ["## Every run", "",
            "*first* = first step, s; *import*/*build* = importing torch (and the engine) and "
            "building the program, s; *process* = the whole subprocess, s; *tail* = seconds the "
            "compile service went on compiling after an engine run exited; *vs eager*: every "
            "step's loss and the final state checksum against eager's: `=` bitwise, `ok` "
            "final loss and checksum within the program's rtol, `drift` beyond it at the end "
            f"but the first {FIRST_STEPS} losses within {FIRST_RTOL:g} (rounding carried along "
            "by training; *from step* = the first loss beyond rtol), else DIFFERS; in brackets "
            "the larger relative difference of final loss and checksum; engine counters: "
            "compiles in this process / compiles sent to the compile service / programs "
            "loaded from disk / fused runs / replayed runs / step-asides / trials / flushes; "
            "torch.compile: Dynamo graphs / graph breaks / FX-graph cache hits.", "",
            "| # | program | mode | whole s | first | steady ms | import | build | process | "
            "tail | load before/after | counters | final loss | vs eager | error |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|"]
    for i, r in enumerate(rows, 1):
        c = r.get("counters") or {}
        if r["mode"].startswith("engine") and c:
            counters = "/".join(str(c.get(k)) for k in (
                "compiles", "service_compiles", "disk_hits", "compiled_runs", "replayed_runs",
                "step_asides", "trials", "flushes"))
        elif c:
            counters = (f"{c.get('unique_graphs')} graphs / {c.get('graph_breaks')} breaks / "
                        f"{c.get('fxgraph_cache_hit')} hits")
        else:
            counters = ""
        diff = max((d for d in (r.get("loss_rel_diff"), r.get("state_rel_diff"))
                    if d is not None), default=None)
        vs = r.get("vs_eager", "")
        if vs not in ("", "=") and diff is not None:
            vs += f" ({diff:.1e}" + (f", from step {r['beyond_rtol_at']}"
                                     if r.get("beyond_rtol_at") else "") + ")"
        name = r["mode"] + (" (primer)" if r.get("primer") else "")
        steady_ms = r["steady_s"] * 1e3 if r.get("steady_s") is not None else None
        out.append(
            f"| {i} | {r['program']} | {name} | {_f(r.get('whole_s'))} | "
            f"{_f(r.get('first_step_s'))} | {_f(steady_ms, '{:.1f}')}"
            f" | {_f(r.get('import_s'), '{:.1f}')} | {_f(r.get('build_s'))} | "
            f"{_f(r.get('process_s'), '{:.1f}')} | {_f(r.get('service_tail_s'), '{:.1f}')} | "
            f"{r.get('load_before')}/{r.get('load_after')} | {counters} | "
            f"{_f(r.get('final_loss'), '{:.6g}')} | {vs} | "
            f"{str(r.get('error', '')).replace('|', '/')[:120]} |")
    out += ["", "Programs:", ""]
    out += [f"- `{p}`: {PROGRAMS[p].description} (rtol {PROGRAMS[p].rtol:g})" for p in programs]
    return "\n".join(out) + "\n"


def write(out_dir: Path, header: dict[str, Any], rows: list[Row], programs: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    full = {**header, "rows": rows,
            "whole": summary(rows, programs, "whole_s"),
            "steady": summary(rows, programs, "steady_s")}
    (out_dir / "whole_run.json").write_text(json.dumps(full, indent=1, default=repr))
    (out_dir / "whole_run.md").write_text(markdown(header, rows, programs))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from benchmarks.graph_breaks import listed
    from benchmarks.suite import threads_arg

    p = argparse.ArgumentParser(prog="python -m benchmarks.whole_run",
                                description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="steps per run (default 200; 40 with --quick)")
    p.add_argument("--quick", action="store_true", help="40 steps per run")
    p.add_argument("--repeats", type=int, default=1, help="runs of every (program, mode)")
    p.add_argument("--programs", help=f"comma-separated subset of: {', '.join(listed())} "
                   "(or tiny, a test program)")
    p.add_argument("--modes", help=f"comma-separated subset of: {', '.join(MODES)}")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output dir ({DEFAULT_OUT})")
    p.add_argument("--timeout", type=float, help="kill a run after this many seconds "
                   "(default 900; 300 with --quick)")
    p.add_argument("--compile-backend", default="inductor", help=(
        "Dynamo backend of the torch_compile modes (default inductor; eager checks the driver "
        "without compiling)"))
    p.add_argument("--threads", default="auto", type=threads_arg, help=(
        "torch/OpenMP threads per run: N, or auto (default): 1 when the machine is busy"))
    return p.parse_args(argv)


def _names(text: str | None, known: list[str], default: list[str], what: str) -> list[str]:
    if not text:
        return default
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return [n for n in known if n in names]


def main(argv: list[str] | None = None) -> int:
    if (argv if argv is not None else sys.argv[1:])[:1] == ["--child"]:
        args = argv if argv is not None else sys.argv[1:]
        return child_main(args[1], args[2])
    from benchmarks.graph_breaks import PROGRAMS, listed
    from benchmarks.machine import describe, machine_info
    from benchmarks.suite import choose_threads, load_average, settings_from_env

    args = parse_args(argv)
    try:
        programs = _names(args.programs, list(PROGRAMS), listed(), "program(s)")
        modes = _names(args.modes, list(MODES), list(MODES), "mode(s)")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.repeats < 1 or (args.steps is not None and args.steps < 1):
        print("error: --steps and --repeats must be at least 1", file=sys.stderr)
        return 2
    steps = args.steps or (40 if args.quick else 200)
    timeout = args.timeout or (300.0 if args.quick else 900.0)
    load_before = load_average()
    threads, threads_why = choose_threads(args.threads, load_before)
    runs = plan(programs, modes, args.repeats)
    command = "python -m benchmarks.whole_run " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    machine = machine_info("cpu")
    header: dict[str, Any] = {
        "command": command.strip(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "steps": steps, "repeats": args.repeats, "compile_backend": args.compile_backend,
        "threads": threads, "threads_why": threads_why,
        "machine": machine, "machine_line": describe(machine), "load_before": load_before,
        "load_after": "(running)", "wall_s": "(running)", "environment": settings_from_env()}
    print(f"{command}: {len(runs)} runs, {steps} steps each, threads "
          f"{threads or 'default'} ({threads_why})", flush=True)
    rtol = {p: PROGRAMS[p].rtol for p in programs}
    rows: list[Row] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ae-whole-run-") as tmp:
        root = Path(tmp)
        try:
            for i, (repeat, program, mode, reported) in enumerate(runs, 1):
                row = run_one(root, repeat, program, mode, steps, timeout, threads,
                              args.compile_backend)
                if not reported:
                    row["primer"] = True
                rows.append(row)
                if mode == "engine_warm" or (mode == "engine" and "engine_warm" not in modes):
                    stop_service(_dirs(root, repeat, program, mode)[0])
                check_results(rows, rtol)
                print(progress(i, len(runs), row), flush=True)
                write(args.out, header, rows, programs)
        except KeyboardInterrupt:
            print(f"interrupted: reporting the {len(rows)} finished runs", flush=True)
        finally:
            for d in root.glob("*/engine"):
                stop_service(d)
    header.update(wall_s=round(time.perf_counter() - t0, 1), load_after=load_average())
    write(args.out, header, rows, programs)
    print("\n" + markdown(header, rows, programs))
    print(f"wrote {args.out / 'whole_run.json'}, {args.out / 'whole_run.md'}")
    return 0


def progress(i: int, n: int, row: Row) -> str:
    head = f"[{i}/{n}] {row['program']:<12} {row['mode']:<19}"
    if ok(row):
        return (f"{head} whole {row['whole_s']:8.2f} s  first {row['first_step_s']:6.2f} s  "
                f"steady {row['steady_s'] * 1e3:8.1f} ms  ({row['process_s']:.0f} s, load "
                f"{row['load_before']}->{row['load_after']}) {row.get('vs_eager', '')}")
    return f"{head} {str(row.get('status')).upper()}: {str(row.get('error'))[:100]}"


if __name__ == "__main__":
    sys.exit(main())
