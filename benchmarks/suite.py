"""``python -m benchmarks``: plan the (workload, size, mode) runs, run each in a fresh subprocess,
then write results.json, results.md and results.png to the out directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.machine import REPO_ROOT, machine_info
from benchmarks.modes import MODES, Mode, parse_modes, wanted_options
from benchmarks.workloads import WORKLOADS, Workload

DEFAULT_OUT = Path(__file__).parent / "out"


@dataclasses.dataclass(frozen=True)
class Settings:
    quick: bool
    device: str
    warmup: int
    steps: int
    max_seconds: float  # timed loop stops after this (at least 3 steps)
    settle_seconds: float  # longest wait, stepping, for the engine's background compiles
    timeout: float  # a run is killed after this many seconds
    threads: int | None  # torch/OpenMP threads per run; None = torch's default
    threads_why: str  # how the thread count was chosen, for the report


@dataclasses.dataclass(frozen=True)
class RunSpec:
    workload: str
    size: str
    mode: Mode
    reported: bool  # False for a primer run that only fills a warm mode's cache


def parse_workloads(text: str | None) -> list[Workload]:
    if not text:
        return list(WORKLOADS.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    return [w for w in WORKLOADS.values() if w.name in names]


def plan(workloads: list[Workload], modes: list[Mode], quick: bool,
         sizes: set[str] | None = None) -> list[RunSpec]:
    """Every selected (workload, size, mode); a warm mode without its primer gets a silent one.

    ``sizes`` (names such as small, large, 64K) picks sizes instead of the quick/full default."""
    runs: list[RunSpec] = []
    selected = {m.name for m in modes}
    for w in workloads:
        chosen = [s for s in w.sizes if s in sizes] if sizes else (
            w.quick_sizes if quick else w.sizes)
        for size in chosen:
            for m in modes:
                if m.primer and m.primer not in selected:
                    runs.append(RunSpec(w.name, size, MODES[m.primer], reported=False))
                runs.append(RunSpec(w.name, size, m, reported=True))
    return runs


def cache_dirs(root: Path, device: str, run: RunSpec) -> tuple[Path, Path]:
    """(inductor dir, engine dir): shared inside a mode's cache group, private otherwise."""
    group = run.mode.cache_group or run.mode.name
    base = root / f"{device}-{run.workload}-{run.size}" / group
    inductor, engine = base / "inductor", base / "engine"
    for d in (inductor, engine):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)  # the engine refuses shared cache dirs
    return inductor, engine


def child_env(inductor_dir: Path, engine_dir: Path, threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if threads:  # also reaches Inductor's OpenMP kernels, which torch.set_num_threads may not
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    # Triton's cache follows Inductor's folder (triton_cache_dir); a variable of its own would
    # also be part of the compile service's identity, a service the driver could not ask about
    env.pop("TRITON_CACHE_DIR", None)
    env["ADAPTIVE_EAGER_CACHE_DIR"] = str(engine_dir)
    env.pop("ADAPTIVE_EAGER", None)  # the eager baseline must not switch the engine on
    return env


ENV_PREFIXES = ("ADAPTIVE_EAGER_", "TORCHINDUCTOR_", "TORCH_", "OMP_", "MKL_", "CUDA_VISIBLE")


def settings_from_env() -> dict[str, str]:
    """Variables that change what the workers measure (they pass through; the report shows them)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def exit_reason(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exit {returncode}"


def kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill the worker and any compile workers it started (they share its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_worker(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, bool]:
    """Run a measuring subprocess in its own session from the repository root: (returncode,
    stderr, timed out). Past ``timeout``, or on Ctrl-C (which the child's own session does not
    get), its whole process group is killed."""
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_group(proc)
        _, stderr = proc.communicate()
        timed_out = True
    except BaseException:
        kill_group(proc)
        raise
    return proc.returncode, stderr, timed_out

def run_one(run: RunSpec, settings: Settings, root: Path) -> dict[str, Any]:
    """Run one measurement in a fresh subprocess; errors and timeouts become result fields."""
    inductor_dir, engine_dir = cache_dirs(root, settings.device, run)
    spec = {"workload": run.workload, "size": run.size, "mode": run.mode.name,
            "kind": run.mode.kind, "device": settings.device, "warmup": settings.warmup,
            "steps": settings.steps, "max_seconds": settings.max_seconds,
            "threads": settings.threads, "settle_seconds": settings.settle_seconds,
            "options": wanted_options(run.mode, str(engine_dir))}
    result_path = root / f"result-{os.getpid()}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "benchmarks.worker", "--spec", json.dumps(spec),
           "--result", str(result_path)]
    env = child_env(inductor_dir, engine_dir, settings.threads)
    t0 = time.perf_counter()
    returncode, stderr, timed_out = run_worker(cmd, env, settings.timeout)
    res: dict[str, Any] = {"workload": run.workload, "size": run.size, "mode": run.mode.name,
                           "process_s": time.perf_counter() - t0, "returncode": returncode}
    if result_path.exists():
        res.update(json.loads(result_path.read_text()))
        result_path.unlink()
    elif timed_out:
        res.update(status="timeout", error=f"killed after {settings.timeout:.0f} s")
    else:
        res.update(status="error", error=f"worker died ({exit_reason(returncode)}): "
                                         f"{_tail(stderr, 2)}"[:500])
    if res.get("status") != "ok":
        res["stderr_tail"] = _tail(stderr, 20)
    return res


def progress_line(i: int, n: int, res: dict[str, Any]) -> str:
    head = f"[{i}/{n}] {res['workload']:<14} {res['size']:<5} {res['mode']:<19}"
    if res.get("status") == "ok":
        return (f"{head} {res['median_s'] * 1e3:10.3f} ms/step  first step "
                f"{res['first_step_s']:.2f} s  ({res['process_s']:.1f} s)")
    return f"{head} {res.get('status', '?').upper()}: {str(res.get('error', ''))[:100]}"


def run_all(runs: list[RunSpec], settings: Settings,
            on_result: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Run every spec in order (cache dirs live in one temp dir); Ctrl-C keeps what finished."""
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ae-bench-") as tmp:
        for i, run in enumerate(runs, 1):
            try:
                res = run_one(run, settings, Path(tmp))
            except KeyboardInterrupt:
                print(f"interrupted: reporting the {len(results)} finished runs", flush=True)
                break
            print(progress_line(i, len(runs), res) + ("" if run.reported else "  (primer)"),
                  flush=True)
            if not run.reported:
                res["primer"] = True  # kept in the JSON, left out of tables and plots
            results.append(res)
            on_result(results)
    return results


def choose_threads(requested: str, load: tuple[float, float, float]) -> tuple[int | None, str]:
    """``auto``: torch's default on an idle machine, 1 on a busy one (see report.busy)."""
    if requested != "auto":
        return int(requested), "--threads"
    if report.busy(load, machine_cores()):
        return 1, f"auto: machine busy, load average {load[0]} on {machine_cores()} cores"
    return None, "auto: machine idle"


def make_settings(args: argparse.Namespace, load: tuple[float, float, float]) -> Settings:
    quick = bool(args.quick)
    threads, threads_why = choose_threads(args.threads, load)
    return Settings(quick=quick, device=args.device,
                    warmup=args.warmup if args.warmup is not None else (5 if quick else 10),
                    steps=args.steps if args.steps is not None else (10 if quick else 30),
                    max_seconds=args.max_seconds if args.max_seconds is not None
                    else (10.0 if quick else 60.0),
                    settle_seconds=args.settle_seconds if args.settle_seconds is not None
                    else (60.0 if quick else 300.0),
                    timeout=args.timeout if args.timeout is not None
                    else (300.0 if quick else 1200.0),
                    threads=threads, threads_why=threads_why)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=(
        "Eager vs adaptive_eager vs torch.compile; each (workload, size, mode) runs in a fresh "
        "process."))
    p.add_argument("--quick", action="store_true", help="small sizes, few steps (a few minutes)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output dir ({DEFAULT_OUT})")
    p.add_argument("--workloads", help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    p.add_argument("--modes", help=f"comma-separated subset of: {', '.join(MODES)}")
    p.add_argument("--sizes", help="comma-separated size names (small, large, 64K, 1M, 16M) "
                   "instead of the --quick/full default")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda runs the suite on the GPU; skipped with a message when absent")
    p.add_argument("--warmup", type=int, help="steps before timing (first step included)")
    p.add_argument("--steps", type=int, help="timed steps per run")
    p.add_argument("--max-seconds", type=float, help="stop the timed loop after this (>= 3 steps)")
    p.add_argument("--timeout", type=float, help="kill a run after this many seconds")
    p.add_argument("--settle-seconds", type=float, help=(
        "longest wait, stepping, for the engine's compiles, measurements and trial before "
        "timing (default 300; mid-size steps compile for minutes on a busy machine)"))
    p.add_argument("--threads", default="auto", type=threads_arg, help=(
        "torch/OpenMP threads per run: N, or auto (default): torch's default unless other work "
        "keeps the machine busy, then 1 (multi-threaded ops on a busy machine wait on "
        "descheduled threads, distorting eager and compiled times by up to 100x)"))
    return p.parse_args(argv)


def threads_arg(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError("expected a positive integer or auto")
    return text


def load_average() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


def machine_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        workloads, modes = parse_workloads(args.workloads), parse_modes(args.modes)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not cuda_available():
        print("CUDA is not available (torch.cuda.is_available() is False): skipping the GPU suite.")
        return 0
    load_before = load_average()
    settings = make_settings(args, load_before)
    sizes = {x.strip() for x in args.sizes.split(",") if x.strip()} if args.sizes else None
    runs = plan(workloads, modes, settings.quick, sizes)
    if not runs:
        print("error: nothing to run (check --workloads/--sizes)", file=sys.stderr)
        return 2
    command = "python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"{command}: {len(runs)} runs on {settings.device}, threads per run "
          f"{settings.threads or 'default'} ({settings.threads_why})", flush=True)
    t0 = time.perf_counter()
    header: dict[str, Any] = {
        "command": command.strip(), "machine": machine_info(settings.device),
        "settings": dataclasses.asdict(settings), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": "(running)", "load_before": load_before, "load_after": "(running)",
        "environment": settings_from_env()}

    def write_partial(results: list[dict[str, Any]]) -> None:  # a crash still leaves a report
        report.write_all(args.out, header, results, with_plot=False)

    results = run_all(runs, settings, write_partial)
    header.update(wall_s=round(time.perf_counter() - t0, 1), load_after=load_average())
    paths = report.write_all(args.out, header, results)
    print("\n" + report.markdown(header, report.shown(results)))
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = sum(r.get("status") != "ok" for r in report.shown(results))
    if failed:
        print(f"{failed} of {len(report.shown(results))} runs failed (see the notes column)")
    return 0
