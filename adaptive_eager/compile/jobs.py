"""Where a compile runs: in this thread, in the compile helper, or in the compile service; the
background worker that waits on them and loads what they send back.

Note [in-process compiles]
Inductor's compile changes process-wide state while it runs: it saves the global RNG states and
restores them at the end (a program drawing numbers meanwhile on another thread has its stream
rewound: draw 2695 came back as draw 1059), and torch.fx's tracer patches ``nn.Module.__call__``
and friends (the program's module calls on another thread ran through the patch: NameError in
user code). No lock the engine takes can shield the user's own Python from that. So a compile
in this process never runs beside the program: it runs in the flushing thread, at the flush
that wants it (the program waits, as with compile_async off), inside ``_compile_guard``, which
also restores the CPU (and initialized CUDA) RNG states and Python's ``random`` state after it.
Only work that touches no such state runs in the background worker: waiting on the helper
process's answer (the compile proper runs there, Note [compile process]), storing the bytes it
sent, and deserializing programs. A helper that fails hands the compile back to the next flush.
Measured here (fx-patch reproducer: 16 Linear+Tanh blocks, SGD, 2 cores shared with other
work): 6 in-process compiles, no error in user code, 171 s of wall time for 18 steps (about 25 s
of waiting per compile). In a thread the same compiles slowed every step 3.4x for as long
(benchmarks/compile_stall.py) and broke the program; the helper process (the default) costs the
program neither.

Note [compile worker]
The background worker is one daemon thread of this module, not a ThreadPoolExecutor (whose
workers concurrent.futures joins at exit: a compile pending at exit held the process for
seconds to minutes, then stored nothing). When the program's main thread ends
(``threading._register_atexit``, before non-daemon threads are joined), work still queued or
running is dropped, the helper is abandoned, and one line on stderr says how many compiles and
that the next run compiles them (their traces are marked hot on disk at submit). The worker imports
nothing itself: the compiler's modules are imported in the program's thread (``_import_compiler``,
0.9-2.4 s here on a 2-core machine, paid once). A background import raced the program's own
``import torch._dynamo`` (which any torch.optim optimizer does) and raised "partially initialized
module" ImportErrors in user code; and a load that imports late, during shutdown, failed to
register its atexit hook.

Note [import when a program lands]
Sending a trace to the compile service or a helper needs none of the compiler's modules; only
loading the program it sends back does. So the import waits for the first program to land: the
worker stores the bytes and hands them back unloaded (``_Landed``) while the compiler is not
imported yet, and the flushing thread imports and loads at the trace's next run. A cold run that
ends before its first program lands (a 200-step script beside a 40 s cold compile) never pays
the import: it cost every such run 0.8-1.5 s of a 1-3 s whole run here, in its fifth step. A
run that gets a program pays it once, at a step it was going to run faster from. Programs from
disk (Note [warm start]) still import first, in the program's thread, before the worker loads.

The manager owns one ``Jobs``; it hands in the helper and the service as a ``Transport`` (their
modules sit in the engine's import circle, above this one) and itself as the ``JobsOwner``: the
options, backend and disk cache, its programs (key, store) and the pickup of a finished compile.
This module imports nothing of the engine: trace entries and graphs are values here (``Any``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from adaptive_eager.compile.parts import Part
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.spans import span

log = logging.getLogger("adaptive_eager")

# One compile in this process at a time (Inductor's own state is process-wide too).
_LOCAL_COMPILE = threading.Lock()


class _CompileHere:
    """A worker job's answer meaning: compile this trace in this process, at the next flush."""


COMPILE_HERE = _CompileHere()


@contextlib.contextmanager
def outside_modes() -> Iterator[None]:
    """Run compiler code with no torch-function or dispatch mode of this thread active.

    Inductor runs tensor ops of its own (fake tensors, constant folding); under the engine's modes
    they would be recorded as if the user had written them.
    """
    with _disable_current_modes():
        funcs = [torch._C._pop_torch_function_stack()
                 for _ in range(torch._C._len_torch_function_stack())]
        try:
            yield
        finally:
            for mode in reversed(funcs):
                torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def _compile_guard() -> Iterator[None]:
    """Around a compile in this process (Note [in-process compiles]): the program's random
    streams are as they were before it."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    py = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)


@contextlib.contextmanager
def progress(label: str, stream: Any = None) -> Iterator[None]:
    """On a terminal, show a long compile as it goes (which trace, seconds so far); else quiet."""
    out = stream if stream is not None else sys.stderr
    if not getattr(out, "isatty", lambda: False)():
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def tick() -> None:
        while not done.wait(1.0):
            elapsed = time.perf_counter() - start
            if elapsed >= 2.0:
                out.write(f"\radaptive_eager: compiling {label} ... {elapsed:.0f}s")
                out.flush()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        elapsed = time.perf_counter() - start
        if elapsed >= 2.0:
            out.write(f"\radaptive_eager: compiled {label} in {elapsed:.1f}s\n")
            out.flush()


# ---- the background worker (Note [compile worker]) ----------------------------------------------
class _Worker:
    """One daemon thread running jobs in order; dropped, not joined, when the program ends."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._running: tuple | None = None
        self.closed = False
        self._pid = os.getpid()

    def submit(self, fn: Callable[..., Any], *args: Any, label: str = "") -> \
            concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._pid != os.getpid():  # a forked child: its parent's thread is not here
                self._thread, self._jobs, self._pid = None, collections.deque(), os.getpid()
            if self.closed:
                fut.cancel()
                return fut
            self._jobs.append((fut, fn, args, label))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="adaptive_eager-compile")
                self._thread.start()
                _register_exit_hook()
            self._cond.notify()
        return fut

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self.closed:
                    self._cond.wait()
                if self.closed:
                    return
                job = self._running = self._jobs.popleft()
            fut, fn, args, _ = job
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as err:  # noqa: B036 - handed to whoever reads the future
                    if not self.closed:
                        fut.set_exception(err)
                else:
                    if not self.closed:
                        fut.set_result(result)
            with self._cond:
                self._running = None
                self._cond.notify_all()

    def is_current(self) -> bool:
        """Whether the caller runs in the worker's thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def pending(self) -> list[str]:
        """Labels of the compiles queued or running (loads and warm-ups have no label)."""
        with self._cond:
            jobs = list(self._jobs) + ([self._running] if self._running is not None else [])
        return [j[3] for j in jobs if j[3]]

    def close(self) -> list[str]:
        """Stop taking work; what was pending is dropped (returned by label)."""
        if self._pid != os.getpid():  # a forked child (a DataLoader worker) exiting: those
            self.closed = True  # jobs are its parent's, to report there (and the lock may be
            return []  # held by a thread that does not exist here)
        with self._cond:
            dropped = self.pending()
            self.closed = True
            for fut, *_ in self._jobs:
                fut.cancel()
            self._jobs.clear()
            self._cond.notify_all()
        return dropped

    def wait(self, timeout: float | None = None) -> None:
        """Until the jobs submitted so far have run."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._jobs or self._running is not None) and not self.closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("compiles still running")
                self._cond.wait(left)


WORKER = _Worker()
# Requests the compile service is answering: id -> (label, cache dir, socket, requester pid).
_SERVICE_PENDING: dict[int, tuple[str, str, Any, int]] = {}
_SERVICE_LOCK = threading.Lock()
_service_broken: str | None = None  # why this process stopped using the service (logged once)
_exit_hook_registered = False
_imported = False  # the compiler's modules were imported in a program thread
_compiler_ready = False  # ... and that import has finished: the worker may load programs


_helper: Any = None  # the compile helper's client (compile_process.HELPER), handed in
_LOAD_HERE = object()  # _compiled's answer: load the landed program in this thread


class _Landed:
    """A program's bytes the worker could not load yet (Note [import when a program lands])."""

    __slots__ = ("data", "graph")

    def __init__(self, data: bytes, graph: Any) -> None:
        self.data = data
        self.graph = graph


def _preload() -> None:
    """Import, in the worker and long before exit, what loading a program imports: one of those
    modules registers an exit hook, which fails once shutdown began."""
    try:
        import concurrent.futures.process  # noqa: F401
        import concurrent.futures.thread  # noqa: F401
    except Exception:  # never fatal: a late load then fails and is dropped
        pass


def _import_dynamo_first() -> None:
    """Import torch._dynamo, whole, before anything of torch._inductor: the other order takes
    their module locks the other way round from a program thread's ``import torch._dynamo`` (any
    torch.optim optimizer does it), and importlib raised _DeadlockError or "partially initialized
    module" in one of the two threads (two threads, two engines)."""
    import torch._dynamo  # noqa: F401


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    try:
        threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
    except RuntimeError:  # already shutting down
        pass


def _at_exit() -> None:
    """The program's main thread ended: compiles with the service go on there (Note [compile
    service]); the others are dropped. Say so once each, do not wait."""
    dropped = WORKER.close()
    with _SERVICE_LOCK:
        # a forked child's copy names its parent's requests: never shut those sockets down
        continuing = [v for v in _SERVICE_PENDING.values() if v[3] == os.getpid()]
        _SERVICE_PENDING.clear()
    for _, _, sock, _ in continuing:
        try:  # wakes the worker blocked on the answer; the service keeps compiling
            sock.shutdown(2)
        except OSError:
            pass
    if continuing:
        n = len(continuing)
        labels = [c[0] for c in continuing]
        try:
            sys.stderr.write(
                f"adaptive_eager: {n} compile{'s' if n != 1 else ''} continue{'' if n != 1 else 's'}"
                f" in the compile service ({', '.join(labels[:3])}{', ...' if n > 3 else ''}); "
                f"the programs land in {continuing[0][1]} for the next run\n")
            sys.stderr.flush()
        except Exception:
            pass
    service_labels = {c[0] for c in continuing}
    dropped = [d for d in dropped if d not in service_labels]
    if not dropped:
        return
    _abandon_helper()
    n = len(dropped)
    try:
        sys.stderr.write(f"adaptive_eager: {n} compile{'s' if n != 1 else ''} still pending at "
                         f"exit dropped ({', '.join(dropped[:3])}{', ...' if n > 3 else ''}); "
                         "the next run compiles them at once (marked hot on disk)\n")
        sys.stderr.flush()
    except Exception:
        pass


def _has_user_ops(g: Any) -> bool:
    """A graph calling ops outside torch's own namespaces (Note [custom ops]): the helper,
    started isolated, cannot import the library that defines them, so it compiles here."""
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target.namespace not in _TORCH_NAMESPACES for n in g.gm.graph.nodes)


_TORCH_NAMESPACES = frozenset({"aten", "prims", "quantized", "_quantized", "inductor"})


def _abandon_helper() -> None:
    """Kill a helper still compiling for us: its answer would come too late, and a daemon
    thread blocked reading its pipe holds that file's lock, which interpreter finalization
    then waits for (measured: 8 s after the last atexit hook, until the helper finished)."""
    try:
        if _helper is not None:
            _helper.abandon()
    except Exception:
        pass


def _service_failed(why: str) -> None:
    """The compile service cannot be used by this process: compile in a helper of our own from
    now on (Note [compile service]); counted, logged once."""
    global _service_broken
    M.service_errors += 1
    if _service_broken is None:
        _service_broken = why
        log.warning("adaptive_eager: the compile service is unavailable (%s); compiling in a "
                    "helper of this process instead", why)


@dataclass(frozen=True)
class Transport:
    """The compile helper and the compile service, handed in by the manager."""

    helper: Any  # compile_process.HELPER: compile(backend, graph) -> (bytes, ...), abandon()
    helper_failed: type[BaseException]  # the helper could not take this compile
    compile_failed: type[BaseException]  # (error, transient): the compile itself failed
    request_bytes: Callable[[Any, Any], bytes]  # (backend, graph): a compile request
    request: Callable[..., Any]  # service.request: the connection the answer comes on
    recv_msg: Callable[[Any], tuple[dict, bytes]]  # service.recv_msg
    unavailable: type[BaseException]  # service.ServiceUnavailable
    sync_compiles: Callable[[], bool]  # distributed.sync_compiles (Note [ranks agree])
    vec_isa_pick: Callable[[], Any]  # compile_process.fast_vec_isa_pick (Note [helper warm-up])


class JobsOwner(Protocol):
    """What the jobs use of the manager that owns them."""

    options: Any
    backend: Any
    disk: Any
    programs: Any  # compile/programs.py: a compiled program's key and store

    def _compiled(self, entry: Any) -> tuple | None: ...


class Jobs(Part):
    """One manager's compiles and loads: which path each takes, and their futures."""

    def __init__(self, owner: JobsOwner, transport: Transport, lock: Any) -> None:
        global _helper
        self.owner, self.transport = owner, transport
        self.lock = lock  # the trace entries' lock (compiler.STATE_LOCK)
        _helper = transport.helper
        self.in_flight: list[concurrent.futures.Future] = []
        self._here: set[str] = set()  # digests the helper could not take: compiled here
        self.submitted: dict[str, float] = {}  # digest -> when its compile or load began

    def import_compiler(self) -> None:
        """Import what compiling and loading need, in the program's thread, before any of it
        runs in the worker (Note [compile worker]: imports racing the program's own)."""
        global _imported, _compiler_ready
        if _imported:
            return
        _imported = True
        start = time.perf_counter()
        with outside_modes():
            _preload()
            warm_up = getattr(self.backend, "warm_up", None)
            try:
                _import_dynamo_first()
                if warm_up is not None:
                    warm_up()
                if self.backend.name == "inductor":  # what deserializing a program imports
                    import torch._inductor.codegen.wrapper  # noqa: F401

                    self.transport.vec_isa_pick()  # loading probes it too (Note [helper warm-up])
            except Exception as err:  # the compile or load that needs it reports it
                log.info("adaptive_eager: importing the compiler failed: %s", err)
        _compiler_ready = True
        log.info("adaptive_eager: compiler imported in %.2fs", time.perf_counter() - start)

    def use_helper(self, entry: Any) -> bool:
        return (self.options.compile_process and getattr(self.backend, "separate_process", False)
                and not entry.in_process and self.transport.helper.broken is None
                and entry.digest not in self._here
                and not (entry.graph is not None and _has_user_ops(entry.graph)))

    def start(self, entry: Any, work: Any, *args: Any, label: str = "") -> None:
        """Run a helper compile or a load in the worker thread (now, with compile_async off).
        Nothing is imported for it (Note [import when a program lands])."""
        entry.state = "compiling"
        with self.lock:
            M.compiles_pending += 1
        if (not self.options.compile_async
                or self.transport.sync_compiles()):  # Note [ranks agree]
            fut: concurrent.futures.Future = concurrent.futures.Future()
            try:
                fut.set_result(work(*args))
            except Exception as err:
                fut.set_exception(err)
            entry.future = fut
            self._finished(fut)
            return
        entry.future = WORKER.submit(work, *args, label=label)
        entry.future.add_done_callback(self._finished)
        self.in_flight.append(entry.future)

    def compile_here(self, entry: Any, g: Any) -> None:
        """Compile in this process, in the flushing thread (Note [in-process compiles])."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.import_compiler()
        with self.lock:
            M.compiles_pending += 1
        try:
            with _LOCAL_COMPILE:
                if self.use_helper(entry):  # compile_async off: wait on the helper instead
                    fut.set_result(self.compile_remote(g, entry))
                else:
                    fut.set_result(self._compile(g, entry))
        except Exception as err:
            fut.set_exception(err)
        except BaseException:  # KeyboardInterrupt mid-compile: the trace may compile later
            with self.lock:
                entry.state = "new"
            raise
        finally:
            self._finished(fut)
        with self.lock:
            entry.future = fut
            again = self.owner._compiled(entry)
        if again is not None:  # the helper failed on the way: compile here after all
            self.compile_here(entry, *again)

    def load_landed(self, entry: Any, landed: _Landed, seconds: float) -> None:
        """Import the compiler and load a program the worker left unloaded, in the flushing
        thread (Note [import when a program lands])."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result((self._load_compiled(landed.data, landed.graph, entry), seconds))
        except Exception as err:
            fut.set_exception(err)
        with self.lock:
            entry.future = fut
            self.owner._compiled(entry)

    def _compile(self, g: Any, entry: Any) -> tuple[Any, float]:
        """Compile in this process and store the program on disk."""
        start = time.perf_counter()
        label = f"trace {entry.digest[:12]} ({g.n_ops} ops)"
        with outside_modes(), _compile_guard(), span("adaptive_eager.compile"), progress(label):
            program = self.backend.compile(g)
        seconds = time.perf_counter() - start
        if g.dynamic:
            M.sym_programs += 1
        entry.from_bytes = False
        M.compiles += 1
        M.compile_seconds += seconds
        self.owner.programs.store(entry, g, program, seconds)
        return program, seconds

    def compile_remote(self, g: Any, entry: Any, service: bool = True) -> Any:
        """In the worker: the service or the helper compiles; the bytes go to disk first (a
        process that ends before using them still leaves them for the next run), then load."""
        if service and self.use_service(entry):
            sock = self.send(entry, g, f"trace {entry.digest[:12]} ({g.n_ops} ops)")
            if sock is not None:
                return self.await_service(sock, g, entry)
        start = time.perf_counter()
        try:
            data, _ = self.transport.helper.compile(self.backend, g)
        except self.transport.helper_failed:  # counted and logged once by the helper's client
            self._here.add(entry.digest)  # this request only, perhaps: never ask again for it
            return COMPILE_HERE
        seconds = time.perf_counter() - start
        M.compiles += 1  # counted here: a process may end before a flush picks the program up
        M.compile_seconds += seconds
        if g.dynamic:
            M.sym_programs += 1
        self.owner.programs.store(entry, g, None, seconds, data)
        return self._load_compiled(data, g, entry), seconds

    def _load_compiled(self, data: bytes, g: Any, entry: Any) -> Any:
        if not _compiler_ready:  # Note [import when a program lands]
            if WORKER.is_current():
                return _Landed(data, g)
            self.import_compiler()
        start = time.perf_counter()
        with outside_modes(), span("adaptive_eager.load"):
            program = self.backend.load(data, g)
        M.compile_load_seconds += time.perf_counter() - start
        entry.from_bytes = True
        self._note_ready(entry)
        return program

    def _note_ready(self, entry: Any) -> None:
        """How long the trace waited, from its submit, for a program (metrics, report)."""
        began = self.submitted.pop(entry.digest, None)
        if began is None:
            return
        waited = time.perf_counter() - began
        M.compile_wait_seconds += waited
        if len(M.program_waits) < 200:
            M.program_waits[entry.digest[:12]] = round(waited, 3)

    # ---- the compile service (Note [compile service] in service.py) ---------------------------
    def use_service(self, entry: Any) -> bool:
        """Only the built-in Inductor backend goes to the shared service (a backend defined by
        one program is that program's code: its own helper runs it), and only with a writable
        disk cache (the service stores what it compiles there)."""
        from adaptive_eager.backends.inductor import InductorBackend

        return (self.options.compile_service and _service_broken is None
                and type(self.backend) is InductorBackend and self.disk is not None
                and not self.disk.read_only and not entry.in_process)

    def send(self, entry: Any, g: Any, label: str) -> Any:
        """Hand the compile to the service; the connection to read the answer from, or None
        (the service is unavailable: counted, logged once, compiled by a helper of ours)."""
        assert self.disk is not None
        try:
            payload = self.transport.request_bytes(self.backend, g)
        except Exception:  # not picklable: the helper path reports it as before
            return None
        header = {"op": "compile", "key": self.owner.programs.key(entry, g), "label": label,
                  "torch": torch.__version__, "backend": self.backend.name, "n_ops": g.n_ops,
                  "size_limit": self.options.cache_size_mb * 1024 * 1024, "pid": os.getpid()}
        try:
            sock = self.transport.request(self.disk.directory, header, payload,
                                          idle_s=self.options.service_idle_s)
        except self.transport.unavailable as err:
            _service_failed(str(err))
            return None
        with _SERVICE_LOCK:
            _SERVICE_PENDING[id(sock)] = (label, str(self.disk.directory), sock, os.getpid())
            M.service_pending += 1
        return sock

    def await_service(self, sock: Any, g: Any, entry: Any) -> Any:
        """In the worker: the service's answer (the program is on disk by then), then load."""
        try:
            header, data = self.transport.recv_msg(sock)
        except (OSError, EOFError, ValueError) as err:
            if WORKER.closed:  # the program is exiting: the service goes on without us
                raise concurrent.futures.CancelledError() from None
            _service_failed(f"it went away mid-compile ({type(err).__name__}: {err})")
            return self.compile_remote(g, entry, service=False)
        finally:
            with _SERVICE_LOCK:
                if _SERVICE_PENDING.pop(id(sock), None) is not None:
                    M.service_pending = max(M.service_pending - 1, 0)
            try:
                sock.close()
            except OSError:
                pass
        status = header.get("status")
        M.compile_queued_seconds += float(header.get("queued_s", 0.0) or 0.0)
        if status == "ok":
            seconds = float(header.get("compile_s", 0.0) or 0.0)
            if header.get("shared") or header.get("from_disk"):
                M.service_shared += 1  # someone else's compile: not one of ours
            else:
                M.compiles += 1
                M.service_compiles += 1
                M.compile_seconds += seconds
                if g.dynamic:
                    M.sym_programs += 1
            self.owner.programs.store(entry, g, None, seconds, data,
                                      stored=bool(header.get("stored")))
            return self._load_compiled(data, g, entry), seconds
        if status == "error":
            raise self.transport.compile_failed(str(header.get("error", "")),
                                                bool(header.get("transient")))
        # unusable here, or its helper died: this compile goes to a helper of ours
        M.helper_errors += 1
        log.info("adaptive_eager: the compile service could not compile trace %s (%s: %s); "
                 "compiling it in a helper of this process", entry.digest[:12], status,
                 str(header.get("error", ""))[:200])
        return self.compile_remote(g, entry, service=False)

    def _finished(self, future: concurrent.futures.Future) -> None:
        """When a compile or load ends (in the worker), even if no flush picks it up (the engine
        may be aside meanwhile)."""
        with self.lock:
            M.compiles_pending = max(M.compiles_pending - 1, 0)
