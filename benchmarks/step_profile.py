"""Where a training step's time goes under the engine: ``python -m benchmarks.step_profile``.

Builds one workload (default: the mid-size GPT-2 step), times plain eager steps, then runs it
under the engine (compiles waited for, stepping aside off, so the engine itself is what is
measured) until its traces are decided, times steady-state steps, and profiles a few with
cProfile. The profile is split by the engine's phases: the dispatch handler (everything the
engine does per intercepted op, including kernels it runs at once: views, random ops, syncs),
recording (``Engine.record``, inside the handler), the ops run at once, the read guard (the
TorchFunctionMode), flushes (op-by-op replay and fused runs, kernels included) and the
step-aside hooks. cProfile slows Python by about 2x, so the per-op figures are upper bounds;
the unprofiled step times are the ones to compare.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.workloads import WORKLOADS

# (label, file suffix, function name or "*" for every function of the file, "cum" for the
# calls' cumulative time or "own" for time in the functions themselves). Cumulative phases nest
# (the read guard's cumulative time holds the dispatch below it; an optimizer step's hook holds
# the flush it makes), so nesting phases are given as their own time only.
PHASES = (
    ("dispatch handler, total (all engine work per op)", "dispatch/mode.py",
     "__torch_dispatch__", "cum"),
    ("  record (key, trie, lazy outputs)", "engine.py", "record", "cum"),
    ("  ops run at once (flush + kernel)", "engine.py", "run_eager", "cum"),
    ("  views of real tensors (kernel included)", "engine.py", "run_view", "cum"),
    ("read guard, own time (TorchFunctionMode)", "dispatch/mode.py", "__torch_function__",
     "own"),
    ("flush, total (kernels included)", "engine.py", "flush", "cum"),
    ("  op-by-op replay (kernels included)", "execute.py", "replay", "cum"),
    ("  fused program runs (kernels included)", "fused.py", "run_fused", "cum"),
    ("  publishing values to lazy tensors", "execute.py", "publish", "cum"),
    ("step-aside and round hooks, own time",
     ("adaptive_eager/aside.py", "adaptive_eager/rounds.py", "adaptive_eager/trial.py",
      "adaptive_eager/saving.py"), "*", "own"),
)


def _steps(bench: Any, n: int, sync: Any) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        bench.step()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _cpu_step(bench: Any, sync: Any) -> float:
    """One step's CPU time in this process (user + system): a busy machine stretches wall
    clock, this much less."""
    c0 = time.process_time()
    bench.step()
    sync()
    return time.process_time() - c0


def aside_check(args: argparse.Namespace, cache: str) -> int:
    """Does running aside cost anything? Two identical copies of the workload in one process:
    A runs under the engine with its default options (background compiles, measuring, the
    trial) until it has stepped aside or kept the engine; B never sees the engine. Then steps
    of A and B alternate (A's inside the context, aside or not; then both outside it): state
    the engine left on A's tensors would make A slower than B, process-wide leftovers (hooks,
    threads, helpers busy) would slow both against the eager steps before."""
    import adaptive_eager as ae
    from adaptive_eager import api

    a = WORKLOADS[args.workload].build(args.size, torch.device("cpu"))
    b = WORKLOADS[args.workload].build(args.size, torch.device("cpu"))

    def pairs(label: str, n: int, sync: Any) -> None:
        ta: list[float] = []
        tb: list[float] = []
        for i in range(n):  # alternate which copy goes first
            first, second = (a, b) if i % 2 == 0 else (b, a)
            for bench in (first, second):
                (ta if bench is a else tb).append(_cpu_step(bench, sync))
        ma, mb = statistics.median(ta), statistics.median(tb)
        print(f"{label}: A {ma * 1e3:.1f} ms CPU/step, B {mb * 1e3:.1f} ms (A/B {ma / mb:.3f}), "
              f"load {os.getloadavg()[0]:.1f}", flush=True)

    _steps(a, 2, lambda: None)
    _steps(b, 2, lambda: None)
    pairs("eager, before", args.steps, lambda: None)
    deadline = time.perf_counter() + args.max_seconds
    with ae.adaptive_eager(backend=args.backend, cache_dir=cache):
        steps = 0
        while time.perf_counter() < deadline:
            _steps(a, 1, ae.sync)
            steps += 1
            pr = api._state.presence
            if pr is not None and pr.trial is None and not pr.waiting and (pr.aside or pr.verdict):
                break
        pr = api._state.presence
        m = ae.metrics()
        where = "aside" if pr is not None and pr.aside else "in the engine"
        print(f"engine on A: {steps} steps, then {where} (kept_fused {m['kept_fused']}, "
              f"kept_replay {m['kept_replay']}, trials {m['trials']}, step_asides "
              f"{m['step_asides']})", flush=True)
        pairs(f"A {where} / B plain, inside the context", args.steps, ae.sync)
    pairs("both outside the context", args.steps, lambda: None)
    return 0


def paired(args: argparse.Namespace, cache: str) -> int:
    """Engine against eager in one process, steps interleaved (the mid-size targets on a
    shared machine, where separate processes see different load): plain eager; the engine with
    its own decisions (default backend, compiles waited for, stepping aside off, so the engine
    itself is measured); and op-by-op replay (backend="replay"). After warming each, rounds of
    one step per mode, the order rotated every round (``--compile`` adds torch.compile of the
    whole step, ``--program`` the engine's largest program called on its own); process CPU time
    per step (one torch thread: kernels run in this thread) and wall clock. Prints the medians,
    the ratios to eager and what the engine decided for its traces."""
    import resource

    import adaptive_eager as ae

    bench = WORKLOADS[args.workload].build(args.size, torch.device("cpu"))
    engine = dict(backend=args.backend, compile_async=False, step_aside=False, cache_dir=cache)
    replay = dict(backend="replay", step_aside=False, cache_dir=cache + "-replay")

    def under(opts: Any, n: int) -> None:
        if callable(opts):  # the compiled step
            for _ in range(n):
                opts()
            return
        if opts is None:
            _steps(bench, n, lambda: None)
            return
        with ae.adaptive_eager(**opts):
            _steps(bench, n, ae.sync)

    modes: dict[str, Any] = {"eager": None, "engine": engine, "replay": replay}
    compiled = torch.compile(bench.step) if args.compile else None
    if compiled is not None:
        modes["compile"] = compiled  # torch.compile of the whole step, same model and data
    t0 = time.perf_counter()
    under(None, 2)
    if compiled is not None:
        for _ in range(3):
            compiled()
    for warm in range(1, args.max_warmup + 1):  # until every flush runs a decided trace
        ae.reset_metrics()
        under(engine, 1)
        m = ae.metrics()
        if warm >= 6 and m["replayed_runs"] + m["compiled_runs"] == m["flushes"] and (
                m["kept_fused"] + m["kept_replay"] == 0):
            break
    under(replay, 3)
    program = _largest_program() if args.program else None
    if program is not None:
        modes["program"] = program
    settle_s = time.perf_counter() - t0
    cpu: dict[str, list[float]] = {k: [] for k in modes}
    wall: dict[str, list[float]] = {k: [] for k in modes}
    faults: dict[str, list[int]] = {k: [] for k in modes}
    names = list(modes)
    ae.reset_metrics()
    for r in range(args.steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, w0 = time.process_time(), time.perf_counter()
            under(modes[name], 1)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    m = ae.metrics()
    med = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"{args.workload} {args.size}, backend {args.backend}, {args.threads} thread(s), "
          f"{args.steps} rounds, warmed in {settle_s:.1f} s (engine settled after {warm} steps), "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<8} {'CPU ms/step':>12} {'x eager':>8} {'wall ms/step':>13} {'x eager':>8} "
          f"{'faults/step':>12}")
    mw = {k: statistics.median(v) for k, v in wall.items()}
    for k in modes:
        print(f"{k:<8} {med[k] * 1e3:12.1f} {med['eager'] / med[k]:8.3f} {mw[k] * 1e3:13.1f} "
              f"{mw['eager'] / mw[k]:8.3f} {statistics.median(faults[k]):12.0f}")
    print(f"engine and replay rounds together: {m['flushes']} flushes, {m['compiled_runs']} fused "
          f"runs, {m['replayed_runs']} op-by-op runs, {m['ops_fused']} ops fused of "
          f"{m['ops_deferred']} deferred")
    from adaptive_eager.cache.memory import TRIE

    for entry in sorted(TRIE.entry_list, key=lambda e: e.n_ops, reverse=True)[:6]:
        if entry.decision:
            print(f"  trace {entry.digest[:12]} ({entry.n_ops} ops): {entry.decision}")
    return 0


def _largest_program() -> Any:
    """The engine's largest program as a step of its own: called on copies of the inputs it was
    built with, as fused.run_fused calls it (its inputs' construction and the engine's
    recording left out), so its time is the program's and compares with torch.compile's."""
    from adaptive_eager.backends.inductor import _detached
    from adaptive_eager.cache.memory import TRIE
    from adaptive_eager.execute import ReplayGuard

    entries = [e for e in TRIE.entry_list if e.program is not None and e.graph is not None]
    if not entries:
        print("no program to time on its own (the engine kept none)")
        return None
    entry = max(entries, key=lambda e: e.n_ops)
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t
              for t in _detached(entry.graph.example_inputs)]
    print(f"'program': trace {entry.digest[:12]} ({entry.n_ops} ops) on its own")
    # held here: the engine's own keep decision may drop it from the entry mid-run
    program = entry.program

    def run() -> None:
        with ReplayGuard():
            program(*inputs)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="gpt2_train")
    p.add_argument("--size", default="mid")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=5, help="timed (and profiled) steps")
    p.add_argument("--max-warmup", type=int, default=30, help="steps before giving up settling")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", help="engine cache (default: a fresh temporary folder)")
    p.add_argument("--aside-check", action="store_true",
                   help="instead of the profile: does the engine leave anything that slows "
                        "plain eager down (see aside_check)")
    p.add_argument("--paired", action="store_true",
                   help="instead of the profile: eager, the engine and op-by-op replay steps "
                        "interleaved in one process (see paired)")
    p.add_argument("--compile", action="store_true",
                   help="--paired: also torch.compile of the whole step, in the same rounds")
    p.add_argument("--program", action="store_true",
                   help="--paired: also the engine's largest program called on its own")
    p.add_argument("--max-seconds", type=float, default=900.0,
                   help="--aside-check: longest engine phase (compiles, measuring, the trial)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import adaptive_eager as ae

    if args.paired:
        cache = args.cache_dir or tempfile.mkdtemp(prefix="ae-paired-")
        os.makedirs(cache, mode=0o700, exist_ok=True)
        os.chmod(cache, 0o700)
        return paired(args, cache)
    if args.aside_check:
        cache = args.cache_dir or tempfile.mkdtemp(prefix="ae-aside-")
        os.makedirs(cache, mode=0o700, exist_ok=True)
        os.chmod(cache, 0o700)
        return aside_check(args, cache)

    bench = WORKLOADS[args.workload].build(args.size, torch.device("cpu"))
    _steps(bench, 2, lambda: None)
    eager = _steps(bench, args.steps, lambda: None)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="ae-profile-")
    os.makedirs(cache, mode=0o700, exist_ok=True)  # a --cache-dir not made yet
    os.chmod(cache, 0o700)
    with ae.adaptive_eager(backend=args.backend, compile_async=False, step_aside=False,
                           cache_dir=cache):
        t0 = time.perf_counter()
        warm = 0
        for warm in range(1, args.max_warmup + 1):
            ae.reset_metrics()
            _steps(bench, 1, ae.sync)
            m = ae.metrics()
            if warm >= 6 and m["replayed_runs"] + m["compiled_runs"] == m["flushes"] and (
                    args.backend == "replay" or m["kept_fused"] + m["kept_replay"] == 0):
                break  # every flush ran a decided trace and nothing is being measured
        settle_s = time.perf_counter() - t0
        ae.reset_metrics()
        engine = _steps(bench, args.steps, ae.sync)
        m_timed = ae.metrics()
        prof = cProfile.Profile()
        prof.enable()
        profiled = _steps(bench, args.steps, ae.sync)
        prof.disable()
    eager2 = _steps(bench, args.steps, lambda: None)
    eager_all = eager + eager2
    ops = m_timed["ops_intercepted"] / args.steps
    stats = pstats.Stats(prof)
    cum: dict[str, float] = {}
    for (file, _line, name), (_cc, _nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        for label, suffix, fn, kind in PHASES:
            if (fn == "*" or name == fn) and file.endswith(suffix):
                cum[label] = cum.get(label, 0.0) + (ct if kind == "cum" else tt)
    me, mg = statistics.median(eager_all), statistics.median(engine)
    print(f"{args.workload} {args.size}, backend {args.backend}, {args.threads} thread(s), "
          f"settled after {warm} steps ({settle_s:.1f} s)")
    print(f"eager median {me * 1e3:.2f} ms/step; engine median {mg * 1e3:.2f} ms/step "
          f"({me / mg:.2f}x eager); profiled {statistics.median(profiled) * 1e3:.2f} ms/step")
    print(f"per step: {ops:.0f} ops intercepted, {m_timed['ops_deferred'] / args.steps:.0f} "
          f"deferred, {m_timed['ops_fused'] / args.steps:.0f} ran fused, "
          f"{m_timed['ops_eager'] / args.steps:.0f} at once, "
          f"{m_timed['flushes'] / args.steps:.1f} flushes "
          f"({m_timed['compiled_runs'] / args.steps:.1f} fused runs), "
          f"flush reasons {dict(m_timed['flush_reasons'])}")
    print(f"eager's own time per intercepted op: {me / max(ops, 1) * 1e6:.1f} µs")
    print(f"{'phase (cProfile, cumulative)':<46} {'ms/step':>9} {'µs/op':>8}")
    for label, _suffix, _fn, _kind in PHASES:
        t = cum.get(label, 0.0) / args.steps
        print(f"{label:<46} {t * 1e3:9.2f} {t / max(ops, 1) * 1e6:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
