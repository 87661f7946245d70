"""The disk cache: compiled programs and per-trace statistics, shared by processes (diskcache).

Every fault here is answered the same way: count it (``disk_errors``), log it once, and carry on
as if the entry were missing. A compiled artifact is code, so the folder must be private: it is
created 0700, and a folder that another user or group can write is refused (the engine then runs
without a disk cache).
"""

from __future__ import annotations

import logging
import os
import pickle
import stat
import time
from pathlib import Path
from typing import Any

import xxhash

from adaptive_eager.metrics import METRICS as M

log = logging.getLogger("adaptive_eager")

FORMAT = 1  # bump when the value layout changes: old entries are then skipped
_PROGRAM = "program:"
_STATS = "stats:"
_QUARANTINE = "quarantine:"
_logged: set[str] = set()


class UnsafeCacheDir(Exception):
    """The cache folder could be written by someone else."""


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


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` 0700 if needed; refuse it if another user or group can write it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise UnsafeCacheDir(f"{path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheDir(f"{path} is writable by its group or by others "
                             f"(mode {stat.S_IMODE(st.st_mode):o}); run chmod 700 on it")


def cache_key(**parts: Any) -> str:
    """xxh3-128 over named parts, in name order, so a key says what it depends on."""
    h = xxhash.xxh3_128()
    for name in sorted(parts):
        h.update(f"{name}={parts[name]!r};".encode())
    return h.hexdigest()


class DiskCache:
    """Programs by key, statistics and quarantine marks by trace digest."""

    def __init__(self, directory: Path, size_limit: int) -> None:
        import diskcache

        self.directory = directory
        # Every value in its own file (min size 0): written whole, then indexed, so a process
        # killed mid-write leaves an orphan file, never a half entry.
        self._cache = diskcache.Cache(str(directory), size_limit=size_limit, timeout=5,
                                      eviction_policy="least-recently-used",
                                      disk_min_file_size=0)

    @classmethod
    def open(cls, directory: Path, size_limit: int) -> DiskCache | None:
        """The cache at ``directory``, or None (with a warning) when it cannot be used safely."""
        try:
            ensure_private_dir(directory)
            return cls(directory, size_limit)
        except UnsafeCacheDir as err:
            M.disk_errors += 1
            _warn_once(f"unsafe:{directory}", "adaptive_eager: refusing cache folder: %s; "
                       "running without the disk cache", err)
        except Exception as err:  # read-only, missing permissions, corrupt index
            M.disk_errors += 1
            _warn_once(f"open:{directory}", "adaptive_eager: cannot open cache folder %s (%s); "
                       "running without the disk cache", directory, err)
        return None

    # ---- compiled programs ------------------------------------------------------------------
    def get_program(self, key: str, torch_version: str) -> dict | None:
        value = self._get(_PROGRAM + key)
        if value is None:
            return None
        try:
            ok = (value["format"] == FORMAT and value["torch"] == torch_version
                  and xxhash.xxh64_intdigest(value["artifact"]) == value["checksum"])
        except (TypeError, KeyError):
            ok = False
        if not ok:
            self._bad(_PROGRAM + key, "entry from another version or damaged")
            return None
        return value

    def put_program(self, key: str, torch_version: str, backend: str, artifact: bytes,
                    info: dict) -> None:
        value = {"format": FORMAT, "torch": torch_version, "backend": backend,
                 "artifact": artifact, "checksum": xxhash.xxh64_intdigest(artifact),
                 "info": info, "written": time.time()}
        self._set(_PROGRAM + key, value)

    # ---- statistics and quarantine ------------------------------------------------------------
    def get_stats(self, digest: str) -> dict | None:
        value = self._get(_STATS + digest)
        return value if isinstance(value, dict) else None

    def put_stats(self, digest: str, stats: dict) -> None:
        self._set(_STATS + digest, stats)

    def quarantine(self, digest: str, reason: str) -> None:
        self._set(_QUARANTINE + digest, {"reason": reason, "when": time.time()})

    def is_quarantined(self, digest: str) -> bool:
        return self._get(_QUARANTINE + digest) is not None

    # ---- plumbing ------------------------------------------------------------------------------
    def _get(self, key: str) -> Any:
        try:
            return self._cache.get(key, default=None)
        except (pickle.UnpicklingError, EOFError, OSError, ValueError, AttributeError,
                ImportError, IndexError, TypeError) as err:
            self._bad(key, f"unreadable ({type(err).__name__}: {err})")
        except Exception as err:  # sqlite errors and the like
            M.disk_errors += 1
            _warn_once(f"get:{type(err).__name__}", "adaptive_eager: disk cache read failed: %s",
                       err)
        return None

    def _set(self, key: str, value: Any) -> None:
        try:
            self._cache.set(key, value)
        except Exception as err:  # full disk, read-only folder, locked database
            M.disk_errors += 1
            _warn_once(f"set:{type(err).__name__}", "adaptive_eager: disk cache write failed "
                       "(%s); continuing without storing", err)

    def _bad(self, key: str, why: str) -> None:
        M.disk_errors += 1
        _warn_once(f"bad:{why[:20]}", "adaptive_eager: skipping disk cache entry %s: %s",
                   key[:40], why)
        try:
            self._cache.delete(key)
        except Exception:
            pass

    def keys(self) -> list[str]:
        return [k for k in self._cache.iterkeys() if isinstance(k, str)]

    def raw(self) -> Any:
        return self._cache

    def close(self) -> None:
        self._cache.close()
