"""The decisions: when a trace compiles, whether its program is kept or dropped, and when the
engine steps aside. No I/O of its own: what it stores goes through the hooks.

Note [adaptive decisions]
Each trace entry moves through states:
  new        runs op by op; its replay time and which Python numbers vary are observed.
  compiling  seen ``hot_after`` times: compiled in the helper process while the program keeps
             running op by op, or at that flush in this process (Note [in-process compiles]
             in compile/jobs.py).
  measuring  program ready (compiled, or loaded from the disk cache): the next runs use it and
             are timed; the first (warm-up) call is not counted.
  fused      measured faster than op-by-op replay, recording overhead included: kept.
  replay     not faster: the program is dropped and the trace never compiles again here (the
             measurement is stored on disk and combined with other processes', Note
             [persisted decisions] in compile/programs.py).
  failed     the compiler or the program raised: op by op from now on, counted, logged once;
             later processes retry transient failures (Note [persisted decisions]).
  quarantined the crosscheck found the fused result differs from op-by-op replay.
A program is used only for runs whose live slots it returns and whose baked-in numbers still hold.

The manager owns one ``Decisions`` and hands it what it needs from the layers above (storing a
measurement, the ranks' agreement in a distributed job, the recent trace entries) as
``PolicyHooks``: this module imports nothing of the engine, so it sits below the compiler. Trace
entries and traces are passed through as values (typed ``Any`` here for the same reason). The
tuning knobs below are module globals: calibrate.py measures the cost constants at start, and
tests set them here.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adaptive_eager.cores import usable_cores
from adaptive_eager.metrics import METRICS as M

log = logging.getLogger("adaptive_eager")

MEASURE_RUNS = 3  # timed fused runs before deciding
MEASURE_RUNS_SYM = 5  # the same for a symbolic trace, timed at whatever sizes come
MIN_OPS = 2  # a one-op trace has nothing to fuse
MIN_OBSERVED = 2  # runs whose Python numbers were compared before a trace compiles
MAX_REBAKES = 2  # recompiles of one trace because a baked-in number changed
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
RECHECK_RATIO = 0.5  # a stored "op-by-op" whose fused time is under this share of our replay
_HISTORY = 8  # timing samples kept per trace and kind
COMPILE_GUESS_S = 10.0  # a cold compile's seconds before one was timed here (Note [learning budget])


_held = threading.local()  # Note [learning budget] in budget.py: this thread's hold on compiles


def compiles_held() -> bool:
    """Whether this thread's learning budget holds new compiles back (disk loads go on)."""
    return getattr(_held, "on", False)


def hold_compiles(on: bool) -> None:
    _held.on = on


def compile_cost() -> float:
    """What a compile beside the program is expected to cost it, in seconds of its time: the
    compile's own seconds (measured here, else COMPILE_GUESS_S) times the share of the cores it
    takes from the program."""
    global _cores
    if not _cores:
        _cores = max(usable_cores(), 1)  # a system call: once
    secs = M.compile_seconds / M.compiles if M.compiles else COMPILE_GUESS_S
    return secs / _cores


_cores = 0


def _run_time(entry: Any) -> float:
    """A trace's time per run (Note [rare traces]): the best of its recent op-by-op runs (a
    cold first replay took 2-3x a warm one), else of its fused runs; 0.0: unknown."""
    xs = list(entry.replay_s) or list(entry.fused_s)
    return min(xs) if xs else 0.0


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]



def _measure_runs(entry: Any) -> int:
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


def _combine(samples: list[dict]) -> tuple[bool, float]:
    """Keep fused?, from the median fused/op-by-op ratio over processes' measurements."""
    ratios = [s["fused_ms"] / s["replay_ms"] for s in samples
              if s.get("fused_ms") and s.get("replay_ms")]
    if not ratios:
        return False, float("inf")
    r = _median(ratios)
    return r <= KEEP_RATIO, r


@dataclass(frozen=True)
class PolicyHooks:
    """What the decisions need from the layers above (the manager builds it)."""

    save_stats: Callable[..., None]  # a measurement to disk (Note [persisted decisions])
    agree_keep: Callable[[Any, bool], bool]  # Note [ranks agree]: keep the program?
    agree_aside: Callable[[str | None], str | None]  # Note [ranks agree]: step aside?
    distributed_job: Callable[[], bool]  # a distributed job (no trace is rare there)
    recent_entries: Callable[[], list[Any]]  # the newest trace entries, oldest first


class Decisions:
    """One per compile manager: the measurements and decisions of its traces, and the
    counts the step-aside decision weighs."""

    def __init__(self, options: Any, compiles: bool, lock: Any, hooks: PolicyHooks) -> None:
        self.options = options
        self._compiles = compiles  # the backend compiles (else nothing here decides)
        self._lock = lock  # the trace entries' lock (compiler.STATE_LOCK)
        self._hooks = hooks
        self._untimed: Any = None  # a checked run: not the program's time
        self.decided: list[Any] = []
        self.flushes = 0
        self.ops_recent = 0.0  # deferred ops of recent flushes, decayed (Note [coverage])
        self.ops_cold = 0.0  # the part of them in traces not yet hot
        self.hits = 0
        self.probe_start: int | None = None
        self.kept_at_probe = 0
        self.stored_fused: dict[str, float] = {}  # digest -> fused s of a stored op-by-op
        self.remeasure: set[str] = set()  # digests whose stored op-by-op is being re-measured
        self._measuring_since: dict[tuple, int] = {}  # Note [undecided means measuring too]
        self.recent: collections.deque = collections.deque(maxlen=RARE_WINDOW)  # flushes' entries
        self._rare_seen: dict[str, tuple[int, int]] = {}  # digest -> (flush, runs it needs)

    # ---- observation (op-by-op runs) ----------------------------------------------------------
    def observe(self, entry: Any, trace: Any) -> None:
        """Note which Python numbers changed since the entry's first run."""
        with self._lock:
            entry.observed += 1
            if entry.scalar_ref is None:
                entry.scalar_ref = list(trace.scalars)
                return
            ref = entry.scalar_ref
            for i, v in enumerate(trace.scalars):
                if i < len(ref) and (type(v) is not type(ref[i]) or v != ref[i]):
                    entry.varying.add(i)

    def record_replay(self, entry: Any, seconds: float, size: int = 0) -> None:
        """``size``: a symbolic trace's size at this run (Note [timing at one size]), else 0."""
        with self._lock:
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
            if entry.state == "replay" and entry.digest in self.stored_fused:
                self._maybe_recheck(entry)

    def _maybe_recheck(self, entry: Any) -> None:
        """A stored "op-by-op" decision this process's timing disagrees with: measure again."""
        if len(entry.replay_s) <= MEASURE_RUNS:  # the stored time, then this process's own
            return
        fused = self.stored_fused.pop(entry.digest)
        replay = _median(entry.replay_s[1:])
        if fused < RECHECK_RATIO * replay:
            log.info("adaptive_eager: trace %s: stored op-by-op decision, but op-by-op takes "
                     "%.3f ms here against a fused %.3f ms: measuring again", entry.digest[:12],
                     replay * 1e3, fused * 1e3)
            self.remeasure.add(entry.digest)
            entry.state = "new"
            entry.disk_checked = False
            entry.fused_s = []
            entry.fused_n = []
            entry.fused_runs = 0
            if entry in self.decided:
                self.decided.remove(entry)

    # ---- the hot rule ---------------------------------------------------------------------------
    def is_hot(self, entry: Any) -> bool:
        """Whether a trace has run often enough to compile (once its program was looked for)."""
        # Runs counted by a backend that never compiles (another engine's replay backend) saw
        # no numbers compared: a trace hot from those alone would bake in every number.
        seen = entry.observed >= min(self.options.hot_after, MIN_OBSERVED)
        hot = (entry.runs >= self.options.hot_after and seen) or entry.was_hot
        if hot and not entry.was_hot and entry.runs < self._runs_needed(entry):
            hot = False  # Note [rare traces]
        return hot

    def _runs_needed(self, entry: Any) -> int:
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
        if entry.runs < hot_after or self._hooks.distributed_job():
            return hot_after
        seen = self._rare_seen.get(entry.digest)
        if seen is not None and self.flushes - seen[0] < RARE_RECHECK:
            return seen[1]
        recent = list(self.recent)  # one C-level copy (other threads append)
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
                     entry.n_ops, q, len(self.recent), need)
        return need

    def symbolic_replay(self, entry: Any) -> None:
        """A symbolic trace has no dynamic-size program yet: once hot, it is decided op by op,
        so the step-aside estimate weighs it like any measured trace."""
        if entry.state == "new" and entry.runs >= self.options.hot_after and entry.replay_s:
            with self._lock:
                entry.state = "replay"
                entry.decision = "op-by-op: symbolic sizes (no dynamic-size program yet)"
                self.mark_decided(entry)

    def untime(self, entry: Any) -> None:
        """A run that checked a size also replayed: it is no timing of the program."""
        self._untimed = entry

    def rebake(self, entry: Any, g: Any, scalars: list[Any]) -> None:
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

    # ---- measuring and deciding ---------------------------------------------------------------
    def record_fused(self, entry: Any, seconds: float, size: int = 0) -> None:
        """``size``: a symbolic trace's size at this run (Note [timing at one size]), else 0."""
        if self._untimed is entry:  # a size's checked run also replayed: no timing
            self._untimed = None
            return
        with self._lock:
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

    def _decide(self, entry: Any) -> None:
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
        self.mark_decided(entry)
        self.remeasure.discard(entry.digest)
        # Note [ranks agree]: the first rank to measure decides for all
        if self._hooks.agree_keep(entry, fused <= KEEP_RATIO * replay):
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
        self._hooks.save_stats(entry, sample=True)

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
        return self._hooks.agree_aside(self._step_aside_reason())

    def _step_aside_reason(self) -> str | None:
        if not self.options.step_aside or not self._compiles:
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
        with self._lock:
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

    def settled(self) -> bool:
        """Every hot trace compiled and decided: the engine runs as fast as it will (the moment
        for a measured trial against plain eager, Note [measured trial] in trial.py)."""
        return (self.options.step_aside and self._compiles and self.probe_start is None
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
        seen = self._measuring_since
        for e in self._hooks.recent_entries():
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

    def mark_decided(self, entry: Any) -> None:
        """Every append to ``decided`` goes here: an entry decided twice (a re-measure, a failure
        after a decision) is weighed once in the step-aside estimate. By identity: entries are
        not compared by value."""
        if not any(e is entry for e in self.decided):
            self.decided.append(entry)
