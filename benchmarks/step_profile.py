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
    ("step-aside and round hooks, own time", "aside.py", "*", "own"),
)


def _steps(bench: Any, n: int, sync: Any) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        bench.step()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="gpt2_train")
    p.add_argument("--size", default="mid")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=5, help="timed (and profiled) steps")
    p.add_argument("--max-warmup", type=int, default=30, help="steps before giving up settling")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", help="engine cache (default: a fresh temporary folder)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import adaptive_eager as ae

    bench = WORKLOADS[args.workload].build(args.size, torch.device("cpu"))
    _steps(bench, 2, lambda: None)
    eager = _steps(bench, args.steps, lambda: None)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="ae-profile-")
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
