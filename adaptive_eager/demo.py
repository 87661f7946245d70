"""A small built-in example: train an MLP in eager and under the engine (op by op, then with the
default backend, which compiles hot traces), compare the losses, show the engine's counters.

    python -m adaptive_eager.demo [--steps N]
"""

from __future__ import annotations

import argparse
import time

import torch

import adaptive_eager as ae


def train(steps: int, options: dict | None, wait_at: int | None = None
          ) -> tuple[list[float], float, int]:
    """Train; return the losses, the seconds, and how many steps ran a fused program.

    With ``wait_at``, the loop waits there for the background compiles (a real program would
    keep running op by op meanwhile; the demo waits so that a short run shows fused steps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    losses: list[float] = []
    ctx = ae.adaptive_eager(**options) if options is not None else None
    fused_steps = 0
    start = time.perf_counter()
    if ctx is not None:
        ctx.__enter__()
    try:
        for step in range(steps):
            if step == wait_at:
                ae.wait_for_compiles()
            before = ae.metrics()["compiled_runs"] if ctx is not None else 0
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if ctx is not None:
                ae.sync()
                fused_steps += ae.metrics()["compiled_runs"] > before
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return losses, time.perf_counter() - start, fused_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    eager_losses, eager_s, _ = train(args.steps, None)
    print(f"eager          : {args.steps} steps in {eager_s:.3f}s, "
          f"final loss {eager_losses[-1]:.6f}")
    ae.reset_metrics()
    replay_losses, replay_s, _ = train(args.steps, {"backend": "replay"})
    same = replay_losses == eager_losses
    print(f"engine, replay : {args.steps} steps in {replay_s:.3f}s, losses bitwise equal to "
          f"eager: {same}")
    ae.reset_metrics()
    # step_aside off: on a model this small plain eager may well be faster, and the engine would
    # then step aside (the point here is to show a fused program running and matching eager).
    fused_losses, fused_s, fused_steps = train(args.steps, {"step_aside": False},
                                               wait_at=min(6, args.steps // 2))
    close = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(fused_losses, eager_losses))
    m = ae.metrics()
    print(f"engine, fused  : {args.steps} steps in {fused_s:.3f}s (including the wait for the "
          f"compile), {fused_steps} of them ran a fused program; losses within 1e-4 of eager: "
          f"{close}")
    print("metrics: " + ", ".join(f"{k}={m[k]}" for k in (
        "ops_intercepted", "ops_deferred", "flushes", "trace_hits", "trace_misses", "fallbacks",
        "compiles", "compiled_runs", "disk_hits", "compile_errors", "fused_errors")))
    if not fused_steps:
        print("no step ran a fused program: see the warnings above (compile_errors="
              f"{m['compile_errors']}, fused_errors={m['fused_errors']})")
    return 0 if same and close and fused_steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
