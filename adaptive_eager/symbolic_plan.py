"""Symbolic programs: how a template trace's graph computes its sizes from ``s``
(Note [symbolic programs]). The template's steps and the trace's ops are lined up (every int
that follows ``s`` checked against its polynomial at this run's ``s``), ``s`` is read off an
input's size, and the ints become graph nodes of SymInt arithmetic. graph.py's ``build`` calls
this for a template's entry.

Below the import circle: this module imports only sizefit.py of the package. What it needs from
above comes in as arguments (the trace, the op specs' ``spec_for``), and ``Unfusable``, the
graph builder's refusal, is defined here so that both raise the same one.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx as fx

from adaptive_eager.sizefit import ExtPat, Poly, arg_kinds

aten = torch.ops.aten


class Unfusable(Exception):
    """The trace cannot become a fused program (it stays op by op): raised by graph.py's builder
    and by the plan here."""


class _Trace(Protocol):
    """What the plan reads of trace.Trace (not imported here: it is in the import circle)."""

    ops: list[tuple]
    ext_ids: dict[int, int]


# Note [symbolic programs]
# A template's entry (Note [symbolic dims] in shapes.py) serves every value of s with one trace
# of concrete ops. Its graph computes every int argument the template fitted as a polynomial in
# s from s itself, and s from ``aten.sym_size.int`` of the first input whose template dim is
# k*s; the backend compiles it with those input dims dynamic (one program, every size). The
# template's keys and the trace's arguments are walked in the same order, and every value is
# checked against the polynomial at this run's s: a disagreement (the walks do not line up) is
# Unfusable, never a guess. Inputs that follow s and share storage enter as separate inputs
# when no op writes them (the same ids as input_ids and labels), else the trace is refused (a
# synthetic base bakes in storage sizes and offsets); static groups (tied weights) keep their
# base. An input whose strides follow s where its sizes do not is refused, unless those dims
# have size 1 (no address moves: generate's ``attention_mask[:, -1:]``). Sizes 0 and 1 never
# reach a template (shapes.py guards them). The graph travels to the compile helper like any
# (its ``dynamic`` field with it), and a later process loads the program from the disk cache
# (the template's entry has the same digest there; its graph is built from the template at
# that process's first s). The backend refuses a program whose dynamic size became a constant
# (Note [specializing kernels] in backends/inductor.py). The compiler runs the first fused
# run at each new size on copies next to op-by-op replay and returns replay's values
# (compile/sizes.py, _CheckedSize) until SYM_CHECKED_SIZES sizes agreed (in this process or, stored
# with the program, in an earlier one: Note [verified sizes] in compile/sizes.py); after that a new
# size runs the program directly, as a static program does, if the program's own shape guards
# hold at it (kept with the artifact as data: Note [program shape guards] in
# backends/inductor.py), and op by op if they fail (Note [trusting a size] in compile/sizes.py). A
# size whose program raised or differed stays op by op, two such sizes quarantine the trace.
class _PolyArg:
    """An int argument that follows s, until the graph computes it."""

    __slots__ = ("p",)

    def __init__(self, p: Any) -> None:
        self.p = p


def _key_ints(part: Any, tensor: bool, out: list) -> None:
    """The fitted int arguments of a template key part, in order (shapes_keys._walk's order)."""
    t = type(part)
    if t is int or t is Poly:
        if not tensor:
            out.append(part)
    elif t is tuple:
        if len(part) == 3 and part[0] == "x":
            return
        if len(part) == 2 and part[0] is int:
            out.append(part[1])
        elif len(part) == 2 and isinstance(part[0], type):
            return
        else:
            for x in part:
                _key_ints(x, True, out)


def _step_ints(key: tuple) -> list:
    spec = key[0]
    pos, kw = arg_kinds(spec)
    out: list = []
    i, p, n = 1, 0, len(key)
    while i < n:
        part = key[i]
        if type(part) is str and part in kw and i + 1 < n:
            _key_ints(key[i + 1], kw[part], out)
            i += 2
            continue
        _key_ints(part, p < len(pos) and pos[p], out)
        p += 1
        i += 1
    return out


def _arg_int_sites(a: Any, scalar: bool, spec: Any, out: list) -> None:
    """The int arguments of one recorded argument that a key holds as values, in key order."""
    t = type(a)
    if t is int:
        if spec.structural or not scalar:
            out.append(a)
    elif t is list or t is tuple:
        for x in a:
            if type(x) is int:
                out.append(x)


def _ext_parts(part: Any, out: list) -> None:
    if type(part) is tuple:
        if len(part) == 3 and part[0] == "x":
            out.append(part[1])
            return
        for x in part:
            _ext_parts(x, out)


def arg_exts(a: Any, out: list) -> None:
    if isinstance(a, torch.Tensor):
        out.append(a)
    elif type(a) is list or type(a) is tuple:
        for x in a:
            arg_exts(x, out)


def symbolic_plan(trace: _Trace, st: Any, reals: list[torch.Tensor],
                  spec_for: Callable[[Any], Any]
                  ) -> tuple[dict[int, list[Any]], dict[int, tuple[int, ...]], list]:
    """Per op: its int arguments' polynomials (None where static); per external: its dims
    that follow s. Raises Unfusable where the template and the trace do not line up.
    ``spec_for``: dispatch/opspec.py's, the op's spec."""
    tpl, s, first = st.tpl, st.s, st.first
    if tpl is None or s < 2 or first + len(tpl.steps) != len(trace.ops):
        raise Unfusable("the trace is not its template's whole path")
    seen: set[int] = set()
    for op, args, kwargs, _ in trace.ops[:first]:
        exts: list = []
        for a in (*args, *kwargs.values()):
            arg_exts(a, exts)
        seen.update(trace.ext_ids[id(t)] for t in exts)
    sym_args: dict[int, list[Any]] = {}
    dims: dict[int, tuple[int, ...]] = {}
    sources: list[tuple[int, int, Any]] = []  # (external, dim, its polynomial)
    for j, (key, ksym, _out, _osym) in enumerate(tpl.steps):
        n_op = first + j
        op, args, kwargs, _ = trace.ops[n_op]
        spec = spec_for(op)
        exts = []
        for a in (*args, *kwargs.values()):
            arg_exts(a, exts)
        new = []
        for t in exts:
            e = trace.ext_ids[id(t)]
            if e not in seen:
                seen.add(e)
                new.append(e)
        pats: list = []
        for part in key[1:]:
            _ext_parts(part, pats)
        if len(pats) != len(new):
            raise Unfusable("template inputs and trace inputs do not line up")
        for e, pat in zip(new, pats):
            r = reals[e]
            if type(pat) is not ExtPat:
                continue
            size = [p(s) if type(p) is Poly else p for p in pat.size]
            stride = [p(s) if type(p) is Poly else p for p in pat.stride]
            if tuple(size) != tuple(r.shape) or tuple(stride) != r.stride():
                raise Unfusable("an input's metadata is not its template's at this size")
            dyn = tuple(d for d, p in enumerate(pat.size) if type(p) is Poly)
            # a stride that follows s only where the size is 1 never moves an address (the
            # program's input checks skip it too): generate's `attention_mask[:, -1:]`
            if not dyn and any(type(p) is Poly and size[d] != 1
                               for d, p in enumerate(pat.stride)):
                raise Unfusable("an input's strides follow s but none of its sizes")
            if dyn:
                dims[e] = dyn
                sources.extend((e, d, pat.size[d]) for d in dyn)
        if not ksym:
            continue
        want = _step_ints(key)
        have: list[int] = []
        for i, a in enumerate(args):
            _arg_int_sites(a, i in spec.scalar_pos, spec, have)
        for k, v in kwargs.items():
            _arg_int_sites(v, k in spec.scalar_kw, spec, have)
        if len(want) != len(have) or any(
                (p(s) if type(p) is Poly else p) != v for p, v in zip(want, have)):
            raise Unfusable(f"{op}: template ints and trace ints do not line up")
        if any(type(p) is Poly for p in want):
            sym_args[n_op] = [p if type(p) is Poly else None for p in want]
    if not dims:
        raise Unfusable("no input size follows s")
    sources.sort(key=lambda x: x[0])
    return sym_args, dims, sources


def symbol_node(g: fx.Graph, ext_nodes: list, sources: list[tuple[int, int, Any]]
                 ) -> Any:
    """s from an input's size (the first one that is k*s), and a maker of nodes computing a
    polynomial of s (SymInt arithmetic: the compiler sees sizes, not constants)."""
    src = next(((e, d, p) for e, d, p in sources if p.c0 == 0 and p.c2 == 0 and p.d == 1), None)
    if src is None:
        raise Unfusable("no input size is a multiple of s")
    e, d, p = src
    sym = g.call_function(aten.sym_size.int, (ext_nodes[e], d))
    if p.c1 != 1:
        sym = g.call_function(operator.floordiv, (sym, p.c1))
    made: dict[Any, Any] = {}

    def node_of(q: Any) -> Any:
        got = made.get(q)
        if got is None:
            v: Any = sym
            if q.c2:
                v = g.call_function(operator.mul, (g.call_function(operator.mul, (sym, sym)),
                                                   q.c2))
                if q.c1:
                    v = g.call_function(operator.add, (v, g.call_function(
                        operator.mul, (sym, q.c1))))
            elif q.c1 != 1:
                v = g.call_function(operator.mul, (sym, q.c1))
            if q.c1 == 0 and q.c2 == 0:
                raise Unfusable("a constant fitted as a polynomial")
            if q.c0:
                v = g.call_function(operator.add, (v, q.c0))
            if q.d != 1:
                v = g.call_function(operator.floordiv, (v, q.d))
            got = made[q] = v
        return got

    return node_of


def mark_ints(args: tuple, kwargs: dict, spec: Any, polys: Any) -> tuple[tuple, dict]:
    """Ints that follow s replaced by _PolyArg markers, in _arg_int_sites' order."""
    def item(x: Any) -> Any:
        if type(x) is not int:
            return x
        p = next(polys)
        return x if p is None else _PolyArg(p)

    def mark(a: Any, scalar: bool) -> Any:
        t = type(a)
        if t is int:
            return item(a) if (spec.structural or not scalar) else a
        if t is list or t is tuple:
            return t(item(x) for x in a)
        return a

    return (tuple(mark(a, i in spec.scalar_pos) for i, a in enumerate(args)),
            {k: mark(v, k in spec.scalar_kw) for k, v in kwargs.items()})


def unmark(a: Any, node_of: Any) -> Any:
    t = type(a)
    if t is _PolyArg:
        return node_of(a.p)
    if t is list or t is tuple:
        return t(unmark(x, node_of) for x in a)
    return a
