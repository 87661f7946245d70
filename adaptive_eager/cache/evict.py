"""Eviction under the cache's size limit: the kernel folder as units eviction removes on their
own, and the choice of which programs and units go (Note [cache size] in disk.py, Note [program
entries] in kernel_refs.py, Note [kernel pins] in pins.py). No SQL and no torch here: the disk
cache reads the rows, this module decides, the disk cache deletes.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from adaptive_eager.cache import kernel_refs, pins, trust


@dataclass(slots=True)
class Unit:
    """What eviction removes at once: the files of one Inductor key (``2w/c2wh...``), one entry
    of another folder (``aotautograd/<entry>``), a top-level file, or a pinned folder whole."""

    name: str  # relative to the kernel folder
    key: str | None  # the Inductor key of a key's files
    paths: list[str] = field(default_factory=list)  # relative, removed without following links
    size: int = 0
    mtime: float = 0.0


@dataclass(slots=True)
class Folder:
    """The kernel folder as last scanned."""

    units: dict[str, Unit] = field(default_factory=dict)
    dirs: dict[str, tuple[int, float]] = field(default_factory=dict)  # top-level folders:
    # their own bytes and mtime
    bad: dict[str, str] = field(default_factory=dict)  # top-level child -> what is untrusted

    def size(self) -> int:
        return sum(u.size for u in self.units.values()) + sum(s for s, _ in self.dirs.values())


def _bytes(st: os.stat_result) -> int:
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


def _tree(path: str) -> tuple[int, float]:
    """(bytes, newest mtime) of ``path`` and all below it, without following links; raises
    Untrusted for anything below that fails the trust rule."""
    size, newest = 0, 0.0
    stack = [path]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        trust.check_own(p, st)
        size += _bytes(st)
        newest = max(newest, st.st_mtime)
        if stat.S_ISDIR(st.st_mode):
            try:
                stack.extend(os.path.join(p, n) for n in os.listdir(p))
            except OSError:
                continue
    return size, newest


def _unit_of(top: str, name: str) -> tuple[str, str | None]:
    """The unit ``top/name`` belongs to: a key's files in Inductor's ``key[1:3]`` folders."""
    if len(top) == 2:
        stem = name.split(".", 1)[0]
        if kernel_refs.is_key(stem) and stem[1:3] == top:
            return f"{top}/{stem}", stem
    return f"{top}/{name}", None


def scan(kernels: Path) -> Folder:
    """Walk the kernel folder (one pass, no links followed) into units; a top-level child that
    holds anything failing the trust rule is reported in ``bad`` instead."""
    folder = Folder()
    try:
        top = list(os.scandir(kernels))
    except OSError:
        return folder
    for entry in top:
        try:
            _scan_top(folder, entry)
        except trust.Untrusted as err:
            folder.bad[entry.name] = str(err)
            folder.dirs.pop(entry.name, None)
            for name in [n for n in folder.units if n.split("/", 1)[0] == entry.name]:
                del folder.units[name]
    return folder


def _scan_top(folder: Folder, entry: os.DirEntry) -> None:
    try:
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return
    trust.check_own(entry.path, st)
    if not stat.S_ISDIR(st.st_mode) or entry.name in pins.PINNED_NAMES:
        size, newest = _tree(entry.path)
        folder.units[entry.name] = Unit(entry.name, None, [entry.name], size, newest)
        return
    folder.dirs[entry.name] = (_bytes(st), st.st_mtime)
    try:
        names = os.listdir(entry.path)
    except OSError:
        return
    for name in names:
        size, newest = _tree(os.path.join(entry.path, name))
        unit_name, key = _unit_of(entry.name, name)
        unit = folder.units.get(unit_name)
        if unit is None:
            unit = folder.units[unit_name] = Unit(unit_name, key)
        unit.paths.append(f"{entry.name}/{name}")
        unit.size += size
        unit.mtime = max(unit.mtime, newest)


@dataclass(slots=True)
class Plan:
    """What one eviction removes, and how many bytes that frees."""

    programs: list[str] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    freed: int = 0


def choose(programs: Iterable[tuple[str, int, float]], refs: dict[str, set[str]],
           units: dict[str, Unit], protected: Callable[[Unit], bool], over: int) -> Plan:
    """Least recently used first until ``over`` bytes are freed: whole program entries
    (``programs``: key, bytes, last use; ``refs``: the kernel keys each names), each with the
    units of the keys no other stored program names, and orphan units (keys no stored program
    names, other entries) by age. Nothing ``protected`` is removed; a program whose own kernels
    are protected stays whole (Note [program entries])."""
    programs = list(programs)
    by_key = {u.key: u for u in units.values() if u.key is not None}
    users: Counter[str] = Counter()
    for key, _, _ in programs:
        users.update(refs.get(key, ()))
    queue: list[tuple[float, int, str, int]] = [(used, 0, key, size)
                                                for key, size, used in programs]
    queue += [(u.mtime, 1, u.name, u.size) for u in units.values()
              if (u.key is None or not users[u.key]) and not protected(u)]
    queue.sort()
    plan = Plan()
    for _, kind, name, size in queue:
        if plan.freed >= over:
            break
        if kind == 1:
            plan.units.append(units[name])
            plan.freed += size
            continue
        keys = refs.get(name, set())
        last = [by_key[k] for k in keys if users[k] == 1 and k in by_key]
        if any(protected(u) for u in last):
            continue  # a compile in flight may rely on them: the whole entry stays
        users.subtract(keys)
        plan.programs.append(name)
        plan.units += last
        plan.freed += size + sum(u.size for u in last)
    return plan


def remove(kernels: Path, unit: Unit) -> None:
    """Delete a unit's files (names checked: only what the scan found inside ``kernels``)."""
    for rel in unit.paths:
        parts = [trust.check_name(p) for p in rel.split("/")]
        trust.remove_tree(kernels.joinpath(*parts))


def remove_empty_dirs(kernels: Path, folder: Folder, since: float | None) -> None:
    """Drop top-level folders left empty, but none a compile in flight wrote into (changed at
    or after ``since``, as scanned)."""
    left = {n.split("/", 1)[0] for n in folder.units}
    for name in [d for d, (_, t) in folder.dirs.items()
                 if d not in left and (since is None or t < since)]:
        try:
            os.rmdir(kernels / trust.check_name(name))
        except OSError:
            continue
        del folder.dirs[name]
