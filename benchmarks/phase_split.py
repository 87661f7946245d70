"""Where a training step's time goes, phase by phase: ``python -m benchmarks.phase_split``.

    python -m benchmarks.phase_split [--size small|mid] [--steps 60] [--skip 20]
                                     [--backend replay|inductor] [--compile] [--threads 1]
                                     [--fused-only]

The varlen GPT-2 training step (``benchmarks.varlen``'s model, batches and AdamW foreach) runs
in one process twice, plain eager and then under the engine with stepping aside off, and each
step is timed in phases: forward (``zero_grad`` and the loss), backward, the optimizer step,
and the rest (``.item()`` of the loss). Under the engine the trace's flush happens inside the
optimizer step's hook; the time of every flush (``Engine.flush``: op-by-op replay or the fused
program, kernels included) is taken out of the phase it fell in and shown as ``flush``, so the
first three engine columns are what recording costs: the model's Python, autograd and the engine's
interception, with no kernel of the trace run. Their sum is a floor for any engine that runs
the user's Python every step, whatever its programs cost; the table sets it beside eager's
whole step and, with ``--compile``, beside torch.compile's (the whole step compiled with its
default automatic dynamic shapes, timed after the other two in the same process).

The default backend is ``replay`` (no compile: the recording phases do not depend on it);
``--backend inductor`` compiles in the process, at the flush that finds the trace hot
(``ADAPTIVE_EAGER_COMPILE_ASYNC=0``, inside the skipped steps), so the flush column is the fused
program's. The engine's cache folder and Inductor's are fresh temporary ones unless
``ADAPTIVE_EAGER_CACHE_DIR`` / ``TORCHINDUCTOR_CACHE_DIR`` are set. Medians over the steps
after ``--skip``; with ``--fused-only``, the engine's medians are over those of them in which a
fused program ran (a hot trace's decision runs it op by op a few times to measure, and with
symbolic sizes again at new sizes: those steps say what replay costs, not the program).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from typing import Any

PHASES = ("forward", "backward", "optimizer", "flush", "item")


def _run(engine: bool, size: str, steps: int, skip: int,
         fused_only: bool = False) -> tuple[list[float], list[float], int]:
    """Median ms of each phase over steps after ``skip``, every step's loss, and how many steps
    were timed. ``fused_only``: time only the steps in which a fused program ran (not the
    engine's op-by-op measuring runs of a hot trace, which a decision may still be taking)."""
    import torch

    import adaptive_eager
    from adaptive_eager.engine import Engine
    from benchmarks import varlen

    model = varlen._train_model(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batches = varlen._batches(steps, size)
    flushed = [0.0]
    real_flush = Engine.flush

    def timed_flush(self: Engine, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_flush(self, *args, **kwargs)
        finally:
            flushed[0] += time.perf_counter() - t

    rows: list[tuple[float, ...]] = []
    losses: list[float] = []
    ctx = adaptive_eager.adaptive_eager() if engine else contextlib.nullcontext()
    Engine.flush = timed_flush  # type: ignore[method-assign]
    try:
        with ctx:
            for i, ids in enumerate(batches):
                runs0 = adaptive_eager.metrics()["compiled_runs"] if fused_only else 0
                flushed[0] = 0.0
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                t1, f1 = time.perf_counter(), flushed[0]
                loss.backward()
                t2, f2 = time.perf_counter(), flushed[0]
                opt.step()
                t3, f3 = time.perf_counter(), flushed[0]
                losses.append(loss.detach().item())
                t4, f4 = time.perf_counter(), flushed[0]
                if fused_only and adaptive_eager.metrics()["compiled_runs"] == runs0:
                    continue
                if i >= skip:  # each phase less the flushes inside it, which have their column
                    rows.append((t1 - t0 - f1, t2 - t1 - (f2 - f1), t3 - t2 - (f3 - f2), f4,
                                 t4 - t3 - (f4 - f3)))
    finally:
        Engine.flush = real_flush  # type: ignore[method-assign]
    if not rows:
        raise SystemExit("phase_split: no step was timed (with --fused-only: no fused program "
                         "ran after --skip; more --steps, or a hot_after the run reaches)")
    return [statistics.median(c) * 1e3 for c in zip(*rows)], losses, len(rows)


def _run_compiled(size: str, steps: int, skip: int) -> tuple[float, list[float]]:
    """torch.compile of the whole step (its default automatic dynamic shapes): median ms of a
    step after ``skip``, and every step's loss."""
    import torch

    from benchmarks import varlen

    step = torch.compile(varlen._train_step(varlen._train_model(size)))
    times, losses = [], []
    for i, ids in enumerate(varlen._batches(steps, size)):
        t0 = time.perf_counter()
        losses.append(step(ids).item())
        if i >= skip:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, losses


def table(eager: list[float], engine: list[float], compile_ms: float | None = None) -> str:
    lines = ["| mode | " + " | ".join(PHASES) + " | recording (fwd+bwd+opt) | step |",
             "|---|" + "---|" * (len(PHASES) + 2)]
    for name, row in (("eager", eager), ("engine kept on", engine)):
        rec = sum(row[:3])
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}" for x in row)
                     + f" | {rec:.2f} | {sum(row):.2f} |")
    if compile_ms:
        lines.append("| torch.compile (whole step) |" + " - |" * (len(PHASES) + 1)
                     + f" {compile_ms:.2f} |")
    rec = sum(engine[:3])
    lines.append("")
    lines.append(f"Engine recording alone: {rec:.2f} ms = {rec / sum(eager):.2f}x eager's whole "
                 f"step ({sum(eager):.2f} ms).")
    if compile_ms:
        lines.append(f"torch.compile's whole step: {compile_ms:.2f} ms; recording alone is "
                     f"{rec / compile_ms:.2f}x that, so the engine kept on reaches at most "
                     f"{compile_ms / rec:.2f}x torch.compile's throughput with a free program; "
                     f"with its program it gives {compile_ms / sum(engine):.2f}x.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small", choices=("small", "mid"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=20, help="steps before timing")
    p.add_argument("--backend", default="replay")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile of the whole step in this process")
    p.add_argument("--fused-only", action="store_true",
                   help="engine: time only steps in which a fused program ran (not a decision's "
                        "op-by-op measuring runs)")
    args = p.parse_args(argv)
    if args.skip >= args.steps:
        p.error(f"--skip {args.skip} leaves no timed step of --steps {args.steps}")
    os.environ["ADAPTIVE_EAGER_STEP_ASIDE"] = "0"  # every step through the engine
    os.environ["ADAPTIVE_EAGER_BACKEND"] = args.backend
    # inductor: compile at the flush that finds the trace hot, inside the skipped steps
    os.environ["ADAPTIVE_EAGER_COMPILE_ASYNC"] = "0"
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # no kernel compiled by an earlier run
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ae-phase-split-ind-")
    if "ADAPTIVE_EAGER_CACHE_DIR" not in os.environ:  # a fresh folder: nothing from earlier runs
        os.environ["ADAPTIVE_EAGER_CACHE_DIR"] = tempfile.mkdtemp(prefix="ae-phase-split-")
    import torch

    torch.set_num_threads(args.threads)
    eager, eager_losses, _ = _run(False, args.size, args.steps, args.skip)
    engine, engine_losses, n_engine = _run(True, args.size, args.steps, args.skip,
                                           args.fused_only)
    diff = max(abs(a - b) for a, b in zip(eager_losses, engine_losses))
    compile_ms = None
    if args.compile:
        compile_ms, compiled_losses = _run_compiled(args.size, args.steps, args.skip)
        diff_c = max(abs(a - b) for a, b in zip(eager_losses, compiled_losses))
    timed = ("" if n_engine == args.steps - args.skip else
             f"; engine: the {n_engine} of them in which a fused program ran")
    print(f"GPT-2 {args.size} varlen step, {args.steps} steps (median of the last "
          f"{args.steps - args.skip}{timed}), backend {args.backend}, ms:\n")
    print(table(eager, engine, compile_ms))
    print(f"max loss difference against eager: engine {diff:.3g}"
          + (f", torch.compile {diff_c:.3g}" if args.compile else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
