"""A small built-in example: train an MLP in eager and under the engine (op by op, then with the
default backend, which compiles hot traces), compare the losses, show the engine's counters.

    python -m adaptive_eager.demo [--steps N]
"""

from __future__ import annotations

import argparse
import time

import torch

import adaptive_eager as ae


def train(steps: int, options: dict | None) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    losses: list[float] = []
    ctx = ae.adaptive_eager(**options) if options is not None else None
    start = time.perf_counter()
    if ctx is not None:
        ctx.__enter__()
    try:
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return losses, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    eager_losses, eager_s = train(args.steps, None)
    print(f"eager          : {args.steps} steps in {eager_s:.3f}s, "
          f"final loss {eager_losses[-1]:.6f}")
    ae.reset_metrics()
    replay_losses, replay_s = train(args.steps, {"backend": "replay"})
    same = replay_losses == eager_losses
    print(f"engine, replay : {args.steps} steps in {replay_s:.3f}s, losses bitwise equal to "
          f"eager: {same}")
    ae.reset_metrics()
    fused_losses, fused_s = train(args.steps, {})
    ae.wait_for_compiles()
    close = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(fused_losses, eager_losses))
    m = ae.metrics()
    print(f"engine, default: {args.steps} steps in {fused_s:.3f}s, losses within 1e-4 of eager: "
          f"{close}")
    print("metrics: " + ", ".join(f"{k}={m[k]}" for k in (
        "ops_intercepted", "ops_deferred", "flushes", "trace_hits", "trace_misses", "fallbacks",
        "compiles", "compiled_runs", "disk_hits")))
    return 0 if same and close else 1


if __name__ == "__main__":
    raise SystemExit(main())
