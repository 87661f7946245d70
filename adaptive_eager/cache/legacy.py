"""Entries of the earlier diskcache format (pickled values): never loaded, only collected."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path
from urllib.parse import quote

from adaptive_eager.cache import trust
from adaptive_eager.cache.folder import listdir, plain_dir, rmdir

LEGACY_DB = "cache.db"
_SUB = re.compile(r"^[0-9a-f]{2}$")
_VAL = re.compile(r"^[0-9a-f]{28}\.val$")


def collect(directory: Path) -> tuple[int, int]:
    """Drop the diskcache-format database and collect value files nothing indexes: only names
    diskcache made, never through links. Returns (entries dropped, value files removed)."""
    legacy = directory / LEGACY_DB
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
            trust.remove_tree(directory / (LEGACY_DB + suffix))
    files = 0
    for sub in listdir(directory):
        if not _SUB.match(sub) or not plain_dir(directory / sub):
            continue
        for sub2 in listdir(directory / sub):
            folder = directory / sub / sub2
            if not _SUB.match(sub2) or not plain_dir(folder):
                continue
            for name in listdir(folder):
                if _VAL.match(name):
                    trust.remove_tree(folder / name)  # unlinks links, never follows
                    files += 1
            rmdir(folder)
        rmdir(directory / sub)
    return dropped, files
