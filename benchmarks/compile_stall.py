"""How much a background compile slows the program while it runs (the GIL is shared).

    python -m benchmarks.compile_stall

One process: a small elementwise step runs op by op (replay backend) for a baseline, then under
the default backend while its hot trace compiles, in the helper process (the default, Note
[compile process]) and in a thread of this process, then fused once it is ready. Prints
median microseconds per step for each phase.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

import adaptive_eager as ae

_X = torch.randn(64, 64)


def step() -> float:
    x = _X
    return (x * 0.5 * (1 + torch.tanh(0.79788 * (x + 0.044715 * x ** 3)))).sum().item()


def timed(n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(3):
            step()
        replay = statistics.median(timed(20) for _ in range(10))
    eager = statistics.median(timed(20) for _ in range(10))
    print(f"torch threads {torch.get_num_threads()}; median us/step: eager {eager:.0f}, "
          f"op-by-op {replay:.0f}")
    for in_helper in (False, True):  # in-process first: its in-memory caches stay here
        ae.clear_caches()
        ae.reset_metrics()
        # a fresh Inductor cache for each, so both really compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ae-stall-inductor-")
        with ae.adaptive_eager(hot_after=3, compile_async=True, step_aside=False,
                               disk_cache=False, compile_process=in_helper,
                               cache_dir=tempfile.mkdtemp(prefix="ae-stall-")):
            for _ in range(4):
                step()  # the third run submits the compile
            during = []
            start = time.perf_counter()
            while ae.metrics()["compiles_pending"] and time.perf_counter() - start < 300:
                during.append(timed(5))
            compile_s = time.perf_counter() - start
            for _ in range(10):
                step()  # measure and decide
            after = statistics.median(timed(20) for _ in range(10))
        where = "helper process" if in_helper else "thread of this process"
        print(f"compile in a {where}: {compile_s:.1f} s; median us/step while compiling "
              f"{statistics.median(during) if during else float('nan'):.0f} "
              f"({len(during)} samples of 5 steps), after ({ae.metrics()['kept_fused']} kept "
              f"fused) {after:.0f}")


if __name__ == "__main__":
    main()
