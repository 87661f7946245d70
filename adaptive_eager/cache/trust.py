"""The one trust rule for everything the engine loads or executes from disk.

Note [cache trust rule]
Programs, statistics, Inductor kernels and run logs are code or steer code, so they are read only
from the private cache folder, and only if nobody but the user could have written them:

* The cache folder itself is a real directory owned by the user and not writable by its group or
  by others. Every folder above it (as written and as resolved) is owned by the user or by root
  and not writable by group or others unless sticky (like /tmp); a symlink on the way must belong
  to the user or root. So nobody else can swap any part of the path.
* Everything inside is reached by names the engine made (checked: no '/', no '..'), with lstat or
  O_NOFOLLOW: a symlink, a file or folder owned by someone else, or one that group or others can
  write is refused (never read) with a clear message, and counted (``disk_errors``).

Once a tree passes, only the user (or root) can change it, so checking when a file is opened is
enough: there is no window in which another user could plant something in between.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

_LOOSE = stat.S_IWGRP | stat.S_IWOTH
_NAME = re.compile(r"^[A-Za-z0-9_.+=-]{1,200}$")


class Untrusted(Exception):
    """A path the engine must not read: someone other than the user could have written it."""


def uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):o}"


def check_own(path: str | Path, st: os.stat_result, kind: str = "entry") -> None:
    """``st`` (from lstat) is a plain file or folder of this user that nobody else can write."""
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted(f"{path} is a symlink; the cache never follows links")
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise Untrusted(f"{path} is not a plain file or folder")
    if hasattr(os, "geteuid") and st.st_uid != uid():
        raise Untrusted(f"{path} belongs to uid {st.st_uid}, not to this user (uid {uid()})")
    if st.st_mode & _LOOSE:
        raise Untrusted(f"{path} is writable by its group or by others (mode {_mode(st)}); "
                        f"run chmod go-w on it")


def _check_ancestor(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        if hasattr(os, "geteuid") and st.st_uid not in (0, uid()):
            raise Untrusted(f"{path} is a symlink owned by uid {st.st_uid}")
        return
    if hasattr(os, "geteuid") and st.st_uid not in (0, uid()):
        raise Untrusted(f"{path} (above the cache folder) belongs to uid {st.st_uid}")
    if st.st_mode & _LOOSE and not st.st_mode & stat.S_ISVTX:
        raise Untrusted(f"{path} (above the cache folder) is writable by group or others "
                        f"(mode {_mode(st)})")


def _prefixes(path: str) -> list[str]:
    parts = Path(path).parts
    return [os.path.join(*parts[:i]) for i in range(1, len(parts))]


def _mkdirs_private(path: str) -> None:
    """Create ``path`` and any missing parents 0700 (makedirs gives parents the umask's mode)."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass


def check_root(path: str | Path, create: bool = True) -> Path:
    """The cache folder, resolved, after checking it and every folder above it."""
    lexical = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if create:
        _mkdirs_private(lexical)
    for p in _prefixes(lexical):  # as written: links on the way must be the user's or root's
        _check_ancestor(p, os.lstat(p))
    last = os.lstat(lexical)
    if stat.S_ISLNK(last.st_mode):  # the path itself: another user's link would pick the folder
        _check_ancestor(lexical, last)
    real = os.path.realpath(lexical)
    for p in _prefixes(real):
        _check_ancestor(p, os.lstat(p))
    st = os.lstat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{real} is not a folder")
    check_own(real, st, "folder")
    return Path(real)


def check_name(name: str) -> str:
    """A single path component the engine made: no separators, no '..'."""
    if not _NAME.match(name) or name in (".", ".."):
        raise Untrusted(f"refusing a file name the engine did not make: {name!r}")
    return name


def private_subdir(root: Path, name: str, create: bool = True) -> Path:
    """``root/name`` as a folder of this user nobody else can write (created 0700)."""
    path = root / check_name(name)
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    check_own(path, os.lstat(path), "folder")
    if not path.is_dir():
        raise Untrusted(f"{path} is not a folder")
    return path


def open_private(root: Path, rel: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """Open ``root/rel`` (engine-made components) without following links, checking every
    folder on the way and the file itself; returns a file descriptor."""
    try:
        return _open_private(root, rel, flags, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise Untrusted(f"{root}/{rel} is a symlink; the cache never follows links") from None
        raise


def _open_private(root: Path, rel: str, flags: int, mode: int) -> int:
    parts = rel.split("/")
    for part in parts:
        check_name(part)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow,
                          dir_fd=fd)
            os.close(fd)
            fd = nxt
            check_own(f"{root}/{rel}", os.fstat(fd), "folder")
        out = os.open(parts[-1], flags | nofollow | getattr(os, "O_CLOEXEC", 0), mode,
                      dir_fd=fd)
    finally:
        os.close(fd)
    try:
        check_own(f"{root}/{rel}", os.fstat(out))
    except Untrusted:
        os.close(out)
        raise
    return out


def read_private(root: Path, rel: str, limit: int = 1 << 30) -> bytes:
    fd = open_private(root, rel)
    with os.fdopen(fd, "rb") as f:
        return f.read(limit)


def read_key_file(path: str | Path, min_bytes: int = 32) -> bytes:
    """A secret from a plain file of this user that nobody else can read or write (0600), at
    least ``min_bytes`` long; raise Untrusted saying what is wrong."""
    try:
        fd = os.open(os.path.expanduser(os.fspath(path)),
                     os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        why = "a symlink" if err.errno == errno.ELOOP else err.strerror
        raise Untrusted(f"key file {path}: cannot open it ({why})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"key file {path}: not a plain file")
        if hasattr(os, "geteuid") and st.st_uid != uid():
            raise Untrusted(f"key file {path}: belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & 0o077:
            raise Untrusted(f"key file {path}: others may read or write it (mode {_mode(st)}); "
                            f"run chmod 600 on it")
        secret = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    if len(secret) < min_bytes:
        raise Untrusted(f"key file {path}: holds {len(secret)} bytes; at least {min_bytes} "
                        f"bytes of secret are needed (e.g. head -c 32 /dev/urandom > FILE)")
    return secret


def scan(folder: Path) -> tuple[int, dict[str, tuple[int, float]], dict[str, str]]:
    """Walk ``folder`` without following links.

    Returns the bytes it holds, per top-level child (bytes, newest mtime), and the top-level
    children that hold anything untrusted (child -> why)."""
    total = 0
    children: dict[str, tuple[int, float]] = {}
    bad: dict[str, str] = {}
    try:
        top = list(os.scandir(folder))
    except FileNotFoundError:
        return 0, {}, {}
    for entry in top:
        size, newest = 0, 0.0
        stack = [entry]
        while stack:
            e = stack.pop()
            try:
                st = e.stat(follow_symlinks=False)
                check_own(e.path, st)
            except FileNotFoundError:
                continue
            except Untrusted as err:
                bad.setdefault(entry.name, str(err))
                continue
            size += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
            newest = max(newest, st.st_mtime)
            if stat.S_ISDIR(st.st_mode):
                try:
                    stack.extend(os.scandir(e.path))
                except OSError:
                    continue
        children[entry.name] = (size, newest)
        total += size
    return total, children, bad


def remove_tree(path: Path) -> None:
    """Delete ``path`` (a file, a link or a folder) without following links."""
    import shutil

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # never follows links (avoids_symlink_attacks)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def loose_umask() -> bool:
    """Whether files this process creates come out writable by group or others (umask 000)."""
    try:
        with open("/proc/self/status") as f:  # reading the umask without setting it (threads)
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & _LOOSE != _LOOSE
    except (OSError, ValueError):
        pass
    return False


def tighten(folder: str | Path, since: float) -> None:
    """Take group/other write off this user's entries made since ``since`` (a compile under a
    loose umask), so the next check does not have to refuse, and delete, fresh kernels."""
    stack = [os.fspath(folder)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode) or st.st_uid != uid():
                continue
            if st.st_mode & _LOOSE and st.st_mtime >= since - 1:
                try:
                    os.chmod(e.path, stat.S_IMODE(st.st_mode) & ~_LOOSE)
                except OSError:
                    pass
            if stat.S_ISDIR(st.st_mode):
                stack.append(e.path)

