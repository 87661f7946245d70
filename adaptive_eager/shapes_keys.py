"""Key walking for symbolic dims (Note [symbolic dims] in shapes.py): which ints of a trace key,
a metadata key or an output may be fitted, the output patterns a fit makes of them (``OutPat``;
``ExtPat`` and ``Poly`` are sizefit.py's), and matching and evaluating those patterns at a value
of ``s``.

Below the import circle: this module imports only core/meta.py and sizefit.py of the package,
so shapes.py and shapes_store.py use it at their top.
"""

from __future__ import annotations

from typing import Any

import torch

from adaptive_eager.core.meta import METAS_BY_ID, Meta, intern_meta
from adaptive_eager.sizefit import ExtPat, Poly, arg_kinds, leaf_match

MISSING = object()  # no value at this s (a pattern or a guard gives none); not a key


class _Hole:
    __slots__ = ()

    def __repr__(self) -> str:
        return "?"


HOLE = _Hole()


# ---- key walking: which ints of a key or an output may be fitted --------------------------
def walk_key(key: tuple, emit: Any) -> tuple:
    """The key with every fittable int replaced by ``emit(value)``; externals by ExtPat."""
    spec = key[0]
    pos, kw = arg_kinds(spec)
    out: list[Any] = [spec]
    i, p, n = 1, 0, len(key)
    while i < n:
        part = key[i]
        if type(part) is str and part in kw and i + 1 < n:
            out.append(part)
            out.append(_walk(key[i + 1], kw[part], emit))
            i += 2
            continue
        out.append(_walk(part, p < len(pos) and pos[p], emit))
        p += 1
        i += 1
    return tuple(out)


def _walk(part: Any, tensor: bool, emit: Any) -> Any:
    t = type(part)
    if t is int:
        return part if tensor else emit(part)  # a slot or external reference, or an int
    if t is tuple:
        if len(part) == 3 and part[0] == "x" and type(part[1]) is int:
            m = METAS_BY_ID[part[1]]
            pat = ExtPat(tuple(emit(v) for v in m.size), tuple(emit(v) for v in m.stride),
                         m.dtype, m.device, m.bits)
            return ("x", pat, part[2])
        if len(part) == 2 and part[0] is int:
            return (int, emit(part[1]))
        if len(part) == 2 and isinstance(part[0], type):
            return part  # (float, v), (bool, v): structural constants
        return tuple(_walk(x, True, emit) for x in part)  # lists: bare ints are slots
    return part


def walk_out(out: Any, emit: Any) -> Any:
    t = type(out)
    if t is Meta:
        return OutPat(tuple(emit(v) for v in out.size), tuple(emit(v) for v in out.stride),
                      emit(out.offset), out.dtype, out.device, out.bits)
    if t is tuple or t is list:
        return t(walk_out(o, emit) for o in out)
    return out  # an int (in-place op returns its argument) or None


def out_skel(out: Any) -> Any:
    t = type(out)
    if t is OutPat:
        return ("M", len(out.size), out.dtype, out.device, out.bits)
    if t is tuple or t is list:
        return (t, tuple(out_skel(o) for o in out))
    return out


def key_skel(k: Any) -> Any:
    t = type(k)
    if t is ExtPat:
        return ("X", len(k.size), k.dtype, k.device, k.bits)
    if t is tuple:
        return tuple(key_skel(x) for x in k)
    return k


def canon_key(key: tuple) -> tuple:
    """Externals whose metadata did not vary go back to their plain ('x', meta id, g) form."""
    return tuple(_canon(p) for p in key)


def _canon(p: Any) -> Any:
    if type(p) is tuple:
        if len(p) == 3 and p[0] == "x" and type(p[1]) is ExtPat:
            pat = p[1]
            if not any(type(v) is Poly for v in (*pat.size, *pat.stride)):
                return ("x", intern_meta(pat.size, pat.stride, 0, pat.dtype, pat.device,
                                         pat.bits).mid, p[2])
            return p
        return tuple(_canon(x) for x in p)
    return p


def walk_mkey(key: tuple, emit: Any) -> tuple:
    """A metadata key (op, input metadata, int arguments) with every fittable int replaced by
    ``emit(value)`` (Note [symbolic dims], single ops)."""
    return (key[0], key[1], _mw(key[2], emit), _mw(key[3], emit), *key[4:])


def _mw(part: Any, emit: Any) -> Any:
    t = type(part)
    if t is int:  # a metadata id
        m = METAS_BY_ID[part]
        return ("m", tuple(emit(v) for v in m.size), tuple(emit(v) for v in m.stride),
                emit(m.offset), m.dtype, m.device, m.bits)
    if t is tuple:
        if len(part) == 2 and part[0] is int:
            return (int, emit(part[1]))
        if len(part) == 2 and isinstance(part[0], type):
            return part
        return tuple(_mw(x, emit) for x in part)
    return part


def storable_out(out: Any) -> bool:
    """Whether an op's outputs are metadata a family can learn (Meta, int, None, sequences)."""
    t = type(out)
    if t is Meta or out is None or t is int:
        return True
    return (t is tuple or t is list) and all(storable_out(o) for o in out)


# ---- patterns at a value of s -------------------------------------------------------------
class OutPat:
    """An output's metadata with fitted sizes, strides and offset."""

    __slots__ = ("size", "stride", "offset", "dtype", "device", "bits", "memo")

    def __init__(self, size: tuple, stride: tuple, offset: Any, dtype: torch.dtype,
                 device: torch.device, bits: int) -> None:
        self.size, self.stride, self.offset = size, stride, offset
        self.dtype, self.device, self.bits = dtype, device, bits
        self.memo: dict[int, Meta | None] = {}  # s -> metadata (sizes recur)

    def eval(self, s: int) -> Meta | None:
        got = self.memo.get(s, MISSING)
        if got is MISSING:
            got = self._eval(s)
            if len(self.memo) < 4096:
                self.memo[s] = got
        return got  # type: ignore[return-value]

    def _eval(self, s: int) -> Meta | None:
        size = _eval_all(self.size, s)
        stride = _eval_all(self.stride, s)
        off = self.offset(s) if type(self.offset) is Poly else self.offset
        if size is None or stride is None or off is None or off < 0 or min(size, default=0) < 0:
            return None
        return intern_meta(size, stride, off, self.dtype, self.device, self.bits)


def _eval_all(parts: tuple, s: int) -> tuple | None:
    out = []
    for p in parts:
        if type(p) is Poly:
            p = p(s)
            if p is None:
                return None
        out.append(p)
    return tuple(out)


def eval_out(out: Any, s: int) -> Any:
    t = type(out)
    if t is OutPat:
        m = out.eval(s)
        return MISSING if m is None else m
    if t is tuple or t is list:
        got = [eval_out(o, s) for o in out]
        return MISSING if any(g is MISSING for g in got) else t(got)
    return out


def instantiate(t: Any, s: int) -> Any:
    """A key pattern with s put in: the concrete key part it matches, or MISSING."""
    tt = type(t)
    if tt is Poly:
        v = t(s)
        return MISSING if v is None else v
    if tt is tuple:
        parts = []
        for x in t:
            x = instantiate(x, s)
            if x is MISSING:
                return MISSING
            parts.append(x)
        return tuple(parts)
    if tt is ExtPat:
        size = _eval_all(t.size, s)
        stride = _eval_all(t.stride, s)
        if size is None or stride is None or min(size, default=0) < 0:
            return MISSING
        return intern_meta(size, stride, 0, t.dtype, t.device, t.bits).mid
    return t


def match_part(t: Any, c: Any, st: list) -> bool:
    """Whether a concrete key part ``c`` fits a template part ``t`` (binding s on first use)."""
    tt = type(t)
    if tt is Poly:
        return leaf_match(t, c, st)
    if tt is ExtPat:
        if type(c) is not int or not 0 <= c < len(METAS_BY_ID):
            return False
        return t.match(METAS_BY_ID[c], st)
    if tt is tuple:
        if type(c) is not tuple or len(c) != len(t):
            return False
        for a, b in zip(t, c):
            if a is not b and not match_part(a, b, st):
                return False
        return True
    return tt is type(c) and t == c
