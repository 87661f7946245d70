"""Note [paired timing]: while a program is measured, fused runs alternate with op-by-op runs of
the same trace, and the keep/drop decision compares those pairs."""

from __future__ import annotations

import torch

import adaptive_eager as ae
from adaptive_eager.cache.memory import TRIE
from adaptive_eager.compiler import MEASURE_RUNS


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        x = torch.tanh(x * 0.9 + w) - 0.1 * x
    return x


def test_measuring_alternates_fused_and_op_by_op_runs(graph_backend: object
                                                      ) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(64), torch.randn(64)
    ref = _step(x, w)
    kinds: list[str] = []
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, step_aside=False,
                           compile_async=False, compile_process=False, disk_cache=False):
        for _ in range(20):
            before = ae.metrics()
            out = _step(x, w)
            ae.sync()
            assert torch.equal(out, ref)  # op by op and the aten-graph program are eager's
            after = ae.metrics()
            kinds.append("F" if after["compiled_runs"] > before["compiled_runs"] else "R")
    entry = max(TRIE.entry_list, key=lambda e: e.n_ops)
    assert entry.state in ("fused", "replay"), entry.state
    assert entry.decision, entry
    assert len(entry.paired_s) == MEASURE_RUNS, entry.paired_s
    first = kinds.index("F")
    # warm-up fused run, then MEASURE_RUNS pairs of (fused, op by op), then the decision
    measured = kinds[first:first + 1 + 2 * MEASURE_RUNS]
    assert measured == ["F"] + ["F", "R"] * MEASURE_RUNS, kinds
    after_decision = set(kinds[first + 1 + 2 * MEASURE_RUNS:])
    assert after_decision == ({"F"} if entry.state == "fused" else {"R"}), (entry.state, kinds)
