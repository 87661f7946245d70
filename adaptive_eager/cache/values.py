"""Type and range checks of every value the disk cache hands out.

Note [cache values are checked]
A value that verifies (Note [cache values are data, verified first] in disk.py) was signed with
this cache's key, but that proves only who signed it, not that the fields hold what the readers
expect: ``adaptive-eager import`` signs entries another version (or a hand-edited file) wrote,
and a field of the wrong type would otherwise reach the compiler, ``cache ls`` or the symbolic
dims as an AttributeError or TypeError in the user's program. So every header is checked here,
field by field, when the cache layer reads it (``DiskCache._get``) and before an import stores
it: a field that is present must have its type and lie in its range (unknown fields are
allowed and never read). A value that fails is one bad entry: counted (``disk_invalid``, and
``disk_errors`` as every refused entry), skipped as if missing, and deleted; an import holding
one stores nothing. Readers may then use the fields they read without guarding each one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], "str | None"]  # None when the value fits, else what was expected

_HEX = re.compile(r"^[0-9a-f]*$")
_TEXT_MAX = 1 << 16
_LIST_MAX = 1 << 20
_MS_MAX = 1e12  # milliseconds, seconds, timestamps: finite, non-negative, below this
_INT_MAX = 1 << 53


def text(limit: int = _TEXT_MAX) -> Check:
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and len(v) <= limit else f"text of at most {limit} chars"
    return check


def number(hi: float = _MS_MAX) -> Check:
    def check(v: Any) -> str | None:
        ok = type(v) in (int, float) and math.isfinite(v) and 0 <= v <= hi
        return None if ok else f"a number from 0 to {hi:g}"
    return check


def integer(lo: int = 0, hi: int = _INT_MAX) -> Check:
    def check(v: Any) -> str | None:
        return None if type(v) is int and lo <= v <= hi else f"an integer from {lo} to {hi}"
    return check


def flag(v: Any) -> str | None:
    return None if type(v) is bool else "true or false"


def hex_text(v: Any) -> str | None:
    ok = isinstance(v, str) and len(v) <= 512 and len(v) % 2 == 0 and bool(_HEX.match(v))
    return None if ok else "hexadecimal text"


def optional(inner: Check) -> Check:
    def check(v: Any) -> str | None:
        why = None if v is None else inner(v)
        return None if why is None else f"{why} or null"
    return check


def list_of(inner: Check, limit: int = _LIST_MAX) -> Check:
    def check(v: Any) -> str | None:
        if not isinstance(v, list) or len(v) > limit:
            return f"a list of at most {limit} items"
        for i, item in enumerate(v):
            why = inner(item)
            if why is not None:
                return f"a list whose item {i} is {why}"
        return None
    return check


def fields(spec: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    """A JSON object whose listed fields, where present, pass their checks."""
    def check(v: Any) -> str | None:
        if not isinstance(v, dict):
            return "an object"
        for name in required:
            if name not in v:
                return f"an object with field {name!r}"
        for name, inner in spec.items():
            if name in v:
                why = inner(v[name])
                if why is not None:
                    return f"an object whose {name!r} is {why}"
        return None
    return check


def anything(v: Any) -> str | None:
    return None


_MS = number()
_SAMPLE = fields({"fused_ms": _MS, "replay_ms": _MS, "at": _MS})
_FAILURE = fields({"stage": text(200), "error": text(), "transient": flag, "at": _MS,
                   "count": integer(1)})
# Checked sizes: an object whose items its one reader checks itself, ignoring (and counting)
# sizes that are not sizes while the rest of the statistics stay in use (Note [verified sizes]).
_SIZES = fields({})

PROGRAM: dict[str, Check] = {
    "format": integer(), "torch": text(200), "backend": text(200), "size": integer(),
    "info": fields({"n_ops": optional(integer()), "compile_s": optional(_MS),
                    "remote": text(4096), "by": text(200)}),
    "written": _MS,
}
PROGRAM_REQUIRED = ("format", "torch", "backend", "size")

TRACE_STATS: dict[str, Check] = {  # Programs.save_stats writes these (compile/programs.py)
    "torch": text(200), "hot": flag, "decision": text(), "varying": list_of(integer(0, 1 << 31)),
    "replay_ms": optional(_MS), "fused_ms": optional(_MS), "compile_s": optional(_MS),
    "n_ops": integer(), "runs": integer(), "error": optional(text()), "in_process": flag,
    "failure": optional(_FAILURE), "samples": list_of(_SAMPLE, 1000),
    "program_key": optional(text(200)), "sym_sizes": optional(_SIZES), "script": text(4096),
    "used_at": _MS,
}

SYMBOLIC: dict[str, Check] = {  # shapes.py: a learnt symbolic trace, or a dead mark
    "dead": text(), "anchor": hex_text, "digest": text(200), "dims": text(),
    "seen": list_of(integer()), "where": list_of(optional(text())),
    "steps": list_of(list_of(anything, 2)),
}

QUARANTINE: dict[str, Check] = {"reason": text(), "when": _MS}

SYMBOLIC_PREFIX = "symdims-"  # shapes_store.PREFIX: stats entries of symbolic traces


def problem(key: str, header: Any, payload_size: int | None = None) -> str | None:
    """What is wrong with the entry ``key`` (None: nothing). ``payload_size`` is the length of
    a program's artifact when it was read (its header must state it)."""
    kind, _, name = key.partition(":")
    if kind == "program":
        why = fields(PROGRAM, PROGRAM_REQUIRED)(header)
        if why is None and payload_size is not None and header["size"] != payload_size:
            why = f"an object whose 'size' is {payload_size} (the artifact's length)"
    elif kind == "stats":
        symbolic = name.startswith(SYMBOLIC_PREFIX)
        why = fields(SYMBOLIC if symbolic else TRACE_STATS)(header)
    elif kind == "quarantine":
        why = fields(QUARANTINE)(header)
    else:
        return f"unknown kind of entry {kind!r}"
    return None if why is None else f"expected {why}"
