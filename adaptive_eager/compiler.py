"""When traces get compiled, where programs come from, and whether a program is worth keeping.

The manager wires its parts: the decisions (compile/policy.py, Note [adaptive decisions] there),
the jobs (compile/jobs.py), the programs (compile/programs.py) and the sizes (compile/sizes.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

import torch

from adaptive_eager import graph as graph_mod
from adaptive_eager import distributed  # Note [ranks agree]
from adaptive_eager.cache import remote as remote_cache  # Note [remote program store]
from adaptive_eager.backends import Backend, get_backend
from adaptive_eager.cache.disk import DiskCache, resolve_cache_dir
from adaptive_eager.cache.memory import TRIE, TraceEntry
from adaptive_eager.compile.jobs import _LOAD_HERE, COMPILE_HERE, WORKER, Jobs, Transport, _Landed
from adaptive_eager.compile.jobs import _compile_guard, _Worker  # noqa: F401 (their old home)
from adaptive_eager.compile.policy import (MEASURE_RUNS, MEASURE_RUNS_SYM,  # noqa: F401 (old home)
                                           MIN_OBSERVED, _at_one_size, _median)
from adaptive_eager.compile.policy import MIN_OPS, Decisions, PolicyHooks, _combine, compiles_held
from adaptive_eager.compile.programs import TRANSIENT_RETRIES  # noqa: F401 (old home)
from adaptive_eager.compile.programs import ProgramHooks, Programs
from adaptive_eager.compile.sizes import SizeHooks, Sizes
from adaptive_eager.compile.sizes import SYM_CHECKED_SIZES, ShapeGuards  # noqa: F401 (old home)
from adaptive_eager.config import Options
from adaptive_eager.compile_process import (HELPER, CompileFailed, HelperFailed,
                                            failure_is_transient, fast_vec_isa_pick,
                                            request_bytes)
from adaptive_eager import service as service_mod
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.program_key import program_key  # Note [program key]
from adaptive_eager.symbolic_plan import Unfusable
from adaptive_eager.trace import Trace

log = logging.getLogger("adaptive_eager")

# Entries live in the process-wide trie, shared by every thread's engine and manager: their
# state changes under this lock (two threads, two contexts: one thread's pickup of a finished
# compile set entry.future to None under the other's feet).
STATE_LOCK = threading.RLock()


def run_size(entry: TraceEntry, trace: Trace) -> int:
    """The size a symbolic trace ran at, for its timings (Note [timing at one size]); 0 for
    a static trace."""
    return trace.sym.s if entry.sym is not None and trace.sym is not None else 0


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


# The compile helper and the compile service, for the jobs (compile/jobs.py imports neither).
_TRANSPORT = Transport(
    helper=HELPER, helper_failed=HelperFailed, compile_failed=CompileFailed,
    request_bytes=request_bytes, request=service_mod.request, recv_msg=service_mod.recv_msg,
    unavailable=service_mod.ServiceUnavailable, sync_compiles=distributed.sync_compiles,
    vec_isa_pick=fast_vec_isa_pick)


def _transient(err: BaseException) -> bool:
    """A failure a later process may not see (Note [persisted decisions], Note [transient
    compile failures] in compile_process.py)."""
    return failure_is_transient(err)



# The program key, the graph builder and the keep rule, for the programs (compile/programs.py).
_PROGRAM_HOOKS = ProgramHooks(program_key=program_key, build=graph_mod.build, combine=_combine)


def _recent_entries() -> list[TraceEntry]:
    """The newest trace entries, for the decisions (Note [undecided means measuring too])."""
    return TRIE.entry_list[-200:]


class CompileManager:
    """One per process and option set: the backend, the disk cache, and the decisions."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.backend: Backend = get_backend(options.backend)
        self.disk: DiskCache | None = None
        self._logged: set[str] = set()
        self.decisions = Decisions(options, self.backend.compiles, STATE_LOCK, PolicyHooks(
            save_stats=self._save_sample, agree_keep=self._agree_keep,
            agree_aside=self._agree_aside, distributed_job=distributed.active,
            recent_entries=_recent_entries))  # when to compile, keep, drop, step aside
        self.sizes = Sizes(SizeHooks(  # Note [trusting a size], Note [verified sizes]
            replay=_replay, close=_close, program_inputs=_program_inputs,
            quarantine=self.quarantine, untimed=self.decisions.untime, save=self._save_sizes))
        self.jobs = Jobs(self, _TRANSPORT, STATE_LOCK)  # where compiles run
        self.programs = Programs(self, _PROGRAM_HOOKS)  # key, store, load, statistics
        if options.disk_cache and self.backend.compiles:
            self.disk = DiskCache.open(resolve_cache_dir(options),
                                       options.cache_size_mb * 1024 * 1024)
            prepare = getattr(self.backend, "prepare", None)
            if self.disk is not None and prepare is not None:
                # points Inductor's folder; imports nothing of it (Note [import when a
                # program lands]): the compiler is imported, Dynamo first, before a load
                prepare(str(self.disk.directory))
            if self.disk is not None:
                self.programs.prefetch()  # Note [warm start]

    @property
    def in_flight(self) -> list[concurrent.futures.Future]:
        """Compiles and loads submitted to the worker (some may be done)."""
        return self.jobs.in_flight

    @in_flight.setter
    def in_flight(self, futures: list[concurrent.futures.Future]) -> None:
        self.jobs.in_flight = futures

    # ---- the decisions (compile/policy.py), as the engine, aside.py and distributed see them ---
    @property
    def decided(self) -> list[TraceEntry]:
        return self.decisions.decided

    @property
    def flushes(self) -> int:
        return self.decisions.flushes

    @property
    def probe_start(self) -> int | None:
        return self.decisions.probe_start

    def step_aside_reason(self) -> str | None:
        """Why the engine should leave the mode stack, or None while something gains."""
        return self.decisions.step_aside_reason()

    def settled(self) -> bool:
        """Every hot trace compiled and decided (Note [measured trial] in trial.py)."""
        return self.decisions.settled()

    def new_probe(self) -> None:
        self.decisions.new_probe()

    def _save_sample(self, entry: TraceEntry, sample: bool = False) -> None:
        self.save_stats(entry, sample=sample)

    def _agree_keep(self, entry: TraceEntry, keep: bool) -> bool:
        return distributed.agree_keep(self, entry, keep)  # Note [ranks agree]

    def _agree_aside(self, reason: str | None) -> str | None:
        return distributed.agree_aside(self, reason)  # Note [ranks agree]

    # ---- the question asked at every flush ----------------------------------------------------
    def program_for(self, entry: TraceEntry, trace: Trace, live: list[int]) -> Any:
        """The program to run this flush with, or None for op-by-op replay."""
        if not self.backend.compiles:
            return None
        self.decisions.recent.append(entry)  # Note [rare traces]
        if entry.sym is not None:  # Note [symbolic dims] in shapes.py
            if not getattr(self.options, "symbolic_programs", False):
                self.decisions.symbolic_replay(entry)
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
                    self.decisions.rebake(entry, g, trace.scalars)
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
                self.jobs.load_landed(entry, local[1], local[2])
            else:
                self.jobs.compile_here(entry, *local)
            with STATE_LOCK:
                if entry.state in ("measuring", "fused") and set(live) <= entry.program_live \
                        and entry.graph.scalars_hold(trace.scalars):
                    return entry.program
        return None

    def _save_sizes(self, entry: TraceEntry) -> None:
        """Checked sizes to disk, with the key of the program they are about."""
        if self.disk is not None:
            self.save_stats(entry, program_key=self.programs.key(entry, entry.graph))

    def _maybe_start(self, entry: TraceEntry, trace: Trace, live: list[int]) -> tuple | None:
        if entry.n_ops < MIN_OPS or WORKER.closed:
            return None
        # Note [ranks agree]: in a distributed job only at the hot run, and as the ranks agree
        if not distributed.ready_to_start(self, entry, trace, live):
            return None
        if not entry.disk_checked:
            entry.disk_checked = True
            # a symbolic trace's program is loaded too
            # (Note [symbolic programs] in symbolic_plan.py)
            if self._from_disk(entry, trace, live):
                return None
        if self.decisions.is_hot(entry) and entry.state == "new":
            if compiles_held():  # Note [learning budget] in budget.py: not affordable yet
                M.compiles_held += 1
                return None
            return self._submit(entry, trace, live)
        return None

    # ---- compiling ----------------------------------------------------------------------------
    def _submit(self, entry: TraceEntry, trace: Trace, live: list[int]) -> tuple | None:
        """Start compiling: in the helper (via the worker), or return what the flushing thread
        compiles here (Note [in-process compiles])."""
        try:
            if entry.sym is not None:  # Note [symbolic programs] in symbolic_plan.py
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
            self.save_stats(entry, hot=True, program_key=self.programs.key(entry, g))
        self.jobs.submitted[entry.digest] = time.perf_counter()
        if (self.jobs.use_helper(entry) and self.options.compile_async
                and not distributed.sync_compiles()):  # Note [ranks agree]
            label = f"trace {entry.digest[:12]} ({g.n_ops} ops)"
            # Sent now, before the compiler's modules are imported here: the service compiles
            # meanwhile, and the request outlives this process (Note [compile service]).
            sock = self.jobs.send(entry, g, label) if self.jobs.use_service(entry) else None
            if sock is not None:
                self.jobs.start(entry, self.jobs.await_service, sock, g, entry, label=label)
            else:
                self.jobs.start(entry, self.jobs.compile_remote, g, entry, label=label)
            return None
        entry.state = "compiling"
        entry.future = None  # nobody else picks it up while this thread compiles
        return (g,)

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
            remote_cache.publish_from(self.disk, self.programs.key(entry, entry.graph),
                                      torch.__version__, self.programs.plan_key(entry, entry.graph),
                                      entry.graph.lifted)
        log.info("adaptive_eager: program for trace %s (%d ops) ready after %.2fs",
                 entry.digest[:12], entry.n_ops, seconds)
        return None

    def compiling(self) -> bool:
        """Whether a compile or a load is still running in the background."""
        with STATE_LOCK:
            self.in_flight = [f for f in self.in_flight if not f.done()]
            return bool(self.in_flight)


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

    def _fail(self, entry: TraceEntry, stage: str, err: BaseException) -> None:
        entry.state = "failed"
        entry.program = None
        # Note [failed means decided]: a trace that cannot be fused runs op by op for good, so
        # the step-aside estimate weighs it as a decided trace. Left out, a program whose every
        # hot trace was declined (an LSTM language model: mkldnn_rnn_layer) had no decision,
        # hence no estimate and no trial, and replayed at 0.63x eager forever.
        if entry.replay_s:
            self.decisions.mark_decided(entry)
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
        level = logging.INFO if isinstance(err, Unfusable) else logging.WARNING
        if kind not in self._logged:
            self._logged.add(kind)
            log.log(level, "adaptive_eager: %s of trace %s failed (%s: %s); it runs op by op%s",
                        stage, entry.digest[:12], type(err).__name__, str(err)[:300],
                        " in this process (a later one retries it)" if transient else "",
                        exc_info=log.isEnabledFor(logging.DEBUG))
        self.save_stats(entry, failure={"stage": stage, "error": entry.error,
                                        "transient": transient})

    # ---- disk (programs: compile/programs.py) -------------------------------------------------
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
        remeasure = entry.digest in self.decisions.remeasure
        failure = stats.get("failure")
        retry = bool(failure) and self.programs.retry_failure(failure)
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
                self.decisions.mark_decided(entry)
                if stats.get("fused_ms"):
                    entry.fused_s = [stats["fused_ms"] / 1e3]
                    # this process re-measures if its own op-by-op time disagrees
                    self.decisions.stored_fused[entry.digest] = stats["fused_ms"] / 1e3
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
        found = self.programs.find(entry, trace, live)
        if found is None:
            return False
        g, key, program = found
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

    def save_stats(self, entry: TraceEntry, hot: bool = False, failure: dict | None = None,
                   sample: bool = False, compiled: bool = False,
                   program_key: str | None = None) -> None:
        """The trace's statistics, merged into those on disk (Note [persisted decisions])."""
        self.programs.save_stats(entry, hot=hot, failure=failure, sample=sample,
                                 compiled=compiled, program_key=program_key)

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
