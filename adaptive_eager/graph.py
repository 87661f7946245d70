"""A trace as an FX graph of aten ops: what a compiler backend receives.

Note [trace graph]
Placeholders are the trace's external tensors, in first-use order, then the Python numbers that
vary between runs of the trace (``lifted``: each a 0-d float64/int64 tensor turned back into a
SymFloat/SymInt with ``aten.item`` inside the graph, so promotion follows Python-scalar rules and
a new learning rate is not a recompile). Numbers that stayed the same in every run seen so far are
baked in as constants; the program is only used while they still hold (``baked``). Ops are copied
literally, in-place ops and views included: the compiler's functionalization (AOTAutograd inside
Inductor) turns them into a functional program whose input mutations are applied in place, and
whose outputs that alias inputs come back as real views of those inputs. Outputs are the live
slots: lazy tensors the user (or autograd) still holds when the trace is flushed; dead
intermediates are the ones fusion removes.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

try:  # Note [graph code on demand]
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # a torch without it: the code is generated at once, as before
    _GraphModule = fx.GraphModule

from adaptive_eager.dispatch import ambient
from adaptive_eager.dispatch.lazy import LazyTensor
from adaptive_eager.symbolic_plan import (Unfusable, arg_exts, mark_ints, symbol_node,
                                          symbolic_plan, unmark)
from adaptive_eager.trace import Slot, Trace

aten = torch.ops.aten

# Scalar overloads whose decomposition branches on the scalar's value: a lifted (unbacked) scalar
# cannot be guarded on, so these take the Tensor overload with a 0-d weight instead.
_LERP_TENSOR = {aten.lerp_.Scalar: aten.lerp_.Tensor, aten.lerp.Scalar: aten.lerp.Tensor}

# Note [clamp of lifted numbers]
# Inductor decomposes ``clamp`` under a promotion wrapper that counts only Python numbers
# (``int``/``float``/``bool``) as arguments, not the SymFloat/SymInt a lifted number becomes:
# ``clamp(bool_or_int_tensor, lo, hi)`` then kept the tensor's dtype (bool) where eager
# promotes to float32, and the engine's layout copy turned every True into 1.0 (torch 2.13;
# PyTorch's own test_clamp_type_promotion). ``clamp_min`` and ``clamp_max`` promote correctly,
# and ``clamp(x, lo, hi)`` is ``clamp_max(clamp_min(x, lo), hi)`` in eager's kernel too (NaN
# in x or a bound propagates; lo > hi gives hi; the int-to-float conversion is monotone, so
# clamping before or after it is the same), so a clamp with a lifted bound is emitted as
# those two.
_CLAMP = {aten.clamp.default}


# Note [foreach scalar lists]
# Inductor lowers no foreach op that takes a list of numbers (``ScalarList``; torch 2.13): one
# such op runs as an aten call over all its tensors. AdamW(foreach=True) has two per step, its
# bias corrections in ``_foreach_div_`` and ``_foreach_addcdiv_``: two extra passes over the
# parameters and optimizer state. In a trace on CPU the list becomes 0-d tensors (a lifted
# number's own float64 placeholder, with no ``item``; a baked one a ``scalar_tensor``
# constant) and the op its ``List`` overload, which Inductor fuses with its neighbours;
# ``addcdiv``/``addcmul`` have no list overload: ``tensor1`` is scaled by the list first and
# added with ``value=1``, ``self + (s * t1) / t2``, the order of eager's CPU kernel. A 0-d
# tensor promotes as a Python number of its kind does (it never raises the dtype of a tensor
# with dims of its own category), except a float against an integral tensor: a Python float
# gives the default dtype, a float64 0-d tensor float64. In-place ops on integral tensors with
# a float raise in eager (never traced); an out-of-place one with floats (and the ``tensor1``
# that ``addcdiv``/``addcmul`` scale) is rewritten only where each tensor is known here to be
# floating: an input, or a value the user still holds such as a gradient (an intermediate's
# dtype is not kept). Lists with complex numbers, and traces that touch another device
# (untested: Inductor copies CPU scalars to the device only for some of its inputs), keep the
# aten call.
_FOREACH_LIST = {getattr(getattr(aten, f"_foreach_{n}{s}"), "ScalarList"):
                 getattr(getattr(aten, f"_foreach_{n}{s}"), "List")
                 for n in ("add", "sub", "mul", "div") for s in ("", "_")}
_FOREACH_ADDC = {getattr(getattr(aten, f"_foreach_{n}{s}"), "ScalarList"):
                 getattr(getattr(aten, f"_foreach_{n}{s}"), "Scalar")
                 for n in ("addcdiv", "addcmul") for s in ("", "_")}
_IN_PLACE_LIST = frozenset(op for op in (*_FOREACH_LIST, *_FOREACH_ADDC)
                           if op._schema.name.endswith("_"))
_SCALAR_DTYPES = {float: torch.float64, int: torch.int64, bool: torch.bool}


def _scalar_list(g: fx.Graph, op: Any, args: tuple, cargs: tuple, trace: Trace,
                 reals: list[torch.Tensor]) -> tuple[Any, tuple] | None:
    """(op, graph args) for a foreach ScalarList op as 0-d tensors, or None to keep it
    (Note [foreach scalar lists])."""
    at = 1 if op in _FOREACH_LIST else 3
    if len(cargs) != at + 1 or not isinstance(cargs[at], (list, tuple)):
        return None
    if any(type(v) is complex for v in args[at]):
        return None
    if any(type(v) is float for v in args[at]):
        # floats: out of place, every tensor must be known to be floating; addcdiv/addcmul
        # scale tensor1 on its own, so it must be floating too (a float self may take ints)
        known = args[:at] if op not in _IN_PLACE_LIST else args[1:2] if at == 3 else ()
        if not all(_floating(t, trace, reals) for a in known for t in a):
            return None
    items = []
    for v, c in zip(args[at], cargs[at]):
        if isinstance(c, fx.Node):
            if c.target is not aten.item.default:  # a size that follows s: keep the op
                return None
            items.append(c.args[0])  # the lifted number's 0-d float64 placeholder
        else:
            dtype = _SCALAR_DTYPES.get(type(v))
            if dtype is None:
                return None
            items.append(g.call_function(aten.scalar_tensor.default, (v,), {"dtype": dtype}))
    for c in cargs[at]:
        if isinstance(c, fx.Node) and not c.users:
            g.erase_node(c)
    if op in _FOREACH_LIST:
        return _FOREACH_LIST[op], (cargs[0], items)
    scaled = g.call_function(aten._foreach_mul.List, (cargs[1], items))
    return _FOREACH_ADDC[op], (cargs[0], scaled, cargs[2], 1)


def _floating(t: Any, trace: Trace, reals: list[torch.Tensor]) -> bool:
    """Whether a recorded tensor argument is known to be floating: an external, or a pending
    value the user still holds (its lazy tensor has the dtype; a dead one is unknown)."""
    if type(t) is Slot:
        w = trace.refs[t.i]() if t.i < len(trace.refs) else None
        return w is not None and w._ae_meta.dtype.is_floating_point
    return reals[trace.ext_ids[id(t)]].is_floating_point()


def _all_cpu(trace: Trace, reals: list[torch.Tensor]) -> bool:
    """Whether the trace's inputs are on CPU and no op names another device."""
    if any(t.device.type != "cpu" for t in reals):
        return False
    for _op, _args, kwargs, _ in trace.ops:
        d = kwargs.get("device")
        if d is not None and torch.device(d).type != "cpu":
            return False
    return True


# Fused optimizer kernels (``AdamW(fused=True)`` & co.) mutate lists of tensors in one op.
# AOTAutograd's functionalization of the in-place op asserts ("mutating a non-functional tensor
# with a functional tensor", torch 2.13, any inputs); their generated functional variants work.
# So the graph calls the functional variant (an extern kernel: the same CPU kernel on copies)
# and copies each result into the argument eager mutates, which functionalization applies to
# the inputs in place.
_FUSED_OPTIM = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"})


def _functional_variant(op: Any) -> tuple[Any, list[int]] | None:
    """(functional overload, positions of the mutated list arguments) for a fused optimizer op."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    name = op._schema.name.split("::")[-1]
    if name not in _FUSED_OPTIM:
        return None
    packet = getattr(aten, name[:-1], None)
    functional = getattr(packet, op._overloadname, None) if packet is not None else None
    if functional is None:
        return None
    mutated = [i for i, a in enumerate(op._schema.arguments)
               if not a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
    return functional, mutated


def _call_functional(g: fx.Graph, functional: Any, mutated: list[int], cargs: tuple,
                     ckw: dict) -> fx.Node:
    node = g.call_function(functional, cargs, ckw)
    for k, pos in enumerate(mutated):
        outs = g.call_function(operator.getitem, (node, k))
        for j, dst in enumerate(cargs[pos]):
            g.call_function(aten.copy_.default,
                            (dst, g.call_function(operator.getitem, (outs, j))))
    return node


# Conjugate and negative views (a bit on the tensor, no copy). Inductor compiles an internal
# ``_conj`` view as if the bit were not there: ``x * c + x.conj()`` came back with the imaginary
# part's sign flipped. Internal ones become their physical ops (same values, a new tensor);
# traces that return such a view, write through one, or take one as input stay op by op.
_BIT_VIEWS = {aten._conj.default: aten.conj_physical.default,
              aten._neg_view.default: aten.neg.default}
# Note [unsafe views] (dispatch/opspec.py): their outputs alias the input, but the schemas say
# no alias, so functionalization treated them as new tensors and a write through one never
# reached the base: ``a.unsafe_split(2)[0].add_(1)`` then ``a * 2`` was wrong in every fused
# program. The graph takes the safe ops, which compute the same views and say so.
_UNSAFE_VIEW_OPS = {aten.unsafe_split.Tensor: aten.split.Tensor,
                    aten.unsafe_split_with_sizes.default: aten.split_with_sizes.default,
                    aten.unsafe_chunk.default: aten.chunk.default}


# Note [views as reshapes]
# A ``view`` (or ``_unsafe_view``) is recorded with the strides eager gave its input, but the
# compiler traces the graph with its own meta functions, whose output strides can differ from
# eager's kernels: ``cat`` of a legacy empty tensor and a transposed one is contiguous in eager
# and keeps the transposed layout under FakeTensor, so the ``view`` matmul recorded next to it
# ("Cannot view a tensor with shape [2, 4, 8, 9] and strides (288, 8, 1, 32)") failed every
# compile of Hugging Face GPT-2's training step. ``reshape`` gives the same values whatever the
# strides (a view where one exists, a copy otherwise); the copy is only safe where no one can
# tell: nothing in the trace writes to that view's alias family, and neither the view nor any view
# made from it is an output.
_RESHAPE_OK = {aten.view.default, aten._unsafe_view.default}


def _reshapable_views(trace: Trace, live: list[int]) -> set[int]:
    """Indices of the trace's view ops that the graph may emit as ``reshape``."""
    from adaptive_eager.dispatch.opspec import spec_for

    family: dict[Any, Any] = {}  # slot (int) or id(external tensor) -> parent key

    def root(k: Any) -> Any:
        while k in family:
            k = family[k]
        return k

    def key(a: Any) -> Any:
        return a.i if type(a) is Slot else ("x", id(a))

    children: dict[int, list[int]] = {}  # view output slots made from each slot
    writes: list[Any] = []  # keys written by some op; their roots once every union is made
    candidates: list[tuple[int, int]] = []  # (op index, output slot)
    for n, (op, args, kwargs, slots) in enumerate(trace.ops):
        spec = spec_for(op)
        if spec.view_arg is not None and spec.view_arg < len(args):
            src = args[spec.view_arg]
            if isinstance(src, (Slot, torch.Tensor)):
                outs = [slots] if type(slots) is int else [s for s in _flat(slots)]
                k = key(src)
                for s in outs:
                    if root(s) != root(k):
                        family[root(s)] = root(k)
                    if type(src) is Slot:
                        children.setdefault(src.i, []).append(s)
                if op in _RESHAPE_OK and type(slots) is int:
                    candidates.append((n, slots))
        if spec.writes:
            for w in spec.writes:
                a = args[w] if type(w) is int and w < len(args) else kwargs.get(w)
                for t in _flat(a) if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, (Slot, torch.Tensor)):
                        writes.append(key(t))
    written = {root(k) for k in writes}
    alive = set(live)
    ok: set[int] = set()
    for n, s in candidates:
        if root(s) in written:
            continue
        stack, seen_live = [s], False
        while stack and not seen_live:
            x = stack.pop()
            seen_live = x in alive
            stack.extend(children.get(x, ()))
        if not seen_live:
            ok.add(n)
    return ok


def _writes_external(trace: Trace) -> bool:
    """Whether some op writes an external tensor, or a view of one, in place."""
    from adaptive_eager.dispatch.opspec import spec_for

    of_ext: set[int] = set()  # slots that are views of an external
    for op, args, kwargs, slots in trace.ops:
        spec = spec_for(op)
        for w in spec.writes or ():
            a = args[w] if type(w) is int and w < len(args) else kwargs.get(w)
            for t in _flat(a) if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) or (type(t) is Slot and t.i in of_ext):
                    return True
        if spec.view_arg is not None and spec.view_arg < len(args):
            src = args[spec.view_arg]
            if isinstance(src, torch.Tensor) or (type(src) is Slot and src.i in of_ext):
                of_ext.update([slots] if type(slots) is int else _flat(slots))
    return False


# Note [writes through shared storage]
# External tensors that share storage enter a program as ``as_strided`` views of one synthetic
# base (Note [synthetic bases]). Inductor (torch 2.13) lowers a write into such a view whose
# value is computed, in the same kernel, from the base read at other positions as one in-place
# loop: ``b.copy_(b.flip(0))`` after an earlier write through the base stored element i before
# it read it as element n - i (a fuzzed program, and torch.compile of the same graph, ended 8
# apart). Eager computes the source first. So a trace whose write into a group that shares
# storage takes a value read from that group at other positions is not fused: it runs op by op,
# bitwise eager's. "Other positions" is decided conservatively from the recorded ops: a value
# read from a member and carried only through pointwise ops to a write into that same member
# (``p.mul_(0.9)``, ``p.add_(p * 2)``, Adam's update of a weight whose transpose is also an
# input) is in place and safe; anything else that reaches a write - a view of a member, another
# member, a flip or gather - is a hazard unless a reduction or a matrix product (which Inductor
# stores to a buffer of its own first) stands between, or an op that reads no values
# (``zeros_like(p)``, ``p.new_empty``: Adam's moments made inside a fused first step). Traces
# whose groups are only read are untouched.
_STORES_FIRST = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot",
                           "convolution", "_convolution", "cudnn_convolution",
                           "mkldnn_convolution", "_scaled_dot_product_flash_attention_for_cpu"})


def _shared_write_hazard(trace: Trace, groups: list[list[int]]) -> str | None:
    """The op whose write into shared external storage reads that storage at other positions
    (Note [writes through shared storage]), or None."""
    from adaptive_eager.dispatch.opspec import spec_for

    group_of = {i: n for n, members in enumerate(groups) if len(members) > 1 for i in members}
    if not group_of:
        return None
    ext_ids = trace.ext_ids
    # Positions: an origin is ("x", ext index) or ("v", slot of a view of a member). ``views``:
    # the group a view slot's storage is in; ``taint``: per slot, the groups its value was read
    # from, with the origin and whether only pointwise ops carried it.
    views: dict[int, set[int]] = {}
    taint: dict[int, dict[int, set[tuple[tuple[str, int], bool]]]] = {}

    def of(a: Any) -> dict[int, set[tuple[tuple[str, int], bool]]]:
        if type(a) is Slot:
            return taint.get(a.i, {})
        if isinstance(a, torch.Tensor):
            i = ext_ids.get(id(a))
            if i in group_of:
                return {group_of[i]: {(("x", i), True)}}
        return {}

    def storage(a: Any) -> set[int]:
        """The groups whose memory a write into ``a`` changes."""
        if type(a) is Slot:
            return views.get(a.i, set())
        if isinstance(a, torch.Tensor):
            i = ext_ids.get(id(a))
            return {group_of[i]} if i in group_of else set()
        return set()

    for op, args, kwargs, slots in trace.ops:
        spec = spec_for(op)
        writes = spec.writes or ()
        written = [args[w] if type(w) is int and w < len(args) else kwargs.get(w)
                   for w in writes]
        others = [a for j, a in enumerate(args) if j not in writes]
        others += [v for k, v in kwargs.items() if k not in writes]
        for target in (t for w in written for t in _flat(w)):
            into = storage(target)
            if not into:
                continue
            origins = {o for entries in of(target).values() for o, _ in entries}
            for a in (x for o in others for x in _flat(o)):
                for g, entries in of(a).items():
                    if g in into and any(not pw or o not in origins for o, pw in entries):
                        return spec.name
        if slots is None:
            continue
        name = op.__name__.split(".")[0] if hasattr(op, "__name__") else ""
        if (torch.Tag.reduction in getattr(op, "tags", ()) or name in _STORES_FIRST
                or name.endswith("_like") or name.startswith("new_")):
            continue  # stored to a buffer first, or reads no values (zeros_like(p): Adam's state)
        merged: dict[int, set[tuple[tuple[str, int], bool]]] = {}
        for a in (x for part in (*args, *kwargs.values()) for x in _flat(part)):
            for g, entries in of(a).items():
                merged.setdefault(g, set()).update(entries)
        if not merged:
            continue
        outs = [slots] if type(slots) is int else [s for s in _flat(slots) if type(s) is int]
        view = spec.view_arg is not None
        pointwise = torch.Tag.pointwise in getattr(op, "tags", ())
        base = storage(args[spec.view_arg]) if view and spec.view_arg < len(args) else set()
        for s in outs:
            if base:  # a view into a group: positions of its own, written through it
                views[s] = base
                taint[s] = {g: {(("v", s), True)} for g in base}
            else:  # a value read from groups (a view of one moves its positions)
                taint[s] = {g: {(o, pw and pointwise and not view) for o, pw in e}
                            for g, e in merged.items()}
    return None


def _flat(a: Any) -> list[Any]:
    if isinstance(a, (list, tuple)):
        return [y for x in a for y in _flat(x)]
    return [] if a is None else [a]


# Note [output aliasing]
# Which outputs share memory is part of a program's result: a write through one must show in
# exactly the tensors that share its storage in eager. Inductor does not always keep that
# (torch 2.13): its no-op removal runs before reinplacing, so ``clone(x)`` after
# ``_foreach_add_([x], ...)`` came back as the input ``x`` itself (the next write to ``x``
# changed the "clone": a running mean read 3.5 where eager had 1.5), and a same-shape ``view``
# of an output came back as the very same tensor object (``t.view_as(t).t_()`` then transposed
# ``t`` too). So the graph records, per output, what it aliases in eager: ``("x", e)`` a view
# of the external ``e``, ``("s", k)`` the fresh tensor of slot ``k`` or a view of it. The fused
# run (fused.py) compares that with what the program returned and copies, or re-views, the
# outputs that alias more than they should.
def _output_roots(trace: Trace, live: list[int]) -> tuple[tuple[str, int], ...]:
    """Per live slot, the external or the fresh slot whose memory it is in eager."""
    from adaptive_eager.dispatch.opspec import spec_for

    root: dict[int, tuple[str, int]] = {}
    for op, args, _kwargs, slots in trace.ops:
        spec = spec_for(op)
        if spec.view_arg is None or spec.view_arg >= len(args) or slots is None:
            continue
        src = args[spec.view_arg]
        if type(src) is Slot:
            r = root.get(src.i, ("s", src.i))
        elif isinstance(src, torch.Tensor) and id(src) in trace.ext_ids:
            r = ("x", trace.ext_ids[id(src)])
        else:
            continue
        for s in _flat(slots):
            if type(s) is int:
                root[s] = r
    return tuple(root.get(s, ("s", s)) for s in live)


def _bit_view_slots(trace: Trace, live: list[int]) -> set[int]:
    """Outputs of conj/neg views that may become physical ops (raises Unfusable otherwise)."""
    views: set[int] = set()
    for op, args, kwargs, slots in trace.ops:
        if op in _BIT_VIEWS:
            if type(slots) is not int:
                raise Unfusable(f"{op} with outputs {slots}")
            views.add(slots)
            continue
        if views and isinstance(op, torch._ops.OpOverload):
            for a, arg in zip(op._schema.arguments, args):
                if (type(arg) is Slot and arg.i in views and a.alias_info is not None
                        and a.alias_info.is_write):
                    raise Unfusable("a write through a conjugate or negative view")
    if views & set(live):
        raise Unfusable("the trace returns a conjugate or negative view")
    return views


# Note [graph code on demand]
# A GraphModule generates and compiles its Python code when made: 25-50 ms for the two 240-290-op
# traces of a small transformer step here, in the flushing thread, at the step that sends them
# to the compile service, which never runs that code (the graph travels as its nodes, and the
# helper makes its own module). torch.fx's _LazyGraphModule (what Dynamo hands Inductor)
# generates it at the first call or ``.code`` instead; Inductor makes it real before compiling.
@dataclasses.dataclass
class TraceGraph:
    gm: fx.GraphModule
    plan: list[tuple]  # per tensor input: ("t", ext) or ("base", ext, storage numel)
    offsets: list[tuple[int, int]]  # (ext, storage offset) baked into synthetic-base views
    lifted: tuple[int, ...]  # positions in trace.scalars that are program inputs
    baked: tuple[int, ...]  # positions that are constants in the program
    baked_values: tuple[Any, ...]
    live: tuple[int, ...]  # slots returned by the program, in output order
    example_inputs: list[Any]
    n_ops: int
    # per tensor input (plan order): the dims that follow the symbol s
    # (Note [symbolic programs] in symbolic_plan.py)
    dynamic: tuple[tuple[int, ...], ...] | None = None
    # the ambient settings the trace was recorded under (Note [ambient state]): read when the
    # graph is built, at a flush, so later readers (the key, a helper's compile) agree with it
    state: tuple[tuple[str, Any], ...] = ()
    # per output: what it aliases in eager (Note [output aliasing]); None: not known
    out_roots: tuple[tuple[str, int], ...] | None = None
    n_ext: int = -1  # the trace's externals when built (-1: not known)
    # whether an op writes an external tensor or a view of one (Note [outputs unlike eager's])
    writes_ext: bool = True

    def inputs(self, ext_reals: list[torch.Tensor], scalars: list[Any]) -> list[Any] | None:
        """Program inputs for this run, or None when its aliased inputs moved (then replay)."""
        if self.n_ext >= 0 and len(ext_reals) != self.n_ext:
            return None  # not the inputs it was built for: never expected, replay
        tensors = _tensor_inputs(self.plan, ext_reals)
        if tensors is None or any(ext_reals[i].storage_offset() != off
                                  for i, off in self.offsets):
            return None
        return [*tensors, *(_scalar_input(scalars[i]) for i in self.lifted)]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["gm"] = _graph_nodes(self.gm.graph)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["gm"] = _GraphModule(torch.nn.Module(), _graph_from_nodes(state["gm"]))
        self.__dict__.update(state)

    def scalars_hold(self, scalars: list[Any]) -> bool:
        """Whether this run's baked-in numbers equal the ones compiled in."""
        return all(type(scalars[i]) is type(v) and scalars[i] == v
                   for i, v in zip(self.baked, self.baked_values))


class _Ref:
    """A node argument in pickled form: the index of the node it names."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple:
        return (_Ref, (self.i,))


def _target_out(t: Any) -> Any:
    if isinstance(t, torch._ops.OpOverload):  # not picklable: by qualified name
        return ("op", t._schema.name, t._overloadname)
    return ("py", t)


def _target_in(t: tuple) -> Any:
    if t[0] == "py":
        return t[1]
    ns, name = t[1].split("::", 1)
    return getattr(getattr(getattr(torch.ops, ns), name), t[2])


def _graph_nodes(g: fx.Graph) -> list[tuple]:
    index: dict[fx.Node, int] = {}
    out = []
    for n in g.nodes:
        index[n] = len(out)
        conv = fx.node.map_arg((n.args, n.kwargs), lambda a: _Ref(index[a]))  # type: ignore
        out.append((n.op, n.name, _target_out(n.target), conv[0], conv[1]))
    return out


def _graph_from_nodes(nodes: list[tuple]) -> fx.Graph:
    g = fx.Graph()
    made: list[fx.Node] = []

    def resolve(a: Any) -> Any:
        if type(a) is _Ref:
            return made[a.i]
        if isinstance(a, tuple):
            return tuple(resolve(x) for x in a)
        if isinstance(a, list):  # fx's immutable_list too
            return [resolve(x) for x in a]
        if isinstance(a, dict):
            return {k: resolve(v) for k, v in a.items()}
        return a

    for op, name, target, args, kwargs in nodes:
        tgt = _target_in(target)
        if op == "placeholder":
            node = g.placeholder(name)
        elif op == "output":
            node = g.output(resolve(args[0]))
        else:
            node = g.create_node(op, tgt, resolve(args), resolve(kwargs), name=name)
        made.append(node)
    return g


def _scalar_input(v: Any) -> torch.Tensor:
    # scalar_tensor, not tensor: 1.2 against 2.5 us a number (73 of them per AdamW step of the
    # varlen benchmark's GPT-2, its bias corrections); same values, dtype, shape and strides
    if type(v) is float:
        return torch.scalar_tensor(v, dtype=torch.float64)
    if type(v) is bool:
        return torch.scalar_tensor(v, dtype=torch.bool)
    if type(v) is int:
        return torch.scalar_tensor(v, dtype=torch.int64)
    raise Unfusable(f"cannot lift a {type(v).__name__} scalar")


def _tensor_inputs(plan: list[tuple], reals: list[torch.Tensor]) -> list[torch.Tensor] | None:
    out = []
    for item in plan:
        t = reals[item[1]]
        if item[0] == "t":
            out.append(t)
        else:
            if _storage_numel(t) != item[2]:
                return None
            # detached: a no_grad view whose base was written in place with grad on would make
            # autograd refuse this view (the program runs below autograd anyway)
            out.append(t.detach().as_strided((item[2],), (1,), 0))
    return out


def _storage_numel(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


def _split_ok(trace: Trace, dims: dict[int, tuple[int, ...]]) -> set[int]:
    """Externals that follow s and that no op writes: they may enter as separate inputs even
    where they share storage (the same ids passed as input_ids and labels), as nothing a
    program does to one can show through another."""
    if not dims:
        return set()
    written: set[int] = set()
    for op, args, kwargs, _ in trace.ops:
        if not isinstance(op, torch._ops.OpOverload):
            return set()
        for pos, a in enumerate(op._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = kwargs.get(a.name, args[pos] if pos < len(args) else None)
            found: list = []
            arg_exts(v, found)
            written.update(trace.ext_ids[id(t)] for t in found if id(t) in trace.ext_ids)
    return {i for i in dims if i not in written}


def _tensor_placeholders(g: fx.Graph, reals: list[torch.Tensor], split: set[int] = frozenset()
                         ) -> tuple[list[list[int]], list[tuple], dict[int, fx.Node]]:
    """Note [synthetic bases]
    External tensors that share storage (``weight`` and ``weight.t()`` in one trace) cannot be
    separate program inputs: a write through one must be seen through the other. Such a group
    enters as one flat view of its storage, and each member is an ``as_strided`` of it inside the
    graph, so functionalization sees one input with views (as AOTAutograd's synthetic bases)."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(reals):
        groups.setdefault(("own", i) if i in split else t.untyped_storage().data_ptr(),
                          []).append(i)
    plan: list[tuple] = []
    bases: dict[int, fx.Node] = {}
    for members in groups.values():
        first = members[0]
        if len(members) == 1:
            bases[first] = g.placeholder(f"x{first}")
            plan.append(("t", first))
            continue
        if len({reals[i].dtype for i in members}) != 1:
            raise Unfusable("inputs of different dtypes share storage")
        plan.append(("base", first, _storage_numel(reals[first])))
        bases[first] = g.placeholder(f"base{first}")
    return list(groups.values()), plan, bases


def _member_views(g: fx.Graph, reals: list[torch.Tensor], groups: list[list[int]],
                  bases: dict[int, fx.Node]) -> tuple[list[Any], list[tuple[int, int]]]:
    nodes: list[Any] = [None] * len(reals)
    offsets: list[tuple[int, int]] = []
    for members in groups:
        if len(members) == 1:
            nodes[members[0]] = bases[members[0]]
            continue
        for i in members:
            t = reals[i]
            nodes[i] = g.call_function(aten.as_strided.default, (
                bases[members[0]], tuple(t.shape), t.stride(), t.storage_offset()))
            offsets.append((i, t.storage_offset()))
    return nodes, offsets


def ext_reals(trace: Trace) -> list[torch.Tensor]:
    return [t._ae_real if type(t) is LazyTensor else t for t in trace.ext]  # type: ignore[misc]


def build(trace: Trace, live: list[int], varying: set[int], template: Any = None) -> TraceGraph:
    """The FX graph of ``trace`` returning ``live`` slots, numbers at ``varying`` positions
    lifted to inputs. ``template``: the trace's shapes.SymTrace when its entry is a template's
    (Note [symbolic programs] in symbolic_plan.py): sizes that follow s are computed from the
    inputs' sizes."""
    if trace.grad_ops:  # Note [grad-mode kernels] in engine.py: compiled below autograd,
        # such a kernel would run without the grad mode it was recorded in (LSTM's
        # mkldnn_rnn_layer then returns no workspace: every program failed when run)
        raise Unfusable("an op whose kernel reads the grad mode (mkldnn_rnn_layer)")
    from adaptive_eager.dispatch.opspec import spec_for

    g = fx.Graph()
    reals = ext_reals(trace)
    if any(t.is_conj() or t.is_neg() for t in reals):
        raise Unfusable("an input is a conjugate or negative view")
    _bit_view_slots(trace, live)
    reshapes = _reshapable_views(trace, live)
    scalars = trace.scalars
    lifted = tuple(i for i in range(len(scalars)) if i in varying)
    sym_args: dict[int, list[Any]] = {}
    dims: dict[int, tuple[int, ...]] = {}
    sources: list = []
    if template is not None:
        sym_args, dims, sources = symbolic_plan(trace, template, reals, spec_for)
    groups, plan, bases = _tensor_placeholders(g, reals, _split_ok(trace, dims))
    hazard = _shared_write_hazard(trace, groups)
    if hazard is not None:
        raise Unfusable(f"{hazard} writes shared storage it reads at other positions")
    lifted_at = {i: g.placeholder(f"s{i}") for i in lifted}  # placeholders all come first
    ext_nodes, offsets = _member_views(g, reals, groups, bases)
    dynamic = None
    poly_node: Any = None
    if template is not None:
        # a synthetic base bakes in its storage size and offsets: only static members
        if any(len(grp) > 1 and any(i in dims for i in grp) for grp in groups):
            raise Unfusable("inputs that follow s share storage and are written")
        poly_node = symbol_node(g, ext_nodes, sources)
        dynamic = tuple(dims.get(item[1], ()) for item in plan)
    baked = tuple(i for i in range(len(scalars)) if i not in varying)
    on_cpu = _all_cpu(trace, reals)
    env: dict[int, fx.Node] = {}
    scalar_pos = [0]

    def scalar(v: Any) -> Any:
        i = scalar_pos[0]
        scalar_pos[0] += 1
        ph = lifted_at.get(i)
        return v if ph is None else g.call_function(aten.item.default, (ph,))

    for n_op, (op, args, kwargs, slots) in enumerate(trace.ops):
        spec = spec_for(op)
        polys = sym_args.get(n_op)
        if polys is not None:  # ints that follow s become markers, then nodes (below)
            args, kwargs = mark_ints(args, kwargs, spec, iter(polys))
        cargs = tuple(_convert(a, i in spec.scalar_pos, spec, trace, ext_nodes, env, scalar)
                      for i, a in enumerate(args))
        ckw = {k: _convert(v, k in spec.scalar_kw, spec, trace, ext_nodes, env, scalar)
               for k, v in kwargs.items()}
        if polys is not None:
            cargs = unmark(cargs, poly_node)
            ckw = {k: unmark(v, poly_node) for k, v in ckw.items()}
        if op in _LERP_TENSOR and isinstance(cargs[2], fx.Node):
            weight = g.call_function(aten.scalar_tensor.default, (cargs[2],),
                                     {"dtype": _dtype_of(args[0], trace)})
            op, cargs = _LERP_TENSOR[op], (cargs[0], cargs[1], weight)
        elif (op in _FOREACH_LIST or op in _FOREACH_ADDC) and not ckw and on_cpu:
            listed = _scalar_list(g, op, args, cargs, trace, reals)
            if listed is not None:
                op, cargs = listed
        elif op in _CLAMP:
            op, cargs, ckw = _clamp_of_lifted(g, op, cargs, ckw)
        op = _BIT_VIEWS.get(op, op)
        op = _UNSAFE_VIEW_OPS.get(op, op)
        if n_op in reshapes:  # Note [views as reshapes]
            op = aten.reshape.default
        variant = _functional_variant(op)
        if variant is not None:
            node = _call_functional(g, variant[0], variant[1], cargs, ckw)
            if slots is not None:
                raise Unfusable(f"{op} returns values")  # schema says it returns nothing
        else:
            node = g.call_function(op, cargs, ckw)
            _bind(slots, node, env, g)
    if scalar_pos[0] != len(scalars):
        raise Unfusable("scalar bookkeeping mismatch")  # never expected: keys and graph disagree
    missing = [s for s in live if s not in env]
    if missing:
        raise Unfusable(f"live slots {missing} have no producer")
    g.output(tuple(env[s] for s in live))
    gm = _GraphModule(torch.nn.Module(), g)  # Note [graph code on demand]
    tensors = _tensor_inputs(plan, reals)
    assert tensors is not None
    return TraceGraph(gm=gm, plan=plan, offsets=offsets, lifted=lifted,
                      baked=baked, baked_values=tuple(scalars[i] for i in baked),
                      live=tuple(live),
                      example_inputs=[*tensors, *(_scalar_input(scalars[i]) for i in lifted)],
                      n_ops=len(trace.ops), dynamic=dynamic, state=ambient.state(),
                      out_roots=_output_roots(trace, live), n_ext=len(reals),
                      writes_ext=_writes_external(trace))


def _clamp_of_lifted(g: fx.Graph, op: Any, cargs: tuple, ckw: dict) -> tuple[Any, tuple, dict]:
    """``clamp`` with a lifted bound as ``clamp_min`` then ``clamp_max`` (Note [clamp of lifted
    numbers]); the op's own arguments otherwise. The last of the two is the op's node."""
    names = ("self", "min", "max")
    bound = dict(zip(names, cargs))
    bound.update(ckw)
    lo, hi = bound.get("min"), bound.get("max")
    if not isinstance(lo, fx.Node) and not isinstance(hi, fx.Node):
        return op, cargs, ckw
    x = bound["self"]
    if lo is None:
        return aten.clamp_max.default, (x, hi), {}
    if hi is None:
        return aten.clamp_min.default, (x, lo), {}
    return aten.clamp_max.default, (g.call_function(aten.clamp_min.default, (x, lo)), hi), {}


def _dtype_of(a: Any, trace: Trace) -> torch.dtype:
    if type(a) is Slot:
        raise Unfusable("lerp on an internal value")  # dtype not tracked per slot here
    return a.dtype


def _convert(a: Any, scalar_position: bool, spec: Any, trace: Trace, ext_nodes: list,
             env: dict, scalar: Any) -> Any:
    """One recorded argument as a graph argument (mirrors the key rules in engine.record)."""
    t = type(a)
    if t is Slot:
        return env[a.i]
    if isinstance(a, torch.Tensor):
        return ext_nodes[trace.ext_ids[id(a)]]
    if t is float or t is complex:
        return a if spec.structural else scalar(a)
    if t is int or t is bool:
        return scalar(a) if scalar_position and not spec.structural else a
    if t is list or t is tuple:
        return t(_convert_item(x, spec, trace, ext_nodes, env, scalar) for x in a)
    return a


def _convert_item(a: Any, spec: Any, trace: Trace, ext_nodes: list, env: dict,
                  scalar: Any) -> Any:
    t = type(a)
    if t is Slot:
        return env[a.i]
    if isinstance(a, torch.Tensor):
        return ext_nodes[trace.ext_ids[id(a)]]
    if (t is float or t is complex) and not spec.structural:
        return scalar(a)
    return a


def _bind(slots: Any, node: fx.Node, env: dict, g: fx.Graph) -> None:
    if type(slots) is int:
        env[slots] = node
    elif slots is not None:
        for i, s in enumerate(slots):
            if s is None:
                continue
            item = g.call_function(operator.getitem, (node, i))
            if type(s) is int:
                env[s] = item
            else:
                _bind(s, item, env, g)
