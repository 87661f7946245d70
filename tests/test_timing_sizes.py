"""Note [timing at one size]: a symbolic trace's measured runs come at different sizes, so the
keep decision compares fused and op-by-op times fitted at one size, not their medians."""

from __future__ import annotations

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import compiler
from adaptive_eager.compile import policy
from adaptive_eager.cache.memory import TRIE
from adaptive_eager.compile.policy import MEASURE_RUNS_SYM, _at_one_size, _median

# Measured in benchmarks.varlen's training step (ms at a sequence length): a program 2-3x faster
# than op by op at any one length, whose measured fused runs happened to come at long lengths
# and op-by-op runs at short ones.
FUSED = ([6.633, 7.169, 4.452, 6.141, 6.333], [53, 58, 38, 55, 57])
REPLAY = ([5.147, 4.888, 5.536, 6.679, 16.271], [21, 18, 22, 31, 60])


def test_fitted_at_one_size_not_medians() -> None:
    (fs, fn), (rs, rn) = FUSED, REPLAY
    assert _median(fs) > policy.KEEP_RATIO * _median(rs)  # medians: "not faster"
    fused, replay = _at_one_size(fs, fn, rs, rn)
    assert fused < 0.6 * replay, (fused, replay)
    # the other way round too: an op-by-op trace whose fused runs came at short sizes
    slow = [t * 3.0 for t in fs]  # fused 3x slower than measured
    fused, replay = _at_one_size(slow, fn, rs, rn)
    assert fused > replay, (fused, replay)


def test_static_traces_compare_medians() -> None:
    fs, rs = [1.0, 5.0, 1.1], [2.0, 2.1, 9.0]
    assert _at_one_size(fs, [0, 0, 0], rs, [0, 0, 0]) == (_median(fs), _median(rs))
    # sizes that do not line up with the times (a list trimmed elsewhere): medians too
    assert _at_one_size(fs, [1, 2], rs, [3, 4, 5]) == (_median(fs), _median(rs))


def test_an_outlier_moves_nothing_and_one_size_takes_the_other_slope() -> None:
    ns = [10, 20, 30, 40, 50]
    rs = [1.0 + 0.1 * n for n in ns]
    fs = [0.5 + 0.05 * n for n in ns]
    base = _at_one_size(fs, ns, rs, ns)
    fs_gc = list(fs)
    fs_gc[2] = 250.0  # a GC pause in one fused run
    assert _at_one_size(fs_gc, ns, rs, ns) == pytest.approx(base)
    # every op-by-op run at one size: the fused runs' slope carries it to the common size
    fused, replay = _at_one_size(fs, ns, [4.0] * 5, [30] * 5)
    assert fused == pytest.approx(0.5 + 0.05 * 30) and replay == pytest.approx(4.0)


def _block(ln: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    h = ln(x).view(B, T, 2, 8)
    return h.softmax(1).sum(-1) * 2.0


def _sized_inputs(seed: int) -> tuple[torch.nn.Module, list[torch.Tensor], list[torch.Tensor]]:
    """A LayerNorm, inputs at lengths short then long (the fused runs' and op-by-op runs'
    sizes differ), and eager's results for them."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(16)
    g = torch.Generator().manual_seed(seed)
    sizes = [5, 7, 9, 11, 13, 6, 8, 10] + [20, 33, 17, 27, 45] * 6
    xs = [torch.randn(2, t, 16, generator=g) for t in sizes]
    with torch.no_grad():
        want = [_block(ln, x) for x in xs]
    return ln, xs, want


def test_measured_runs_carry_their_sizes(graph_backend: object,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The sizes the decision fits are the sizes the runs came at (one symbolic trace, programs
    of eager's own kernels), and results stay eager's."""
    decided: list[tuple] = []
    real = policy._at_one_size

    def spy(fs: list, fn: list, ps: list, pn: list) -> tuple[float, float]:
        decided.append((list(fn), list(pn)))
        return real(fs, fn, ps, pn)

    monkeypatch.setattr(policy, "_at_one_size", spy)
    ln, xs, want = _sized_inputs(1)
    ran: list[int] = []
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, symbolic_programs=True,
                           step_aside=False, compile_async=False, compile_process=False,
                           disk_cache=False), torch.no_grad():
        for x, w in zip(xs, want):
            y = _block(ln, x)
            ae.sync()
            assert torch.equal(y, w)  # eager's kernels either way
            ran.append(x.shape[1])
    entry = max((e for e in TRIE.entry_list if e.sym is not None), key=lambda e: e.n_ops)
    assert entry.state in ("fused", "replay"), (entry.state, entry.fused_n, entry.paired_n,
                                                 entry.fused_runs, ae.metrics()["sym_checked"])
    assert decided, entry.decision
    fn, pn = decided[-1]
    assert len(pn) == MEASURE_RUNS_SYM and len(fn) >= MEASURE_RUNS_SYM, decided
    assert set(fn) | set(pn) <= set(ran) and len(set(fn) | set(pn)) > 1, decided


def test_stored_sample_is_what_the_decision_compared(graph_backend: object,
                                                      tmp_path: object) -> None:
    """Note [persisted decisions]: the sample a process leaves on disk is the pair of times its
    keep decision compared (fitted at one size), so the next process decides alike; the plain
    medians of all runs (mixed sizes, unpaired runs) once stored 'op-by-op' for a kept program."""
    from adaptive_eager.cache.disk import DiskCache

    ln, xs, want = _sized_inputs(2)
    with ae.adaptive_eager(backend=graph_backend.name, hot_after=2, symbolic_programs=True,
                           step_aside=False, compile_async=False, compile_process=False,
                           cache_dir=str(tmp_path)), torch.no_grad():
        for x, w in zip(xs, want):
            y = _block(ln, x)
            ae.sync()
            assert torch.equal(y, w)
    entry = max((e for e in TRIE.entry_list if e.sym is not None), key=lambda e: e.n_ops)
    assert entry.state in ("fused", "replay") and entry.decided_s is not None, entry.state
    disk = DiskCache.open(tmp_path, 1 << 30)  # type: ignore[arg-type]
    assert disk is not None
    try:
        stats = disk.get_stats(entry.digest)
    finally:
        disk.close()
    (sample,) = stats["samples"]
    fused, replay = entry.decided_s
    assert sample["fused_ms"] == round(fused * 1e3, 4)
    assert sample["replay_ms"] == round(replay * 1e3, 4)
    keep, _ = compiler._combine(stats["samples"])
    assert keep == (entry.state == "fused"), (stats["decision"], entry.decision)
