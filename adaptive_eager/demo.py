"""A small built-in example: train an MLP in eager and under the engine, compare, show metrics.

    python -m adaptive_eager.demo [--steps N]
"""

from __future__ import annotations

import argparse
import time

import torch

import adaptive_eager as ae


def train(steps: int, use_engine: bool) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    losses: list[float] = []
    ctx = ae.adaptive_eager() if use_engine else None
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
    eager_losses, eager_s = train(args.steps, use_engine=False)
    ae.reset_metrics()
    engine_losses, engine_s = train(args.steps, use_engine=True)
    same = eager_losses == engine_losses
    print(f"eager : {args.steps} steps in {eager_s:.3f}s, final loss {eager_losses[-1]:.6f}")
    print(f"engine: {args.steps} steps in {engine_s:.3f}s, final loss {engine_losses[-1]:.6f}")
    print(f"losses bitwise equal to eager: {same}")
    m = ae.metrics()
    print("metrics: " + ", ".join(f"{k}={m[k]}" for k in (
        "ops_intercepted", "ops_deferred", "flushes", "trace_hits", "trace_misses", "fallbacks")))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
