"""When traces get compiled, where programs come from, and whether a program is worth keeping.

Note [adaptive decisions]
Each trace entry moves through states:
  new        runs op by op; its replay time and which Python numbers vary are observed.
  compiling  seen ``hot_after`` times: compiled in a background thread (or at once with
             compile_async off) while the program keeps running op by op.
  measuring  program ready (compiled, or loaded from the disk cache): the next runs use it and
             are timed; the first (warm-up) call is not counted.
  fused      measured faster than op-by-op replay, recording overhead included: kept.
  replay     not faster: the program is dropped and the trace never compiles again here (the
             decision is stored on disk, so later processes do not compile it either).
  failed     the compiler or the program raised: op by op from now on, counted, logged once.
  quarantined the crosscheck found the fused result differs from op-by-op replay.
A program is used only for runs whose live slots it returns and whose baked-in numbers still hold.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from adaptive_eager.spans import span
from adaptive_eager import graph as graph_mod
from adaptive_eager.backends import Backend, get_backend
from adaptive_eager.cache.disk import DiskCache, cache_key, resolve_cache_dir
from adaptive_eager.cache.memory import TraceEntry
from adaptive_eager.config import Options
from adaptive_eager.compile_process import HELPER, HelperFailed
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.trace import Trace

log = logging.getLogger("adaptive_eager")

ENGINE_VERSION = "0.1.0"
MEASURE_RUNS = 3  # timed fused runs before deciding
MIN_OPS = 2  # a one-op trace has nothing to fuse
MIN_DECISIONS = 1  # traces measured before the engine may step aside
RECORD_S = 6e-6  # recording cost per op over eager's; measured at start (calibrate.py)
REPLAY_EXTRA_S = 3e-6  # op-by-op replay's cost per op over eager's; measured at start too
NO_REPEAT_FLUSHES = 300  # flushes after which a hit rate under 5% means traces do not repeat
NO_REPEAT_OPS = 5000  # ops after which mostly-new metadata means shapes never settle
PROBE_FLUSHES = 50  # flushes a probe gets to find a trace worth fusing
KEEP_RATIO = 0.9  # fused (plus nothing else) must take at most this share of replay time
_HISTORY = 8


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


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def _flags() -> str:
    """Global settings that change generated code, for the disk key."""
    return (f"mm={torch.get_float32_matmul_precision()};det="
            f"{torch.are_deterministic_algorithms_enabled()}")


class CompileManager:
    """One per process and option set: the backend, the disk cache, the compile worker."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.backend: Backend = get_backend(options.backend)
        self.disk: DiskCache | None = None
        if options.disk_cache and self.backend.compiles:
            self.disk = DiskCache.open(resolve_cache_dir(options),
                                       options.cache_size_mb * 1024 * 1024)
            prepare = getattr(self.backend, "prepare", None)
            if self.disk is not None and prepare is not None:
                prepare(str(self.disk.directory))
            warm_up = getattr(self.backend, "warm_up", None)
            if self.disk is not None and warm_up is not None and options.compile_async:
                # A warm cache means programs will load soon: import the compiler now, in the
                # worker, so the first load does not start from a cold interpreter.
                self._worker().submit(warm_up)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.decided: list[TraceEntry] = []
        self.flushes = 0
        self.hits = 0
        self.probe_start: int | None = None
        self.kept_at_probe = 0
        self.in_flight: list[concurrent.futures.Future] = []

    # ---- observation (op-by-op runs) ----------------------------------------------------------
    def observe(self, entry: TraceEntry, trace: Trace) -> None:
        """Note which Python numbers changed since the entry's first run."""
        if entry.scalar_ref is None:
            entry.scalar_ref = list(trace.scalars)
            return
        ref = entry.scalar_ref
        for i, v in enumerate(trace.scalars):
            if i < len(ref) and (type(v) is not type(ref[i]) or v != ref[i]):
                entry.varying.add(i)

    def record_replay(self, entry: TraceEntry, seconds: float) -> None:
        if M.compiles_pending and entry.replay_s:
            return  # a compile running alongside inflates this run: keep the clean samples
        entry.replay_s.append(seconds)
        if len(entry.replay_s) > _HISTORY:
            del entry.replay_s[0]

    # ---- the question asked at every flush ----------------------------------------------------
    def program_for(self, entry: TraceEntry, trace: Trace, live: list[int]) -> Any:
        """The program to run this flush with, or None for op-by-op replay."""
        if not self.backend.compiles:
            return None
        state = entry.state
        if state == "compiling":
            if not entry.future.done():
                return None
            self._compiled(entry)
            state = entry.state
        if state in ("measuring", "fused"):
            g = entry.graph
            if set(live) <= entry.program_live and g.scalars_hold(trace.scalars):
                return entry.program
            return None
        if state == "new":
            self._maybe_start(entry, trace, live)
            if entry.state in ("measuring", "fused"):
                return self.program_for(entry, trace, live)
        return None

    def _maybe_start(self, entry: TraceEntry, trace: Trace, live: list[int]) -> None:
        if entry.n_ops < MIN_OPS:
            return
        if not entry.disk_checked:
            entry.disk_checked = True
            if self._from_disk(entry, trace, live):
                return
        hot = entry.runs >= self.options.hot_after or entry.was_hot
        if hot and entry.state == "new":
            self._submit(entry, trace, live)

    # ---- compiling ----------------------------------------------------------------------------
    def _submit(self, entry: TraceEntry, trace: Trace, live: list[int]) -> None:
        try:
            g = graph_mod.build(trace, live, entry.varying)
        except Exception as err:  # Unfusable, or a trace shape we do not handle
            self._fail(entry, "graph", err)
            return
        entry.graph = g
        entry.program_live = frozenset(live)
        entry.loaded_state = "measuring"
        self._start(entry, self._compile, g, entry)

    def _start(self, entry: TraceEntry, work: Any, *args: Any) -> None:
        """Run a compile or a load in the worker thread (or now, with compile_async off)."""
        entry.state = "compiling"
        with self._lock:
            M.compiles_pending += 1
        if self.options.compile_async:
            entry.future = self._worker().submit(work, *args)
            entry.future.add_done_callback(self._finished)
            self.in_flight.append(entry.future)
        else:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            try:
                fut.set_result(work(*args))
            except BaseException as err:
                fut.set_exception(err)
            entry.future = fut
            self._finished(fut)
            self._compiled(entry)

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="adaptive_eager-compile")
        return self._pool

    def _compile(self, g: graph_mod.TraceGraph, entry: TraceEntry) -> tuple[Any, float]:
        """Compile, then store the program on disk (in the worker: a process that ends before
        using it still leaves it for the next run)."""
        start = time.perf_counter()
        label = f"trace {entry.digest[:12]} ({g.n_ops} ops)"
        with outside_modes(), span("adaptive_eager.compile"), progress(label):
            program, data = self._compile_program(g, entry)
        seconds = time.perf_counter() - start
        M.compiles += 1  # counted here: a process may end before a flush picks the program up
        M.compile_seconds += seconds
        self._store(entry, g, program, seconds, data)
        return program, seconds

    def _compile_program(self, g: graph_mod.TraceGraph, entry: TraceEntry
                         ) -> tuple[Any, bytes | None]:
        """The program, in the helper process where possible (Note [compile process])."""
        if (self.options.compile_process and getattr(self.backend, "separate_process", False)
                and not entry.in_process):
            try:
                data, _ = HELPER.compile(self.backend, g)
            except HelperFailed:
                pass  # counted and logged once by the helper's client; compile here instead
            else:
                entry.from_bytes = True
                return self.backend.load(data, g), data
        entry.from_bytes = False
        return self.backend.compile(g), None

    def _finished(self, future: concurrent.futures.Future) -> None:
        """When a compile or load ends (in the worker), even if no flush picks it up (the engine
        may be aside meanwhile)."""
        with self._lock:
            M.compiles_pending = max(M.compiles_pending - 1, 0)

    def _compiled(self, entry: TraceEntry) -> None:
        try:
            program, seconds = entry.future.result()
        except Exception as err:
            M.compile_errors += 1
            self._fail(entry, "compile", err)
            return
        finally:
            entry.future = None
        entry.compile_s = seconds
        entry.program = program
        entry.state = entry.loaded_state
        log.info("adaptive_eager: program for trace %s (%d ops) ready after %.2fs",
                 entry.digest[:12], entry.n_ops, seconds)

    # ---- measuring and deciding ---------------------------------------------------------------
    def record_fused(self, entry: TraceEntry, seconds: float) -> None:
        entry.fused_runs += 1
        if entry.fused_runs == 1 and entry.state == "measuring":
            return  # warm-up call: first-touch costs are not the program's steady state
        entry.fused_s.append(seconds)
        if len(entry.fused_s) > _HISTORY:
            del entry.fused_s[0]
        if entry.state == "measuring" and len(entry.fused_s) >= MEASURE_RUNS:
            self._decide(entry)

    def _decide(self, entry: TraceEntry) -> None:
        fused = _median(entry.fused_s)
        replay = _median(entry.replay_s) if entry.replay_s else float("inf")
        self.decided.append(entry)
        if fused <= KEEP_RATIO * replay:
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
        self.save_stats(entry)

    # ---- stepping aside (Note [stepping aside] in aside.py) -----------------------------------
    def note_flush(self, hit: bool) -> None:
        self.flushes += 1
        self.hits += hit

    def step_aside_reason(self) -> str | None:
        """Why the engine should leave the mode stack, or None while something gains."""
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
        if len(self.decided) < MIN_DECISIONS or self._undecided_hot():
            return None
        engine = eager = 0.0  # one run of every decided trace, each way
        for e in self.decided:
            replay = _median(e.replay_s) if e.replay_s else 0.0
            run = _median(e.fused_s) if e.state == "fused" and e.fused_s else replay
            engine += run + e.n_ops * RECORD_S
            eager += max(replay - e.n_ops * REPLAY_EXTRA_S, 0.0)
        if engine >= eager:
            return (f"{len(self.decided)} traces measured: under the engine a round takes "
                    f"{engine * 1e3:.3f} ms, plain eager about {eager * 1e3:.3f} ms")
        return None

    def compiling(self) -> bool:
        """Whether a compile or a load is still running in the background."""
        self.in_flight = [f for f in self.in_flight if not f.done()]
        return bool(self.in_flight)

    def settled(self) -> bool:
        """Every hot trace compiled and decided: the engine runs as fast as it will (the moment
        for a measured trial against plain eager, Note [measured trial] in aside.py)."""
        return (self.options.step_aside and self.backend.compiles and self.probe_start is None
                and len(self.decided) >= MIN_DECISIONS and not self._undecided_hot()
                and M.compiles_pending == 0)

    def _undecided_hot(self) -> bool:
        """A hot trace still on its way to a decision (compiling or being measured)."""
        from adaptive_eager.cache.memory import TRIE

        return any(e.state == "compiling" for e in TRIE.entry_list[-200:])

    def new_probe(self) -> None:
        self.probe_start = self.flushes
        self.kept_at_probe = sum(e.state == "fused" for e in self.decided)

    def fused_failed(self, entry: TraceEntry, err: BaseException) -> None:
        M.fused_errors += 1
        if entry.from_bytes and not entry.in_process:
            # A program that went through serialization can fail where the compiler's in-memory
            # one runs (an AOTAutograd runtime wrapper rebuilt from bytes, seen on a Llama
            # trace whose outputs alias each other). Compile this trace here, keep it off disk.
            entry.in_process = True
            entry.program = None
            entry.fused_s.clear()
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
        M.quarantined += 1
        entry.state = "quarantined"
        entry.program = None
        entry.decision = f"quarantined: {why}"
        log.warning("adaptive_eager: trace %s quarantined: %s; it runs op by op from now on",
                    entry.digest[:12], why)
        if self.disk is not None:
            self.disk.quarantine(entry.digest, why)

    def _fail(self, entry: TraceEntry, stage: str, err: BaseException) -> None:
        entry.state = "failed"
        entry.program = None
        entry.error = f"{stage}: {type(err).__name__}: {err}"[:500]
        entry.decision = f"op-by-op: {stage} failed"
        kind = f"{stage}:{type(err).__name__}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("adaptive_eager: %s of trace %s failed (%s: %s); it runs op by op",
                        stage, entry.digest[:12], type(err).__name__, str(err)[:300],
                        exc_info=log.isEnabledFor(logging.DEBUG))
        self.save_stats(entry)

    # ---- disk ---------------------------------------------------------------------------------
    def _program_key(self, entry: TraceEntry, g: graph_mod.TraceGraph) -> str:
        return cache_key(trace=entry.digest, live=g.live, lifted=g.lifted, offsets=g.offsets,
                         baked=tuple(zip(g.baked, g.baked_values)), torch=torch.__version__,
                         engine=ENGINE_VERSION, backend=self.backend.options_key(),
                         flags=_flags())

    def _store(self, entry: TraceEntry, g: graph_mod.TraceGraph, program: Any,
               seconds: float, data: bytes | None = None) -> None:
        if self.disk is None or entry.in_process:
            return
        try:
            if data is None:
                with outside_modes():
                    data = self.backend.serialize(program)
        except Exception as err:
            M.disk_errors += 1
            log.info("adaptive_eager: program of %s not serializable: %s", entry.digest[:12], err)
            return
        self.disk.put_program(self._program_key(entry, g), torch.__version__, self.backend.name,
                              data, {"n_ops": g.n_ops, "compile_s": seconds})
        self.save_stats(entry, hot=True)

    def _from_disk(self, entry: TraceEntry, trace: Trace, live: list[int]) -> bool:
        """Start loading a program (or take a past decision) for this trace from the disk cache.

        Loading runs where compiling would (in the worker thread when compile_async is on): the
        first load in a process imports Inductor, which takes seconds, and the program must not
        wait for it."""
        if self.disk is None:
            return False
        if self.disk.is_quarantined(entry.digest):
            entry.state = "quarantined"
            entry.decision = "quarantined in an earlier run"
            return True
        stats = self.disk.get_stats(entry.digest)
        if stats is None:
            M.disk_misses += 1
            return False
        if stats.get("decision", "").startswith("op-by-op") and stats.get("torch") == \
                torch.__version__:
            entry.state = "replay"
            entry.decision = stats["decision"] + " (earlier run)"
            if stats.get("replay_ms") and stats.get("fused_ms"):  # counts for stepping aside
                entry.replay_s = [stats["replay_ms"] / 1e3]
                entry.fused_s = [stats["fused_ms"] / 1e3]
                self.decided.append(entry)
            return True
        entry.was_hot = bool(stats.get("hot"))
        entry.varying |= set(stats.get("varying", ()))
        if stats.get("in_process"):  # its deserialized program failed before: compile here
            entry.in_process = True
            return False
        if stats.get("replay_ms") and not entry.replay_s:
            # The loaded program is timed again here; its op-by-op time comes from the run that
            # measured it, so the keep decision and stepping aside have something to weigh it
            # against (this process may never replay the trace).
            entry.replay_s = [stats["replay_ms"] / 1e3]
        try:
            g = graph_mod.build(trace, live, entry.varying)
        except Exception:
            return False
        value = self.disk.get_program(self._program_key(entry, g), torch.__version__)
        if value is None:
            M.disk_misses += 1
            return False
        entry.graph = g
        entry.program_live = frozenset(live)
        entry.loaded_state = "measuring"  # measured again here: this process may differ
        entry.decision = stats.get("decision", "") + " (loaded)"
        self._start(entry, self._load, value["artifact"], g, entry)
        return True

    def _load(self, data: bytes, g: graph_mod.TraceGraph, entry: TraceEntry
              ) -> tuple[Any, float]:
        try:
            with outside_modes(), span("adaptive_eager.load"):
                program = self.backend.load(data, g)
        except Exception as err:
            M.disk_errors += 1
            log.warning("adaptive_eager: cached program for %s failed to load (%s); "
                        "compiling it instead", entry.digest[:12], err)
            return self._compile(g, entry)
        M.disk_hits += 1
        entry.from_bytes = True
        return program, 0.0

    def save_stats(self, entry: TraceEntry, hot: bool = False) -> None:
        if self.disk is None:
            return
        self.disk.put_stats(entry.digest, {
            "torch": torch.__version__, "hot": hot or entry.runs >= self.options.hot_after
            or entry.was_hot, "decision": entry.decision, "varying": sorted(entry.varying),
            "replay_ms": entry.summary()["replay_ms"], "fused_ms": entry.summary()["fused_ms"],
            "compile_s": entry.compile_s, "n_ops": entry.n_ops, "runs": entry.runs,
            "error": entry.error, "in_process": entry.in_process,
        })

    def wait(self, timeout: float | None = None) -> None:
        """Block until submitted compiles finish (tests and benchmarks use this)."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result(timeout)


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
