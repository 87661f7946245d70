"""A trace: the ops deferred since the last flush, over numbered slots and external tensors."""

from __future__ import annotations

from typing import Any

import torch

from adaptive_eager.cache.memory import TRIE, TrieNode
from adaptive_eager.core.errors import Unsupported
from adaptive_eager.core.meta import intern_meta, meta_of
from adaptive_eager.dispatch.lazy import LazyTensor
from adaptive_eager.dispatch.outside import ESCAPED, escaped

_DisableFunction = torch._C.DisableTorchFunction
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.parameter.Buffer)
_storage = torch._C.TensorBase.untyped_storage  # not torch.Tensor's wrapper (mode.install_hooks)


class Slot:
    """Marks, inside a recorded op's arguments, the output of an earlier op of the same trace."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"%{self.i}"


SLOTS: list[Slot] = [Slot(i) for i in range(8192)]  # shared markers: no allocation per op
COMPARE_BUDGET = 50_000  # op comparisons loop_period may make at one cap flush


def slot_marker(i: int) -> Slot:
    while len(SLOTS) <= i:
        SLOTS.append(Slot(len(SLOTS)))
    return SLOTS[i]


class Trace:
    """Append-only list of deferred ops.

    ``ops`` holds ``(op, args, kwargs, out_slots)`` with pending inputs as ``Slot`` markers.
    ``refs[s]`` is a weak reference to the lazy tensor of slot ``s`` (dead once the user dropped
    it), ``last[s]`` the index of the last op reading it, ``scalars`` the Python numbers keyed by
    type only, in recording order. ``ext`` are the tensors that come from outside the
    trace (parameters, inputs, values of earlier traces), numbered by first use; ``groups`` maps a
    storage address to the index of its alias group, so aliasing between inputs is part of the key.
    """

    __slots__ = ("engine", "ops", "ext", "ext_ids", "groups", "n_slots", "node", "start",
                 "off_keys", "off_outs", "off_where", "off_node", "refs", "last", "scalars",
                 "after_warmup", "grad_ops", "sym")

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.ops: list[tuple] = []
        self.ext: list[torch.Tensor] = []
        self.ext_ids: dict[int, int] = {}
        self.groups: dict[int, int] = {}
        self.n_slots = 0
        self.refs: list[Any] = []
        self.last: list[int] = []
        self.scalars: list[Any] = []
        self.after_warmup = False  # started right after a flush that learned a new op
        self.grad_ops: dict[int, bool] = {}  # op index -> grad mode (Note [grad-mode kernels])
        self.start: TrieNode = TRIE.root(torch.get_default_dtype())
        self.node: TrieNode | None = self.start  # None once the trace leaves the trie
        self.off_node: TrieNode | None = None  # last trie node before it left
        self.off_keys: list[tuple] = []
        self.off_outs: list[Any] = []
        self.off_where: list[str] = []
        self.sym: Any = None  # shapes.SymTrace: what learnt formulas gave (Note [symbolic dims])

    def register(self, t: torch.Tensor) -> tuple:
        """Number a tensor from outside the trace; return its key part ('x', meta id, group).

        The C accelerator numbers the common case itself (Note [first uses in C] in _hot.c): a
        change here must be made there too (tests/test_accel.py compares the two)."""
        with _DisableFunction():
            if type(t) is LazyTensor:
                meta = t._ae_meta
                real = t._ae_real
                owner = t._ae_trace.engine
                if owner is not self.engine:  # another thread's value: its owner must keep
                    owner.shared = True       # the object a lazy tensor (Note [threads ...])
            else:
                if type(t) not in _PLAIN:
                    raise Unsupported(f"tensor subclass {type(t).__name__}")
                if t.layout is not torch.strided or t.is_quantized or t.is_nested:
                    raise Unsupported(f"{t.layout} tensor")
                if t.device.type == "meta":
                    raise Unsupported("meta tensor")
                meta = meta_of(t)
                real = t
            try:
                addr = _storage(real).data_ptr()
            except RuntimeError:  # no storage (a ZeroTensor of forward-mode AD): run it now
                raise Unsupported("tensor without storage") from None
        if ESCAPED and addr in ESCAPED and escaped(addr):  # Note [memory the outside can see]
            raise Unsupported("memory visible outside torch")
        group = self.groups.setdefault(addr, len(self.groups))
        self.ext_ids[id(t)] = len(self.ext)
        self.ext.append(t)
        # The storage offset is left out: no deferred op's output metadata depends on an
        # external's offset, since views of real tensors are made at once (engine.run_view).
        sig = intern_meta(meta.size, meta.stride, 0, meta.dtype, meta.device, meta.bits)
        return ("x", sig.mid, group)

    def forget(self, n_ext: int, n_scalars: int) -> None:
        """Note [unrecorded op's inputs]
        An op's inputs are numbered while its key is built; when the op is then not recorded
        (its metadata needs a real run, an argument is unsupported, it must run now) the
        externals and numbers it added belong to no op. Left in place they made two runs of
        one trace (one key) differ in their externals: a program's input plan, built at a run
        with such leftovers (a nested tensor's pieces), indexed past the next run's externals
        (IndexError in a fused run), and could as well have picked the wrong tensor."""
        with _DisableFunction():
            for t in self.ext[n_ext:]:
                self.ext_ids.pop(id(t), None)
            del self.ext[n_ext:]
            del self.scalars[n_scalars:]
            keep = {_storage(t._ae_real if type(t) is LazyTensor else t).data_ptr()
                    for t in self.ext}
            for addr in [a for a in self.groups if a not in keep]:
                del self.groups[addr]

    def touches_storage(self, t: torch.Tensor) -> bool:
        """Whether a real tensor shares storage with an input of this trace (pending writes).
        A sparse or other storage-less tensor may hold any of them (its indices and values):
        it counts as touching the trace whenever the trace has inputs."""
        if t.layout is not torch.strided:
            return bool(self.groups)
        with _DisableFunction():
            return _storage(t).data_ptr() in self.groups

    def leave_trie(self) -> None:
        self.off_node = self.node
        self.node = None



def _same_step(a: tuple, b: tuple) -> bool:
    """Two recorded ops alike for loop_period: one overload, pending (Slot) arguments at the
    same places. The places tell a loop's first iteration (reading an outside tensor) from the
    later ones (reading the previous iteration's output)."""
    if a[0] is not b[0]:
        return False
    ma, mb = a[1], b[1]
    if len(ma) != len(mb):
        return False
    for x, y in zip(ma, mb):
        if (type(x) is Slot) is not (type(y) is Slot):
            return False
    return True


def loop_period(ops: list, most: int) -> int:
    """The sequence's period: the smallest P <= ``most`` such that every op from the second
    period on repeats the op P before it (overload, and where its arguments are pending), or 0.
    The first period is left out: a trace that starts mid-loop reads from outside there what
    the loop later reads from itself.

    Note [cap at the loop's period]
    A loop in one long context with no sync, no module call and no optimizer step (a simulation,
    ``tiny_ops`` run under ``ADAPTIVE_EAGER=1``) is cut only by the trace cap. When the loop's
    period P does not divide the cap, every cut starts the next trace at another phase of the
    loop: 4096 ops of a 200-op step make 25 different traces, each compiled once it is hot (12
    compiles of 4096 ops were in flight after 2 minutes) and hit once in 25 flushes. At a cap
    flush the engine takes the cap down to the largest multiple of P (4000): from the second
    trace on, every trace starts at the same phase and is the same trace. The period is that of
    the whole step, not of its inner loop: 40 iterations of 5 ops look 5-periodic by overloads
    alone, but the first iteration reads the step's input from outside (a cap of 4095 made 40
    phases). Where the cut falls changes no result (a flush is valid anywhere); a wrong P only
    moves it. Comparisons are bounded (COMPARE_BUDGET) at each cap flush."""
    n = len(ops)
    if n < 2:
        return 0
    end = ops[-1]
    budget = COMPARE_BUDGET
    for p in range(1, min(most, n // 3) + 1):
        budget -= 1
        if budget <= 0:
            return 0
        if not _same_step(ops[n - 1 - p], end):
            continue
        for i in range(n - 2, 2 * p - 1, -1):  # from the end: a wrong P fails within a period
            budget -= 1
            if not _same_step(ops[i], ops[i - p]):
                break
        else:
            return p
    return 0
