"""Review findings left as LOW (session 12): each fixed with a test that failed before."""

from __future__ import annotations

from types import SimpleNamespace

from adaptive_eager import compiler


def _bare_manager() -> compiler.CompileManager:
    mgr = object.__new__(compiler.CompileManager)
    mgr.decided = []
    mgr._remeasure = set()
    mgr.save_stats = lambda entry, sample=False: None  # type: ignore[method-assign]
    return mgr


def _entry() -> SimpleNamespace:
    return SimpleNamespace(digest="d" * 40, runs=9, state="measuring", n_ops=3,
                           fused_s=[1e-5] * 3, paired_s=[2e-5] * 3, replay_s=[2e-5],
                           program=object(), decision="", error="")


def test_deciding_an_entry_twice_counts_it_once() -> None:
    # _decide and _symbolic_replay appended without the identity check _fail makes, so an
    # entry decided again (a re-measure) weighed twice in the step-aside estimate
    mgr, entry = _bare_manager(), _entry()
    mgr._decide(entry)  # type: ignore[arg-type]
    mgr._decide(entry)  # type: ignore[arg-type]
    assert len(mgr.decided) == 1 and mgr.decided[0] is entry
    other = _entry()
    mgr._decide(other)  # type: ignore[arg-type]
    assert len(mgr.decided) == 2
