"""Pins on an Inductor kernel folder: what the size limit must not evict while it is in use.

Note [kernel pins]
A process that compiles or loads Inductor programs relies on files in the kernel folder that
its memory says exist: ``_precompile_header`` is memoized (``functools.cache``), so a warm
helper whose precompiled header was evicted by another process's size limit passed
``-include`` of a missing file to every later compile, and each failed. A compile in flight
relies on the kernels it has written so far until it has serialized its program. So each such
process holds a pin (``<kernels>/adaptive_eager-pins/<pid>-<n>.pin``, 0600, under an
exclusive ``flock`` for as long as the process lives, released by the kernel when it dies):

* while any pin lives, ``PINNED_NAMES`` (precompiled headers, Inductor's lock folder, the pins)
  are never evicted;
* the pin's JSON names ``since``: the start of the process's oldest compile in flight; no
  kernel file written at or after it is evicted, nor a program whose own kernels are among
  them (Note [program entries] in kernel_refs.py).

The eviction (``FolderSize.evict`` in limit.py) reads the pins: a pin whose ``flock`` it can take
belongs to a process that is gone, and is removed. A live pin it cannot read (being rewritten) pins
everything. Precompiled headers are ~150 MB (torch 2.13, g++): a cache folder whose size limit is
under ``PCH_MIN_LIMIT`` compiles without them (Note [Inductor kernel folder]), so pinning them never
holds such a folder over its limit. """

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

PINS_DIR = "adaptive_eager-pins"
PINNED_NAMES = ("precompiled_headers", "locks", PINS_DIR)
PCH_MIN_LIMIT = 1 << 30  # bytes: a smaller size limit compiles without precompiled headers

_counter = itertools.count()
_lock = threading.Lock()
_pins: dict[tuple[int, str], Pin] = {}


class Pin:
    """This process's pin on one kernel folder (Note [kernel pins])."""

    def __init__(self, kernel_dir: str) -> None:
        folder = os.path.join(kernel_dir, PINS_DIR)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        name = os.path.join(folder, f"{os.getpid()}-{next(_counter)}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        self.fd = os.open(name + ".tmp", flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.lock = threading.Lock()
        self.starts: dict[int, float] = {}
        self._write()
        os.rename(name + ".tmp", name + ".pin")  # seen by others only once locked

    def _write(self) -> None:
        since = min(self.starts.values(), default=None)
        data = json.dumps({"pid": os.getpid(), "since": since}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Pin every kernel entry written from now until the block ends."""
        token = next(_counter)
        with self.lock:
            self.starts[token] = time.time() - 1.0  # mtimes can lag the clock a little
            self._write()
        try:
            yield
        finally:
            with self.lock:
                self.starts.pop(token, None)
                self._write()


def pin(kernel_dir: str) -> Pin | None:
    """This process's pin on ``kernel_dir`` (made at first use, held until exit); None if the
    folder cannot hold one (read-only): nothing there is evicted by this process's limit then."""
    key = (os.getpid(), os.path.abspath(kernel_dir))
    with _lock:
        got = _pins.get(key)
        if got is None:
            try:
                got = _pins[key] = Pin(key[1])
            except OSError:
                return None
        return got


@contextlib.contextmanager
def compiling(kernel_dir: str) -> Iterator[None]:
    """``pin(kernel_dir).compiling()``, or nothing where no pin can be made."""
    p = pin(kernel_dir)
    if p is None:
        yield
        return
    with p.compiling():
        yield


def live_pins(kernel_dir: Path) -> tuple[bool, float | None]:
    """(any live pin, the oldest ``since`` of them; -inf when one could not be read), removing
    the pins of processes that are gone."""
    folder = kernel_dir / PINS_DIR
    try:
        names = os.listdir(folder)
    except OSError:
        return False, None
    live, since = False, None
    for name in names:
        if not name.endswith(".pin"):
            continue
        held, value = _read_pin(folder / name)
        if not held:
            continue
        live = True
        if value is not None:
            since = value if since is None else min(since, value)
    return live, since


def _read_pin(path: Path) -> tuple[bool, float | None]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False, None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its process lives
            try:
                since = json.loads(os.pread(fd, 4096, 0) or b"{}").get("since")
                return True, None if since is None else float(since)
            except (ValueError, TypeError, AttributeError, OSError):
                return True, float("-inf")  # being rewritten: pins everything
        try:
            os.unlink(path)  # its process is gone
        except OSError:
            pass
        return False, None
    finally:
        os.close(fd)
