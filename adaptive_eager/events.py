"""The run log: what each run did with its traces, written once at the end of the run.

Nothing here runs per op. Misses are noted when a trace ends (explain.py says why), aggregated by
(cause, op, source line), and written with per-trace statistics as one JSON-lines file per run in
``<cache dir>/runs/``. Files are bounded (top traces, top misses) and only the newest runs are kept.
The runs folder and its files obey the cache trust rule (Note [cache trust rule]): a ``runs`` that
is a link, or belongs to someone else, is neither written, read nor pruned, and pruning deletes only
plain files this user owns, by the names this module made, never through a link.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import sys
import time
import uuid
from pathlib import Path

from adaptive_eager import distributed
from adaptive_eager.cache import trust

log = logging.getLogger("adaptive_eager")

MAX_MISS_GROUPS = 500
MAX_TRACES = 200
MAX_OPS_LISTED = 400
KEEP_RUNS = 50
MAX_ARGV_CHARS = 2000
_RUN_FILE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}\.jsonl$")


class RunLog:
    def __init__(self) -> None:
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.start = time.time()
        self.misses: dict[tuple, dict] = {}

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
            from adaptive_eager.metrics import METRICS

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

