"""Why a trace missed: the first op where it left the known traces, as a diff, with a source line.

A trace leaves the trie at exactly one op (Note [trie of traces]): the path up to there is the
nearest known trace, and the sibling edges of that node are what was seen at this point before.
Comparing the new op key with the closest sibling names what changed: an op, a dimension, a dtype,
a Python number that shapes the output, or how inputs alias. Runs only on a miss, never per op.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from adaptive_eager.core.meta import METAS_BY_ID
from adaptive_eager.events import RUN_LOG
from adaptive_eager.metrics import METRICS

_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (__import__("torch"), __import__("adaptive_eager")) if m.__file__
)


def user_frame(depth: int = 2) -> str:
    """``file:line (function)`` of the innermost frame outside torch and adaptive_eager."""
    frame = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP_DIRS) and not path.startswith("<frozen"):
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "<unknown>"


# Note [flush causes]
# Every flush ends a trace where the user's code made it end: a ``.item()``, a ``print`` of a
# tensor, an op that cannot be deferred, a data-dependent shape, the optimizer step. Each flush
# is counted under its reason and the first frame outside torch and this package (``user_frame``:
# a frame walk per flush, never per op), with the ops it ran and, when they ran op by op, the
# seconds that took. ``adaptive-eager report`` turns those seconds into time lost with this
# run's measured ratio of fused to op-by-op time, and ranks the lines by it (report.py). The
# table is bounded (FLUSH_SITES_MAX lines; later lines share one row).
FLUSH_SITES_MAX = 256
_OTHER_SITES = "(other lines)"


def note_flush_site(reason: str, n_ops: int, op_by_op: bool, seconds: float) -> None:
    """Count one flush under its reason and the user's source line (Note [flush causes])."""
    sites = METRICS.flush_sites
    key = f"{reason} at {user_frame(3)}"
    row = sites.get(key)
    if row is None:
        if len(sites) >= FLUSH_SITES_MAX:
            key = f"{reason} at {_OTHER_SITES}"
            row = sites.get(key)
        if row is None:
            row = sites[key] = [0, 0, 0, 0.0]
    row[0] += 1
    row[1] += n_ops
    if op_by_op:
        row[2] += n_ops
        row[3] += seconds
    RUN_LOG.timeline.note_flush(seconds, n_ops, op_by_op, METRICS)  # Note [run timeline]


def _meta_text(mid: int) -> str:
    m = METAS_BY_ID[mid]
    return f"{m.dtype} {list(m.size)}"


def _describe(part: Any) -> str:
    if isinstance(part, tuple) and len(part) == 3 and part[0] == "x":
        return f"input tensor {_meta_text(part[1])}"
    if isinstance(part, int) and not isinstance(part, bool):
        return f"output of op slot {part}" if part >= 0 else f"input tensor #{~part}"
    if isinstance(part, type):
        return f"a {part.__name__}"
    return repr(part)


def _diff_part(pos: str, old: Any, new: Any) -> dict:
    """One differing argument, classified."""
    if (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 3
            and old[0] == new[0] == "x"):
        mo, mn = METAS_BY_ID[old[1]], METAS_BY_ID[new[1]]
        if mo.dtype != mn.dtype:
            return {"cause": "dtype", "arg": pos, "old": str(mo.dtype), "new": str(mn.dtype)}
        if len(mo.size) != len(mn.size):
            return {"cause": "rank", "arg": pos, "old": list(mo.size), "new": list(mn.size)}
        for d, (a, b) in enumerate(zip(mo.size, mn.size)):
            if a != b:
                return {"cause": "shape", "arg": pos, "dim": d, "old": a, "new": b,
                        "old_shape": list(mo.size), "new_shape": list(mn.size)}
        if mo.stride != mn.stride or mo.offset != mn.offset:
            return {"cause": "layout", "arg": pos, "old": [mo.stride, mo.offset],
                    "new": [mn.stride, mn.offset]}
        if mo.device != mn.device:
            return {"cause": "device", "arg": pos, "old": str(mo.device), "new": str(mn.device)}
        return {"cause": "alias", "arg": pos, "old": old[2], "new": new[2]}
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) and not (
            len(old) == 2 and isinstance(old[0], type)):
        for k, (a, b) in enumerate(zip(old, new)):
            if a != b or type(a) is not type(b):
                return _diff_part(f"{pos}[{k}]", a, b)
    if isinstance(old, tuple) and len(old) == 2 and isinstance(old[0], type):
        old_v: Any = old[1]
    else:
        old_v = old
    new_v = new[1] if isinstance(new, tuple) and len(new) == 2 and isinstance(new[0], type) else new
    tensorish = (isinstance(old, int) and not isinstance(old, bool)) or (
        isinstance(old, tuple) and old[:1] == ("x",))
    if tensorish:
        return {"cause": "wiring", "arg": pos, "old": _describe(old), "new": _describe(new)}
    return {"cause": "scalar", "arg": pos, "old": repr(old_v), "new": repr(new_v)}


def diff_keys(old: tuple, new: tuple) -> dict:
    """The first difference between two op keys (same op assumed)."""
    if len(old) != len(new):
        return {"cause": "arguments", "old": len(old) - 1, "new": len(new) - 1}
    for j in range(1, len(old)):
        a, b = old[j], new[j]
        if a != b or type(a) is not type(b):
            return _diff_part(f"arg {j - 1}", a, b)
    return {"cause": "unknown"}


def explain_miss(node: Any, key: tuple, where: str) -> dict:
    """What differed at the op where a trace left the trie (node = last shared node).

    Traces are compared with the known ones that went on from the same node; at the start of a
    trace only those recorded from the same source line count (the same call site), so two
    unrelated traces that happen to start with the same op are not reported as one varying.
    """
    siblings = [(k, n) for k, n in node.children.items()
                if node.depth > 0 or n.where is None or n.where == where]
    op = key[0]
    same_op = [k for k, _ in siblings if k[0] == op]
    if same_op:
        best = min(same_op, key=lambda k: _distance(k, key))
        info = diff_keys(best, key)
    elif siblings:
        info = {"cause": "op", "old": sorted({str(k[0]) for k, _ in siblings})[:3],
                "new": str(op)}
    else:
        info = {"cause": "new" if node.depth == 0 else "extended"}
    info["op"] = str(op)
    info["index"] = node.depth
    info["prefix"] = node.digest.hex()[:16]
    info["where"] = where
    return info


def _distance(a: tuple, b: tuple) -> int:
    if len(a) != len(b):
        return 1 << 20
    return sum(1 for x, y in zip(a, b) if x != y or type(x) is not type(y))


def advice(info: dict, where: str) -> str:
    """One line a user can act on."""
    op, cause = info.get("op", "?"), info.get("cause")
    at = f" at {where}" if where else ""
    if cause == "shape":
        return (f"dim {info['dim']} of {info['arg']} of {op} varies {info['old']}..{info['new']}"
                f"{at}: the engine makes such a dim symbolic once it has seen it take three "
                "values (Note [symbolic dims]); if this keeps missing, another dim varies with "
                "it: pad or bucket one of them")
    if cause == "rank":
        return f"rank of {info['arg']} of {op} changed {info['old']} -> {info['new']}{at}"
    if cause == "dtype":
        return (f"dtype of {info['arg']} of {op} changed {info['old']} -> {info['new']}{at}: "
                "cast to one dtype before this op")
    if cause == "scalar":
        return (f"Python value {info['arg']} of {op} changed {info['old']} -> {info['new']}{at}: "
                "it decides output shapes or is an int/size, so it is part of the key; keep it "
                "constant or pass it as a tensor")
    if cause == "layout":
        return f"strides of {info['arg']} of {op} changed{at}: call .contiguous() before it"
    if cause == "alias":
        return f"aliasing of {info['arg']} of {op} changed{at} (a view in one run, not the other)"
    if cause == "wiring":
        return f"{info['arg']} of {op} comes from a different tensor than before{at}"
    if cause == "op":
        return (f"a different op{at}: {op} where earlier runs had {', '.join(info['old'])} "
                "(control flow, or a dtype/device conversion that was a no-op before)")
    if cause == "device":
        return f"device of {info['arg']} of {op} changed{at}"
    if cause == "new":
        return f"first sight of a trace starting with {op}{at}"
    return f"trace continued past a known end with {op}{at}"
