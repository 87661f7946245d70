"""Benchmark suite for adaptive_eager (not collected by pytest; nothing here is named test_*).

    python -m benchmarks [--quick] [--out DIR] [--workloads a,b] [--modes x,y] [--device cpu|cuda]
    python -m benchmarks.op_overhead [--out DIR]

Each (workload, size, mode) runs in its own fresh subprocess (``benchmarks.worker``) so compile
caches and warm-ups are isolated; results land in ``benchmarks/out/`` as JSON, markdown and PNG.
"""

import os

# Note [learning budget] in adaptive_eager/budget.py: by default the engine spends at most 5% of a
# run beyond eager's time on learning, so on a machine with few cores it holds its first compile
# back for minutes. The benchmarks that measure what the engine does once it has decided (steady
# steps, per-op costs, time to a fused step) run without that limit, unless the caller set one;
# ``benchmarks.whole_run`` times whole runs as a user sees them and gives its engine runs the
# caller's environment as it was (``USER_BUDGET``).
USER_BUDGET = os.environ.get("ADAPTIVE_EAGER_BUDGET")
os.environ.setdefault("ADAPTIVE_EAGER_BUDGET", "0")
