"""The cache folder's size: what it holds, as last measured, and eviction down to its limit
(Note [cache size] in disk.py)."""

from __future__ import annotations

import os
import time
from typing import Any

from adaptive_eager.cache import evict, pins, trust
from adaptive_eager.cache.folder import DB_NAME, INDUCTOR_DIR, RUNS_DIR, SECRET_NAME, warn_once
from adaptive_eager.cache.trust import Untrusted
from adaptive_eager.metrics import METRICS as M

_RESCAN_S = 60.0


class FolderSize:
    """One cache folder's measured size; evicts through the cache's own database calls."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache  # the DiskCache (its directory, lock and SQL)
        self.folder = evict.Folder()  # the kernel folder as last scanned
        self.other_bytes = 0
        self.scanned_at = 0.0

    def db_bytes(self) -> int:
        """The database's files, and the secret and folders around everything else."""
        c = self.cache
        total = 0
        for name in (DB_NAME, DB_NAME + "-journal", DB_NAME + ".corrupt"):
            try:
                st = os.lstat(c.directory / name)
            except OSError:
                continue
            total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
        for name in (".", SECRET_NAME, INDUCTOR_DIR, RUNS_DIR):
            try:
                total += os.lstat(c.directory / name).st_blocks * 512
            except (OSError, AttributeError):
                pass
        return total

    def rescan(self) -> None:
        """Measure the kernel folder and the run logs; drop kernel subfolders that fail the
        trust rule (Inductor would load them)."""
        c = self.cache
        kernels = c.directory / INDUCTOR_DIR
        try:
            trust.private_subdir(c.directory, INDUCTOR_DIR, create=not c.read_only)
        except FileNotFoundError:
            pass
        except Untrusted as err:  # a link, or someone else's: never used, made anew
            c.refused(f"kernels:{kernels}", f"Inductor kernels: {err}; removing it")
            if not c.read_only:
                trust.remove_tree(kernels)
                trust.private_subdir(c.directory, INDUCTOR_DIR)
        folder = evict.scan(kernels)
        for name, why in folder.bad.items():
            c.refused(f"kernels:{kernels}", f"Inductor kernels: {why}; removing "
                      f"{kernels / name}")
            if c.read_only:
                raise Untrusted(f"Inductor kernels in a read-only cache folder: {why}")
            trust.remove_tree(kernels / name)
        self.folder = folder
        self.other_bytes = trust.scan(c.directory / RUNS_DIR)[0]
        self.scanned_at = time.monotonic()

    def measure(self) -> int:
        """Walk the folder again and return ``usage()``."""
        c = self.cache
        with c.lock:
            try:
                self.rescan()
            except Untrusted:
                pass
        return self.usage()

    def usage(self) -> int:
        """Bytes the folder holds: database, Inductor kernels, run logs (as last measured)."""
        return self.db_bytes() + self.folder.size() + self.other_bytes

    def enforce(self, rescan: bool = False, limit: int | None = None) -> int:
        """Evict least recently used program entries and orphan kernels until the folder fits
        (Note [cache size]); returns how many were evicted. Never raises."""
        c = self.cache
        limit = c.size_limit if limit is None else limit
        if c.read_only:
            return 0
        try:
            with c.lock:
                if rescan or time.monotonic() - self.scanned_at > _RESCAN_S:
                    self.rescan()
                over = self.usage() - limit
                if over <= 0:
                    return 0
                return self.evict(over)
        except Exception as err:
            M.disk_errors += 1
            warn_once(f"evict:{type(err).__name__}", "adaptive_eager: could not keep the "
                      "cache folder within its size limit: %s", err)
            return 0

    def evict(self, over: int) -> int:
        """Whole program entries and orphan kernels, least recently used first (Note [program
        entries]), then statistics; never what a live process pins (Note [kernel pins])."""
        c = self.cache
        kernels = c.directory / INDUCTOR_DIR
        live, since = pins.live_pins(kernels)
        keep = set(pins.PINNED_NAMES) if live else {pins.PINS_DIR}

        def protected(unit: evict.Unit) -> bool:
            return (unit.name.split("/", 1)[0] in keep
                    or since is not None and unit.mtime >= since)

        programs = c.sql("SELECT key, size, accessed FROM entries WHERE key LIKE 'program:%'")
        refs: dict[str, set[str]] = {}
        for program, key in c.sql("SELECT program, key FROM kernels"):
            refs.setdefault(program, set()).add(key)
        plan = evict.choose(programs, refs, self.folder.units, protected, over)
        if plan.programs:  # the rows before their kernels: never an entry without them
            gone = [(key,) for key in plan.programs]
            c.transaction([("DELETE FROM entries WHERE key = ?", gone),
                           ("DELETE FROM kernels WHERE program = ?", gone)])
        # a program another process stored since the query above may name a kernel too
        named = {key for (key,) in c.sql("SELECT DISTINCT key FROM kernels")}
        for unit in plan.units:
            if unit.key is None or unit.key not in named:
                evict.remove(kernels, unit)
                self.folder.units.pop(unit.name, None)
        evict.remove_empty_dirs(kernels, self.folder, since)
        if set(refs) - {key for key, _, _ in programs}:  # of programs gone (a cut write)
            c.sql("DELETE FROM kernels WHERE program NOT IN (SELECT key FROM entries)")
        n = len(plan.programs) + len(plan.units)
        over -= plan.freed
        if over > 0:  # statistics alone over the limit: oldest first
            for (key, size) in c.sql("SELECT key, size FROM entries "
                                     "WHERE key NOT LIKE 'program:%' ORDER BY accessed"):
                if over <= 0:
                    break
                c.sql("DELETE FROM entries WHERE key = ?", (key,))
                over -= size
                n += 1
        return n
