"""Programs: the key a program is stored under, its store and load (disk cache, remote store),
the warm-start prefetch, and the trace statistics kept beside it.

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

The manager owns one ``Programs`` and is its ``ProgramsOwner`` (options, backend, disk cache, and
the sizes and jobs); what sits in the engine's import circle above this module (the program key
function, the graph builder, the keep rule) comes in as ``ProgramHooks``. Trace entries, traces
and graphs are values here (``Any``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from adaptive_eager.cache import remote as remote_cache  # Note [remote program store]
from adaptive_eager.compile.jobs import WORKER, outside_modes
from adaptive_eager.compile.parts import Part
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.spans import span

log = logging.getLogger("adaptive_eager")

PREFETCH_MAX = 32  # programs of this script loaded at engine start (Note [warm start])
PREFETCH_WAIT_S = 60.0  # a first hit waits for its program's prefetch (never loads it twice)
TRANSIENT_RETRIES = 3  # later processes that retry a transient failure at once
RETRY_AFTER_S = 3600.0  # after that, a transient failure is retried once this old
_SAMPLES = 8  # per-process measurements kept in a trace's statistics


def _script_id() -> str:
    """The program's script, as the statistics name it (prefetch, Note [warm start])."""
    arg = sys.argv[0] if sys.argv else ""
    if not arg or arg in ("-c", "-m", "-"):
        return ""
    try:
        return os.path.realpath(arg)
    except (OSError, ValueError):
        return ""


@dataclass(frozen=True)
class ProgramHooks:
    """What the programs need from the layers above, handed in by the manager."""

    program_key: Callable[..., str]  # program_key.program_key (Note [program key])
    build: Callable[..., Any]  # graph.build(trace, live, varying, template=...)
    combine: Callable[[list[dict]], tuple[bool, float]]  # samples -> (keep fused?, ratio)


class ProgramsOwner(Protocol):
    """What the programs use of the manager that owns them."""

    options: Any
    backend: Any
    disk: Any
    sizes: Any  # compile/sizes.py: the checked sizes stored with a program
    jobs: Any  # compile/jobs.py: the compiler's import before a load


class Programs(Part):
    """One manager's programs on disk and on the remote store, and its traces' statistics."""

    def __init__(self, owner: ProgramsOwner, hooks: ProgramHooks) -> None:
        self.owner, self.hooks = owner, hooks
        self._prefetched: dict[str, concurrent.futures.Future] = {}  # program key -> load
        self.warm = False  # earlier runs of this script stored programs (Note [learning budget])

    def prefetch(self) -> None:
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
        self.warm = True
        self.owner.jobs.import_compiler()  # in the program's thread, before the worker loads
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

    def take_prefetched(self, key: str) -> Any:
        """A program prefetched for ``key`` (waiting briefly for its load), or None."""
        fut = self._prefetched.pop(key, None)
        if fut is None:
            return None
        try:
            return fut.result(timeout=PREFETCH_WAIT_S)
        except Exception:  # failed or slow: loaded (or compiled) the ordinary way instead
            return None

    def _backend_key(self) -> str:
        return f"{self.backend.name}:{self.backend.options_key()}"

    def key(self, entry: Any, g: Any) -> str:
        """The key the program of this trace and graph is stored and served under (Note [program
        key] in program_key.py)."""
        extra = {}
        if g.dynamic:  # programs with their shape guards (Note [program shape guards]): one
            extra["guards"] = 1  # stored before them is not loaded, it compiles again once
        trace = dict(digest=entry.digest, live=g.live, lifted=g.lifted, offsets=g.offsets,
                     baked=tuple(zip(g.baked, g.baked_values)), **extra)
        return self.hooks.program_key(trace, self._backend_key(), g.state)

    def plan_key(self, entry: Any, g: Any) -> str:
        """Where the remote store keeps the plan of this trace's program: from what a process
        knows at the trace's first run (Note [remote program plan] in cache/remote.py)."""
        trace = dict(digest=entry.digest, live=g.live, dynamic=g.dynamic, plan=1)
        return self.hooks.program_key(trace, self._backend_key(), g.state)

    def store(self, entry: Any, g: Any, program: Any, seconds: float, data: bytes | None = None,
              stored: bool = False) -> None:
        if self.disk is None or entry.in_process:
            return
        if stored:  # the compile service wrote it (Note [compile service])
            self.save_stats(entry, hot=True, compiled=True, program_key=self.key(entry, g))
            return
        try:
            if data is None:
                with outside_modes():
                    data = self.backend.serialize(program)
        except Exception as err:
            M.disk_errors += 1
            log.info("adaptive_eager: program of %s not serializable: %s", entry.digest[:12], err)
            return
        key = self.key(entry, g)
        self.disk.put_program(key, torch.__version__, self.backend.name,
                              data, {"n_ops": g.n_ops, "compile_s": seconds})
        self.save_stats(entry, hot=True, compiled=True, program_key=key)

    def retry_failure(self, failure: dict) -> bool:
        """Whether a failure stored by an earlier process is worth trying again here."""
        if not failure.get("transient"):
            return False
        return (int(failure.get("count", 1)) <= TRANSIENT_RETRIES
                or time.time() - float(failure.get("at", 0.0)) >= RETRY_AFTER_S)

    def find(self, entry: Any, trace: Any, live: list[int]) -> tuple[Any, str, Any] | None:
        """This trace's stored program, loaded: prefetched, from disk, or from the remote store
        (by its key, else by its plan) as ``(graph, key, program)``; None when there is none
        (counted) or it failed to load (then the trace compiles again, at once)."""
        try:  # a template's entry: its dynamic-size graph (Note [symbolic programs])
            g = self.hooks.build(trace, live, entry.varying,
                                 template=trace.sym if entry.sym is not None else None)
        except Exception:
            return None
        key = self.key(entry, g)
        program = self.take_prefetched(key)
        if program is not None:
            M.disk_hits += 1
        else:
            value = self._stored_program(key)
            if value is None:  # Note [remote program plan] in cache/remote.py
                g, key, value = self._by_remote_plan(entry, trace, live, g, key)
            if value is None:
                M.disk_misses += 1
                return None
            program = self._load_now(value["artifact"], g, entry)
            if program is None:  # counted and logged: compiled again, at once (it was hot)
                entry.was_hot = True
                return None
        return g, key, program

    def _stored_program(self, key: str) -> dict | None:
        """The program stored under ``key``: on disk, else the remote store's (Note [remote
        program store]), written to disk and read back from there."""
        value = self.disk.get_program(key, torch.__version__)
        if value is None and remote_cache.fetch_into(self.disk, key, torch.__version__):
            value = self.disk.get_program(key, torch.__version__)
        return value

    def _by_remote_plan(self, entry: Any, trace: Any, live: list[int],
                        g: Any, key: str) -> tuple[Any, str, dict | None]:
        """Note [remote program plan] in cache/remote.py: the program another machine compiled
        for this trace, found through the numbers it lifted (graph, key and stored value), or
        ``(g, key, None)``."""
        plan = remote_cache.fetch_plan(self.plan_key(entry, g), torch.__version__)
        if plan is None:
            return g, key, None
        varying = entry.varying | {i for i in plan if i < len(trace.scalars)}
        if varying == entry.varying:  # nothing this process does not know: the same key
            return g, key, None
        try:
            planned = self.hooks.build(trace, live, varying,
                                       template=trace.sym if entry.sym is not None else None)
        except Exception:
            return g, key, None
        planned_key = self.key(entry, planned)
        value = self._stored_program(planned_key)
        if value is None:
            return g, key, None
        entry.varying |= varying  # lifted numbers are inputs: correct whatever their values
        return planned, planned_key, value

    def _load_now(self, data: bytes, g: Any, entry: Any) -> Any:
        """Note [warm start]
        A program on disk is loaded at the trace's first run in this process, in the flushing
        thread, and used by that very run: deserializing an Inductor artifact takes 7-23 ms
        here (the compiler's modules are imported once before, as for any load). Programs this
        script used in its recent runs are loaded even earlier, in the worker, from engine start
        on (``prefetch``: their keys are in the statistics), so those first runs find them
        ready. Returns None when the program fails to load (counted in ``disk_errors``)."""
        self.owner.jobs.import_compiler()
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

    def save_stats(self, entry: Any, hot: bool = False, failure: dict | None = None,
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
            keep, ratio = self.hooks.combine(samples)
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
            "sym_sizes": self.owner.sizes.record(  # Note [verified sizes]
                entry, program_key or old.get("program_key"), old.get("sym_sizes")),
            "script": _script_id() or old.get("script", ""), "used_at": round(time.time(), 1),
        })
