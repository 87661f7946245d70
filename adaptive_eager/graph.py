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

from adaptive_eager.dispatch.lazy import LazyTensor
from adaptive_eager.trace import Slot, Trace

aten = torch.ops.aten

# Scalar overloads whose decomposition branches on the scalar's value: a lifted (unbacked) scalar
# cannot be guarded on, so these take the Tensor overload with a 0-d weight instead.
_LERP_TENSOR = {aten.lerp_.Scalar: aten.lerp_.Tensor, aten.lerp.Scalar: aten.lerp.Tensor}


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


class Unfusable(Exception):
    """The trace cannot become a fused program (it stays op by op)."""


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

    def inputs(self, ext_reals: list[torch.Tensor], scalars: list[Any]) -> list[Any] | None:
        """Program inputs for this run, or None when its aliased inputs moved (then replay)."""
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
        state["gm"] = fx.GraphModule(torch.nn.Module(), _graph_from_nodes(state["gm"]))
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
    if type(v) is float:
        return torch.tensor(v, dtype=torch.float64)
    if type(v) is bool:
        return torch.tensor(v, dtype=torch.bool)
    if type(v) is int:
        return torch.tensor(v, dtype=torch.int64)
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
            out.append(t.as_strided((item[2],), (1,), 0))
    return out


def _storage_numel(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


def _tensor_placeholders(g: fx.Graph, reals: list[torch.Tensor]
                         ) -> tuple[list[list[int]], list[tuple], dict[int, fx.Node]]:
    """Note [synthetic bases]
    External tensors that share storage (``weight`` and ``weight.t()`` in one trace) cannot be
    separate program inputs: a write through one must be seen through the other. Such a group
    enters as one flat view of its storage, and each member is an ``as_strided`` of it inside the
    graph, so functionalization sees one input with views (as AOTAutograd's synthetic bases)."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(reals):
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(i)
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


def build(trace: Trace, live: list[int], varying: set[int]) -> TraceGraph:
    """The FX graph of ``trace`` returning ``live`` slots, numbers at ``varying`` positions
    lifted to inputs."""
    if trace.grad_ops:  # Note [grad-mode kernels] in engine.py: compiled below autograd,
        # such a kernel would run without the grad mode it was recorded in (LSTM's
        # mkldnn_rnn_layer then returns no workspace: every program failed when run)
        raise Unfusable("an op whose kernel reads the grad mode (mkldnn_rnn_layer)")
    g = fx.Graph()
    reals = ext_reals(trace)
    if any(t.is_conj() or t.is_neg() for t in reals):
        raise Unfusable("an input is a conjugate or negative view")
    _bit_view_slots(trace, live)
    scalars = trace.scalars
    lifted = tuple(i for i in range(len(scalars)) if i in varying)
    groups, plan, bases = _tensor_placeholders(g, reals)
    lifted_at = {i: g.placeholder(f"s{i}") for i in lifted}  # placeholders all come first
    ext_nodes, offsets = _member_views(g, reals, groups, bases)
    baked = tuple(i for i in range(len(scalars)) if i not in varying)
    env: dict[int, fx.Node] = {}
    scalar_pos = [0]

    def scalar(v: Any) -> Any:
        i = scalar_pos[0]
        scalar_pos[0] += 1
        ph = lifted_at.get(i)
        return v if ph is None else g.call_function(aten.item.default, (ph,))

    for op, args, kwargs, slots in trace.ops:
        from adaptive_eager.dispatch.opspec import spec_for

        spec = spec_for(op)
        cargs = tuple(_convert(a, i in spec.scalar_pos, spec, trace, ext_nodes, env, scalar)
                      for i, a in enumerate(args))
        ckw = {k: _convert(v, k in spec.scalar_kw, spec, trace, ext_nodes, env, scalar)
               for k, v in kwargs.items()}
        if op in _LERP_TENSOR and isinstance(cargs[2], fx.Node):
            weight = g.call_function(aten.scalar_tensor.default, (cargs[2],),
                                     {"dtype": _dtype_of(args[0], trace)})
            op, cargs = _LERP_TENSOR[op], (cargs[0], cargs[1], weight)
        op = _BIT_VIEWS.get(op, op)
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
    gm = fx.GraphModule(torch.nn.Module(), g)
    tensors = _tensor_inputs(plan, reals)
    assert tensors is not None
    return TraceGraph(gm=gm, plan=plan, offsets=offsets, lifted=lifted,
                      baked=baked, baked_values=tuple(scalars[i] for i in baked),
                      live=tuple(live),
                      example_inputs=[*tensors, *(_scalar_input(scalars[i]) for i in lifted)],
                      n_ops=len(trace.ops))


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
