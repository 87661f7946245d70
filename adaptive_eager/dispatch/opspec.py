"""What the engine does with each aten op, decided once per op from its schema and tags.

Note [op policy]
DEFER        recorded into the trace; outputs are lazy tensors.
ALLOC        empty/empty_like/...: only metadata is read, so they run at once (no flush) and give
             real, uninitialised tensors; random in-place fills on them need no flush (dropout).
RANDOM       tagged nondeterministic_seeded: run at once, in program order, so the generator moves
             exactly as in eager (DESIGN trap 11). A flush first only if an input is still pending.
PASSTHROUGH  metadata-only or bookkeeping ops (profiler ranges, lift_fresh): run at once, no flush.
INPLACE_VIEW t_/squeeze_/resize_/set_/as_strided_ change a tensor's metadata, which a wrapper can't
             follow lazily (trap 3): flush, run, then refresh the wrapper's sizes.
SYNC         the result is a Python value or its shape depends on data (item, nonzero): flush.
CHECKED      deferred like DEFER once a record-time check of its index values passes; otherwise
             run at once, so eager's out-of-bounds error rises at its line (Note [value checks]
             in dispatch/bounds.py).
OUT          out= overloads whose functional overload is deferred: recorded as it, then a copy_
             into each out, where the call allows (Note [out= ops] in dispatch/outvariant.py).
FALLBACK     everything the engine does not model (other out= variants, non-aten namespaces,
             storages).

Note [custom ops]
A user's own op (``torch.library.custom_op``, or ``torch.library.define`` plus ``register_fake``)
is deferred like an aten op when it has a fake implementation: registering one is the user's
statement, as torch.compile requires, that the op is functional apart from the inputs its schema
says it writes, so running it later, at the flush, is what eager would have computed. Its output
metadata comes from running it once (Note [metadata by running]), as for aten ops, so a wrong fake
impl cannot give a wrong lazy tensor; it replays as itself, and in a fused program it is an extern
call (Inductor's fallback kernel for an op with a fake impl). Ops whose schema writes an input
(``mutates_args``) are deferred too when they return nothing or only new tensors: the write lands
in program order at replay, as aten in-place ops do; custom ops may not return aliases of inputs.
Ops without a fake impl, and namespaces of communication and runtime ops (``c10d``,
``_c10d_functional``, ...), whose effects are outside the tensors they take, keep the
flush-and-run fallback. A fake impl that makes its output sizes from data
(``torch.library.get_ctx().new_dynamic_size()``) makes the op a SYNC point: sizes learned from one
run would be wrong for the next values. A custom op that draws random numbers must say so with
``tags=torch.Tag.nondeterministic_seeded`` (then it runs at once, in program order, as RANDOM).
"""

from __future__ import annotations

import inspect
import re
import types
from typing import Any

import torch

from adaptive_eager.core import hooks
from adaptive_eager.dispatch.bounds import CHECKS

DEFER, ALLOC, RANDOM, PASSTHROUGH, INPLACE_VIEW, SYNC, FALLBACK, GRAD_MODE, OUT, CHECKED = range(10)
POLICY_NAMES = ("defer", "alloc", "random", "passthrough", "inplace_view", "sync", "fallback",
                "grad_mode", "out", "checked")  # GRAD_MODE: replayed under its recorded grad mode

_aten = torch.ops.aten
GRAD_MODE_OPS = frozenset({_aten.mkldnn_rnn_layer.default})  # kernels that read the grad mode

_ALLOC_OPS = {
    _aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.empty_permuted.default,
}
# Note [unsafe views]
# ``unsafe_split``, ``unsafe_chunk`` and ``_unsafe_view`` return tensors that share their input's
# storage (at its offset) but say no alias in their schemas, so autograd does not track them as
# views. The engine treated them as ordinary ops: metadata of an external input are keyed
# without its storage offset (Note [views of real tensors] in engine.py), so the outputs of
# ``unsafe_split`` on a real slice at offset 54 were announced at offset 0 (packed-sequence
# GRU/LSTM layers split each step's slice of the input projection this way: a metadata mismatch,
# then kernels reading wrappers' absent data). They are views of their first argument here:
# made at once on real tensors, with view metadata on lazy ones.
_UNSAFE_VIEWS = frozenset({_aten.unsafe_split.Tensor, _aten.unsafe_split_with_sizes.default,
                           _aten.unsafe_chunk.default, _aten._unsafe_view.default})
# Output sizes that follow tensor values, though the ops carry no dynamic_output_shape tag
# (FakeTensor has its own rules for them): learning their metadata from one run was wrong for
# the next lengths (``pack_padded_sequence`` of lengths [5, 3, 2] then [5, 5, 5]), and their
# outputs are read by C++ code that follows (packed RNN layers read ``batch_sizes``' data).
# Under inference mode composite ops reach the engine whole: ``torch.where(cond)``,
# ``repeat_interleave(repeats_tensor)``, ``tensor_split(indices_tensor)`` and ``narrow(start_tensor)``
# then came with the sizes (or view offset) learnt from the first values. Found by running every
# OpInfo sample under inference mode and listing the composite ops that reach a dispatch mode
# whole while their decomposition runs a data-dependent op; the others it lists have sizes that
# follow sizes (combinations, cov, corrcoef, ctc_loss) or return a Python value (is_nonzero).
_DATA_SHAPED = frozenset({_aten._pack_padded_sequence.default, _aten._pad_packed_sequence.default,
                          _aten._padded_dense_to_jagged_forward.default,
                          _aten.nonzero_numpy.default, _aten.where.default,
                          _aten.repeat_interleave.self_Tensor, _aten.narrow.Tensor,
                          _aten.tensor_split.tensor_indices_or_sections})
# Forward-mode AD's dual-number ops reach a dispatch mode only under inference mode (their
# kernels there assert inference mode and read the thread's dual levels): deferred, they
# replayed at a flush outside inference mode and raised an internal assert.
_FORWARD_AD = frozenset({_aten._make_dual.default, _aten._unpack_dual.default,
                         _aten._fw_primal.default, _aten._make_dual_copy.default,
                         _aten._fw_primal_copy.default})
# Ops that return non-tensors but read only metadata, or that only tag a fresh tensor.
_PASSTHROUGH_OPS = {
    _aten.lift_fresh.default, _aten.is_same_size.default,
    _aten._has_compatible_shallow_copy_type.default, _aten.sym_size.int, _aten.sym_stride.int,
    _aten.sym_numel.default, _aten.sym_storage_offset.default, _aten.dim.default,
    _aten.is_coalesced.default,
}
# Output shapes that follow from float arguments (scale factors) or Python numbers (ranges).
_STRUCTURAL_NAMES = ("upsample", "_upsample", "arange", "range", "linspace", "logspace")
_SCALAR_TYPES = {"number", "Optional[number]"}
_TENSOR_RETURNS = {"Tensor", "List[Tensor]", "Optional[Tensor]"}


class OpSpec:
    """The per-op facts the hot path needs, computed once (see Note [op policy])."""

    __slots__ = ("op", "name", "policy", "reason", "scalar_pos", "scalar_kw", "structural",
                 "ret_alias", "bool_index", "view_arg", "host_learns", "writes", "functional")

    def __init__(self, op: torch._ops.OpOverload) -> None:
        self.op = op
        self.name = str(op)
        schema = op._schema
        args = schema.arguments
        self.scalar_pos = frozenset(
            i for i, a in enumerate(args) if not a.kwarg_only and str(a.type) in _SCALAR_TYPES)
        self.scalar_kw = frozenset(
            a.name for a in args if a.kwarg_only and str(a.type) in _SCALAR_TYPES)
        no_tensor_args = not any("Tensor" in str(a.type) for a in args)
        base = op.__name__.split(".")[0]
        self.structural = no_tensor_args or base.startswith(_STRUCTURAL_NAMES) or any(
            "float[]" in str(a.type) or "List[float]" in str(a.type) for a in args)
        self.ret_alias = _return_aliases(schema)
        self.view_arg = _view_arg(schema)
        if self.view_arg is None and op in _UNSAFE_VIEWS:  # Note [unsafe views]
            self.view_arg = 0
        self.writes = _written_args(schema)  # Note [read guard] in mode.py
        self.bool_index = op in (_aten.index.Tensor, _aten._unsafe_index.Tensor)
        self.policy, self.reason = _classify(op, schema)
        if self.policy == DEFER and op in GRAD_MODE_OPS:  # Note [grad-mode kernels] in engine.py
            self.policy, self.reason = GRAD_MODE, "deferred; its kernel reads the grad mode"
        if self.policy == DEFER and op in CHECKS:  # Note [value checks] in dispatch/bounds.py
            self.policy, self.reason = CHECKED, "deferred once its index values are in bounds"
        self.host_learns = 0  # host-scalar runs whose metadata was learned (engine.run_host_scalar)
        # OUT: (the functional overload's spec, the out argument names in return order)
        self.functional: tuple[OpSpec, tuple[str, ...]] | None = None
        if self.policy == OUT:
            self.functional = _functional_of(op)
            if self.functional is None:
                self.policy, self.reason = FALLBACK, "out= variant without a deferrable functional"

    # A spec stands for its op in trace keys (it hashes by identity, an OpOverload in Python):
    # it prints as the op, so digests and explanations read the same as with the op itself.
    def __repr__(self) -> str:
        return repr(self.op)

    def __str__(self) -> str:
        return self.name


def _return_aliases(schema: torch._C.FunctionSchema) -> tuple[int | None, ...]:
    """For each return, the positional argument it writes to and returns (in-place ops)."""
    writers: dict[frozenset[str], int] = {}
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is not None and info.is_write and not a.kwarg_only:
            writers[frozenset(info.before_set)] = i
    out: list[int | None] = []
    for r in schema.returns:
        info = r.alias_info
        out.append(writers.get(frozenset(info.before_set)) if info is not None and info.is_write
                   else None)
    return tuple(out)


def _view_arg(schema: torch._C.FunctionSchema) -> int | None:
    """For view ops (a return aliases an argument without writing it): that argument's index.

    Views of real tensors run at once (Note [views of real tensors] in engine.py)."""
    text = str(schema)
    rets = text.rsplit(" -> ", 1)[-1]
    found = re.search(r"Tensor\((\w+)\)", rets)  # Tensor(a) or Tensor(a)[] (split, unbind)
    if found is None or "!" in rets:
        return None
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is not None and not info.is_write and found.group(1) in info.before_set:
            return i if not a.kwarg_only else None
    return None


def _written_args(schema: torch._C.FunctionSchema) -> tuple[int | str, ...] | None:
    """The arguments an op writes (positions; names of keyword-only ones, such as out=), or None."""
    out = tuple(a.name if a.kwarg_only else i for i, a in enumerate(schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write)
    return out or None


def _classify(op: torch._ops.OpOverload, schema: torch._C.FunctionSchema) -> tuple[int, str]:
    ns = op.namespace
    if ns == "profiler":
        return PASSTHROUGH, "profiler range"  # trap 4: every optimizer step records these
    if op in _PASSTHROUGH_OPS:
        return PASSTHROUGH, "metadata only"
    if ns == "_c10d_functional" and op._schema.name.split("::")[-1] in _collectives():
        return DEFER, "functional collective, run in program order"
    if ns != "aten":
        why = _custom_op_fallback(op, ns)
        if why is not None:
            return FALLBACK, why
        if _fake_is_data_dependent(op):
            return SYNC, "custom op whose output shape depends on tensor values"
    if any(a.is_out for a in schema.arguments):
        if ns == "aten" and all(str(a.type) == "Tensor" for a in schema.arguments if a.is_out):
            return OUT, "out= variant: its functional op, then a copy into the out"
        return FALLBACK, "out= variant (may resize its output)"
    for a in schema.arguments:
        t = str(a.type)
        if "Storage" in t or "Stream" in t:
            return FALLBACK, f"argument type {t}"
    tags = op.tags
    if torch.Tag.inplace_view in tags:
        return INPLACE_VIEW, "changes a tensor's shape or strides in place"
    if op in _ALLOC_OPS:
        return ALLOC, "allocation"
    if torch.Tag.nondeterministic_seeded in tags:
        return RANDOM, "random"
    if torch.Tag.data_dependent_output in tags:
        return SYNC, "result depends on tensor values"
    if op in _DATA_SHAPED:
        return SYNC, "output shape depends on tensor values (untagged)"
    if op in _FORWARD_AD:
        return FALLBACK, "forward-mode AD (its kernel reads the dual-level state)"
    if op is _aten._efficientzerotensor.default:  # a ZeroTensor has no storage to replay on
        return FALLBACK, "ZeroTensor (forward-mode AD's zero tangents): no storage"
    if torch.Tag.dynamic_output_shape in tags and op not in (_aten.index.Tensor,
                                                                _aten._unsafe_index.Tensor):
        return SYNC, "output shape depends on tensor values"
    for r in schema.returns:
        if str(r.type) not in _TENSOR_RETURNS:
            return SYNC, f"returns {r.type}"
    return DEFER, "deferred"


def _functional_of(op: torch._ops.OpOverload) -> tuple[OpSpec, tuple[str, ...]] | None:
    """The deferrable functional overload of an out= op: the overload of the same op whose
    arguments are the out= op's minus its outs (same names and types) and which returns one
    tensor per out (Note [out= ops] in dispatch/outvariant.py)."""
    schema = op._schema
    outs = tuple(a.name for a in schema.arguments if a.is_out)
    want = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
    packet = getattr(torch.ops.aten, schema.name.split("::")[-1], None)
    if packet is None:
        return None
    for name in packet.overloads():
        cand = getattr(packet, name)
        cs = cand._schema
        if cand is op or any(a.is_out or (a.alias_info is not None and a.alias_info.is_write)
                             for a in cs.arguments):
            continue
        if [(a.name, str(a.type)) for a in cs.arguments] != want or len(cs.returns) != len(outs):
            continue
        if any(str(r.type) != "Tensor" or r.alias_info is not None for r in cs.returns):
            continue
        fspec = spec_for(cand)
        if fspec.policy != DEFER or fspec.view_arg is not None:
            return None
        return fspec, outs
    return None


def _collectives() -> frozenset[str]:
    """Functional collectives deferred into traces (Note [collectives in traces] in
    distributed.py; the slot installs the hooks they need); none before the package is
    imported (Note [hook slots] in core/hooks.py)."""
    return hooks.collectives() if hooks.collectives is not None else frozenset()


# Namespaces whose ops act outside the tensors they are given (communication, runtime state).
_EFFECT_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor",
                      "_quantized", "profiler", "prims", "debugprims", "inductor", "higher_order",
                      "_inductor_test", "fsdp", "streams", "debug_mode_ops", "rngprims",
                      "symm_mem", "_c10d", "triton", "torchbind")


def _custom_op_fallback(op: torch._ops.OpOverload, ns: str) -> str | None:
    """Why a non-aten op cannot be deferred, or None when it is a user op with a fake impl
    (Note [custom ops])."""
    if ns in _EFFECT_NAMESPACES:
        return f"non-aten op ({ns})"
    if not has_fake_impl(op):
        return f"non-aten op ({ns}) without a fake impl"
    return None


def has_fake_impl(op: torch._ops.OpOverload) -> bool:
    """Whether the user registered a fake (meta) implementation for ``op``."""
    return _fake_fn(op) is not None


def _fake_fn(op: torch._ops.OpOverload) -> Any:
    try:
        from torch._library.custom_ops import OPDEFS
        from torch._library.simple_registry import singleton
    except ImportError:  # pragma: no cover - a torch without the custom-op library
        return None
    opdef = OPDEFS.get(op._name)
    if opdef is not None:
        # custom_op always registers a fake kernel that raises until register_fake is called
        return opdef._abstract_fn
    kernel = singleton.find(op._name).fake_impl.kernel
    return None if kernel is None else getattr(kernel, "func", kernel)


_DYNAMIC_NAMES = frozenset({"get_ctx", "new_dynamic_size", "new_unbacked_symint",
                            "create_unbacked_symint"})


def _fake_is_data_dependent(op: torch._ops.OpOverload) -> bool:
    """Whether the fake impl makes output sizes from data (``torch.library.get_ctx()``'s
    ``new_dynamic_size``): output metadata learned from one run would be wrong for the next
    values, so such ops are sync points. Read from the names its code uses (nested functions
    too); a fake impl that hides the call in a helper elsewhere is not seen."""
    fn = _fake_fn(op)
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    todo = [code] if code is not None else []
    while todo:
        c = todo.pop()
        if _DYNAMIC_NAMES.intersection(c.co_names):
            return True
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return False


SPECS: dict[torch._ops.OpOverload, OpSpec] = {}


def spec_for(op: torch._ops.OpOverload) -> OpSpec:
    spec = SPECS.get(op)
    if spec is None:
        spec = SPECS[op] = OpSpec(op)
        try:  # the dispatch mode reads it from here: no dict lookup, no Python __hash__
            op._ae_spec = spec  # type: ignore[union-attr]
        except AttributeError:  # an op object without a __dict__: the dict lookup serves
            pass
    return spec


hooks.spec_for = spec_for  # Note [hook slots] in core/hooks.py
