"""Threads and the engine (Note [threads and lazy tensors] in engine.py).

- A deferred in-place write to a real tensor is visible to another thread once the writing
  thread hands off through ``Event.set``, ``Queue.put``, ``Condition.notify``,
  ``Semaphore.release``, ``Barrier.wait`` or ``Thread.start``, as in eager; through a bare
  ``Lock`` the writer calls ``adaptive_eager.sync()`` first (documented).
- A lazy tensor read or used on another thread (plain eager or under its own engine) has
  eager's value, while its own thread keeps recording; no deadlock, no corruption of the
  recording thread's later results.
Every thread is joined with a timeout: a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import adaptive_eager as ae

JOIN_TIMEOUT = 120.0


def _run_threads(*targets: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as err:  # reported in the test's own thread
                errors.append(err)
        return run

    threads = [threading.Thread(target=guard(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread did not finish"
    if errors:
        raise errors[0]


def _engine() -> Any:
    return ae.adaptive_eager(backend="replay", step_aside=False, check=True)


# ---- in-place writes to real tensors, seen after a handoff ---------------------------------------

class _Handoff:
    """One-way signal from the writer to the reader, and back, through a given primitive."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "event":
            self.go, self.back = threading.Event(), threading.Event()
        elif kind == "queue":
            self.go_q, self.back_q = queue.Queue(), queue.Queue()
        elif kind == "condition":
            self.cond = threading.Condition()
            self.turn = "writer"
        elif kind == "semaphore":
            self.go_s, self.back_s = threading.Semaphore(0), threading.Semaphore(0)
        elif kind == "barrier":
            self.barrier = threading.Barrier(2)

    def signal(self) -> None:  # writer: my writes are done
        if self.kind == "event":
            self.go.set()
        elif self.kind == "queue":
            self.go_q.put(1)
        elif self.kind == "condition":
            with self.cond:
                self.turn = "reader"
                self.cond.notify()
        elif self.kind == "semaphore":
            self.go_s.release()
        else:
            self.barrier.wait()

    def wait(self) -> None:  # reader
        if self.kind == "event":
            self.go.wait()
            self.go.clear()
        elif self.kind == "queue":
            self.go_q.get()
        elif self.kind == "condition":
            with self.cond:
                self.cond.wait_for(lambda: self.turn == "reader")
        elif self.kind == "semaphore":
            self.go_s.acquire()
        else:
            self.barrier.wait()

    def done(self) -> None:  # reader: I have read
        if self.kind == "event":
            self.back.set()
        elif self.kind == "queue":
            self.back_q.put(1)
        elif self.kind == "condition":
            with self.cond:
                self.turn = "writer"
                self.cond.notify()
        elif self.kind == "semaphore":
            self.back_s.release()
        else:
            self.barrier.wait()

    def wait_done(self) -> None:  # writer
        if self.kind == "event":
            self.back.wait()
            self.back.clear()
        elif self.kind == "queue":
            self.back_q.get()
        elif self.kind == "condition":
            with self.cond:
                self.cond.wait_for(lambda: self.turn == "writer")
        elif self.kind == "semaphore":
            self.back_s.acquire()
        else:
            self.barrier.wait()


def _writer_reader(kind: str, use_engine: bool, rounds: int = 5) -> list[float]:
    w = torch.zeros(3)
    seen: list[float] = []
    h = _Handoff(kind)

    def writer() -> None:
        ctx = _engine() if use_engine else torch.no_grad()
        with ctx:
            for _ in range(rounds):
                w.add_(1.0)
                w.mul_(1.5)
                h.signal()
                h.wait_done()

    def reader() -> None:  # plain eager
        for _ in range(rounds):
            h.wait()
            seen.append(float(w[0]))
            h.done()

    _run_threads(writer, reader)
    return seen


@pytest.mark.parametrize("kind", ["event", "queue", "condition", "semaphore", "barrier"])
def test_inplace_write_visible_after_handoff(kind: str) -> None:
    """Was (Event): the plain-eager reader saw the value from before the writer's last write."""
    expected = _writer_reader(kind, use_engine=False)
    got = _writer_reader(kind, use_engine=True)
    assert got == expected
    assert ae.metrics()["ops_deferred"] > 0  # the writes were deferred, then flushed


def test_inplace_write_visible_to_a_started_thread() -> None:
    w = torch.zeros(2)
    seen: list[float] = []
    with _engine():
        for i in range(3):
            w.add_(2.0)
            t = threading.Thread(target=lambda: seen.append(float(w[0])))
            t.start()  # eager: the thread sees every write made before start()
            t.join(JOIN_TIMEOUT)
    assert seen == [2.0, 4.0, 6.0]


def test_bare_lock_handoff_needs_sync() -> None:
    """A bare Lock's release is C code the engine cannot see: the documented rule is to call
    ``adaptive_eager.sync()`` before releasing a lock that guards tensors written under the
    engine. With it, the reader sees every write, as in eager."""
    w = torch.zeros(2)
    lock = threading.Lock()
    seen: list[float] = []
    turns = {"n": 0}
    rounds = 4

    def writer() -> None:
        with _engine():
            for i in range(rounds):
                while True:
                    with lock:
                        if turns["n"] == 2 * i:
                            w.add_(1.0)
                            ae.sync()  # the documented step
                            turns["n"] += 1
                            break

    def reader() -> None:
        for i in range(rounds):
            while True:
                with lock:
                    if turns["n"] == 2 * i + 1:
                        seen.append(float(w[0]))
                        turns["n"] += 1
                        break

    _run_threads(writer, reader)
    assert seen == [1.0, 2.0, 3.0, 4.0]


# ---- lazy tensors read on another thread --------------------------------------------------------

def _producer_values(n: int, x: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    acc = torch.zeros_like(x)
    sums = []
    for i in range(n):
        y = (x * (i + 1)).sin() @ x
        acc.add_(y)
        sums.append(y.sum().item())
    return sums, acc


@pytest.mark.parametrize("channel", ["queue", "simple_queue"])
def test_lazy_tensor_read_on_plain_thread(channel: str) -> None:
    """Was: RecursionError in materialize. ``queue.Queue.put`` is a handoff (the producer's
    trace runs at put); ``SimpleQueue`` is C code, so the consumer runs the producer's trace
    itself while the producer keeps recording."""
    torch.manual_seed(0)
    x = torch.randn(24, 24)
    n = 40
    expected, expected_acc = _producer_values(n, x)
    for _ in range(2):  # the second round defers every op (the first learns them)
        q: Any = queue.Queue() if channel == "queue" else queue.SimpleQueue()
        acc = torch.zeros_like(x)
        got: list[float] = []

        def producer() -> None:
            with _engine():
                for i in range(n):
                    y = (x * (i + 1)).sin() @ x
                    acc.add_(y)
                    q.put(y)
                    for _ in range(3):
                        (y * 2).cos()  # keeps recording while the consumer reads
                q.put(None)

        def consumer() -> None:
            while (y := q.get()) is not None:
                got.append(y.sum().item())

        _run_threads(producer, consumer)
        assert got == expected
        assert torch.equal(acc, expected_acc)  # the producer's own writes are intact
    m = ae.metrics()
    assert m["engine_errors"] == 0 and m["replay_errors"] == 0
    if channel == "simple_queue":
        assert m["flush_reasons"]["other_thread:read"] > 0, m["flush_reasons"]


def test_lazy_tensor_read_while_owner_blocks() -> None:
    """The owner waits (Event.wait is no handoff) for the reader, which needs the owner's
    pending values: the reader runs the trace itself, so there is no deadlock."""
    x = torch.arange(6.0)
    box: dict[str, Any] = {}
    read, stored = threading.Event(), threading.Event()

    def owner() -> None:
        with _engine():
            for i in range(3):
                box["y"] = (x + i).exp()
                box["i"] = i
                stored.set()  # a handoff: flushes what is pending now...
                z = (box["y"] * 2).sqrt()  # ...then this stays pending while we wait
                box["z"] = z
                box["z_ready"] = True
                read.wait()
                read.clear()

    def reader() -> None:
        for i in range(3):
            stored.wait()
            stored.clear()
            while not box.get("z_ready"):
                pass
            box["z_ready"] = False
            box.setdefault("seen", []).append(box["z"].tolist())  # pending on the owner
            read.set()

    _run_threads(owner, reader)
    assert box["seen"] == [((x + i).exp() * 2).sqrt().tolist() for i in range(3)]


def test_lazy_tensor_used_under_another_engine() -> None:
    """Thread B, under its own engine, uses thread A's lazy tensors as inputs."""
    x = torch.randn(8, 8)
    n = 12
    expected = [((x * i).tanh() @ x + 1).sum().item() for i in range(n)]
    for _ in range(2):
        q: Any = queue.SimpleQueue()
        got: list[float] = []

        def a() -> None:
            with _engine():
                for i in range(n):
                    q.put((x * i).tanh())
                    (x * 3).relu()  # more pending work on A
                q.put(None)

        def b() -> None:
            with _engine():
                while (y := q.get()) is not None:
                    got.append((y @ x + 1).sum().item())

        _run_threads(a, b)
        assert got == expected
    assert ae.metrics()["engine_errors"] == 0


def test_handoff_flush_never_runs_inside_the_engine() -> None:
    """A handoff while a flush is already running on the thread (the engine's own compile
    submission, a logging queue) must not flush again."""
    from adaptive_eager import engine as engine_mod

    with _engine():
        for _ in range(2):  # the second time they are deferred
            y = torch.ones(4) * 2
            y = y * 2
        eng = engine_mod.owned_engine()
        assert eng is not None
        eng.flushing += 1
        try:
            threading.Event().set()  # would flush, but the thread is inside a flush
            assert eng.trace.ops
        finally:
            eng.flushing -= 1
        threading.Event().set()
        assert not eng.trace.ops
        assert y.tolist() == [4.0] * 4
