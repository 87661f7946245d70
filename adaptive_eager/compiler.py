"""When traces get compiled, where programs come from, and whether a program is worth keeping.

Note [adaptive decisions]
Each trace entry moves through states:
  new        runs op by op; its replay time and which Python numbers vary are observed.
  compiling  seen ``hot_after`` times: compiled in the helper process while the program keeps
             running op by op, or at that flush in this process (Note [in-process compiles]).
  measuring  program ready (compiled, or loaded from the disk cache): the next runs use it and
             are timed; the first (warm-up) call is not counted.
  fused      measured faster than op-by-op replay, recording overhead included: kept.
  replay     not faster: the program is dropped and the trace never compiles again here (the
             measurement is stored on disk and combined with other processes', Note
             [persisted decisions]).
  failed     the compiler or the program raised: op by op from now on, counted, logged once;
             later processes retry transient failures (Note [persisted decisions]).
  quarantined the crosscheck found the fused result differs from op-by-op replay.
A program is used only for runs whose live slots it returns and whose baked-in numbers still hold.

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

Note [persisted decisions]
Statistics on disk carry evidence with an age. A failure records its stage, error, whether it is
transient (an OSError such as ENOSPC, a timeout, a helper that died, memory) and how often and
when it happened: a transient one is retried by later processes (each of the next
``TRANSIENT_RETRIES`` processes, then once it is ``RETRY_AFTER_S`` old); a permanent one stays
op by op. Keep-or-drop measurements are kept per process (``samples``, the last ``_SAMPLES``);
the stored decision is the median of their fused/op-by-op ratios, so one contended process no
longer overrides three others. A sample is what that process's decision compared (its paired
runs, a symbolic trace's fitted at one size: Note [timing at one size]), not the medians of
all its runs: for a varlen mid-size GPT-2 step those mixed sizes and cold first fused runs, and
a process that kept its program (fused 212 ms against 355 op by op at one size) stored
"fused/op-by-op 1.22", so every later process ran the step op by op. A process that loads an
"op-by-op" decision re-measures when its own op-by-op time makes the stored fused time a clear
win here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from adaptive_eager.spans import span
from adaptive_eager import graph as graph_mod
from adaptive_eager import distributed  # Note [ranks agree]
from adaptive_eager.cache import remote as remote_cache  # Note [remote program store]
from adaptive_eager.backends import Backend, get_backend
from adaptive_eager.cache.disk import DiskCache, resolve_cache_dir
from adaptive_eager.cache.memory import TraceEntry
from adaptive_eager.compile.sizes import SizeHooks, Sizes
from adaptive_eager.compile.sizes import SYM_CHECKED_SIZES, ShapeGuards  # noqa: F401 (their old home)
from adaptive_eager.config import Options
from adaptive_eager.compile_process import (HELPER, CompileFailed, HelperFailed,
                                            failure_is_transient, request_bytes)
from adaptive_eager import service as service_mod
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.program_key import program_key  # Note [program key]
from adaptive_eager.trace import Trace

log = logging.getLogger("adaptive_eager")

MEASURE_RUNS = 3  # timed fused runs before deciding
MEASURE_RUNS_SYM = 5  # the same for a symbolic trace, timed at whatever sizes come
MIN_OPS = 2  # a one-op trace has nothing to fuse
MIN_OBSERVED = 2  # runs whose Python numbers were compared before a trace compiles
MAX_REBAKES = 2  # recompiles of one trace because a baked-in number changed
PREFETCH_MAX = 32  # programs of this script loaded at engine start (Note [warm start])
PREFETCH_WAIT_S = 60.0  # a first hit waits for its program's prefetch (never loads it twice)
MIN_DECISIONS = 1  # traces measured before the engine may step aside
COVERAGE = 0.5  # share of recent deferred ops in hot traces before it may (Note [coverage])
COVERAGE_DECAY = 0.99  # per flush: the recent ops are those of about the last 100 flushes
COVERAGE_FLUSHES = 16  # flushes seen before the share says anything; the engine checks every 16
RARE_WINDOW = 512  # recent flushes a trace's runs are counted over (Note [rare traces])
RARE_RATIO = 10  # another trace ran this many times as often there (and as long): rare, hot later
RARE_RECHECK = 64  # flushes a rare verdict is kept before it is counted again
RECORD_S = 6e-6  # recording cost per op over eager's; measured at start (calibrate.py)
REPLAY_EXTRA_S = 3e-6  # op-by-op replay's cost per op over eager's; measured at start too
EAGER_OP_S = 1e-6  # eager's own time for a tiny op (the dispatcher); measured at start too
FLUSH_S = 20e-6  # a flush's own cost, outside recording and running the trace (calibrate.py)
REPLAY_FIXED_S = 5e-6  # op-by-op replay's cost per run, whatever its length (calibrate.py)
NO_REPEAT_FLUSHES = 300  # flushes after which a hit rate under 5% means traces do not repeat
NO_REPEAT_OPS = 5000  # ops after which mostly-new metadata means shapes never settle
PROBE_FLUSHES = 50  # flushes a probe gets to find a trace worth fusing
KEEP_RATIO = 0.9  # fused (plus nothing else) must take at most this share of replay time
MEASURING_STALE_FLUSHES = 200  # a measuring trace idle this long no longer holds decisions
TRANSIENT_RETRIES = 3  # later processes that retry a transient failure at once
RETRY_AFTER_S = 3600.0  # after that, a transient failure is retried once this old
RECHECK_RATIO = 0.5  # a stored "op-by-op" whose fused time is under this share of our replay
_HISTORY = 8
_SAMPLES = 8  # per-process measurements kept in a trace's statistics

# Entries live in the process-wide trie, shared by every thread's engine and manager: their
# state changes under this lock (two threads, two contexts: one thread's pickup of a finished
# compile set entry.future to None under the other's feet).
STATE_LOCK = threading.RLock()
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


def _run_time(entry: TraceEntry) -> float:
    """A trace's time per run (Note [rare traces]): the best of its recent op-by-op runs (a
    cold first replay took 2-3x a warm one), else of its fused runs; 0.0: unknown."""
    xs = list(entry.replay_s) or list(entry.fused_s)
    return min(xs) if xs else 0.0


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def run_size(entry: TraceEntry, trace: Trace) -> int:
    """The size a symbolic trace ran at, for its timings (Note [timing at one size]); 0 for
    a static trace."""
    return trace.sym.s if entry.sym is not None and trace.sym is not None else 0


def _measure_runs(entry: TraceEntry) -> int:
    """Timed runs of each kind before deciding: more for a symbolic trace, whose runs come at
    different sizes (Note [timing at one size])."""
    return MEASURE_RUNS if entry.sym is None else MEASURE_RUNS_SYM


def _line_at(ts: list[float], ns: list[int], slope: float | None, at: float) -> float:
    """A robust line through (size, seconds) evaluated at size ``at``: Theil-Sen, the median
    of the pairwise slopes (``slope`` when the sizes here never differ), the median
    intercept; an outlier run (a GC pause) moves neither."""
    b = _slope(ts, ns)
    if b is None:
        b = slope if slope is not None else 0.0
    return _median([t - b * n for t, n in zip(ts, ns)]) + b * at


def _slope(ts: list[float], ns: list[int]) -> float | None:
    slopes = [(ts[j] - ts[i]) / (ns[j] - ns[i]) for i in range(len(ts))
              for j in range(i + 1, len(ts)) if ns[j] != ns[i]]
    return _median(slopes) if slopes else None


def _at_one_size(fused_s: list[float], fused_n: list[int], paired_s: list[float],
                 paired_n: list[int]) -> tuple[float, float]:
    """Note [timing at one size]
    A symbolic trace's measured runs come at whatever sizes the program calls it with: in the
    varlen benchmark (sequence 16-64) one run's medians said "fused 6.523 ms is not faster
    than 6.184 ms" and the engine ran the step op by op for good (4 of 60 steps fused), for a
    program 2-3x faster than op by op at any one size (runs logged by size in two other runs:
    op by op 6.5-7.6 ms at 18-21, fused 2.1-2.8 ms at 16-21 and 6.6-7.2 ms at 53-58). Each
    kind's times are fitted as a line in the size (Theil-Sen) and both are compared at the
    median size of all the runs; a kind whose runs all came at one size takes the other kind's
    slope. Static traces (every size 0) compare plain medians, as before."""
    if (len(fused_n) != len(fused_s) or len(paired_n) != len(paired_s)
            or len(set(fused_n) | set(paired_n)) < 2):
        return _median(fused_s), _median(paired_s)
    b_f, b_r = _slope(fused_s, fused_n), _slope(paired_s, paired_n)
    if b_f is None and b_r is None:
        return _median(fused_s), _median(paired_s)
    at = float(_median(fused_n + paired_n))
    fused = _line_at(fused_s, fused_n, b_r, at)
    replay = _line_at(paired_s, paired_n, b_f, at)
    floor = 0.25 * min(min(fused_s), min(paired_s))  # a line below every run: not a time
    return max(fused, floor), max(replay, floor)


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


def _has_user_ops(g: graph_mod.TraceGraph) -> bool:
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
        HELPER.abandon()
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


def _script_id() -> str:
    """The program's script, as the statistics name it (prefetch, Note [warm start])."""
    arg = sys.argv[0] if sys.argv else ""
    if not arg or arg in ("-c", "-m", "-"):
        return ""
    try:
        return os.path.realpath(arg)
    except (OSError, ValueError):
        return ""


# What the sizes (compile/sizes.py) need from the layers above, handed in through SizeHooks.
def _replay(trace: Trace, live: list[int]) -> list[Any]:
    from adaptive_eager.execute import replay

    return replay(trace, live, False)


def _close(fused: Any, eager: Any) -> bool:
    from adaptive_eager.fused import _close

    return _close(fused, eager)


def _program_inputs(g: graph_mod.TraceGraph, trace: Trace) -> list[Any] | None:
    from adaptive_eager.execute import ReplayGuard
    from adaptive_eager.graph import ext_reals

    with ReplayGuard():  # the engine's own tensor ops, as in run_fused
        return g.inputs([t.detach() for t in ext_reals(trace)], trace.scalars)


def _transient(err: BaseException) -> bool:
    """A failure a later process may not see (Note [persisted decisions], Note [transient
    compile failures] in compile_process.py)."""
    return failure_is_transient(err)


def _combine(samples: list[dict]) -> tuple[bool, float]:
    """Keep fused?, from the median fused/op-by-op ratio over processes' measurements."""
    ratios = [s["fused_ms"] / s["replay_ms"] for s in samples
              if s.get("fused_ms") and s.get("replay_ms")]
    if not ratios:
        return False, float("inf")
    r = _median(ratios)
    return r <= KEEP_RATIO, r


class CompileManager:
    """One per process and option set: the backend, the disk cache, and the decisions."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.backend: Backend = get_backend(options.backend)
        self.disk: DiskCache | None = None
        self._logged: set[str] = set()
        self.sizes = Sizes(SizeHooks(  # Note [trusting a size], Note [verified sizes]
            replay=_replay, close=_close, program_inputs=_program_inputs,
            quarantine=self.quarantine, untimed=self._untime, save=self._save_sizes))
        self._untimed: TraceEntry | None = None  # a checked run: not the program's time
        self.decided: list[TraceEntry] = []
        self.flushes = 0
        self.ops_recent = 0.0  # deferred ops of recent flushes, decayed (Note [coverage])
        self.ops_cold = 0.0  # the part of them in traces not yet hot
        self.hits = 0
        self.probe_start: int | None = None
        self.kept_at_probe = 0
        self.in_flight: list[concurrent.futures.Future] = []
        self._stored_fused: dict[str, float] = {}  # digest -> fused s of a stored op-by-op
        self._remeasure: set[str] = set()  # digests whose stored op-by-op is being re-measured
        self._here: set[str] = set()  # digests the helper could not take: compiled here
        self._prefetched: dict[str, concurrent.futures.Future] = {}  # program key -> load
        self._submitted: dict[str, float] = {}  # digest -> when its compile or load began
        self._measuring_since: dict[tuple, int] = {}  # Note [undecided means measuring too]
        self._recent: collections.deque = collections.deque(maxlen=RARE_WINDOW)  # flushes' entries
        self._rare_seen: dict[str, tuple[int, int]] = {}  # digest -> (flush, runs it needs)
        if options.disk_cache and self.backend.compiles:
            self.disk = DiskCache.open(resolve_cache_dir(options),
                                       options.cache_size_mb * 1024 * 1024)
            prepare = getattr(self.backend, "prepare", None)
            if self.disk is not None and prepare is not None:
                # points Inductor's folder; imports nothing of it (Note [import when a
                # program lands]): the compiler is imported, Dynamo first, before a load
                prepare(str(self.disk.directory))
            if self.disk is not None:
                self._prefetch()

    # ---- warm start (Note [warm start]) -------------------------------------------------------
    def _prefetch(self) -> None:
        """Load, in the worker, the programs this script used in its recent runs, so the first
        hot run of their traces here runs fused (Note [warm start])."""
        if WORKER.closed or not _script_id():
            return
        try:
            keys = self.disk.recent_programs(_script_id(), PREFETCH_MAX)
        except Exception:
            return
        if not keys:
            return
        self._import_compiler()  # in this (the program's) thread, before the worker loads
        for key in keys:
            self._prefetched[key] = WORKER.submit(self._prefetch_one, key)

    def _prefetch_one(self, key: str) -> Any:
        value = self.disk.get_program(key, torch.__version__)
        if value is None:
            return None
        start = time.perf_counter()
        with outside_modes(), span("adaptive_eager.load"):
            program = self.backend.load(value["artifact"], None)
        M.compile_load_seconds += time.perf_counter() - start
        M.prefetched += 1
        return program

    def _take_prefetched(self, key: str) -> Any:
        """A program prefetched for ``key`` (waiting briefly for its load), or None."""
        fut = self._prefetched.pop(key, None)
        if fut is None:
            return None
        try:
            return fut.result(timeout=PREFETCH_WAIT_S)
        except Exception:  # failed or slow: loaded (or compiled) the ordinary way instead
            return None

    def _import_compiler(self) -> None:
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

                    from adaptive_eager.compile_process import fast_vec_isa_pick

                    fast_vec_isa_pick()  # loading probes it too (Note [helper warm-up])
            except Exception as err:  # the compile or load that needs it reports it
                log.info("adaptive_eager: importing the compiler failed: %s", err)
        _compiler_ready = True
        log.info("adaptive_eager: compiler imported in %.2fs", time.perf_counter() - start)

    # ---- observation (op-by-op runs) ----------------------------------------------------------
    def observe(self, entry: TraceEntry, trace: Trace) -> None:
        """Note which Python numbers changed since the entry's first run."""
        with STATE_LOCK:
            entry.observed += 1
            if entry.scalar_ref is None:
                entry.scalar_ref = list(trace.scalars)
                return
            ref = entry.scalar_ref
            for i, v in enumerate(trace.scalars):
                if i < len(ref) and (type(v) is not type(ref[i]) or v != ref[i]):
                    entry.varying.add(i)

    def record_replay(self, entry: TraceEntry, seconds: float, size: int = 0) -> None:
        """``size``: a symbolic trace's size at this run (Note [timing at one size]), else 0."""
        with STATE_LOCK:
            if entry.state == "measuring" and entry.fused_runs >= 2:
                # Note [paired timing]: an op-by-op run between two measured fused runs
                entry.paired_s.append(seconds)
                entry.paired_n.append(size)
                runs = _measure_runs(entry)
                if len(entry.paired_s) >= runs and len(entry.fused_s) >= runs:
                    self._decide(entry)
                return
            if M.compiles_pending and entry.replay_s:
                return  # a compile running alongside inflates this run: keep the clean samples
            entry.replay_s.append(seconds)
            if len(entry.replay_s) > _HISTORY:
                del entry.replay_s[0]
            if entry.state == "replay" and entry.digest in self._stored_fused:
                self._maybe_recheck(entry)

    def _maybe_recheck(self, entry: TraceEntry) -> None:
        """A stored "op-by-op" decision this process's timing disagrees with: measure again."""
        if len(entry.replay_s) <= MEASURE_RUNS:  # the stored time, then this process's own
            return
        fused = self._stored_fused.pop(entry.digest)
        replay = _median(entry.replay_s[1:])
        if fused < RECHECK_RATIO * replay:
            log.info("adaptive_eager: trace %s: stored op-by-op decision, but op-by-op takes "
                     "%.3f ms here against a fused %.3f ms: measuring again", entry.digest[:12],
                     replay * 1e3, fused * 1e3)
            self._remeasure.add(entry.digest)
            entry.state = "new"
            entry.disk_checked = False
            entry.fused_s = []
            entry.fused_n = []
            entry.fused_runs = 0
            if entry in self.decided:
                self.decided.remove(entry)

    # ---- the question asked at every flush ----------------------------------------------------
    def program_for(self, entry: TraceEntry, trace: Trace, live: list[int]) -> Any:
        """The program to run this flush with, or None for op-by-op replay."""
        if not self.backend.compiles:
            return None
        self._recent.append(entry)  # Note [rare traces]
        if entry.sym is not None:  # Note [symbolic dims] in shapes.py
            if not getattr(self.options, "symbolic_programs", False):
                self._symbolic_replay(entry)
                return None
            prog = self._program_for(entry, trace, live)
            return None if prog is None else self.sizes.program(entry, trace, prog)
        return self._program_for(entry, trace, live)

    def _program_for(self, entry: TraceEntry, trace: Trace, live: list[int]) -> Any:
        local = None
        with STATE_LOCK:
            state = entry.state
            if state == "compiling":
                fut = entry.future
                if fut is None or not fut.done():
                    return None  # running, or being compiled by another thread right now
                local = self._compiled(entry)
                state = entry.state
            if state in ("measuring", "fused"):
                if (state == "measuring" and entry.fused_runs >= 2
                        and len(entry.paired_s) < len(entry.fused_s)):
                    return None  # Note [paired timing]: this run is timed op by op
                g = entry.graph
                if set(live) <= entry.program_live:
                    if g.scalars_hold(trace.scalars):
                        return entry.program
                    self._rebake(entry, g, trace.scalars)
                return None
            if state == "new" and local is None:
                local = self._maybe_start(entry, trace, live)
                fut = entry.future
                if (local is None and entry.state == "compiling" and fut is not None
                        and fut.done()):  # loaded at once (compile_async off)
                    local = self._compiled(entry)
                if entry.state in ("measuring", "fused"):
                    return self._program_for(entry, trace, live)
        if local is not None:  # outside the lock: other threads' flushes go on meanwhile
            if local[0] is _LOAD_HERE:
                self._load_landed(entry, local[1], local[2])
            else:
                self._compile_here(entry, *local)
            with STATE_LOCK:
                if entry.state in ("measuring", "fused") and set(live) <= entry.program_live \
                        and entry.graph.scalars_hold(trace.scalars):
                    return entry.program
        return None

    def _symbolic_replay(self, entry: TraceEntry) -> None:
        """A symbolic trace has no dynamic-size program yet: once hot, it is decided op by op,
        so the step-aside estimate weighs it like any measured trace."""
        if entry.state == "new" and entry.runs >= self.options.hot_after and entry.replay_s:
            with STATE_LOCK:
                entry.state = "replay"
                entry.decision = "op-by-op: symbolic sizes (no dynamic-size program yet)"
                self._mark_decided(entry)

    def _untime(self, entry: TraceEntry) -> None:
        """A run that checked a size also replayed: it is no timing of the program."""
        self._untimed = entry

    def _save_sizes(self, entry: TraceEntry) -> None:
        """Checked sizes to disk, with the key of the program they are about."""
        if self.disk is not None:
            self.save_stats(entry, program_key=self._program_key(entry, entry.graph))

    def _rebake(self, entry: TraceEntry, g: graph_mod.TraceGraph, scalars: list[Any]) -> None:
        """A number compiled in as a constant changed: it varies after all. Mark it and compile
        the trace again with it as an input (at most MAX_REBAKES times; after that the trace
        stays op by op whenever its numbers differ from the program's)."""
        if entry.rebakes >= MAX_REBAKES:
            return
        changed = {i for i, v in zip(g.baked, g.baked_values)
                   if type(scalars[i]) is not type(v) or scalars[i] != v}
        if not changed:
            return
        entry.rebakes += 1
        entry.varying |= changed
        entry.program = None
        entry.graph = None
        entry.fused_s.clear()
        entry.fused_n.clear()
        entry.fused_runs = 0
        entry.state = "new"  # the next flush compiles it again, with these numbers as inputs
        log.info("adaptive_eager: trace %s: Python numbers at %s changed after its compile; "
                 "compiling it again with them as inputs", entry.digest[:12], sorted(changed))

    def _maybe_start(self, entry: TraceEntry, trace: Trace, live: list[int]) -> tuple | None:
        if entry.n_ops < MIN_OPS or WORKER.closed:
            return None
        # Note [ranks agree]: in a distributed job only at the hot run, and as the ranks agree
        if not distributed.ready_to_start(self, entry, trace, live):
            return None
        if not entry.disk_checked:
            entry.disk_checked = True
            # a symbolic trace's program is loaded too (Note [symbolic programs] in graph.py)
            if self._from_disk(entry, trace, live):
                return None
        # Runs counted by a backend that never compiles (another engine's replay backend) saw
        # no numbers compared: a trace hot from those alone would bake in every number.
        seen = entry.observed >= min(self.options.hot_after, MIN_OBSERVED)
        hot = (entry.runs >= self.options.hot_after and seen) or entry.was_hot
        if hot and not entry.was_hot and entry.runs < self._runs_needed(entry):
            hot = False  # Note [rare traces]
        if hot and entry.state == "new":
            return self._submit(entry, trace, live)
        return None

    def _runs_needed(self, entry: TraceEntry) -> int:
        """Note [rare traces]
        A trace is hot after ``hot_after`` runs, but a compile is worth only what the trace's
        own runs can gain, and that is small for a trace that runs far less than another one:
        ``generate()``'s prefill, its first decode step (the cache is the prefill's view, so
        it is not the symbolic decode trace), its attention-mask set-up and a 2-op check in
        the logits processor run once per call, against 31-63 runs of the decode trace. Each
        became hot after 3 calls and compiled (10-30 s of a core each): a first process of the
        varlen benchmark's four generate cases compiled 15 programs, 4 of them per token. So over
        the last RARE_WINDOW flushes, from this trace's first run there on, runs are counted:
        where another trace ran q >= RARE_RATIO times as often and also took at least as long
        in all (its runs x its best recent run time against this trace's), this trace is hot
        only after hot_after x q runs (the prefill of a 32-token generation after some 93
        calls). Counts, not times, set q: a trace's first op-by-op runs are cold and, while a
        compile is in flight, its only timed ones (record_replay keeps no samples then), so
        time ratios of single samples swung 3x under load and a time-weighted rule let the
        prefill and the mask set-up compile in one run and not the next. The time condition
        only keeps a heavy trace (a prefill of a long prompt) from reading as rare beside a
        frequent light one (a 2-op check per token); it allows this trace up to q times the
        other's time per run, so a cold sample does not flip it. Counting
        from the trace's own first run keeps a phase change (a loop after a warm-up) from
        making the new loop's trace rare beside the old one. Not rare: traces that run about
        equally often (a step cut by ``.item()`` calls; a 15-op foreach optimizer trace beside
        an 800-op forward and backward, which op counts as weights made rare at q ~ 50;
        gradient accumulation over fewer than RARE_RATIO micro-batches), a trace an earlier
        process found hot (``was_hot``), a trace with no timing yet, and a distributed job
        (whose ranks agree on the hot run, Note [ranks agree]). The verdict is kept
        for RARE_RECHECK flushes (counting is O(window), at the trace's hot runs only)."""
        hot_after = self.options.hot_after
        if entry.runs < hot_after or distributed.active():
            return hot_after
        seen = self._rare_seen.get(entry.digest)
        if seen is not None and self.flushes - seen[0] < RARE_RECHECK:
            return seen[1]
        recent = list(self._recent)  # one C-level copy (other threads append)
        try:
            first = recent.index(entry)
        except ValueError:
            first = len(recent)
        counts = collections.Counter(recent[first:])  # since this trace first ran in the window
        mine = max(counts.get(entry, 0), 1)
        own = mine * _run_time(entry)
        q = 0
        for e, c in counts.items():  # the most frequent trace that also took as long in all
            if e is not entry and c >= RARE_RATIO * mine and c // mine > q and own and \
                    c * _run_time(e) >= own:
                q = c // mine
        need = hot_after * q if q else hot_after
        if len(self._rare_seen) > 4096:
            self._rare_seen.clear()
        self._rare_seen[entry.digest] = (self.flushes, need)
        if need > hot_after and seen is None:
            log.info("adaptive_eager: trace %s (%d ops) is rare: another trace ran %dx as often "
                     "over the last %d flushes; it compiles after %d runs", entry.digest[:12],
                     entry.n_ops, q, len(self._recent), need)
        return need

    # ---- compiling ----------------------------------------------------------------------------
    def _submit(self, entry: TraceEntry, trace: Trace, live: list[int]) -> tuple | None:
        """Start compiling: in the helper (via the worker), or return what the flushing thread
        compiles here (Note [in-process compiles])."""
        try:
            if entry.sym is not None:  # Note [symbolic programs] in graph.py
                g = graph_mod.build(trace, live, entry.varying, template=trace.sym)
            else:
                g = graph_mod.build(trace, live, entry.varying)
        except Exception as err:  # Unfusable, or a trace shape we do not handle
            self._fail(entry, "graph", err)
            return None
        entry.graph = g
        entry.program_live = frozenset(live)
        entry.loaded_state = "measuring"
        if self.disk is not None:  # hot (the next run compiles or loads it at once), and the
            # program's key for the next run's prefetch (Note [warm start])
            self.save_stats(entry, hot=True, program_key=self._program_key(entry, g))
        self._submitted[entry.digest] = time.perf_counter()
        if (self._use_helper(entry) and self.options.compile_async
                and not distributed.sync_compiles()):  # Note [ranks agree]
            label = f"trace {entry.digest[:12]} ({g.n_ops} ops)"
            # Sent now, before the compiler's modules are imported here: the service compiles
            # meanwhile, and the request outlives this process (Note [compile service]).
            sock = self._send(entry, g, label) if self._use_service(entry) else None
            if sock is not None:
                self._start(entry, self._await_service, sock, g, entry, label=label)
            else:
                self._start(entry, self._compile_remote, g, entry, label=label)
            return None
        entry.state = "compiling"
        entry.future = None  # nobody else picks it up while this thread compiles
        return (g,)

    def _use_helper(self, entry: TraceEntry) -> bool:
        return (self.options.compile_process and getattr(self.backend, "separate_process", False)
                and not entry.in_process and HELPER.broken is None
                and entry.digest not in self._here
                and not (entry.graph is not None and _has_user_ops(entry.graph)))

    def _start(self, entry: TraceEntry, work: Any, *args: Any, label: str = "") -> None:
        """Run a helper compile or a load in the worker thread (now, with compile_async off).
        Nothing is imported for it (Note [import when a program lands])."""
        entry.state = "compiling"
        with STATE_LOCK:
            M.compiles_pending += 1
        if not self.options.compile_async or distributed.sync_compiles():  # Note [ranks agree]
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

    def _compile_here(self, entry: TraceEntry, g: graph_mod.TraceGraph) -> None:
        """Compile in this process, in the flushing thread (Note [in-process compiles])."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._import_compiler()
        with STATE_LOCK:
            M.compiles_pending += 1
        try:
            with _LOCAL_COMPILE:
                if self._use_helper(entry):  # compile_async off: wait on the helper instead
                    fut.set_result(self._compile_remote(g, entry))
                else:
                    fut.set_result(self._compile(g, entry))
        except Exception as err:
            fut.set_exception(err)
        except BaseException:  # KeyboardInterrupt mid-compile: the trace may compile later
            with STATE_LOCK:
                entry.state = "new"
            raise
        finally:
            self._finished(fut)
        with STATE_LOCK:
            entry.future = fut
            again = self._compiled(entry)
        if again is not None:  # the helper failed on the way: compile here after all
            self._compile_here(entry, *again)

    def _load_landed(self, entry: TraceEntry, landed: _Landed, seconds: float) -> None:
        """Import the compiler and load a program the worker left unloaded, in the flushing
        thread (Note [import when a program lands])."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result((self._load_compiled(landed.data, landed.graph, entry), seconds))
        except Exception as err:
            fut.set_exception(err)
        with STATE_LOCK:
            entry.future = fut
            self._compiled(entry)

    def _compile(self, g: graph_mod.TraceGraph, entry: TraceEntry) -> tuple[Any, float]:
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
        self._store(entry, g, program, seconds)
        return program, seconds

    def _compile_remote(self, g: graph_mod.TraceGraph, entry: TraceEntry,
                        service: bool = True) -> Any:
        """In the worker: the service or the helper compiles; the bytes go to disk first (a
        process that ends before using them still leaves them for the next run), then load."""
        if service and self._use_service(entry):
            sock = self._send(entry, g, f"trace {entry.digest[:12]} ({g.n_ops} ops)")
            if sock is not None:
                return self._await_service(sock, g, entry)
        start = time.perf_counter()
        try:
            data, _ = HELPER.compile(self.backend, g)
        except HelperFailed:  # counted and logged once by the helper's client
            self._here.add(entry.digest)  # this request only, perhaps: never ask again for it
            return COMPILE_HERE
        seconds = time.perf_counter() - start
        M.compiles += 1  # counted here: a process may end before a flush picks the program up
        M.compile_seconds += seconds
        if g.dynamic:
            M.sym_programs += 1
        self._store(entry, g, None, seconds, data)
        return self._load_compiled(data, g, entry), seconds

    def _load_compiled(self, data: bytes, g: graph_mod.TraceGraph, entry: TraceEntry) -> Any:
        if not _compiler_ready:  # Note [import when a program lands]
            if WORKER.is_current():
                return _Landed(data, g)
            self._import_compiler()
        start = time.perf_counter()
        with outside_modes(), span("adaptive_eager.load"):
            program = self.backend.load(data, g)
        M.compile_load_seconds += time.perf_counter() - start
        entry.from_bytes = True
        self._note_ready(entry)
        return program

    def _note_ready(self, entry: TraceEntry) -> None:
        """How long the trace waited, from its submit, for a program (metrics, report)."""
        began = self._submitted.pop(entry.digest, None)
        if began is None:
            return
        waited = time.perf_counter() - began
        M.compile_wait_seconds += waited
        if len(M.program_waits) < 200:
            M.program_waits[entry.digest[:12]] = round(waited, 3)

    # ---- the compile service (Note [compile service] in service.py) ---------------------------
    def _use_service(self, entry: TraceEntry) -> bool:
        """Only the built-in Inductor backend goes to the shared service (a backend defined by
        one program is that program's code: its own helper runs it), and only with a writable
        disk cache (the service stores what it compiles there)."""
        from adaptive_eager.backends.inductor import InductorBackend

        return (self.options.compile_service and _service_broken is None
                and type(self.backend) is InductorBackend and self.disk is not None
                and not self.disk.read_only and not entry.in_process)

    def _send(self, entry: TraceEntry, g: graph_mod.TraceGraph, label: str) -> Any:
        """Hand the compile to the service; the connection to read the answer from, or None
        (the service is unavailable: counted, logged once, compiled by a helper of ours)."""
        assert self.disk is not None
        try:
            payload = request_bytes(self.backend, g)
        except Exception:  # not picklable: the helper path reports it as before
            return None
        header = {"op": "compile", "key": self._program_key(entry, g), "label": label,
                  "torch": torch.__version__, "backend": self.backend.name, "n_ops": g.n_ops,
                  "size_limit": self.options.cache_size_mb * 1024 * 1024, "pid": os.getpid()}
        try:
            sock = service_mod.request(self.disk.directory, header, payload,
                                       idle_s=self.options.service_idle_s)
        except service_mod.ServiceUnavailable as err:
            _service_failed(str(err))
            return None
        with _SERVICE_LOCK:
            _SERVICE_PENDING[id(sock)] = (label, str(self.disk.directory), sock, os.getpid())
            M.service_pending += 1
        return sock

    def _await_service(self, sock: Any, g: graph_mod.TraceGraph, entry: TraceEntry) -> Any:
        """In the worker: the service's answer (the program is on disk by then), then load."""
        try:
            header, data = service_mod.recv_msg(sock)
        except (OSError, EOFError, ValueError) as err:
            if WORKER.closed:  # the program is exiting: the service goes on without us
                raise concurrent.futures.CancelledError() from None
            _service_failed(f"it went away mid-compile ({type(err).__name__}: {err})")
            return self._compile_remote(g, entry, service=False)
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
            self._store(entry, g, None, seconds, data, stored=bool(header.get("stored")))
            return self._load_compiled(data, g, entry), seconds
        if status == "error":
            raise CompileFailed(str(header.get("error", "")), bool(header.get("transient")))
        # unusable here, or its helper died: this compile goes to a helper of ours
        M.helper_errors += 1
        log.info("adaptive_eager: the compile service could not compile trace %s (%s: %s); "
                 "compiling it in a helper of this process", entry.digest[:12], status,
                 str(header.get("error", ""))[:200])
        return self._compile_remote(g, entry, service=False)

    def _finished(self, future: concurrent.futures.Future) -> None:
        """When a compile or load ends (in the worker), even if no flush picks it up (the engine
        may be aside meanwhile)."""
        with STATE_LOCK:
            M.compiles_pending = max(M.compiles_pending - 1, 0)

    def _compiled(self, entry: TraceEntry) -> tuple | None:
        """Pick up a finished compile or load (under STATE_LOCK); returns what to compile here
        when the worker handed the compile back."""
        fut, entry.future = entry.future, None
        try:
            result = fut.result()
        except concurrent.futures.CancelledError:
            entry.state = "new"
            return None
        except Exception as err:
            M.compile_errors += 1
            self._fail(entry, "compile", err)
            return None
        if result is COMPILE_HERE:
            entry.future = None
            return (entry.graph,)
        program, seconds = result
        if type(program) is _Landed:  # loaded by the caller, outside the lock
            return (_LOAD_HERE, program, seconds)
        entry.compile_s = seconds
        entry.program = program
        entry.state = entry.loaded_state
        if (remote_cache.from_env() is not None and self.disk is not None
                and entry.graph is not None):
            # Note [remote program store]: what compiled here, to the other machines
            remote_cache.publish_from(self.disk, self._program_key(entry, entry.graph),
                                      torch.__version__, self._plan_key(entry, entry.graph),
                                      entry.graph.lifted)
        log.info("adaptive_eager: program for trace %s (%d ops) ready after %.2fs",
                 entry.digest[:12], entry.n_ops, seconds)
        return None

    # ---- measuring and deciding ---------------------------------------------------------------
    def record_fused(self, entry: TraceEntry, seconds: float, size: int = 0) -> None:
        """``size``: a symbolic trace's size at this run (Note [timing at one size]), else 0."""
        if self._untimed is entry:  # a size's checked run also replayed: no timing
            self._untimed = None
            return
        with STATE_LOCK:
            entry.fused_runs += 1
            if entry.fused_runs == 1 and entry.state == "measuring":
                entry.paired_s.clear()  # a new measurement starts (Note [paired timing])
                entry.paired_n.clear()
                entry.fused_s.clear()
                entry.fused_n.clear()
                return  # warm-up call: first-touch costs are not the program's steady state
            entry.fused_s.append(seconds)
            entry.fused_n.append(size)
            if len(entry.fused_s) > _HISTORY:
                del entry.fused_s[0]
                if entry.fused_n:  # (lists out of step compare medians: _at_one_size)
                    del entry.fused_n[0]
            # Decided at the last paired op-by-op run (record_replay); the second condition
            # is for a trace whose op-by-op runs never come (none were made to alternate).
            runs = _measure_runs(entry)
            if entry.state == "measuring" and (
                    len(entry.fused_s) >= runs and len(entry.paired_s) >= runs
                    or len(entry.fused_s) >= 2 * runs + 2):
                self._decide(entry)

    def _decide(self, entry: TraceEntry) -> None:
        """Note [paired timing]
        While a program is measured, its fused runs alternate with op-by-op runs of the same
        trace (after one fused warm-up run: F, F1, R1, F2, R2, F3, R3), and the decision compares
        the medians of those pairs. Comparing fused runs with op-by-op runs timed in an earlier
        phase (before and during the compile) mis-decided on a loaded machine: a mid-size GPT-2
        step's program, about 20% faster when timed alternately, was dropped as "not faster"
        The alternation is a function of run counts only, so ranks of one job
        alternate alike (Note [ranks agree]). Op-by-op runs are bitwise eager; fused ones within
        tolerance, as at any time while a program is measured."""
        if len(entry.paired_s) >= _measure_runs(entry):
            fused, replay = _at_one_size(entry.fused_s, entry.fused_n, entry.paired_s,
                                         entry.paired_n)
        else:
            fused = _median(entry.fused_s)
            replay = _median(entry.replay_s) if entry.replay_s else float("inf")
        entry.decided_s = (fused, replay)
        self._mark_decided(entry)
        self._remeasure.discard(entry.digest)
        # Note [ranks agree]: the first rank to measure decides for all
        if distributed.agree_keep(self, entry, fused <= KEEP_RATIO * replay):
            entry.state = "fused"
            entry.decision = f"fused: {fused * 1e3:.3f} ms vs op-by-op {replay * 1e3:.3f} ms"
            M.kept_fused += 1
        else:
            entry.state = "replay"
            entry.decision = (f"op-by-op: fused {fused * 1e3:.3f} ms is not faster than "
                              f"{replay * 1e3:.3f} ms")
            entry.program = None
            M.kept_replay += 1
        log.info("adaptive_eager: trace %s: %s", entry.digest[:12], entry.decision)
        self.save_stats(entry, sample=True)

    # ---- stepping aside (Note [stepping aside] in aside.py) -----------------------------------
    def note_flush(self, hit: bool, n_ops: int, state: str) -> None:
        """A flush of ``n_ops`` ops whose trace entry is in ``state`` (Note [coverage])."""
        self.flushes += 1
        self.hits += hit
        self.ops_recent = self.ops_recent * COVERAGE_DECAY + n_ops
        self.ops_cold = self.ops_cold * COVERAGE_DECAY + (n_ops if state == "new" else 0)

    # Note [coverage]
    # Decisions about the whole thread (step aside, or a trial against plain eager) are made
    # from the traces decided so far; they speak for the program only when hot traces are
    # most of what it runs. A Mamba-style scan (a Python loop over 32 time steps, forward and
    # backward, Adam) learns its step's ops in its first step, then a 5-op trace that runs a
    # dozen times a step is hot and decided first: "1 traces measured" stepped the whole
    # thread aside for 2000 rounds before its 2,000-op step trace had run twice (fused later,
    # it ran in 4 ms against 26 op by op). So neither happens while traces not yet hot (state
    # "new") ran more than 1 - COVERAGE of the ops deferred over about the last 100 flushes (a
    # decayed count, per flush: cheap, and the learning step's ops fade out). Hot traces still
    # compiling or being measured hold decisions back on their own (Note [undecided means
    # measuring too]); traces that never repeat have their own rules (hits, settled shapes).
    # The share says nothing before the program's later traces were seen at all: a step whose
    # first half is a dozen 2-op flushes had one of them decided, and the share "covered", 10
    # flushes in, before the step's own 61-op trace ran once; so at least COVERAGE_FLUSHES
    # flushes first (a training loop with one flush a step still steps aside within 30 steps).
    def _covered(self) -> bool:
        return self.flushes >= COVERAGE_FLUSHES and \
            self.ops_cold <= (1.0 - COVERAGE) * self.ops_recent

    def step_aside_reason(self) -> str | None:
        """Why the engine should leave the mode stack, or None while something gains."""
        # Note [ranks agree]: ranks of a distributed job step aside together
        return distributed.agree_aside(self, self._step_aside_reason())

    def _step_aside_reason(self) -> str | None:
        if not self.options.step_aside or not self.backend.compiles:
            return None
        if self.probe_start is not None:
            if self.flushes - self.probe_start < PROBE_FLUSHES:
                return None
            kept = sum(e.state == "fused" for e in self.decided)
            if kept > self.kept_at_probe:
                self.probe_start = None
                return None
            return f"a probe of {PROBE_FLUSHES} flushes found no new trace worth fusing"
        if self.flushes >= NO_REPEAT_FLUSHES and self.hits < 0.05 * self.flushes:
            return f"traces do not repeat ({self.hits} hits in {self.flushes} flushes)"
        if M.ops_intercepted >= NO_REPEAT_OPS and M.meta_misses >= 0.5 * M.ops_intercepted:
            return (f"shapes do not settle ({M.meta_misses} of {M.ops_intercepted} ops saw new "
                    "metadata and ran eagerly)")
        if len(self.decided) < MIN_DECISIONS or self._undecided_hot() or not self._covered():
            return None
        engine, eager = self.round_estimate()
        if engine >= eager:
            return (f"{len(self.decided)} traces measured: under the engine a round takes "
                    f"{engine * 1e3:.3f} ms, plain eager about {eager * 1e3:.3f} ms")
        return None

    def round_estimate(self) -> tuple[float, float]:
        """Seconds for one run of every decided trace under the engine, and under plain eager.

        Note [flushes cost too]
        Under the engine a trace costs its recording (RECORD_S beyond eager's own call, plus
        that call's dispatcher time EAGER_OP_S, since recording replaces it and the kernel runs
        later), its run (fused or op by op), and its flush (FLUSH_S: finishing the trace, its
        live outputs, publishing them, the sync that asked for it); plain eager costs the op-by-op
        run less replay's own cost per op (REPLAY_EXTRA_S) and per run (REPLAY_FIXED_S). The
        per-op terms alone, calibrated on one 200-op flush, missed the per-flush ones: a loop
        with an ``.item()`` every 4 ops (benchmarks' ``item_loop``) kept its 4-op programs in a
        warm process at 0.09x eager (about 110 us an iteration against eager's 8), because its
        12 us programs looked faster than an "eager" of 26-62 us read off replay times that held
        about 10 us of replay's fixed cost and 70 us of flushing. Op-by-op times come from the
        runs paired with fused ones (Note [paired timing]) where there are enough: the
        unpaired samples of a trace that compiled are its first runs (one, while a compile is
        in flight), the slowest. Eager's side takes the fastest op-by-op run: in a warm process
        the first op-by-op runs of a loaded program's trace are the first calls of their kernels
        in the process (86-102 us for that 4-op trace, 21-37 us later), and only the best of the
        runs is an estimate of eager's own time, as in the calibration. Eager's side never goes
        below EAGER_OP_S an op: for a trace of tiny ops the replay's fastest run less replay's
        own costs is within their noise (0 for benchmarks' context_loop's 20 ops)."""
        engine = eager = 0.0
        with STATE_LOCK:
            decided = list(self.decided)
        per_op = RECORD_S + EAGER_OP_S
        for e in decided:
            samples = e.paired_s if len(e.paired_s) >= MEASURE_RUNS else e.replay_s
            replay = _median(samples) if samples else 0.0
            run = _median(e.fused_s) if e.state == "fused" and e.fused_s else replay
            best = min(min(e.paired_s, default=replay), min(e.replay_s, default=replay))
            if e.sym is not None and len(e.paired_s) >= _measure_runs(e) and e.fused_s:
                # Note [timing at one size]: both sides at one size, not the shortest
                # op-by-op run against the median fused one
                fused, replay = _at_one_size(e.fused_s, e.fused_n, e.paired_s, e.paired_n)
                run = fused if e.state == "fused" else replay
                best = replay
            engine += run + e.n_ops * per_op + FLUSH_S
            # eager runs each op at least at the dispatcher's cost: the difference alone came
            # out at 0 for 20 tiny ops ("plain eager about 0.000 ms" against a real 39 us)
            eager += max(best - e.n_ops * REPLAY_EXTRA_S - REPLAY_FIXED_S, e.n_ops * EAGER_OP_S)
        return engine, eager

    def compiling(self) -> bool:
        """Whether a compile or a load is still running in the background."""
        with STATE_LOCK:
            self.in_flight = [f for f in self.in_flight if not f.done()]
            return bool(self.in_flight)

    def settled(self) -> bool:
        """Every hot trace compiled and decided: the engine runs as fast as it will (the moment
        for a measured trial against plain eager, Note [measured trial] in aside.py)."""
        return (self.options.step_aside and self.backend.compiles and self.probe_start is None
                and len(self.decided) >= MIN_DECISIONS and not self._undecided_hot()
                and M.compiles_pending == 0 and self._covered())

    def _undecided_hot(self) -> bool:
        """A hot trace still on its way to a decision (compiling or being measured).

        Note [undecided means measuring too]
        A program that is ready but still being measured is undecided as well: counting only
        compiles let the estimate step aside on a mid-size GPT-2 step's 18-op trace alone ("1
        traces measured") while its 464-op step program, loaded from disk, was still being
        timed, so that program never ran again. A measuring trace that stops running (a shape seen
        once) counts only for MEASURING_STALE_FLUSHES flushes after it was first seen so."""
        from adaptive_eager.cache.memory import TRIE

        seen = self._measuring_since
        for e in TRIE.entry_list[-200:]:
            if e.state == "compiling":
                return True
            if e.state == "measuring":
                key = (e.digest, e.fused_runs + len(e.paired_s))  # moves on with every timed run
                since = seen.setdefault(key, self.flushes)
                if self.flushes - since <= MEASURING_STALE_FLUSHES:
                    return True
        return False

    def new_probe(self) -> None:
        self.probe_start = self.flushes
        self.kept_at_probe = sum(e.state == "fused" for e in self.decided)

    def fused_failed(self, entry: TraceEntry, err: BaseException) -> None:
        with STATE_LOCK:
            self._fused_failed(entry, err)

    def _fused_failed(self, entry: TraceEntry, err: BaseException) -> None:
        M.fused_errors += 1
        if entry.from_bytes and not entry.in_process:
            # A program that went through serialization can fail where the compiler's in-memory
            # one runs (Note [graph pickling] in graph.py fixed the case seen most). Compile this
            # trace here, keep it off disk.
            entry.in_process = True
            entry.program = None
            entry.fused_s.clear()
            entry.fused_n.clear()
            entry.fused_runs = 0
            entry.error = f"run after deserializing: {type(err).__name__}: {err}"[:500]
            log.warning("adaptive_eager: the deserialized program of trace %s failed (%s: %s); "
                        "compiling it in this process", entry.digest[:12], type(err).__name__,
                        str(err)[:200])
            self.save_stats(entry)
            entry.state = "new"  # the next flush submits it again (not from inside a run)
            return
        self._fail(entry, "run", err)

    def quarantine(self, entry: TraceEntry, why: str) -> None:
        with STATE_LOCK:
            M.quarantined += 1
            entry.state = "quarantined"
            entry.program = None
            entry.decision = f"quarantined: {why}"
        log.warning("adaptive_eager: trace %s quarantined: %s; it runs op by op from now on",
                    entry.digest[:12], why)
        if self.disk is not None:
            self.disk.quarantine(entry.digest, why)

    def _mark_decided(self, entry: TraceEntry) -> None:
        """Every append to ``decided`` goes here: an entry decided twice (a re-measure, a failure
        after a decision) is weighed once in the step-aside estimate. By identity: entries are
        not compared by value."""
        if not any(e is entry for e in self.decided):
            self.decided.append(entry)

    def _fail(self, entry: TraceEntry, stage: str, err: BaseException) -> None:
        entry.state = "failed"
        entry.program = None
        # Note [failed means decided]: a trace that cannot be fused runs op by op for good, so
        # the step-aside estimate weighs it as a decided trace. Left out, a program whose every
        # hot trace was declined (an LSTM language model: mkldnn_rnn_layer) had no decision,
        # hence no estimate and no trial, and replayed at 0.63x eager forever.
        if entry.replay_s:
            self._mark_decided(entry)
        entry.error = f"{stage}: {type(err).__name__}: {err}"[:500]
        transient = _transient(err)
        entry.decision = f"op-by-op: {stage} failed" + (" (transient)" if transient else "")
        kind = f"{stage}:{type(err).__name__}"
        if entry.sym is not None:  # a template's program refused (Note [trusting a size])
            if stage == "graph":
                M.sym_unfusable += 1
            elif "dynamic size became a constant" in str(err):
                M.sym_specialized += 1  # Note [specializing kernels] in backends/inductor.py
        # A trace the graph builder declines (Unfusable: an LSTM kernel, a conj view) is a known
        # limit, not a fault: said at INFO (and in the report's decisions), not as a warning.
        level = logging.INFO if isinstance(err, graph_mod.Unfusable) else logging.WARNING
        if kind not in self._logged:
            self._logged.add(kind)
            log.log(level, "adaptive_eager: %s of trace %s failed (%s: %s); it runs op by op%s",
                        stage, entry.digest[:12], type(err).__name__, str(err)[:300],
                        " in this process (a later one retries it)" if transient else "",
                        exc_info=log.isEnabledFor(logging.DEBUG))
        self.save_stats(entry, failure={"stage": stage, "error": entry.error,
                                        "transient": transient})

    # ---- disk ---------------------------------------------------------------------------------
    def _program_key(self, entry: TraceEntry, g: graph_mod.TraceGraph) -> str:
        extra = {}
        if g.dynamic:  # programs with their shape guards (Note [program shape guards]): one
            extra["guards"] = 1  # stored before them is not loaded, it compiles again once
        trace = dict(digest=entry.digest, live=g.live, lifted=g.lifted, offsets=g.offsets,
                     baked=tuple(zip(g.baked, g.baked_values)), **extra)
        return program_key(trace, f"{self.backend.name}:{self.backend.options_key()}", g.state)

    def _plan_key(self, entry: TraceEntry, g: graph_mod.TraceGraph) -> str:
        """Where the remote store keeps the plan of this trace's program: from what a process
        knows at the trace's first run (Note [remote program plan] in cache/remote.py)."""
        trace = dict(digest=entry.digest, live=g.live, dynamic=g.dynamic, plan=1)
        return program_key(trace, f"{self.backend.name}:{self.backend.options_key()}", g.state)

    def _store(self, entry: TraceEntry, g: graph_mod.TraceGraph, program: Any,
               seconds: float, data: bytes | None = None, stored: bool = False) -> None:
        if self.disk is None or entry.in_process:
            return
        if stored:  # the compile service wrote it (Note [compile service])
            self.save_stats(entry, hot=True, compiled=True, program_key=self._program_key(entry, g))
            return
        try:
            if data is None:
                with outside_modes():
                    data = self.backend.serialize(program)
        except Exception as err:
            M.disk_errors += 1
            log.info("adaptive_eager: program of %s not serializable: %s", entry.digest[:12], err)
            return
        key = self._program_key(entry, g)
        self.disk.put_program(key, torch.__version__, self.backend.name,
                              data, {"n_ops": g.n_ops, "compile_s": seconds})
        self.save_stats(entry, hot=True, compiled=True, program_key=key)

    def _retry_failure(self, failure: dict) -> bool:
        """Whether a failure stored by an earlier process is worth trying again here."""
        if not failure.get("transient"):
            return False
        return (int(failure.get("count", 1)) <= TRANSIENT_RETRIES
                or time.time() - float(failure.get("at", 0.0)) >= RETRY_AFTER_S)

    def _from_disk(self, entry: TraceEntry, trace: Trace, live: list[int]) -> bool:
        """Start loading a program (or take a past decision) for this trace from the disk cache.

        Loading runs in the worker thread (the first load in a process imports Inductor, which
        takes seconds, and the program must not wait for it); deserializing patches nothing."""
        if self.disk is None:
            return False
        if self.disk.is_quarantined(entry.digest):
            entry.state = "quarantined"
            entry.decision = "quarantined in an earlier run"
            return True
        stats = self.disk.get_stats(entry.digest)
        if stats is None and remote_cache.from_env() is None:
            M.disk_misses += 1
            return False
        stats = stats or {}  # Note [remote program store]: the program may be on the store
        remeasure = entry.digest in self._remeasure
        failure = stats.get("failure")
        retry = bool(failure) and self._retry_failure(failure)
        if retry:
            log.info("adaptive_eager: trace %s failed transiently before (%s, %d time(s)); "
                     "trying again", entry.digest[:12], failure.get("error", "")[:120],
                     int(failure.get("count", 1)))
        if (stats.get("decision", "").startswith("op-by-op") and not retry and not remeasure
                and stats.get("torch") == torch.__version__):
            entry.state = "replay"
            entry.decision = stats["decision"] + " (earlier run)"
            if stats.get("replay_ms"):  # counts for stepping aside (failed ones too: Note
                entry.replay_s = [stats["replay_ms"] / 1e3]  # [failed means decided])
                self._mark_decided(entry)
                if stats.get("fused_ms"):
                    entry.fused_s = [stats["fused_ms"] / 1e3]
                    # this process re-measures if its own op-by-op time disagrees
                    self._stored_fused[entry.digest] = stats["fused_ms"] / 1e3
            return True
        entry.was_hot = bool(stats.get("hot")) or retry
        entry.varying |= set(stats.get("varying", ()))
        if stats.get("in_process"):  # its deserialized program failed before: compile here
            entry.in_process = True
            return False
        if stats.get("replay_ms") and not entry.replay_s:
            # The loaded program is timed again here; its op-by-op time comes from the run that
            # measured it, so the keep decision and stepping aside have something to weigh it
            # against (this process may never replay the trace).
            entry.replay_s = [stats["replay_ms"] / 1e3]
        try:  # a template's entry: its dynamic-size graph (Note [symbolic programs])
            g = graph_mod.build(trace, live, entry.varying,
                                template=trace.sym if entry.sym is not None else None)
        except Exception:
            return False
        key = self._program_key(entry, g)
        program = self._take_prefetched(key)
        if program is not None:
            M.disk_hits += 1
        else:
            value = self._stored_program(key)
            if value is None:  # Note [remote program plan] in cache/remote.py
                g, key, value = self._by_remote_plan(entry, trace, live, g, key)
            if value is None:
                M.disk_misses += 1
                return False
            program = self._load_now(value["artifact"], g, entry)
            if program is None:  # counted and logged: compiled again, at once (it was hot)
                entry.was_hot = True
                return False
        entry.graph = g
        entry.program_live = frozenset(live)
        entry.decision = (f"{stats['decision']} (loaded)" if stats.get("decision")
                          else "loaded from the disk cache, not measured yet")
        entry.from_bytes = True
        entry.program = program
        if entry.sym is not None:  # Note [verified sizes]
            self.sizes.load(entry, stats, key, program)
        entry.compile_s = 0.0
        entry.state = entry.loaded_state = "measuring"  # measured again: this process differs
        return True

    def _stored_program(self, key: str) -> dict | None:
        """The program stored under ``key``: on disk, else the remote store's (Note [remote
        program store]), written to disk and read back from there."""
        value = self.disk.get_program(key, torch.__version__)
        if value is None and remote_cache.fetch_into(self.disk, key, torch.__version__):
            value = self.disk.get_program(key, torch.__version__)
        return value

    def _by_remote_plan(self, entry: TraceEntry, trace: Trace, live: list[int],
                        g: graph_mod.TraceGraph, key: str) -> tuple[Any, str, dict | None]:
        """Note [remote program plan] in cache/remote.py: the program another machine compiled
        for this trace, found through the numbers it lifted (graph, key and stored value), or
        ``(g, key, None)``."""
        plan = remote_cache.fetch_plan(self._plan_key(entry, g), torch.__version__)
        if plan is None:
            return g, key, None
        varying = entry.varying | {i for i in plan if i < len(trace.scalars)}
        if varying == entry.varying:  # nothing this process does not know: the same key
            return g, key, None
        try:
            planned = graph_mod.build(trace, live, varying,
                                      template=trace.sym if entry.sym is not None else None)
        except Exception:
            return g, key, None
        planned_key = self._program_key(entry, planned)
        value = self._stored_program(planned_key)
        if value is None:
            return g, key, None
        entry.varying |= varying  # lifted numbers are inputs: correct whatever their values
        return planned, planned_key, value

    def _load_now(self, data: bytes, g: graph_mod.TraceGraph, entry: TraceEntry) -> Any:
        """Note [warm start]
        A program on disk is loaded at the trace's first run in this process, in the flushing
        thread, and used by that very run: deserializing an Inductor artifact takes 7-23 ms
        here (the compiler's modules are imported once before, as for any load). Programs this
        script used in its recent runs are loaded even earlier, in the worker, from engine start
        on (``_prefetch``: their keys are in the statistics), so those first runs find them
        ready. Returns None when the program fails to load (counted in ``disk_errors``)."""
        self._import_compiler()
        start = time.perf_counter()
        try:
            with outside_modes(), span("adaptive_eager.load"):
                program = self.backend.load(data, g)
        except Exception as err:
            M.disk_errors += 1
            log.warning("adaptive_eager: cached program for %s failed to load (%s); "
                        "compiling it instead", entry.digest[:12], err)
            return None
        seconds = time.perf_counter() - start
        M.compile_load_seconds += seconds
        M.disk_hits += 1
        if len(M.program_waits) < 200:
            M.program_waits[entry.digest[:12]] = round(seconds, 3)
        return program

    def save_stats(self, entry: TraceEntry, hot: bool = False, failure: dict | None = None,
                   sample: bool = False, compiled: bool = False,
                   program_key: str | None = None) -> None:
        """Merge this process's view of the trace into its statistics on disk (Note [persisted
        decisions]): samples accumulate, a failure counts up, a success clears it."""
        if self.disk is None:
            return
        try:
            old = self.disk.get_stats(entry.digest) or {}
        except Exception:
            old = {}
        summary = entry.summary()
        samples = [s for s in old.get("samples", ()) if isinstance(s, dict)]
        decision = entry.decision
        # the sample is what _decide compared, not the medians (Note [persisted decisions])
        decided = entry.decided_s
        if sample and decided is not None and math.isfinite(decided[1]):
            samples = (samples + [{"fused_ms": round(decided[0] * 1e3, 4),
                                   "replay_ms": round(decided[1] * 1e3, 4),
                                   "at": round(time.time(), 1)}])[-_SAMPLES:]
            keep, ratio = _combine(samples)
            decision = (f"{'fused' if keep else 'op-by-op'}: median fused/op-by-op "
                        f"{ratio:.2f} over {len(samples)} measurement(s); here {entry.decision}")
        elif not decision and old.get("decision"):
            decision = old["decision"]  # a hot mark or a store keeps what was decided
        stored_failure = old.get("failure")
        if failure is not None:
            same = stored_failure and stored_failure.get("stage") == failure["stage"]
            failure = dict(failure, at=round(time.time(), 1),
                           count=(int(stored_failure.get("count", 1)) + 1) if same else 1)
        elif compiled or sample:
            failure = None  # compiled fine here: an earlier transient failure is over
        else:
            failure = stored_failure
        if compiled and decision.startswith("op-by-op") and old.get("failure"):
            decision = ""  # the failure this decision recorded is over
        self.disk.put_stats(entry.digest, {
            "torch": torch.__version__, "hot": hot or entry.runs >= self.options.hot_after
            or entry.was_hot or bool(old.get("hot")), "decision": decision,
            "varying": sorted(entry.varying | set(old.get("varying", ()))),
            "replay_ms": summary["replay_ms"] or old.get("replay_ms"),
            "fused_ms": summary["fused_ms"] or old.get("fused_ms"),
            "compile_s": entry.compile_s or old.get("compile_s", 0.0), "n_ops": entry.n_ops,
            "runs": entry.runs, "error": entry.error, "in_process": entry.in_process,
            "failure": failure, "samples": samples,
            "program_key": program_key or old.get("program_key"),
            "sym_sizes": self.sizes.record(entry, program_key or old.get("program_key"),
                                           old.get("sym_sizes")),  # Note [verified sizes]
            "script": _script_id() or old.get("script", ""), "used_at": round(time.time(), 1),
        })

    def wait(self, timeout: float | None = None) -> None:
        """Block until submitted compiles finish (tests and benchmarks use this)."""
        WORKER.wait(timeout)
        with STATE_LOCK:
            pending = [f for f in self.in_flight if not f.done()]
        if pending:
            done, not_done = concurrent.futures.wait(pending, timeout)
            if not_done:
                raise TimeoutError("compiles still running")


_managers: dict[Options, CompileManager] = {}
_managers_lock = threading.Lock()


def manager_for(options: Options) -> CompileManager:
    with _managers_lock:
        m = _managers.get(options)
        if m is None:
            m = _managers[options] = CompileManager(options)
        return m


def reset_managers() -> None:
    with _managers_lock:
        for m in _managers.values():
            if m.disk is not None:
                m.disk.close()
        _managers.clear()
