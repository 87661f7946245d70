"""Benchmark suite for adaptive_eager (not collected by pytest; nothing here is named test_*).

    python -m benchmarks [--quick] [--out DIR] [--workloads a,b] [--modes x,y] [--device cpu|cuda]
    python -m benchmarks.op_overhead [--out DIR]

Each (workload, size, mode) runs in its own fresh subprocess (``benchmarks.worker``) so compile
caches and warm-ups are isolated; results land in ``benchmarks/out/`` as JSON, markdown and PNG.
"""
