"""The disk cache: compiled programs and per-trace statistics, shared by processes (SQLite).

Every fault here is answered the same way: count it (``disk_errors``), log it once, and carry on
as if the entry were missing. A compiled artifact is code, so the folder is a trust boundary
(Note [cache trust rule] in trust.py) and nothing read from it is believed before it is verified.

Note [cache values are data, verified first]
Every value is one SQLite BLOB, stored inline (no value files whose names a row could point
elsewhere): ``MAC(32) | "AEC2" | u32 header length | header JSON | payload``. The MAC is
HMAC-SHA256 under a per-cache secret (``<dir>/secret``, 32 random bytes, created 0600 with
O_EXCL|O_NOFOLLOW) over the key and the exact bytes after it; it is checked before anything is
parsed. Headers are JSON and payloads raw bytes: statistics and quarantine marks are plain JSON,
a program is its JSON metadata plus the backend's artifact bytes. Nothing is unpickled, so a
planted value can at most be refused; ``cache ls`` reads headers only. A value that verifies
then has its fields checked by type and range before anyone reads them (Note [cache values are
checked] in values.py). Entries of the earlier diskcache format (pickles) are never loaded:
they are counted and their files collected.

Note [cache size]
``cache_size_mb`` bounds everything the folder holds: the database, the run logs and Inductor's
kernels in ``<dir>/inductor``. At open and after every program stored (by this process or by
the compile service) the folder is measured again (one walk without following links: a compile
writes its kernels before its program is stored) and, while it is over the limit, the least
recently used of these go (``evict.choose``): a whole program entry, its row together with the
kernel files no other stored program names (Note [program entries] in kernel_refs.py), or an
orphan, kernel files no stored program names, by age. A stored program's kernels therefore go
only with it, and an evicted program is a plain miss: compiled again, as if never stored.
Eviction never removes what a live process relies on (Note [kernel pins] in pins.py):
precompiled headers and Inductor's locks while any process uses the folder, kernels written
since a compile in flight began (a program whose own kernels are among them stays whole). A
folder whose limit cannot hold precompiled headers (``pins.PCH_MIN_LIMIT``) compiles without
them. Kernels of a stored program that are gone all the same (deleted by hand, an entry of an
earlier format) are rebuilt from the source in its artifact when it is loaded. An eviction
costs the walk, two queries and one transaction: with 2,000 programs and 8,000 kernel files
(67 MiB) the walk alone takes 0.05 s, evicting 1% of the folder 0.1 s, 10% 0.2 s (2 cores).
A corrupt database is moved aside (``cache.sqlite.corrupt``) and rebuilt; a folder this user
cannot write is served read-only.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote


from adaptive_eager.cache import evict, kernel_refs, legacy, trust, values
from adaptive_eager.cache.folder import DB_NAME, INDUCTOR_DIR, warn_once, writable
from adaptive_eager.cache.limit import FolderSize
from adaptive_eager.cache.seal import BadEntry, Seal, load_secret
from adaptive_eager.cache.trust import Untrusted
from adaptive_eager.metrics import METRICS as M

log = logging.getLogger("adaptive_eager")

FORMAT = 2  # bump when the value layout changes: old entries are then skipped
_PROGRAM = "program:"
_STATS = "stats:"
_QUARANTINE = "quarantine:"
_KEY = re.compile(r"^(program|stats|quarantine):[A-Za-z0-9_.+=-]{1,256}$")
_TOUCH_S = 600.0  # a use is recorded at most this often (each record is a committed write)
# Kernel folders that passed the trust rule in this process, writable (the backend uses them).
KERNEL_DIRS_OK: set[str] = set()
# Their caches' size limits in bytes (precompiled headers only where they fit: Note [cache size]).
KERNEL_DIR_LIMITS: dict[str, int] = {}

UnsafeCacheDir = Untrusted  # the name earlier versions exported


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptive_eager"


def resolve_cache_dir(options: Any) -> Path:
    """The cache folder an engine with ``options`` uses."""
    return Path(options.cache_dir).expanduser() if options.cache_dir else default_cache_dir()


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700 if needed; raise Untrusted unless it passes the trust rule."""
    return trust.check_root(path, create=True)


def _corrupt(err: Exception) -> bool:
    """SQLite says the file is not a sound database (rather than busy, read-only, full)."""
    text = str(err).lower()
    return type(err) is sqlite3.DatabaseError or "malformed" in text or "not a database" in text


class DiskCache:
    """Programs by key, statistics and quarantine marks by trace digest."""

    def __init__(self, directory: Path, size_limit: int) -> None:
        self.directory = trust.check_root(directory, create=True)
        self.size_limit = int(size_limit)
        self.read_only = not writable(self.directory)
        self.lock = threading.RLock()
        self._pid = os.getpid()
        self._seal = Seal(load_secret(self.directory, self.read_only, self.refused))
        self._conn: sqlite3.Connection | None = None
        self._connect()
        self.size = FolderSize(self)
        self.size.rescan()  # the trust check of the kernels, also in a read-only folder
        if not self.read_only:
            self._collect_legacy()
            self.enforce_limit()
            KERNEL_DIRS_OK.add(str(self.directory / INDUCTOR_DIR))
            KERNEL_DIR_LIMITS[str(self.directory / INDUCTOR_DIR)] = self.size_limit

    @classmethod
    def open(cls, directory: Path, size_limit: int) -> DiskCache | None:
        """The cache at ``directory``, or None (with a warning) when it cannot be used safely."""
        try:
            return cls(directory, size_limit)
        except Untrusted as err:
            M.disk_errors += 1
            warn_once(f"unsafe:{directory}", "adaptive_eager: refusing cache folder: %s; "
                       "running without the disk cache", err)
        except Exception as err:  # read-only and empty, missing permissions, unusable index
            M.disk_errors += 1
            warn_once(f"open:{directory}", "adaptive_eager: cannot open cache folder %s (%s); "
                       "running without the disk cache", directory, err)
        return None

    # ---- the secret and the database ---------------------------------------------------------
    def _db_path(self) -> Path:
        return self.directory / DB_NAME

    def _check_db_files(self) -> None:
        for name in (DB_NAME, DB_NAME + "-journal", DB_NAME + "-wal", DB_NAME + "-shm"):
            try:
                st = os.lstat(self.directory / name)
            except FileNotFoundError:
                continue
            try:
                trust.check_own(self.directory / name, st)
                if not stat.S_ISREG(st.st_mode):
                    raise Untrusted(f"{self.directory / name} is not a plain file")
            except Untrusted as err:
                if self.read_only:
                    raise
                # Never opened: removed (a link is unlinked, not followed), then rebuilt.
                self.refused(f"db:{self.directory}", f"{err}; removing it")
                trust.remove_tree(self.directory / name)

    def _connect(self) -> None:
        self._check_db_files()
        path = self._db_path()
        try:
            if self.read_only or (path.exists() and not writable(path)):
                self.read_only = True
                uri = f"file:{quote(str(path))}?mode=ro"
                conn = sqlite3.connect(uri, uri=True, timeout=5, isolation_level=None,
                                       check_same_thread=False)
                conn.execute("SELECT count(*) FROM entries").fetchone()
            else:
                fresh = not path.exists()
                if fresh:  # create it 0600 ourselves, never through a planted link
                    os.close(trust.open_private(self.directory, DB_NAME,
                                                os.O_RDWR | os.O_CREAT, 0o600))
                conn = sqlite3.connect(str(path), timeout=5, isolation_level=None,
                                       check_same_thread=False)
                conn.execute("PRAGMA auto_vacuum = FULL")  # deletes give space back
                conn.execute("PRAGMA journal_mode = DELETE")
                conn.execute("PRAGMA synchronous = NORMAL")
                conn.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, "
                             "value BLOB NOT NULL, size INTEGER NOT NULL, "
                             "accessed REAL NOT NULL)")
                conn.execute("CREATE TABLE IF NOT EXISTS kernels (program TEXT NOT NULL, "
                             "key TEXT NOT NULL, PRIMARY KEY (program, key)) WITHOUT ROWID")
                conn.execute("SELECT count(*) FROM entries").fetchone()
        except sqlite3.DatabaseError as err:
            if not _corrupt(err) or self.read_only:
                raise
            self._move_aside(err)
            return self._connect()
        self._conn = conn

    def _move_aside(self, err: Exception) -> None:
        M.disk_errors += 1
        warn_once(f"corrupt:{self.directory}", "adaptive_eager: the cache database %s is "
                   "damaged (%s); moved it aside to %s and starting an empty one",
                   self._db_path(), err, DB_NAME + ".corrupt")
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None
        os.replace(self._db_path(), self.directory / (DB_NAME + ".corrupt"))
        for suffix in ("-journal", "-wal", "-shm"):
            trust.remove_tree(self.directory / (DB_NAME + suffix))

    def _db(self) -> sqlite3.Connection:
        if self._pid != os.getpid():  # a forked child must not share its parent's connection
            self._pid, self._conn = os.getpid(), None
            self._connect()
        if self._conn is None:
            raise sqlite3.OperationalError("the cache database is closed")
        return self._conn

    def sql(self, query: str, args: tuple = ()) -> list[tuple]:
        """Run one statement; a damaged database is moved aside and rebuilt (once)."""
        with self.lock:
            try:
                return self._db().execute(query, args).fetchall()
            except sqlite3.DatabaseError as err:
                if not _corrupt(err) or self.read_only:
                    raise
                self._move_aside(err)
                self._connect()
                return self._db().execute(query, args).fetchall()

    def transaction(self, steps: list[tuple[str, tuple | list]]) -> None:
        """Run ``steps`` (statement, arguments; a list of argument tuples runs each) as one
        transaction; a damaged database is moved aside and rebuilt (once)."""
        with self.lock:
            try:
                _run_steps(self._db(), steps, transaction=True)
            except sqlite3.DatabaseError as err:
                if not _corrupt(err) or self.read_only:
                    raise
                self._move_aside(err)
                self._connect()
                _run_steps(self._db(), steps, transaction=True)

    # ---- values ---------------------------------------------------------------------------------
    def encode(self, key: str, header: dict, payload: bytes = b"") -> bytes:
        return self._seal.encode(key, header, payload)

    def decode(self, key: str, blob: Any, header_only: bool = False) -> tuple[dict, bytes]:
        """Verify the MAC first, then parse; raise BadEntry for anything else."""
        return self._seal.decode(key, blob, header_only)

    def checked(self, key: str, blob: Any, header_only: bool = False) -> tuple[dict, bytes]:
        """``decode``, then the type and range checks of every field (Note [cache values are
        checked] in values.py); raise BadEntry for a value that fails either."""
        header, payload = self.decode(key, blob, header_only)
        why = values.problem(key, header, None if header_only else len(payload))
        if why is not None:
            M.disk_invalid += 1
            raise BadEntry(f"unexpected content ({why})")
        return header, payload

    def _get(self, key: str, header_only: bool = False, touch: bool = False
             ) -> tuple[dict, bytes] | None:
        try:
            rows = self.sql("SELECT value, accessed FROM entries WHERE key = ?", (key,))
        except Exception as err:  # sqlite errors and the like
            M.disk_errors += 1
            warn_once(f"get:{type(err).__name__}", "adaptive_eager: disk cache read failed: %s",
                       err)
            return None
        if not rows:
            return None
        try:
            value = self.checked(key, rows[0][0], header_only)
        except BadEntry as err:
            self._bad(key, str(err))
            return None
        if touch and not self.read_only and time.time() - rows[0][1] > _TOUCH_S:
            try:  # least recently used eviction needs the time of last use (roughly: a write)
                self.sql("UPDATE entries SET accessed = ? WHERE key = ?", (time.time(), key))
            except Exception:
                pass
        return value

    def _set(self, key: str, header: dict, payload: bytes = b"") -> None:
        if self.read_only:
            return
        try:
            blob = self.encode(key, header, payload)
            if key.startswith(_PROGRAM):  # the kernels it names first: Note [program entries]
                self.transaction(_refs_steps(key, payload))
            self.sql("INSERT OR REPLACE INTO entries (key, value, size, accessed) "
                      "VALUES (?, ?, ?, ?)", (key, blob, len(blob), time.time()))
        except Exception as err:  # full disk, read-only folder, locked database
            M.disk_errors += 1
            if "readonly" in str(err).lower():
                self.read_only = True
            warn_once(f"set:{type(err).__name__}", "adaptive_eager: disk cache write failed "
                       "(%s); continuing without storing", err)

    def _bad(self, key: str, why: str) -> None:
        M.disk_errors += 1
        warn_once(f"bad:{why[:20]}", "adaptive_eager: skipping disk cache entry %s: %s",
                   key[:40], why)
        if not self.read_only:
            try:
                self.sql("DELETE FROM entries WHERE key = ?", (key,))
                self.sql("DELETE FROM kernels WHERE program = ?", (key,))
            except Exception:
                pass

    @staticmethod
    def refused(kind: str, why: str) -> None:
        M.disk_errors += 1
        warn_once(f"refused:{kind}", "adaptive_eager: refusing %s", why)

    # ---- compiled programs ------------------------------------------------------------------
    def get_program(self, key: str, torch_version: str) -> dict | None:
        got = self._get(_PROGRAM + key, touch=True)
        if got is None:
            return None
        header, artifact = got
        if header.get("format") != FORMAT or header.get("torch") != torch_version:
            self._bad(_PROGRAM + key, "entry from another version")
            return None
        return {**header, "artifact": artifact}

    def put_program(self, key: str, torch_version: str, backend: str, artifact: bytes,
                    info: dict) -> None:
        header = {"format": FORMAT, "torch": torch_version, "backend": backend,
                  "size": len(artifact), "info": info, "written": time.time()}
        self._set(_PROGRAM + key, header, bytes(artifact))
        self.enforce_limit(rescan=True)  # its kernels are on disk by now: Note [cache size]

    def program_info(self, key: str) -> dict | None:
        """A program's metadata only (its artifact is neither returned nor parsed)."""
        got = self._get(key if key.startswith(_PROGRAM) else _PROGRAM + key, header_only=True)
        return None if got is None else got[0]

    # ---- statistics and quarantine ------------------------------------------------------------
    def get_stats(self, digest: str) -> dict | None:
        got = self._get(_STATS + digest)
        return None if got is None else got[0]

    def put_stats(self, digest: str, stats: dict) -> None:
        self._set(_STATS + digest, dict(stats))

    def recent_programs(self, script: str, limit: int) -> list[str]:
        """Program keys that runs of ``script`` stored or used, newest first, whose programs are
        still here (the prefetch at engine start, Note [warm start] in compile/programs.py). Reads
        the statistics' JSON headers only."""
        rows = self.sql("SELECT key, value FROM entries WHERE key LIKE 'stats:%' "
                         "ORDER BY accessed DESC LIMIT 500")
        found: list[tuple[float, str]] = []
        for key, blob in rows:
            try:
                stats = self.checked(key, blob, header_only=True)[0]
            except BadEntry as err:
                self._bad(key, str(err))
                continue
            pk = stats.get("program_key")
            if (isinstance(pk, str) and stats.get("script") == script and stats.get("hot")
                    and not stats.get("decision", "").startswith("op-by-op")):
                found.append((stats.get("used_at", 0.0), pk))
        found.sort(reverse=True)
        keys = []
        for _, pk in found:
            if pk not in keys and self.sql("SELECT 1 FROM entries WHERE key = ?",
                                            (_PROGRAM + pk,)):
                keys.append(pk)
            if len(keys) >= limit:
                break
        return keys

    def quarantine(self, digest: str, reason: str) -> None:
        self._set(_QUARANTINE + digest, {"reason": reason, "when": time.time()})

    def is_quarantined(self, digest: str) -> bool:
        return self._get(_QUARANTINE + digest) is not None

    # ---- whole entries (cache ls / export / import) -------------------------------------------
    def get_entry(self, key: str) -> tuple[dict, bytes] | None:
        """A verified entry as (header, payload)."""
        return self._get(key)

    def put_entry(self, key: str, header: dict, payload: bytes = b"") -> bool:
        """Store an entry the user vouches for, under this cache's key (False: refused)."""
        if entry_problem(key, header, len(payload)) is not None or self.read_only:
            return False
        self._set(key, header, payload)
        return True

    def store_entries(self, entries: Iterable[tuple[str, dict, bytes]]) -> int:
        """Store all of ``entries`` (``import``: checked by the caller with ``entry_problem``)
        in one transaction, or none of them: raises on any failure (rolled back). Returns how
        many were stored."""
        if self.read_only:
            raise sqlite3.OperationalError(f"{self.directory} is read-only")
        n = 0
        with self.lock:
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            try:
                for key, header, payload in entries:
                    why = entry_problem(key, header, len(payload))
                    if why is not None:
                        raise BadEntry(f"{key[:40]}: {why}")
                    blob = self.encode(key, header, payload)
                    if key.startswith(_PROGRAM):
                        _run_steps(db, _refs_steps(key, payload))
                    db.execute("INSERT OR REPLACE INTO entries (key, value, size, accessed) "
                               "VALUES (?, ?, ?, ?)", (key, blob, len(blob), time.time()))
                    n += 1
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return n

    def raw_get(self, key: str) -> bytes | None:
        """The stored bytes, unverified (tests and repair only: never parse them)."""
        rows = self.sql("SELECT value FROM entries WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def raw_set(self, key: str, blob: bytes) -> None:
        """Store bytes as they are (tests: a planted or damaged value)."""
        self.sql("INSERT OR REPLACE INTO entries (key, value, size, accessed) "
                  "VALUES (?, ?, ?, ?)", (key, blob, len(blob), time.time()))

    def clear(self) -> int:
        n = self.sql("SELECT count(*) FROM entries")[0][0]
        self.sql("DELETE FROM entries")
        self.sql("DELETE FROM kernels")
        trust.remove_tree(self.directory / INDUCTOR_DIR)
        self.size.folder = evict.Folder()  # measured anew at the next rescan
        return int(n)

    # ---- size and earlier formats ---------------------------------------------------------------
    def measure(self) -> int:
        """Walk the folder again and return ``usage()``."""
        return self.size.measure()

    def usage(self) -> int:
        """Bytes the folder holds: database, Inductor kernels, run logs (as last measured)."""
        return self.size.usage()

    def enforce_limit(self, rescan: bool = False, limit: int | None = None) -> int:
        """Evict until the folder fits (Note [cache size]); how many were evicted. Never raises."""
        return self.size.enforce(rescan, limit)

    def _collect_legacy(self) -> None:
        dropped, files = legacy.collect(self.directory)
        if dropped or files:
            M.disk_errors += 1
            warn_once(f"legacy:{self.directory}", "adaptive_eager: dropped %d cache entries "
                      "of an earlier format (not loaded) and %d value files in %s",
                      dropped, files, self.directory)

    # ---- the rest of the API ----------------------------------------------------------------------
    def keys(self) -> list[str]:
        return [k for (k,) in self.sql("SELECT key FROM entries ORDER BY key")
                if isinstance(k, str)]

    def raw(self) -> Any:
        return self

    def close(self) -> None:
        with self.lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception:
                    pass
                self._conn = None


def entry_problem(key: Any, header: Any, payload_size: int = 0) -> str | None:
    """What keeps an entry from being stored (None: nothing): its key's form, then its
    fields (Note [cache values are checked] in values.py)."""
    if type(key) is not str or not _KEY.match(key):
        return "a key of the form program:, stats: or quarantine: and a name"
    if not key.startswith(_PROGRAM) and payload_size:
        return "only programs carry an artifact"
    return values.problem(key, header, payload_size if key.startswith(_PROGRAM) else None)


def _refs_steps(key: str, artifact: bytes) -> list[tuple[str, tuple | list]]:
    """The statements that record the kernels program ``key`` names (Note [program entries])."""
    names = kernel_refs.keys_in(artifact)
    return [("DELETE FROM kernels WHERE program = ?", (key,)),
            ("INSERT OR IGNORE INTO kernels (program, key) VALUES (?, ?)",
             [(key, k) for k in names])]


def _run_steps(db: sqlite3.Connection, steps: list[tuple[str, tuple | list]],
               transaction: bool = False) -> None:
    if transaction:
        db.execute("BEGIN IMMEDIATE")
    try:
        for query, args in steps:
            if isinstance(args, list):
                db.executemany(query, args)
            else:
                db.execute(query, args)
        if transaction:
            db.execute("COMMIT")
    except BaseException:
        if transaction:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        raise
