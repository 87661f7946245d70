"""Turn the runs' results into results.json, results.md (tables) and results.png (bar charts)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.machine import describe
from benchmarks.modes import COMPILE_BASELINE, EAGER_BASELINE, MODES
from benchmarks.workloads import WORKLOADS, describe_size

Result = dict[str, Any]

COLUMNS = ("mode", "median ms/step", "min-max ms", "x eager", "x compile", "first step s",
           "warm-up s", "process s", "compiles", "ops/step", "us/op", "overhead us/op",
           "peak RSS MB", "vs eager", "notes")

LEGEND = """\
Columns: *median ms/step* after warm-up, with *min-max* over the timed steps; *x eager* and
*x compile* are speedups (baseline median / this median, >1 = faster) against `eager` and against
`torch_compile`; *first step s* is the first call (includes compiling); *warm-up s* runs from the
first step to the first timed step (warm-up steps, and for the engine, stepping until its
background compiles are done and measured); *process s* is the whole fresh subprocess (imports,
setup, warm-up, timed steps); *compiles* comes from the engine's metrics (`compiles`, n/a until
it counts them) or Dynamo's unique graphs; *ops/step* is
`ops_intercepted` per timed step; *us/op* is time per step / ops per step; *overhead us/op* is
(this - eager) per intercepted op; *peak RSS MB* is `ru_maxrss` of the subprocess; *vs eager*
compares with eager every step's logged loss over the steps both ran where a workload logs one (`= (N steps)` bitwise, else the largest absolute difference), otherwise the first step's result (`=` bitwise, else the relative difference).
"""


def shown(results: list[Result]) -> list[Result]:
    """The runs the user asked for (primer runs that only filled a cache are left out)."""
    return [r for r in results if not r.get("primer")]


def ok(res: Result | None) -> bool:
    return res is not None and res.get("status") == "ok"


def find(results: list[Result], workload: str, size: str, modes: tuple[str, ...]) -> Result | None:
    """The first successful result among ``modes`` (in that order) for this workload and size."""
    for name in modes:
        for r in results:
            if r["workload"] == workload and r["size"] == size and r["mode"] == name and ok(r):
                return r
    return None


def result_of(results: list[Result], workload: str, size: str, mode: str) -> Result | None:
    """This run's result, failed or not."""
    return next((r for r in results if (r["workload"], r["size"], r["mode"]) == (workload, size,
                                                                                mode)), None)


def speedup(baseline: Result | None, res: Result) -> float | None:
    if not ok(baseline) or not ok(res) or not res["median_s"]:
        return None
    assert baseline is not None
    return baseline["median_s"] / res["median_s"]


def us_per_op(res: Result) -> float | None:
    ops = res.get("ops_per_step")
    return res["median_s"] * 1e6 / ops if ok(res) and ops else None


def overhead_per_op(eager: Result | None, res: Result) -> float | None:
    ops = res.get("ops_per_step")
    if not ok(eager) or not ok(res) or not ops:
        return None
    assert eager is not None
    return (res["median_s"] - eager["median_s"]) * 1e6 / ops


def losses_vs_eager(eager: Result, res: Result) -> str | None:
    """Every step's loss against eager's, over the steps both ran (a mode runs more steps when it
    settles compiles): "= (N steps)" when bitwise equal, else the largest absolute difference."""
    a, b = res.get("losses"), eager.get("losses")
    if not a or not b:
        return None
    n = min(len(a), len(b))
    worst = max(abs(x - y) for x, y in zip(a[:n], b[:n]))
    if all(x == y for x, y in zip(a[:n], b[:n])):
        return f"= ({n} steps)"
    return f"max abs diff {worst:.1e} ({n} steps)" if math.isfinite(worst) else "NaN"


def check_vs_eager(eager: Result | None, res: Result) -> str:
    if not ok(eager) or not ok(res) or res.get("checksum") is None:
        return ""
    assert eager is not None
    per_step = losses_vs_eager(eager, res)
    if per_step is not None:
        return per_step
    a, b = res["checksum"], eager["checksum"]
    if a == b:
        return "="
    rel = abs(a - b) / max(abs(b), 1e-30)
    return f"{rel:.0e}" if math.isfinite(rel) else "NaN"


def notes(res: Result) -> str:
    if not ok(res):
        return f"**{str(res.get('status', 'error')).upper()}**: {_clean(res.get('error', ''))}"
    parts = list(res.get("notes") or [])
    timed = res.get("counters_timed") or {}
    total = res.get("counters_total") or {}
    n = res.get("steps_timed") or 1
    if "flushes" in timed:
        parts.append("per step: " + ", ".join(
            f"{timed[key] / n:.3g} {key.removeprefix('trace_')}"
            for key in ENGINE_PER_STEP if key in timed))
        run_totals = [f"{key} {total[key]:.3g}" for key in ENGINE_TOTALS if total.get(key)]
        if run_totals:
            parts.append("run: " + ", ".join(run_totals))
    if res.get("settle_steps"):
        parts.append(f"{res['settle_steps']} settle steps")
    if res.get("compiles_pending_at_timing"):
        parts.append(f"{res['compiles_pending_at_timing']:g} compiles still pending when timed")
    if "unique_graphs" in total:
        hit, miss = total.get("fxgraph_cache_hit", 0), total.get("fxgraph_cache_miss", 0)
        parts.append(f"graph breaks {total.get('graph_breaks', 0):g}, FX cache hit/miss "
                     f"{hit:g}/{miss:g}")
    return "; ".join(parts)


ENGINE_PER_STEP = ("flushes", "trace_hits", "trace_misses", "fallbacks", "compiled_runs",
                   "replayed_runs")
ENGINE_TOTALS = ("compile_seconds", "compile_errors", "disk_hits", "disk_misses", "disk_errors",
                 "kept_fused", "kept_replay", "step_asides", "quarantined", "fused_errors",
                 "engine_errors", "replay_errors")


def _clean(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")[:300]


def _num(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _sig(x: float | None) -> str:
    """Three significant digits, no scientific notation for everyday magnitudes."""
    if x is None:
        return ""
    if x == 0 or 1e-3 <= abs(x) < 1e6:
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return f"{x:.2e}"


def row(res: Result, eager: Result | None, compiled: Result | None) -> list[str]:
    if not ok(res):
        return [res["mode"], *[""] * (len(COLUMNS) - 3), "", notes(res)]
    compiles = res.get("compiles")
    mem = _num(res.get("peak_rss_mb"), ".0f")
    if "cuda_peak_mb" in res:
        mem += f" (GPU {res['cuda_peak_mb']:.0f})"
    return [
        res["mode"], _sig(res["median_s"] * 1e3),
        f"{_sig(res['min_s'] * 1e3)}-{_sig(res['max_s'] * 1e3)}",
        _num(speedup(eager, res), ".3g"), _num(speedup(compiled, res), ".3g"),
        _num(res.get("first_step_s"), ".3f"), _num(res.get("warmup_s"), ".2f"),
        _num(res.get("process_s"), ".1f"),
        "n/a" if compiles is None else f"{compiles:g}",
        _num(res.get("ops_per_step"), "g"), _sig(us_per_op(res)), _sig(overhead_per_op(eager, res)),
        mem, check_vs_eager(eager, res), notes(res),
    ]


def groups(results: list[Result]) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for r in results:
        if (r["workload"], r["size"]) not in seen:
            seen.append((r["workload"], r["size"]))
    return seen


def table(results: list[Result], workload: str, size: str) -> list[str]:
    eager = find(results, workload, size, EAGER_BASELINE)
    compiled = find(results, workload, size, COMPILE_BASELINE)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        if r["workload"] == workload and r["size"] == size:
            lines.append("| " + " | ".join(row(r, eager, compiled)) + " |")
    return lines


def busy(load: tuple[float, ...], cores: int) -> bool:
    """Whether other work was running: a 1-minute load average above half the usable cores."""
    return load[0] > 0.5 * cores


def summary(results: list[Result]) -> list[str]:
    """One line per workload/size, one column per mode: median ms/step (speedup vs eager)."""
    modes = [m for m in MODES if any(r["mode"] == m for r in results)]
    lines = ["| workload | size | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for w, s in groups(results):
        eager = find(results, w, s, EAGER_BASELINE)
        cells = []
        for m in modes:
            res = result_of(results, w, s, m)
            if res is None:
                cells.append("")
            elif not ok(res):
                cells.append(str(res.get("status", "error")).upper())
            else:
                sp = speedup(eager, res)
                cells.append(_sig(res["median_s"] * 1e3) + (f" ({sp:.2f}x)" if sp else ""))
        lines.append(f"| {w} | {s} | " + " | ".join(cells) + " |")
    return lines


def header_lines(header: dict[str, Any]) -> list[str]:
    s = header["settings"]
    machine = header["machine"]
    threads = f"{s.get('threads') or 'torch default (' + str(machine['torch_threads']) + ')'}" \
        f" ({s.get('threads_why', '')})"
    out = [
        f"- Command: `{header['command']}`",
        f"- Machine: {describe(machine)}",
        (f"- Device: {s['device']}; threads per run: {threads}; started {header['started']}; "
         f"suite wall time {header['wall_s']} s"),
        (f"- Load average (1/5/15 min) before: {header['load_before']}, "
         f"after: {header['load_after']}"),
        (f"- Per run: fresh subprocess; {s['warmup']} warm-up steps (first step included), then "
         f"up to {s['steps']} timed steps (stopping after {s['max_seconds']:g} s, at least 3); "
         f"timeout {s['timeout']:g} s"),
        "- Modes: " + "; ".join(f"`{m.name}`: {m.description}" for m in MODES.values()),
    ]
    if header.get("environment"):
        out.append("- Environment: " + ", ".join(f"`{k}={v}`"
                                                 for k, v in header["environment"].items()))
    if busy(tuple(header["load_before"]), machine["usable_cores"]):
        out.append("- **Warning**: other work kept the machine busy when the suite started; "
                   "timings are noisy, compare modes within a table rather than across runs.")
    return out


def markdown(header: dict[str, Any], results: list[Result]) -> str:
    out = ["# adaptive_eager benchmarks", "", *header_lines(header), "",
           "## Summary: median ms/step (speedup vs eager)", "", *summary(results), "", LEGEND]
    for workload, size in groups(results):
        w = WORKLOADS[workload]
        out += [f"## {workload} / {size} ({describe_size(workload, size)})", "",
                f"{w.description}.", "", *table(results, workload, size), ""]
    return "\n".join(out)


def plot(path: Path, results: list[Result], title: str = "") -> bool:
    """Speedup vs eager and time to first step per workload/size; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = groups(results)
    modes = [m for m in MODES if any(r["mode"] == m for r in results)]
    fig, (ax_speed, ax_first) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(keys)), 9))
    width = 0.8 / max(len(modes), 1)
    colors = plt.get_cmap("tab10")
    for j, mode in enumerate(modes):
        color = colors(j)
        xs, speed, lo, hi, first_x, first = [], [], [], [], [], []
        for i, (w, s) in enumerate(keys):
            x = i + (j - (len(modes) - 1) / 2) * width
            res = result_of(results, w, s, mode)
            if res is not None and not ok(res):  # mark the failure where the bar would be
                for ax in (ax_speed, ax_first):
                    ax.text(x, 0.02, "failed", transform=ax.get_xaxis_transform(), rotation=90,
                            ha="center", va="bottom", fontsize=7, color=color)
            if not ok(res):
                continue
            assert res is not None
            first_x.append(x)
            first.append(res["first_step_s"])
            eager = find(results, w, s, EAGER_BASELINE)
            sp = speedup(eager, res)
            if sp is not None and eager is not None:
                xs.append(x)
                speed.append(sp)
                lo.append(sp - eager["median_s"] / res["max_s"])
                hi.append(eager["median_s"] / res["min_s"] - sp)
        ax_speed.bar(xs, speed, width, yerr=[lo, hi], capsize=2, label=mode, color=color)
        ax_first.bar(first_x, first, width, label=mode, color=color)
    labels = [f"{w}\n{s}" for w, s in keys]
    for ax in (ax_speed, ax_first):
        ax.set_xticks(range(len(keys)), labels, fontsize=8)
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    ax_speed.axhline(1.0, color="black", linewidth=0.8)
    ax_speed.set_ylabel("speedup vs eager (median; bars: min/max)")
    ax_first.set_ylabel("time to first step (s)")
    from matplotlib.patches import Patch

    ax_speed.legend(handles=[Patch(color=colors(j), label=m) for j, m in enumerate(modes)],
                    fontsize=8, ncol=3)
    if title:
        ax_speed.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(out_dir: Path, header: dict[str, Any], results: list[Result],
              with_plot: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md"]
    paths[0].write_text(json.dumps({**header, "results": results}, indent=1, default=repr))
    results = shown(results)
    paths[1].write_text(markdown(header, results))
    if not with_plot:
        return paths
    png = out_dir / "results.png"
    machine = header["machine"]
    title = (f"{header['command']}\n{machine['device']}, {machine['cpu']}, "
             f"{machine['usable_cores']} cores, torch {machine['torch']}")
    if plot(png, results, title):
        paths.append(png)
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return paths
