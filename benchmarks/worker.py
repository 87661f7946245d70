"""One measurement in a fresh process: ``python -m benchmarks.worker --spec JSON --result PATH``.

Builds the workload, runs it under the mode, and writes one JSON object to PATH. Any exception is
caught and written as ``status: "error"`` so the suite can put it in its table; a crash that kills
the process (segfault, OOM) is noticed by the parent from the missing result file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.modes import probe_engine_options
from benchmarks.workloads import WORKLOADS, Bench

Step = Callable[[], Any]
MAX_LOSSES = 5000


def device_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def numeric(d: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


class Runner:
    """How one mode runs a step: the context to enter, the callable, the sync, the counters."""

    def __init__(self, kind: str, bench: Bench, device: torch.device,
                 options: dict[str, Any]) -> None:
        self.kind = kind
        self.notes: list[str] = []
        self.options_used: dict[str, Any] = {}
        self._device_sync = device_sync(device)
        self.step: Step = bench.step
        self.ae: Any = None
        self.inside = False  # the program enters the engine's context itself
        if kind == "engine":
            import adaptive_eager

            self.ae = adaptive_eager
            self.options_used, self.notes = probe_engine_options(adaptive_eager, options)
            if bench.enters_engine is not None:
                bench.enters_engine(self.options_used)
                self.inside = True
        elif kind == "compile":
            self.step = torch.compile(bench.step)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.ae is None:
            yield
            return
        self.ae.reset_metrics()
        if self.inside:
            yield
            return
        with self.ae.adaptive_eager(**self.options_used):
            yield

    def sync(self) -> None:
        if self.ae is not None:
            self.ae.sync()
        self._device_sync()

    def counters(self) -> dict[str, float]:
        if self.ae is not None:
            return numeric(self.ae.metrics())
        if self.kind == "compile":
            from torch._dynamo.utils import counters

            return {
                "unique_graphs": counters["stats"]["unique_graphs"],
                "graph_breaks": sum(counters["graph_break"].values()),
                "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
                "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
            }
        return {}

    def compiles(self, total: dict[str, float]) -> float | None:
        if self.kind == "compile":
            return total.get("unique_graphs")
        if self.kind == "engine":
            return total.get("compiles")  # None until the engine counts compiles
        return 0


def timed_step(runner: Runner) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = runner.step()
    runner.sync()
    return time.perf_counter() - t0, out


SETTLE_EXTRA_STEPS = 5  # after compiles finish: the engine times fused runs before keeping them
SETTLE_MIN_STEPS = 8  # a trace turns hot on its 3rd run and is submitted on the 4th: look later
SETTLE_QUIET_STEPS = 3  # consecutive steps with nothing pending before timing starts


def _measuring() -> bool:
    """A trace whose program is compiling or still being timed against op-by-op replay (its
    keep/drop decision and the trial after it are still to come)."""
    try:
        from adaptive_eager.cache.memory import TRIE
    except ImportError:
        return False
    return any(e.state in ("compiling", "measuring") for e in TRIE.entry_list[-200:])


def settle(runner: Runner, max_seconds: float) -> dict[str, Any]:
    """Engine only: keep stepping while background compiles are pending, then a few more steps
    so that fresh programs are measured and kept (or dropped) before timing starts.

    "Nothing pending" must hold for a few consecutive steps: a step's traces are submitted one
    after another (the short one first), and between one compile's end and the next one's
    submission the counters read zero. A long trace's compile (minutes for a 500-op training
    step on a busy machine) is waited for up to ``max_seconds``."""
    if runner.ae is None:
        return {}
    steps = 0
    deadline = time.perf_counter() + max_seconds

    def busy() -> bool:  # compiling, measuring a program, or timing the engine against eager
        c = runner.counters()  # (Notes [paired timing], [measured trial])
        return (c.get("compiles_pending", 0) > 0 or c.get("trials_running", 0) > 0
                or _measuring())

    def wait(min_steps: int) -> None:
        nonlocal steps
        quiet = 0
        start = steps
        while time.perf_counter() < deadline and (quiet < SETTLE_QUIET_STEPS
                                                  or steps - start < min_steps):
            timed_step(runner)
            steps += 1
            quiet = 0 if busy() else quiet + 1

    wait(SETTLE_MIN_STEPS)
    total = runner.counters()
    if total.get("compiles", 0) or total.get("disk_hits", 0):
        wait(SETTLE_EXTRA_STEPS)  # programs are timed and kept; then a trial may start
    return {"settle_steps": steps,
            "compiles_pending_at_timing": runner.counters().get("compiles_pending", 0)}


def timed_loop(runner: Runner, steps: int, max_seconds: float) -> list[float]:
    """Up to ``steps`` timed steps, stopping after ``max_seconds`` (but never before 3)."""
    times: list[float] = []
    deadline = time.perf_counter() + max_seconds
    while len(times) < steps and (len(times) < 3 or time.perf_counter() < deadline):
        times.append(timed_step(runner)[0])
    return times


def measure(runner: Runner, bench: Bench, spec: dict[str, Any]) -> dict[str, Any]:
    """First step, warm-up steps, settling (engine compiles), then the timed steps."""
    res: dict[str, Any] = {}
    with runner.active():
        t_first = time.perf_counter()
        res["first_step_s"], out = timed_step(runner)
        res["checksum"] = bench.checksum(out)
        del out
        for _ in range(max(spec["warmup"] - 1, 0)):
            timed_step(runner)
        res.update(settle(runner, spec["settle_seconds"]))
        res["warmup_s"] = time.perf_counter() - t_first  # first step to steady state
        before = runner.counters()
        times = timed_loop(runner, spec["steps"], spec["max_seconds"])
        after = runner.counters()
    res.update(times_s=times, steps_timed=len(times), median_s=statistics.median(times),
               min_s=min(times), max_s=max(times))
    res["counters_total"] = after
    res["counters_timed"] = diff(after, before)
    res["compiles"] = runner.compiles(after)
    ops = res["counters_timed"].get("ops_intercepted")
    res["ops_per_step"] = ops / len(times) if ops is not None else None
    return res


def peak_memory(device: torch.device) -> dict[str, float]:
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    if device.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(spec["device"])
    workload = WORKLOADS[spec["workload"]]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    res: dict[str, Any] = {"status": "ok", "threads": torch.get_num_threads(),
                           "load_at_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    bench = workload.build(spec["size"], device)
    runner = Runner(spec["kind"], bench, device, spec["options"])
    res["setup_s"] = time.perf_counter() - t0
    res["options_used"] = runner.options_used
    res["notes"] = runner.notes
    res.update(measure(runner, bench, spec))
    if bench.losses is not None:  # every step's loss, compared with eager's by the report
        res["losses"] = list(bench.losses[:MAX_LOSSES])
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="JSON object (see suite.RunSpec)")
    parser.add_argument("--result", required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    try:
        res = run(spec)
    except BaseException as err:  # noqa: BLE001  # recorded in the table, never fatal to the suite
        res = {"status": "error", "error": f"{type(err).__name__}: {err}".strip()[:500],
               "traceback": traceback.format_exc()[-4000:]}
    res.update(peak_memory(torch.device(spec["device"])))
    with open(args.result, "w") as f:
        json.dump(res, f, default=repr)
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
