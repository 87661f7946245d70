"""The built-in example: a step that fusion speeds up, run in eager, under the engine op by op and
with fused programs; its results compared with eager's in every run, and the engine's own account
of what it decided for each trace and why.

    python -m adaptive_eager.demo [--steps N] [--elements N]

The step updates a float32 state of 1M elements with 13 elementwise ops (a tanh-GELU, a gain, an
average with the old state). In eager each op is a pass over memory (and, with several threads,
a parallel region of its own); Inductor fuses the 13 into one loop, several times faster on a CPU.

Exit status 0 when every engine run matched eager (op by op: bitwise; fused: within
``TOLERANCE``) and no fault was counted; 1 otherwise. Running op by op because the fused program
was measured not to pay, in this run or in an earlier one whose decision the disk cache kept, is
the engine's decision, not a fault: the demo says so and exits 0.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import adaptive_eager as ae
from adaptive_eager.cache.disk import resolve_cache_dir
from adaptive_eager.cache.memory import TRIE, TraceEntry
from adaptive_eager.compiler import manager_for
from adaptive_eager.report import decision_text

TOLERANCE = 1e-5  # fused: |fused - eager| <= TOLERANCE * (1 + |eager|), elementwise
# counters that mean a fault here (a chain of elementwise ops defers and fuses entirely)
FAULTS = ("engine_errors", "replay_errors", "compile_errors", "fused_errors", "quarantined",
          "fallbacks")
# counters of a degraded run whose results stay right (the cache or compile service unusable)
DEGRADED = ("disk_errors", "service_errors", "helper_errors")
_EARLIER = " (earlier run)"  # the compiler's mark on a decision taken from the disk cache
COUNTERS = ("ops_intercepted", "ops_deferred", "flushes", "trace_hits", "trace_misses",
            "compiles", "disk_hits", "compiled_runs", "replayed_runs", "kept_fused",
            "kept_replay") + FAULTS


def step(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """One update of the state: 13 elementwise aten ops, each a full pass over memory in eager."""
    inner = x + 0.044715 * x * x * x
    y = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * inner))
    return 0.5 * x + 0.5 * y * gain


@dataclass
class Run:
    """One pass over the steps: the final state, each step's seconds, whether it ran fused."""

    state: torch.Tensor
    seconds: list[float] = field(default_factory=list)
    fused: list[bool] = field(default_factory=list)
    waited: float = 0.0  # seconds spent waiting for compiles (not in ``seconds``)
    metrics: dict[str, Any] = field(default_factory=dict)
    traces: list[TraceEntry] = field(default_factory=list)
    stored: dict[str, dict] = field(default_factory=dict)  # trace -> its disk-cache statistics
    cache_dir: str = ""

    def median_ms(self, fused: bool | None = None) -> float | None:
        """Median step in ms: of all steps, or of the fused (or op-by-op) ones only."""
        s = sorted(t for t, f in zip(self.seconds, self.fused) if fused is None or f == fused)
        return 1e3 * s[len(s) // 2] if s else None


def run(steps: int, elements: int, options: dict[str, Any] | None) -> Run:
    """The steps in eager (``options`` None) or under the engine with ``options``.

    Under the engine each step ends with ``sync()`` (one trace per step, as a training step that
    reads its loss), and a compile in flight is waited for before the next step: a real program
    keeps running op by op meanwhile; the demo waits so that a short run shows fused steps. The
    engine's in-memory caches are cleared first, so the run starts as a new process would (the
    disk cache stays)."""
    torch.manual_seed(0)
    out = Run(torch.randn(elements))
    gain = 0.5 + 0.5 * torch.rand(elements)
    if options is None:
        for _ in range(steps):
            start = time.perf_counter()
            out.state = step(out.state, gain)
            out.seconds.append(time.perf_counter() - start)
            out.fused.append(False)
        return out
    ae.clear_caches()
    ae.reset_metrics()
    ctx = ae.adaptive_eager(**options)
    with ctx:
        for _ in range(steps):
            if ae.metrics()["compiles_pending"]:
                start = time.perf_counter()
                ae.wait_for_compiles()
                out.waited += time.perf_counter() - start
            before = ae.metrics()["compiled_runs"]
            start = time.perf_counter()
            out.state = step(out.state, gain)
            ae.sync()
            out.seconds.append(time.perf_counter() - start)
            out.fused.append(ae.metrics()["compiled_runs"] > before)
    out.metrics = ae.metrics()
    out.traces = list(TRIE.entry_list)
    disk = manager_for(ctx.options).disk
    out.cache_dir = str(resolve_cache_dir(ctx.options)) if disk is not None else "not used"
    for e in out.traces:
        stats = disk.get_stats(e.digest) if disk is not None else None
        if stats and stats.get("decision"):
            out.stored[e.digest] = stats
    return out


def within_tolerance(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    diff = (got - want).abs()
    return bool((diff <= TOLERANCE * (1.0 + want.abs())).all()), float(diff.max())


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def trace_lines(e: TraceEntry, stored: dict | None) -> list[str]:
    """One trace from the engine's trace table: runs, state, measured times, decisions."""
    s = e.summary()
    times = [f"op by op {s['replay_ms']:.1f} ms" if s["replay_ms"] is not None else "",
             f"fused {s['fused_ms']:.1f} ms" if s["fused_ms"] is not None else ""]
    if s["compile_s"]:
        times.append(f"compiled in this run in {s['compile_s']:.1f} s")
    elif s["fused_runs"]:
        times.append("program loaded from the disk cache")
    decision = decision_text(s["decision"])
    lines = [f"  trace {s['trace'][:12]}: {s['n_ops']} ops, ran {s['runs']}x "
             f"({s['fused_runs']}x fused), now {s['state']}; median times: "
             f"{', '.join(t for t in times if t) or 'not timed'}",
             f"    decision: {decision or 'none yet (not hot)'}"]
    if stored and decision.removesuffix(_EARLIER) != stored["decision"]:
        lines.append(f"    in the disk cache, for the next run: {stored['decision']}")
    return lines


def explain(fused: Run, eager_ms: float | None) -> list[str]:
    """The engine's decisions for the traces that repeated, and the verdict in words."""
    repeated = [e for e in fused.traces if e.runs > 1 or e.decision]
    lines = ["what the engine decided (its trace table after the fused run):"]
    for e in repeated:
        lines += trace_lines(e, fused.stored.get(e.digest))
    once = len(fused.traces) - len(repeated)
    if once:
        cut = sum(n for r, n in fused.metrics["flush_reasons"].items() if r.startswith("new_op"))
        why = (f"the first step, cut {cut}x where the engine met an op for the first time"
               if cut else "not hot")
        lines.append(f"  {once} more trace(s) ran once ({why}): op by op")
    kept = [e for e in repeated if e.state == "fused"]
    dropped = [e for e in repeated if e.state == "replay"]
    fused_ms = fused.median_ms(fused=True)
    if kept and fused_ms is not None and eager_ms is not None:
        lines.append(f"verdict: the engine kept {len(kept)} fused program(s); a fused step took "
                     f"{fused_ms:.1f} ms against eager's {eager_ms:.1f} ms "
                     f"({eager_ms / fused_ms:.1f}x faster)")
    elif dropped:
        where = ("an earlier run (the disk cache kept its decision)"
                 if any(e.decision.endswith(_EARLIER) for e in dropped) else "this run")
        lines.append(f"verdict: the engine runs this step op by op, as decided in {where} "
                     "for the reason above: the engine's decision, not a fault")
    else:
        lines.append("verdict: no trace was decided in this run (too few --steps to compile "
                     "and measure a program)")
    return lines


def faults(r: Run) -> list[str]:
    found = [f"{k}={r.metrics[k]}" for k in FAULTS if r.metrics.get(k)]
    found += [f"trace {e.digest[:12]} quarantined (its fused program disagreed with eager)"
              for e in r.traces if e.state == "quarantined"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12,
                        help="steps per run (default 12: enough to compile, measure and keep "
                             "a program)")
    parser.add_argument("--elements", type=int, default=1 << 20, help="size of the state")
    args = parser.parse_args(argv)
    steps, n = max(args.steps, 1), max(args.elements, 1)
    if ae.is_enabled():  # ADAPTIVE_EAGER=1: the eager reference must run without the engine
        ae.disable()
        print("the engine was on (ADAPTIVE_EAGER=1): switched off; the demo enters it itself")
    print(f"workload: {steps} steps of a 13-op elementwise update of a {n:,}-element float32 "
          f"state, {torch.get_num_threads()} CPU thread(s)")
    eager = run(steps, n, None)
    eager_ms = eager.median_ms()
    print(f"  eager            : median step {ms(eager_ms)}")
    # step_aside off: every step stays under the engine, so each trace's own decision shows
    replay = run(steps, n, {"backend": "replay", "step_aside": False})
    same = torch.equal(replay.state, eager.state)
    print(f"  engine, op by op : median step {ms(replay.median_ms())}; final state bitwise "
          f"equal to eager's: {same}")
    fused = run(steps, n, {"step_aside": False})
    close, diff = within_tolerance(fused.state, eager.state)
    n_fused = sum(fused.fused)
    if not n_fused:  # every step ran op by op: bitwise eager
        close = close and torch.equal(fused.state, eager.state)
    m = fused.metrics
    print(f"  engine, fused    : {n_fused} of {steps} steps ran a fused program (median "
          f"{ms(fused.median_ms(fused=True))}), {steps - n_fused} op by op (median "
          f"{ms(fused.median_ms(fused=False))}); waited {fused.waited:.1f} s for compiles "
          f"({m['compiles']} compiled here, {m['disk_hits']} loaded from the disk cache)")
    print(f"    final state within {TOLERANCE:g} of eager's: {close} (largest difference "
          f"{diff:.2g}{'; no step ran fused, so bitwise equal' if not n_fused else ''})")
    for line in explain(fused, eager_ms):
        print(line)
    print("counters: " + ", ".join(f"{k}={m[k]}" for k in COUNTERS))
    print(f"disk cache: {fused.cache_dir} (`adaptive-eager report` shows each run's account)")
    degraded = [f"{k}={m[k]}" for k in DEGRADED if m.get(k)]
    if degraded:
        print(f"degraded, results unaffected: {', '.join(degraded)} (see the warnings above)")
    bad = faults(replay) + faults(fused)
    problems = (["op-by-op results differ from eager's"] if not same else []) + (
        [f"fused results outside {TOLERANCE:g} of eager's"] if not close else []) + bad
    if problems:
        print("FAULT: " + "; ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
