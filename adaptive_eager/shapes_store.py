"""Stored symbolic templates: a template's steps as JSON data and back (Note [symbolic dims] in
shapes.py, Persistence). Keys and outputs become tagged values (op names, dtypes, sizes and the
fitted polynomials' coefficients: nothing executable); decoding interns their metadata again.

Below the import circle: this module imports only core/meta.py, sizefit.py and
shapes_keys.py of the package. Decoding an op's name needs ``spec_for`` (dispatch/opspec.py, in
the circle): the caller passes it in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adaptive_eager.core.meta import METAS_BY_ID, Meta, intern_meta
from adaptive_eager.shapes_keys import OutPat
from adaptive_eager.sizefit import ExtPat, Poly


PREFIX = "symdims-"


def disk_name(anchor: bytes, digest: str) -> str:
    return f"{PREFIX}{anchor.hex()}-{digest[:32]}"


def encode_steps(steps: list[tuple]) -> list[list]:
    """A template's steps (key, sym?, out, sym out?) as JSON data; NotStorable where a key part
    or an output has no stored form."""
    return [[_enc(k), _enc_out(o)] for k, _, o, _ in steps]


def decode_steps(data: list, spec_for: Callable[[Any], Any]) -> list[tuple]:
    """Stored steps as a template's (key, sym?, out, sym out?); ``spec_for`` makes an op's spec
    from the op. Raises on data of another format (or a torch without that op)."""
    steps = []
    for k, o in data:
        key = _dec(k, spec_for)
        out = _dec_out(o, spec_for)
        steps.append((key, _has_poly(key), out, _has_poly_out(out)))
    return steps


class NotStorable(Exception):
    """A key part or an output with no stored form: the template stays in memory only."""


def _enc(p: Any) -> Any:
    t = type(p)
    if t is bool:
        return {"b": p}
    if t is int:
        return p
    if t is float:
        return {"f": repr(p)}
    if t is str:
        return {"s": p}
    if p is None:
        return None
    if t is Poly:
        return {"P": [p.c0, p.c1, p.c2, p.d]}
    if t is tuple:
        if len(p) == 3 and p[0] == "x" and type(p[1]) is int:
            m = METAS_BY_ID[p[1]]
            return {"x": [list(m.size), list(m.stride), str(m.dtype), str(m.device), m.bits],
                    "g": p[2]}
        if len(p) == 3 and p[0] == "x" and type(p[1]) is ExtPat:
            e = p[1]
            return {"X": [[_enc(v) for v in e.size], [_enc(v) for v in e.stride], str(e.dtype),
                          str(e.device), e.bits], "g": p[2]}
        return {"T": [_enc(x) for x in p]}
    if t in (type,) and p in (int, float, bool, complex):
        return {"t": p.__name__}
    if isinstance(p, torch.dtype):
        return {"dt": str(p)}
    if isinstance(p, torch.device):
        return {"dev": str(p)}
    if isinstance(p, (torch.memory_format, torch.layout)):
        return {"mf" if isinstance(p, torch.memory_format) else "ly": str(p)}
    name = getattr(p, "name", None)
    if hasattr(p, "op") and hasattr(p, "policy") and isinstance(name, str):
        return {"op": name}
    raise NotStorable(f"key part of type {t.__name__}")


def _enc_out(o: Any) -> Any:
    t = type(o)
    if t is Meta:
        return {"M": [list(o.size), list(o.stride), o.offset, str(o.dtype), str(o.device),
                      o.bits]}
    if t is OutPat:
        return {"O": [[_enc(v) for v in o.size], [_enc(v) for v in o.stride], _enc(o.offset),
                      str(o.dtype), str(o.device), o.bits]}
    if t is tuple or t is list:
        return {"T" if t is tuple else "L": [_enc_out(x) for x in o]}
    if o is None or t is int:
        return o
    raise NotStorable(f"output of type {t.__name__}")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.split(".", 1)[1])
    if not isinstance(dt, torch.dtype):
        raise ValueError(name)
    return dt


def _dec(p: Any, spec_for: Callable[[Any], Any]) -> Any:
    if p is None or type(p) is int:
        return p
    if type(p) is not dict or len(p) not in (1, 2):
        raise ValueError("bad key part")
    tag = next(k for k in p if k != "g")
    v = p[tag]
    if tag == "b":
        return bool(v)
    if tag == "f":
        return float(v)
    if tag == "s":
        return str(v)
    if tag == "P":
        return Poly(*(int(x) for x in v))
    if tag == "x":
        size, stride, dt, dev, bits = v
        m = intern_meta(tuple(int(x) for x in size), tuple(int(x) for x in stride), 0,
                        _dtype(dt), torch.device(dev), int(bits))
        return ("x", m.mid, int(p["g"]))
    if tag == "X":
        size, stride, dt, dev, bits = v
        return ("x", ExtPat(tuple(_dec(x, spec_for) for x in size),
                            tuple(_dec(x, spec_for) for x in stride),
                            _dtype(dt), torch.device(dev), int(bits)), int(p["g"]))
    if tag == "T":
        return tuple(_dec(x, spec_for) for x in v)
    if tag == "t":
        return {"int": int, "float": float, "bool": bool, "complex": complex}[v]
    if tag == "dt":
        return _dtype(v)
    if tag == "dev":
        return torch.device(v)
    if tag == "mf" or tag == "ly":  # memory format, layout: torch.<name>
        return getattr(torch, v.split(".", 1)[1])
    if tag == "op":
        ns, name, overload = v.split(".")
        return spec_for(getattr(getattr(getattr(torch.ops, ns), name), overload))
    raise ValueError(f"bad key tag {tag}")


def _dec_out(o: Any, spec_for: Callable[[Any], Any]) -> Any:
    if o is None or type(o) is int:
        return o
    (tag, v), = o.items()
    if tag == "M":
        size, stride, off, dt, dev, bits = v
        return intern_meta(tuple(size), tuple(stride), int(off), _dtype(dt), torch.device(dev),
                           int(bits))
    if tag == "O":
        size, stride, off, dt, dev, bits = v
        return OutPat(tuple(_dec(x, spec_for) for x in size),
                      tuple(_dec(x, spec_for) for x in stride), _dec(off, spec_for),
                      _dtype(dt), torch.device(dev), int(bits))
    if tag in ("T", "L"):
        got = [_dec_out(x, spec_for) for x in v]
        return tuple(got) if tag == "T" else got
    raise ValueError(f"bad output tag {tag}")


def _has_poly(p: Any) -> bool:
    t = type(p)
    if t is Poly or t is ExtPat:
        return True
    return t is tuple and any(_has_poly(x) for x in p)


def _has_poly_out(o: Any) -> bool:
    t = type(o)
    if t is OutPat:
        return True
    return (t is tuple or t is list) and any(_has_poly_out(x) for x in o)
