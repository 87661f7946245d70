"""Review findings rated LOW: each fixed with a test that failed before."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from adaptive_eager import config
from adaptive_eager.compile.policy import Decisions, PolicyHooks


def _decisions() -> Decisions:
    """The decisions of a compile manager, with nothing stored and no ranks to agree with."""
    hooks = PolicyHooks(save_stats=lambda entry, sample=False: None,
                        agree_keep=lambda entry, keep: keep, agree_aside=lambda reason: reason,
                        distributed_job=lambda: False, recent_entries=list)
    return Decisions(config.resolve({}), True, threading.RLock(), hooks)


def _entry() -> SimpleNamespace:
    return SimpleNamespace(digest="d" * 40, runs=9, state="measuring", n_ops=3,
                           fused_s=[1e-5] * 3, paired_s=[2e-5] * 3, replay_s=[2e-5],
                           program=object(), decision="", error="", sym=None,
                           fused_n=[0] * 3, paired_n=[0] * 3)


def test_deciding_an_entry_twice_counts_it_once() -> None:
    # _decide and _symbolic_replay appended without the identity check _fail makes, so an
    # entry decided again (a re-measure) weighed twice in the step-aside estimate
    dec, entry = _decisions(), _entry()
    dec._decide(entry)  # type: ignore[arg-type]
    dec._decide(entry)  # type: ignore[arg-type]
    assert len(dec.decided) == 1 and dec.decided[0] is entry
    other = _entry()
    dec._decide(other)  # type: ignore[arg-type]
    assert len(dec.decided) == 2


def test_a_storage_method_with_nothing_pending_is_no_fallback() -> None:
    # regions.storage_call counted a fallback for every storage method run under the engine,
    # even with no pending trace to cut short
    import torch

    import adaptive_eager as ae
    from adaptive_eager.metrics import METRICS as M

    x = torch.randn(8)
    storage = x.untyped_storage()
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for _ in range(2):  # the first run of an op runs eagerly: learn x + 1
            (x + 1).clone()
            ae.sync()
        before = M.fallback_ops["storage method"]
        storage.fill_(0)  # nothing pending: no flush, no fallback
        assert M.fallback_ops["storage method"] == before
        y = x + 1  # pending, reads x
        storage.fill_(0)  # flushes the pending trace first: a fallback
        assert M.fallback_ops["storage method"] == before + 1
        y = y.clone()
    assert torch.equal(x, torch.zeros(8)) and torch.equal(y, torch.ones(8))
