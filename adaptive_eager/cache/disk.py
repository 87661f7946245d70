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

import hashlib
import hmac
import json
import logging
import os
import re
import sqlite3
import stat
import struct
import threading
import time
from pathlib import Path
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote


from adaptive_eager.cache import evict, kernel_refs, pins, trust, values
from adaptive_eager.cache.trust import Untrusted
from adaptive_eager.metrics import METRICS as M

log = logging.getLogger("adaptive_eager")

FORMAT = 2  # bump when the value layout changes: old entries are then skipped
_PROGRAM = "program:"
_STATS = "stats:"
_QUARANTINE = "quarantine:"
DB_NAME = "cache.sqlite"
SECRET_NAME = "secret"
INDUCTOR_DIR = "inductor"
RUNS_DIR = "runs"
_LEGACY_DB = "cache.db"  # the diskcache format (pickled values): never loaded
_LEGACY_SUB = re.compile(r"^[0-9a-f]{2}$")
_LEGACY_VAL = re.compile(r"^[0-9a-f]{28}\.val$")
_KEY = re.compile(r"^(program|stats|quarantine):[A-Za-z0-9_.+=-]{1,256}$")
_MAGIC = b"AEC2"
_HEAD = struct.Struct("<I")
_MAC_LEN = 32
_RESCAN_S = 60.0
_TOUCH_S = 600.0  # a use is recorded at most this often (each record is a committed write)
_logged: set[str] = set()
# Kernel folders that passed the trust rule in this process, writable (the backend uses them).
KERNEL_DIRS_OK: set[str] = set()
# Their caches' size limits in bytes (precompiled headers only where they fit: Note [cache size]).
KERNEL_DIR_LIMITS: dict[str, int] = {}

UnsafeCacheDir = Untrusted  # the name earlier versions exported


class BadEntry(Exception):
    """A value that failed verification or parsing."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adaptive_eager"


def resolve_cache_dir(options: Any) -> Path:
    """The cache folder an engine with ``options`` uses."""
    return Path(options.cache_dir).expanduser() if options.cache_dir else default_cache_dir()


def _warn_once(kind: str, msg: str, *args: Any) -> None:
    if kind not in _logged:
        _logged.add(kind)
        log.warning(msg, *args)


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700 if needed; raise Untrusted unless it passes the trust rule."""
    return trust.check_root(path, create=True)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, bytes):
        return obj.hex()
    return str(obj)


def _corrupt(err: Exception) -> bool:
    """SQLite says the file is not a sound database (rather than busy, read-only, full)."""
    text = str(err).lower()
    return type(err) is sqlite3.DatabaseError or "malformed" in text or "not a database" in text


class DiskCache:
    """Programs by key, statistics and quarantine marks by trace digest."""

    def __init__(self, directory: Path, size_limit: int) -> None:
        self.directory = trust.check_root(directory, create=True)
        self.size_limit = int(size_limit)
        self.read_only = not _writable(self.directory)
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._secret = self._load_secret()
        self._conn: sqlite3.Connection | None = None
        self._connect()
        self._scanned_at = 0.0
        self._folder = evict.Folder()  # the kernel folder as last scanned
        self._other_bytes = 0
        self._rescan()  # the trust check of the kernels, also in a read-only folder
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
            _warn_once(f"unsafe:{directory}", "adaptive_eager: refusing cache folder: %s; "
                       "running without the disk cache", err)
        except Exception as err:  # read-only and empty, missing permissions, unusable index
            M.disk_errors += 1
            _warn_once(f"open:{directory}", "adaptive_eager: cannot open cache folder %s (%s); "
                       "running without the disk cache", directory, err)
        return None

    # ---- the secret and the database ---------------------------------------------------------
    def _load_secret(self) -> bytes:
        """The per-cache MAC key: read only if it is this user's regular 0600 file."""
        for _ in range(3):
            try:
                fd = trust.open_private(self.directory, SECRET_NAME)
            except FileNotFoundError:
                if self.read_only:
                    raise Untrusted(f"{self.directory} is read-only and has no {SECRET_NAME}; "
                                    "nothing in it can be verified") from None
                self._create_secret()
                continue
            except Untrusted as err:
                if self.read_only:
                    raise
                self._refused(f"secret:{self.directory}", str(err))
                trust.remove_tree(self.directory / SECRET_NAME)  # a new key: old values fail
                continue
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read(_MAC_LEN + 1)
            if stat.S_IMODE(st.st_mode) & 0o077 or len(data) != _MAC_LEN:
                if self.read_only:
                    raise Untrusted(f"{self.directory / SECRET_NAME} is readable by others "
                                    "or damaged")
                self._refused(f"secret:{self.directory}", f"{self.directory / SECRET_NAME} is "
                              f"readable by others or damaged; making a new one")
                trust.remove_tree(self.directory / SECRET_NAME)
                continue
            return data
        raise Untrusted(f"could not create a private {SECRET_NAME} in {self.directory}")

    def _create_secret(self) -> None:
        tmp = f"{SECRET_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = trust.open_private(self.directory, tmp,
                                os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(_MAC_LEN))
                f.flush()
                os.fsync(f.fileno())
            try:  # atomic and exclusive: two processes starting at once agree on one key
                os.link(self.directory / tmp, self.directory / SECRET_NAME,
                        follow_symlinks=False)
            except FileExistsError:
                pass
        finally:
            try:
                os.unlink(self.directory / tmp)
            except OSError:
                pass

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
                self._refused(f"db:{self.directory}", f"{err}; removing it")
                trust.remove_tree(self.directory / name)

    def _connect(self) -> None:
        self._check_db_files()
        path = self._db_path()
        try:
            if self.read_only or (path.exists() and not _writable(path)):
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
        _warn_once(f"corrupt:{self.directory}", "adaptive_eager: the cache database %s is "
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

    def _sql(self, query: str, args: tuple = ()) -> list[tuple]:
        """Run one statement; a damaged database is moved aside and rebuilt (once)."""
        with self._lock:
            try:
                return self._db().execute(query, args).fetchall()
            except sqlite3.DatabaseError as err:
                if not _corrupt(err) or self.read_only:
                    raise
                self._move_aside(err)
                self._connect()
                return self._db().execute(query, args).fetchall()

    def _transaction(self, steps: list[tuple[str, tuple | list]]) -> None:
        """Run ``steps`` (statement, arguments; a list of argument tuples runs each) as one
        transaction; a damaged database is moved aside and rebuilt (once)."""
        with self._lock:
            try:
                _run_steps(self._db(), steps, transaction=True)
            except sqlite3.DatabaseError as err:
                if not _corrupt(err) or self.read_only:
                    raise
                self._move_aside(err)
                self._connect()
                _run_steps(self._db(), steps, transaction=True)

    # ---- values ---------------------------------------------------------------------------------
    def _mac(self, key: str, body: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + body, hashlib.sha256).digest()

    def encode(self, key: str, header: dict, payload: bytes = b"") -> bytes:
        head = json.dumps(header, default=_jsonable, sort_keys=True).encode()
        body = _MAGIC + _HEAD.pack(len(head)) + head + payload
        return self._mac(key, body) + body

    def decode(self, key: str, blob: Any, header_only: bool = False) -> tuple[dict, bytes]:
        """Verify the MAC first, then parse; raise BadEntry for anything else."""
        if not isinstance(blob, bytes) or len(blob) < _MAC_LEN + len(_MAGIC) + _HEAD.size:
            raise BadEntry("not a value this cache wrote (old format or damaged)")
        mac, body = blob[:_MAC_LEN], blob[_MAC_LEN:]
        if not hmac.compare_digest(mac, self._mac(key, body)):
            raise BadEntry("failed verification: not written by this cache, or damaged")
        if body[:len(_MAGIC)] != _MAGIC:
            raise BadEntry("unknown value format")
        n = _HEAD.unpack_from(body, len(_MAGIC))[0]
        start = len(_MAGIC) + _HEAD.size
        try:
            header = json.loads(body[start:start + n])
        except ValueError as err:
            raise BadEntry(f"unreadable header ({err})") from None
        if not isinstance(header, dict):
            raise BadEntry("header is not a JSON object")
        return header, (b"" if header_only else body[start + n:])

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
            rows = self._sql("SELECT value, accessed FROM entries WHERE key = ?", (key,))
        except Exception as err:  # sqlite errors and the like
            M.disk_errors += 1
            _warn_once(f"get:{type(err).__name__}", "adaptive_eager: disk cache read failed: %s",
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
                self._sql("UPDATE entries SET accessed = ? WHERE key = ?", (time.time(), key))
            except Exception:
                pass
        return value

    def _set(self, key: str, header: dict, payload: bytes = b"") -> None:
        if self.read_only:
            return
        try:
            blob = self.encode(key, header, payload)
            if key.startswith(_PROGRAM):  # the kernels it names first: Note [program entries]
                self._transaction(_refs_steps(key, payload))
            self._sql("INSERT OR REPLACE INTO entries (key, value, size, accessed) "
                      "VALUES (?, ?, ?, ?)", (key, blob, len(blob), time.time()))
        except Exception as err:  # full disk, read-only folder, locked database
            M.disk_errors += 1
            if "readonly" in str(err).lower():
                self.read_only = True
            _warn_once(f"set:{type(err).__name__}", "adaptive_eager: disk cache write failed "
                       "(%s); continuing without storing", err)

    def _bad(self, key: str, why: str) -> None:
        M.disk_errors += 1
        _warn_once(f"bad:{why[:20]}", "adaptive_eager: skipping disk cache entry %s: %s",
                   key[:40], why)
        if not self.read_only:
            try:
                self._sql("DELETE FROM entries WHERE key = ?", (key,))
                self._sql("DELETE FROM kernels WHERE program = ?", (key,))
            except Exception:
                pass

    @staticmethod
    def _refused(kind: str, why: str) -> None:
        M.disk_errors += 1
        _warn_once(f"refused:{kind}", "adaptive_eager: refusing %s", why)

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
        rows = self._sql("SELECT key, value FROM entries WHERE key LIKE 'stats:%' "
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
            if pk not in keys and self._sql("SELECT 1 FROM entries WHERE key = ?",
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
        with self._lock:
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
        rows = self._sql("SELECT value FROM entries WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def raw_set(self, key: str, blob: bytes) -> None:
        """Store bytes as they are (tests: a planted or damaged value)."""
        self._sql("INSERT OR REPLACE INTO entries (key, value, size, accessed) "
                  "VALUES (?, ?, ?, ?)", (key, blob, len(blob), time.time()))

    def clear(self) -> int:
        n = self._sql("SELECT count(*) FROM entries")[0][0]
        self._sql("DELETE FROM entries")
        self._sql("DELETE FROM kernels")
        trust.remove_tree(self.directory / INDUCTOR_DIR)
        self._folder = evict.Folder()
        return int(n)

    # ---- size -----------------------------------------------------------------------------------
    def _db_bytes(self) -> int:
        """The database's files, and the secret and folders around everything else."""
        total = 0
        for name in (DB_NAME, DB_NAME + "-journal", DB_NAME + ".corrupt"):
            try:
                st = os.lstat(self.directory / name)
            except OSError:
                continue
            total += max(st.st_size, getattr(st, "st_blocks", 0) * 512)
        for name in (".", SECRET_NAME, INDUCTOR_DIR, RUNS_DIR):
            try:
                total += os.lstat(self.directory / name).st_blocks * 512
            except (OSError, AttributeError):
                pass
        return total

    def _rescan(self) -> None:
        """Measure the kernel folder and the run logs; drop kernel subfolders that fail the
        trust rule (Inductor would load them)."""
        kernels = self.directory / INDUCTOR_DIR
        try:
            trust.private_subdir(self.directory, INDUCTOR_DIR, create=not self.read_only)
        except FileNotFoundError:
            pass
        except Untrusted as err:  # a link, or someone else's: never used, made anew
            self._refused(f"kernels:{kernels}", f"Inductor kernels: {err}; removing it")
            if not self.read_only:
                trust.remove_tree(kernels)
                trust.private_subdir(self.directory, INDUCTOR_DIR)
        folder = evict.scan(kernels)
        for name, why in folder.bad.items():
            self._refused(f"kernels:{kernels}", f"Inductor kernels: {why}; removing "
                          f"{kernels / name}")
            if self.read_only:
                raise Untrusted(f"Inductor kernels in a read-only cache folder: {why}")
            trust.remove_tree(kernels / name)
        self._folder = folder
        self._other_bytes = trust.scan(self.directory / RUNS_DIR)[0]
        self._scanned_at = time.monotonic()

    def measure(self) -> int:
        """Walk the folder again and return ``usage()``."""
        with self._lock:
            try:
                self._rescan()
            except Untrusted:
                pass
        return self.usage()

    def usage(self) -> int:
        """Bytes the folder holds: database, Inductor kernels, run logs (as last measured)."""
        return self._db_bytes() + self._folder.size() + self._other_bytes

    def enforce_limit(self, rescan: bool = False, limit: int | None = None) -> int:
        """Evict least recently used program entries and orphan kernels until the folder fits
        (Note [cache size]); returns how many were evicted. Never raises."""
        limit = self.size_limit if limit is None else limit
        if self.read_only:
            return 0
        try:
            with self._lock:
                if rescan or time.monotonic() - self._scanned_at > _RESCAN_S:
                    self._rescan()
                over = self.usage() - limit
                if over <= 0:
                    return 0
                return self._evict(over)
        except Exception as err:
            M.disk_errors += 1
            _warn_once(f"evict:{type(err).__name__}", "adaptive_eager: could not keep the "
                       "cache folder within its size limit: %s", err)
            return 0

    def _evict(self, over: int) -> int:
        """Whole program entries and orphan kernels, least recently used first (Note [program
        entries]), then statistics; never what a live process pins (Note [kernel pins])."""
        kernels = self.directory / INDUCTOR_DIR
        live, since = pins.live_pins(kernels)
        keep = set(pins.PINNED_NAMES) if live else {pins.PINS_DIR}

        def protected(unit: evict.Unit) -> bool:
            return (unit.name.split("/", 1)[0] in keep
                    or since is not None and unit.mtime >= since)

        programs = self._sql("SELECT key, size, accessed FROM entries "
                             "WHERE key LIKE 'program:%'")
        refs: dict[str, set[str]] = {}
        for program, key in self._sql("SELECT program, key FROM kernels"):
            refs.setdefault(program, set()).add(key)
        plan = evict.choose(programs, refs, self._folder.units, protected, over)
        if plan.programs:  # the rows before their kernels: never an entry without them
            gone = [(key,) for key in plan.programs]
            self._transaction([("DELETE FROM entries WHERE key = ?", gone),
                               ("DELETE FROM kernels WHERE program = ?", gone)])
        # a program another process stored since the query above may name a kernel too
        named = {key for (key,) in self._sql("SELECT DISTINCT key FROM kernels")}
        for unit in plan.units:
            if unit.key is None or unit.key not in named:
                evict.remove(kernels, unit)
                self._folder.units.pop(unit.name, None)
        evict.remove_empty_dirs(kernels, self._folder, since)
        if set(refs) - {key for key, _, _ in programs}:  # of programs gone (a cut write)
            self._sql("DELETE FROM kernels WHERE program NOT IN (SELECT key FROM entries)")
        n = len(plan.programs) + len(plan.units)
        over -= plan.freed
        if over > 0:  # statistics alone over the limit: oldest first
            for (key, size) in self._sql("SELECT key, size FROM entries "
                                         "WHERE key NOT LIKE 'program:%' ORDER BY accessed"):
                if over <= 0:
                    break
                self._sql("DELETE FROM entries WHERE key = ?", (key,))
                over -= size
                n += 1
        return n

    # ---- earlier formats --------------------------------------------------------------------
    def _collect_legacy(self) -> None:
        """Drop the diskcache-format database (pickled values, never loaded) and collect value
        files nothing indexes: only names diskcache made, never through links."""
        legacy = self.directory / _LEGACY_DB
        dropped = 0
        try:
            st = os.lstat(legacy)
        except FileNotFoundError:
            st = None
        if st is not None:
            try:
                trust.check_own(legacy, st)
                conn = sqlite3.connect(f"file:{quote(str(legacy))}?mode=ro", uri=True)
                try:
                    dropped = int(conn.execute("SELECT count(*) FROM Cache").fetchone()[0])
                finally:
                    conn.close()
            except Exception:
                pass
            for suffix in ("", "-wal", "-shm"):
                trust.remove_tree(self.directory / (_LEGACY_DB + suffix))
        files = 0
        for sub in _listdir(self.directory):
            if not _LEGACY_SUB.match(sub) or not _plain_dir(self.directory / sub):
                continue
            for sub2 in _listdir(self.directory / sub):
                folder = self.directory / sub / sub2
                if not _LEGACY_SUB.match(sub2) or not _plain_dir(folder):
                    continue
                for name in _listdir(folder):
                    if _LEGACY_VAL.match(name):
                        trust.remove_tree(folder / name)  # unlinks links, never follows
                        files += 1
                _rmdir(folder)
            _rmdir(self.directory / sub)
        if dropped or files:
            M.disk_errors += 1
            _warn_once(f"legacy:{self.directory}", "adaptive_eager: dropped %d cache entries "
                       "of an earlier format (not loaded) and %d value files in %s",
                       dropped, files, self.directory)

    # ---- the rest of the API ----------------------------------------------------------------------
    def keys(self) -> list[str]:
        return [k for (k,) in self._sql("SELECT key FROM entries ORDER BY key")
                if isinstance(k, str)]

    def raw(self) -> Any:
        return self

    def close(self) -> None:
        with self._lock:
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


def _writable(path: Path) -> bool:
    """Whether this process may write ``path`` (effective ids: what opening it would see)."""
    if os.access in os.supports_effective_ids:
        return os.access(path, os.W_OK, effective_ids=True)
    return os.access(path, os.W_OK)


def _listdir(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _plain_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode)


def _rmdir(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
