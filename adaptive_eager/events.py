"""The run log: what each run did with its traces, written once at the end of the run.

Nothing here runs per op. Misses are noted when a trace ends (explain.py says why), aggregated by
(cause, op, source line), and written with per-trace statistics as one JSON-lines file per run in
``<cache dir>/runs/``. Files are bounded (top traces, top misses) and only the newest runs are kept.
The runs folder and its files obey the cache trust rule (Note [cache trust rule]): a ``runs`` that
is a link, or belongs to someone else, is neither written, read nor pruned, and pruning deletes only
plain files this user owns, by the names this module made, never through a link.
The run's timeline (``Timeline``, Note [run timeline]) rides in the same file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from adaptive_eager import distributed
from adaptive_eager.cache import trust
from adaptive_eager.metrics import METRICS

log = logging.getLogger("adaptive_eager")

MAX_MISS_GROUPS = 500
MAX_TRACES = 200
MAX_OPS_LISTED = 400
KEEP_RUNS = 50
MAX_ARGV_CHARS = 2000
_RUN_FILE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}\.jsonl$")


# Note [run timeline]
# ``adaptive-eager report --html`` draws a run as a timeline: when traces ran fused or op by op,
# when compiles were in flight, when the engine stepped aside. Nothing here runs per op: each
# flush (explain.note_flush_site) adds its seconds to a time bucket, split at bucket edges, as
# fused or op-by-op time, and compares a few counters with the last flush's to see phases
# begin or end. Compiles, stepping aside and waiting aside happen outside flushes (a compile
# thread, a round end), so their times are those of the flushes that saw them: a compile window
# opens at the flush that submitted it (whose seconds, spent submitting or compiling, go to the
# window, not to the run buckets) and closes at the first flush after the last compile in
# flight finished; an aside spans the last flush before it to the first flush after it (the
# first trace recorded on return counts as aside). A phase still open when the log is written
# runs to the log's end. Bounded: at most MAX_BUCKETS buckets (when a run outgrows them,
# neighbours merge and the width doubles) and MAX_PHASES phases (later ones are counted, not
# kept). The time between flushes while the engine is on is recording and the program's own
# Python; the timeline does not tell them apart.
MAX_BUCKETS = 240
MAX_PHASES = 400
FIRST_WIDTH_S = 0.05
# bucket fields: flushes fused, flushes op by op, seconds fused, seconds op by op, ops fused,
# ops op by op
_FUSED, _OP_BY_OP = 0, 1


class Timeline:
    """Per-flush buckets and phase transitions of a run (Note [run timeline])."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.time() if start is None else start
        self.width = FIRST_WIDTH_S
        self.buckets: list[list[float]] = []
        self.phases: list[list[Any]] = []  # [kind, start s, end s, count, compile s]
        self.dropped = 0
        self.first: float | None = None  # start of the first flush, seconds from ``start``
        self.last_end: float | None = None  # end of the newest flush
        self.seen = [0, 0, 0, 0.0]  # step asides, compile waits, compiles+loads, compile s
        self.window: list[Any] | None = None  # the open compile window: [start, seen[2:]]
        self.lock = threading.Lock()

    def note_flush(self, seconds: float, n_ops: int, op_by_op: bool, m: Any) -> None:
        """One flush that just ended, ``m`` the process's Metrics (read, never written)."""
        end = time.time() - self.start
        begin = max(end - seconds, 0.0)
        with self.lock:
            if self.first is None:
                self.first = begin
            compile_began = self._phases_seen(m, begin, end)
            # a flush that submitted a compile (or ran one) spent its time on that: the compile
            # window covers it, the run buckets count it without its seconds
            self._add(begin, begin if compile_began else end, end,
                      _OP_BY_OP if op_by_op else _FUSED, n_ops)
            self.last_end = end

    def _phases_seen(self, m: Any, begin: float, end: float) -> bool:
        """Phases begun or ended since the last flush; True if a compile began in this one."""
        for i, kind, now in ((0, "aside", m.step_asides), (1, "waiting", m.compile_waits)):
            if now > self.seen[i] and self.last_end is not None:
                self._phase(kind, self.last_end, begin, now - self.seen[i], 0.0)
            self.seen[i] = now
        done = m.compiles + m.disk_hits + m.service_shared
        opened = self.window is None and bool(m.compiles_pending or done != self.seen[2])
        if opened:
            self.window = [begin, self.seen[2], self.seen[3]]  # submitted in this flush
        if self.window is not None and not m.compiles_pending:
            start, done0, secs0 = self.window
            # finished inside this flush (compiled here), else before it began
            self._phase("compiling", start, end if opened else begin, done - done0,
                        m.compile_seconds - secs0)
            self.window = None
        self.seen[2], self.seen[3] = done, m.compile_seconds
        return opened

    def _phase(self, kind: str, start: float, end: float, n: int, secs: float) -> None:
        if len(self.phases) >= MAX_PHASES:
            self.dropped += 1
            return
        self.phases.append([kind, round(start, 4), round(max(end, start), 4), n, round(secs, 4)])

    def _add(self, begin: float, end: float, at: float, kind: int, n_ops: int) -> None:
        """Seconds ``begin``..``end`` into the buckets they cover, the flush counted at ``at``."""
        while at >= self.width * MAX_BUCKETS:
            self._coarsen()
        last = int(at / self.width)
        b = self.buckets
        while len(b) <= last:
            b.append([0, 0, 0.0, 0.0, 0, 0])
        b[last][kind] += 1
        b[last][4 + kind] += n_ops
        i = int(begin / self.width)
        while i <= last and begin < end:  # a long flush spreads over the buckets it covers
            part = min(end, (i + 1) * self.width) - max(begin, i * self.width)
            if part > 0:
                b[i][2 + kind] += part
            i += 1

    def _coarsen(self) -> None:
        """Merge neighbouring buckets: twice the width, half the count."""
        b = self.buckets
        self.buckets = [[x + y for x, y in zip(b[i], b[i + 1] if i + 1 < len(b) else [0] * 6)]
                        for i in range(0, len(b), 2)]
        self.width *= 2

    def record(self, m: dict) -> dict:
        """The timeline for the run log; phases still open run to now."""
        now = time.time() - self.start
        with self.lock:
            phases = [list(p) for p in self.phases]
            last = self.last_end if self.last_end is not None else now
            for i, kind, key in ((0, "aside", "step_asides"), (1, "waiting", "compile_waits")):
                if m.get(key, 0) > self.seen[i]:
                    phases.append([kind, round(last, 4), round(now, 4),
                                   m[key] - self.seen[i], 0.0, "open"])
            if self.window is not None:
                opened, done0, secs0 = self.window
                done = m.get("compiles", 0) + m.get("disk_hits", 0) + m.get("service_shared", 0)
                phases.append(["compiling", round(opened, 4), round(now, 4), done - done0,
                               round(m.get("compile_seconds", 0.0) - secs0, 4), "open"])
            return {"start": self.start, "end": round(now, 4), "width": self.width,
                    "first_flush": self.first, "last_flush": self.last_end,
                    "buckets": [[round(v, 5) if isinstance(v, float) else v for v in row]
                                for row in self.buckets],
                    "phases": phases, "phases_dropped": self.dropped}


class RunLog:
    def __init__(self) -> None:
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.start = time.time()
        self.misses: dict[tuple, dict] = {}
        self.timeline = Timeline(self.start)

    def add_miss(self, digest: str, n_ops: int, info: dict) -> None:
        group = (info.get("cause"), info.get("op"), info.get("where"), info.get("arg"),
                 info.get("dim"))
        rec = self.misses.get(group)
        if rec is None:
            if len(self.misses) >= MAX_MISS_GROUPS:
                return
            rec = self.misses[group] = {**info, "count": 0, "values": [], "traces": []}
        rec["count"] += 1
        for v in (info.get("old"), info.get("new")):
            if v is not None and v not in rec["values"] and len(rec["values"]) < 16:
                rec["values"].append(v)
        if digest not in rec["traces"] and len(rec["traces"]) < 8:
            rec["traces"].append(digest)

    def records(self, entries: list, metrics: dict) -> list[dict]:
        out: list[dict] = [{
            "type": "run", "run_id": self.run_id, "start": self.start, "end": time.time(),
            "argv": bounded_argv(sys.argv), "pid": os.getpid(), "metrics": metrics,
            "timeline": self.timeline.record(metrics),  # Note [run timeline]
            **distributed.log_fields(),  # a rank's job and remote-store counters (report.py)
        }]
        top = sorted(entries, key=lambda e: e.runs * max(e.n_ops, 1), reverse=True)[:MAX_TRACES]
        for e in top:
            out.append({"type": "trace", "run_id": self.run_id, **e.summary(),
                        "ops": e.op_listing(MAX_OPS_LISTED)})
        for rec in self.misses.values():
            out.append({"type": "miss", "run_id": self.run_id, **rec})
        return out

    def write(self, directory: Path, entries: list, metrics: dict) -> Path | None:
        """Append this run's records to its file; never raises (a log must not break a run)."""
        try:
            root = trust.check_root(directory, create=True)
            runs = trust.private_subdir(root, "runs")
            name = f"{self.run_id}.jsonl"
            tmp = f"{self.run_id}.{os.getpid()}.tmp"
            fd = trust.open_private(runs, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                for rec in self.records(entries, metrics):
                    f.write(json.dumps(rec, default=str) + "\n")
            os.replace(runs / tmp, runs / name)  # atomic: a reader never sees half a file
            _prune(runs)
            return runs / name
        except trust.Untrusted as err:
            METRICS.disk_errors += 1
            log.warning("adaptive_eager: not writing the run log: %s", err)
            return None
        except Exception as err:
            log.warning("adaptive_eager: could not write the run log: %s", err)
            return None


def bounded_argv(argv: list[str], limit: int = MAX_ARGV_CHARS) -> list[str]:
    """The whole command line, cut at ``limit`` characters (with an ellipsis) so a huge argv
    cannot bloat the log."""
    out: list[str] = []
    used = 0
    for arg in argv:
        arg = str(arg)
        if used + len(arg) > limit:
            out.append(arg[:max(limit - used, 0)] + "...")
            break
        out.append(arg)
        used += len(arg) + 1
    return out


def _by_age(folder: Path) -> list[Path]:
    """This user's plain run files, oldest first; links, foreign files and files another
    process deletes meanwhile are left out."""
    aged = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        if not _RUN_FILE.match(name):
            continue
        p = folder / name
        try:
            st = os.lstat(p)
            trust.check_own(p, st)
        except (OSError, trust.Untrusted):
            continue
        if stat.S_ISREG(st.st_mode):
            aged.append((st.st_mtime, p))
    return [p for _, p in sorted(aged)]


def _prune(runs: Path) -> None:
    files = _by_age(runs)
    for old in files[:-KEEP_RUNS]:
        try:
            old.unlink()  # a plain file (lstat above); unlink never follows a link anyway
        except OSError:
            pass


def clear_runs(directory: Path) -> int:
    """Delete the run logs under ``directory``; only this user's plain files by the names this
    module made (``_by_age``), in a ``runs`` folder that passes the trust rule. Returns how many."""
    folder = _runs_folder(directory)
    if folder is None:
        return 0
    n = 0
    for path in _by_age(folder):
        try:
            path.unlink()  # lstat'ed as a plain file; unlink never follows a link
            n += 1
        except OSError:
            pass
    return n


def _runs_folder(directory: Path) -> Path | None:
    """``directory/runs`` if it passes the trust rule, else None (with a warning)."""
    try:
        root = trust.check_root(directory, create=False)
        return trust.private_subdir(root, "runs", create=False)
    except FileNotFoundError:
        return None
    except trust.Untrusted as err:
        log.warning("adaptive_eager: not reading run logs: %s", err)
        return None


def read_runs(directory: Path) -> list[list[dict]]:
    """All run logs under ``directory``, oldest first; unreadable lines are skipped."""
    runs: list[list[dict]] = []
    folder = _runs_folder(directory)
    if folder is None:
        return runs
    for path in _by_age(folder):
        recs = []
        try:
            text = trust.read_private(folder, path.name, 64 << 20).decode("utf-8", "replace")
        except (OSError, trust.Untrusted):  # pruned by another process since, or replaced
            continue
        for line in text.splitlines():
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
        if recs and recs[0].get("type") == "run":
            runs.append(recs)
    return runs


RUN_LOG = RunLog()

