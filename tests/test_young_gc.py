"""Note [young collections]: while the engine records, the young generation's threshold sits
above what a pending trace keeps alive; the program's own threshold is never touched, and
garbage cycles are still collected."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import collector


@pytest.fixture
def default_threshold() -> Iterator[tuple[int, ...]]:
    before = gc.get_threshold()
    gc.set_threshold(*collector._DEFAULT)
    yield collector._DEFAULT
    gc.set_threshold(*before)


def _chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x * 1.0001 + 0.5
    return x


def _young_collections(fn) -> int:
    seen = []

    def cb(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()  # counts start at zero
    gc.callbacks.append(cb)
    try:
        fn()
    finally:
        gc.callbacks.remove(cb)
    return len(seen)


def test_threshold_raised_while_recording_and_restored(default_threshold: tuple) -> None:
    x = torch.randn(16)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        raised = gc.get_threshold()
        y = _chain(x, 5)
    assert raised[0] == collector.young_threshold(4096) > default_threshold[0]
    assert raised[1:] == default_threshold[1:]
    assert gc.get_threshold() == default_threshold
    assert torch.equal(y, _chain(x, 5))
    with ae.adaptive_eager(backend="replay", step_aside=False, gc_headroom=False):
        assert gc.get_threshold() == default_threshold  # off: left alone


def test_a_programs_own_threshold_is_left_alone(default_threshold: tuple) -> None:
    gc.set_threshold(300, 5, 5)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        assert gc.get_threshold() == (300, 5, 5)
    assert gc.get_threshold() == (300, 5, 5)
    gc.set_threshold(*default_threshold)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        gc.set_threshold(1000, 10, 10)  # set inside: kept on the way out
    assert gc.get_threshold() == (1000, 10, 10)


def test_a_pending_trace_sets_off_no_collection(default_threshold: tuple) -> None:
    # collections are counted process-wide: a compile an earlier test left running in a
    # background thread of this process (Inductor allocates heavily) must end first
    ae.wait_for_compiles()
    x = torch.randn(16)
    want = _chain(x, 600)
    for _ in range(2):  # learn the ops' metadata and the trace
        with ae.adaptive_eager(backend="replay", step_aside=False, gc_headroom=False):
            _chain(x, 600)
    got: list[torch.Tensor] = []

    def run(headroom: bool) -> None:
        with ae.adaptive_eager(backend="replay", step_aside=False, gc_headroom=headroom):
            got.append(_chain(x, 600))  # 600 pending ops, one flush at the exit

    assert _young_collections(lambda: run(False)) >= 1  # the interpreter's 700 is passed
    # another thread's allocations count too: the better of two runs (a broken headroom
    # collects in both)
    assert min(_young_collections(lambda: run(True)) for _ in range(2)) == 0
    assert all(torch.equal(g, want) for g in got)


class _Cycle:
    def __init__(self) -> None:
        self.me = self
        self.t = torch.ones(4)


def test_garbage_cycles_are_still_collected(default_threshold: tuple) -> None:
    x = torch.randn(16)
    refs = []
    with ae.adaptive_eager(backend="replay", step_aside=False):
        for i in range(3 * collector.young_threshold(4096)):
            c = _Cycle()
            if i % 100 == 0:
                refs.append(weakref.ref(c))
            del c
        y = _chain(x, 5)
    assert torch.equal(y, _chain(x, 5))
    collected = sum(r() is None for r in refs)
    assert collected >= len(refs) // 2, (collected, len(refs))  # no gc.collect() was called


def test_two_threads_restore_once_both_left(default_threshold: tuple) -> None:
    entered, leave = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with ae.adaptive_eager(backend="replay", step_aside=False):
                entered.set()
                leave.wait(30)
                _chain(torch.randn(4), 3)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            entered.set()

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(30)
    with ae.adaptive_eager(backend="replay", step_aside=False):
        assert gc.get_threshold()[0] > default_threshold[0]
    assert gc.get_threshold()[0] > default_threshold[0]  # the other thread still records
    leave.set()
    t.join(30)
    assert not errors and not t.is_alive()
    assert gc.get_threshold() == default_threshold
