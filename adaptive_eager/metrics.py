"""Process-wide counters. Plain attributes so the per-op increments stay cheap."""

from __future__ import annotations

from collections import Counter
from typing import Any


class Metrics:
    __slots__ = (
        "ops_intercepted", "ops_deferred", "ops_eager", "flushes", "trace_hits", "trace_misses",
        "fallbacks", "meta_misses", "engine_errors", "replay_errors", "flush_reasons",
        "fallback_ops", "engine_error_kinds", "compiles", "compiles_pending", "compile_seconds",
        "compile_errors", "compiled_runs", "replayed_runs", "ops_fused", "disk_hits", "disk_misses",
        "disk_errors", "disk_invalid", "quarantined", "fused_errors", "kept_fused", "kept_replay",
        "step_asides", "budget_asides", "budget_rounds", "compiles_held",
        "trials", "trials_running", "guard_arms", "guard_disarms", "compile_waits", "layout_fixes", "helper_errors",
        "alias_fixes",
        "service_errors", "service_compiles", "service_shared", "compile_queued_seconds",
        "compile_load_seconds", "compile_wait_seconds", "prefetched", "program_waits",
        "service_pending", "sym_learned", "sym_loaded", "sym_ops", "sym_hits", "sym_verified",
        "sym_guard_fallbacks", "sym_left", "sym_mispredicted", "sym_dims",
        "sym_programs", "sym_checked", "sym_program_fallbacks", "sym_trusted",
        "sym_guard_refused", "sym_guards_unknown", "sym_sizes_loaded", "sym_specialized",
        "sym_unfusable", "key_repairs", "flush_sites", "cores_lent",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ops_intercepted = 0  # every aten op the dispatch mode saw
        self.ops_deferred = 0  # recorded into a trace instead of running
        self.ops_eager = 0  # ran at once (allocations, random ops, sync points, fallbacks)
        self.flushes = 0  # traces executed
        self.trace_hits = 0  # an executed trace matched one seen before
        self.trace_misses = 0  # an executed trace was new
        self.fallbacks = 0  # ops that could not be deferred and ran eagerly after a flush
        self.meta_misses = 0  # first sight of (op, input metadata): ran eagerly to learn outputs
        self.engine_errors = 0  # internal faults answered by falling back to eager
        self.replay_errors = 0  # deferred ops that raised when their trace ran
        self.compiles = 0  # traces compiled in this process
        self.compiles_pending = 0  # compiles submitted and not finished
        self.compile_seconds = 0.0
        self.compile_errors = 0  # a backend raised while compiling (the trace stays op by op)
        self.compiled_runs = 0  # flushes that ran a fused program
        self.replayed_runs = 0  # flushes that ran op by op
        self.ops_fused = 0  # deferred ops that ran inside fused programs
        self.disk_hits = 0  # compiled programs loaded from the disk cache
        self.disk_misses = 0
        self.disk_errors = 0  # unreadable/foreign entries, failed writes, refused folders
        self.disk_invalid = 0  # entries that verified but whose fields fail their checks
        self.quarantined = 0  # traces whose fused program disagreed with op-by-op replay
        self.fused_errors = 0  # a fused program raised at run time (replayed instead)
        self.kept_fused = 0  # decisions: fused measured faster than replay
        self.kept_replay = 0  # decisions: fused not faster, trace stays op by op
        self.step_asides = 0  # times the engine left the mode stack because nothing gained
        self.budget_asides = 0  # times the engine ran plain to stay in its learning budget
        self.budget_rounds = 0  # ... rounds it ran so (Note [learning budget], saving.py)
        self.compiles_held = 0  # hot runs whose compile the learning budget held back
        self.trials = 0  # measured trials: rounds timed under the engine, then in plain eager
        self.trials_running = 0  # 1 while a trial is timing rounds (benchmarks wait for it)
        self.guard_arms = 0  # the read guard went on the mode stack (Note [read guard], mode.py)
        self.guard_disarms = 0  # ... and came off it
        self.compile_waits = 0  # times the engine ran plain eager while a compile was in flight
        self.cores_lent = 0  # ... with one intra-op thread fewer (Note [compile cores], cores.py)
        self.layout_fixes = 0
        # fused outputs re-viewed or copied: they shared memory eager's do not share
        self.alias_fixes = 0
        self.helper_errors = 0  # the compile helper process failed; compiles moved in-process  # fused outputs copied into the strides eager gives them
        # where the time to a fused program went (Note [compile service])
        self.service_errors = 0  # the compile service could not be used; compiled here instead
        self.service_compiles = 0  # compiles the service ran for this process
        self.service_shared = 0  # answered by the service from another request or from disk
        self.compile_queued_seconds = 0.0  # waiting in the service's queue (and helper start)
        self.compile_load_seconds = 0.0  # deserializing programs (compiled or from disk)
        self.compile_wait_seconds = 0.0  # from a trace's submit to its program being ready
        self.prefetched = 0  # programs loaded at engine start (hot in earlier runs)
        self.service_pending = 0  # compiles the service is running for us (they outlive us)
        # Note [symbolic dims] in shapes.py
        self.sym_learned = 0  # templates fitted in this process (one trace for every size)
        self.sym_loaded = 0  # templates learnt by an earlier process, read from the disk cache
        self.sym_ops = 0  # recorded ops whose output metadata came from a fitted formula
        self.sym_hits = 0  # traces run through a template (a trie hit whatever the size)
        self.sym_verified = 0  # sizes whose predicted metadata a replay checked in full
        self.sym_guard_fallbacks = 0  # keys a template refused (s in {0, 1}, a bad value)
        self.sym_left = 0  # traces that left a template midway (went on as static keys)
        self.sym_mispredicted = 0  # predictions the replay check found wrong (template dropped)
        self.sym_dims: dict[str, int] = {}  # "dims of op at file:line" -> traces served
        self.sym_programs = 0  # dynamic-size programs compiled for symbolic traces
        self.sym_checked = 0  # sizes whose first fused run agreed with op-by-op replay
        self.sym_program_fallbacks = 0  # symbolic fused runs replayed instead (raise, mismatch)
        # Note [program shape guards] in backends/inductor.py, Note [symbolic programs]
        self.sym_trusted = 0  # new sizes run unchecked: enough sizes agreed, the guards hold
        self.sym_guard_refused = 0  # sizes the program's own guards refused (run op by op)
        self.sym_guards_unknown = 0  # programs (or sizes) whose guards could not be read:
        # every new size checked against replay instead
        self.sym_sizes_loaded = 0  # sizes checked by an earlier process, read from disk
        self.sym_specialized = 0  # template programs refused: a dynamic size became a constant
        self.sym_unfusable = 0  # template traces the graph builder refused (Unfusable)
        # dispatch keys set back to what the mode stack says (Note [mode stack under inference
        # mode] in dispatch/tls.py)
        self.key_repairs = 0
        self.program_waits: dict[str, float] = {}  # trace -> seconds until its program was ready
        self.flush_reasons: Counter[str] = Counter()
        # Note [flush causes]: "<reason> at <file:line (function)>" -> [flushes, ops, ops run op
        # by op, seconds running op by op]
        self.flush_sites: dict[str, list] = {}
        self.fallback_ops: Counter[str] = Counter()
        self.engine_error_kinds: Counter[str] = Counter()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            if name == "flush_sites":
                value = {k: list(v) for k, v in value.items()}
            out[name] = dict(value) if isinstance(value, (Counter, dict)) else value
        return out


METRICS = Metrics()
