"""In-process caches: a trie of known traces, and output metadata per (op, input metadata).

Note [trie of traces]
A trace is a sequence of op keys. Each key names the op, its inputs as trace-relative references
(an int >= 0 is the slot of an output made earlier in this trace; ~i is the i-th external tensor;
a tuple ('x', meta id, storage group) registers a new external), and its non-tensor arguments
(Python floats and Scalars by type only, so a changing learning rate is not a new trace). Because
the metadata of every slot follows from the path, a trie node can hold the output metadata of its
op: walking a known path records ops without any shape inference. A node where a trace ended
carries a ``TraceEntry``; ending there again is a trace hit. Nodes carry a stable xxh3-128 digest of
their path, computed once when the node is made, so a trace's key is known the moment it ends.

Note [metadata by running]
Off the trie, output metadata comes from ``MetaCache``: one entry per (op, metadata of each tensor
input, non-tensor arguments, default dtype). On a miss the op is run eagerly once, on real inputs,
and its real outputs' metadata are stored. That makes metadata exact (meta kernels disagree with
CPU kernels on strides for some ops, DESIGN trap 14) and errors eager's own (trap 7).
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from adaptive_eager.core.meta import METAS_BY_ID
from adaptive_eager.dispatch.ambient import root_state

# What an output of a recorded op is: a Meta (new lazy tensor), an int (the positional argument an
# in-place op returns), None, or a tuple/list of those.
OutSpec = Any


def stable_repr(key: Any) -> str:
    """A process-independent text for a key (op names, dtypes, ints; types by name).

    An external's key part ``('x', meta id, group)`` is written with the metadata itself: meta
    ids are numbered in the order a process first sees each shape, so two runs of one script
    that meet shapes in another order (calibration on or off, a different first batch) would
    otherwise give one trace two digests and miss the disk cache."""
    if isinstance(key, tuple):
        if len(key) == 3 and key[0] == "x" and type(key[1]) is int:
            m = METAS_BY_ID[key[1]] if 0 <= key[1] < len(METAS_BY_ID) else None
            if m is not None:
                return f"(x,{m.key!r},{key[2]!r})"
        return "(" + ",".join(stable_repr(k) for k in key) + ")"
    if isinstance(key, type):
        return key.__name__
    return repr(key)


class TraceEntry:
    """A trace that has ended at least once, with its statistics and its program."""

    __slots__ = ("digest", "runs", "hits", "n_ops", "node", "state", "program", "program_live",
                 "replay_s", "fused_s", "compile_s", "decision", "future", "disk_checked",
                 "fused_runs", "error", "scalar_ref", "varying", "graph", "was_hot", "loaded_state",
                 "from_bytes", "in_process", "observed", "rebakes", "replay_plan", "release_plan",
                 "paired_s", "sym", "fused_n", "paired_n", "decided_s", "alias_fix")

    def __init__(self, node: TrieNode, n_ops: int) -> None:
        self.node = node
        self.digest = node.digest.hex()
        self.runs = 0
        self.hits = 0
        self.n_ops = n_ops
        self.state = "new"  # new | compiling | measuring | fused | replay | failed | quarantined
        self.program: Any = None
        self.program_live: frozenset[int] = frozenset()
        self.replay_s: list[float] = []  # recent op-by-op timings
        self.fused_s: list[float] = []  # recent fused timings
        self.paired_s: list[float] = []  # op-by-op runs between measured fused runs (Note [paired timing])
        # a symbolic trace's size at each of those runs (Note [timing at one size])
        self.fused_n: list[int] = []
        self.paired_n: list[int] = []
        # (fused, op by op) seconds the keep decision compared: what goes to disk as this
        # process's sample (Note [persisted decisions] in compile/programs.py)
        self.decided_s: tuple[float, float] | None = None
        self.compile_s = 0.0
        self.decision = ""
        self.future: Any = None
        self.disk_checked = False
        self.fused_runs = 0
        self.error = ""
        self.scalar_ref: list[Any] | None = None  # Python numbers of the first run
        self.varying: set[int] = set()  # positions of numbers that changed between runs
        self.observed = 0  # runs whose numbers a compiling backend compared (observe)
        self.rebakes = 0  # recompiles because a baked-in number changed after the compile
        self.graph: Any = None  # the TraceGraph the program was built from
        self.was_hot = False  # an earlier process found this trace hot
        self.loaded_state = "measuring"  # state once the pending compile or load is done
        self.from_bytes = False  # the program was deserialized (helper process or disk)
        self.in_process = False  # compile here only: its deserialized program failed to run
        self.replay_plan: list[tuple] | None = None  # Note [replay call plan] in execute.py
        self.release_plan: tuple | None = None  # (live slots, drops by op) of the last replay
        self.sym: Any = None  # the shapes.Template this entry serves (Note [symbolic dims])
        # (program, its outputs' alias repairs): Note [output aliasing] in graph.py
        self.alias_fix: tuple[Any, tuple] | None = None

    def summary(self) -> dict:
        return {"trace": self.digest, "runs": self.runs, "hits": self.hits, "n_ops": self.n_ops,
                "state": self.state, "decision": self.decision,
                "compile_s": round(self.compile_s, 4),
                "replay_ms": _median_ms(self.replay_s), "fused_ms": _median_ms(self.fused_s),
                # op by op between fused runs (Note [paired timing]): what a fused run saves
                "paired_ms": _median_ms(self.paired_s),
                "fused_runs": self.fused_runs, "error": self.error}

    def op_listing(self, limit: int) -> list[list[str]]:
        """[op name, source line] from the first op of the trace to its end."""
        ops = []
        node: TrieNode | None = self.node
        while node is not None and node.key is not None:
            ops.append([str(node.key[0]), node.where or ""])
            node = node.parent
        ops.reverse()
        return ops[:limit]


def _median_ms(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[len(s) // 2] * 1e3, 4)


class TrieNode:
    __slots__ = ("children", "out", "digest", "entry", "depth", "parent", "key", "where", "sym")

    def __init__(self, out: OutSpec, digest: bytes, depth: int, parent: TrieNode | None = None,
                 key: tuple | None = None, where: str | None = None) -> None:
        self.children: dict[tuple, TrieNode] = {}
        self.out = out
        self.digest = digest
        self.entry: TraceEntry | None = None
        self.depth = depth
        self.parent = parent
        self.key = key
        self.where = where  # user source line of the op, when it was first recorded
        # Note [symbolic dims] (shapes.py): a list of templates anchored here, or (template,
        # next step) on a template's own nodes; read only when a key misses ``children``
        self.sym: Any = None

    def child(self, key: tuple, out: OutSpec, where: str | None = None) -> TrieNode:
        node = self.children.get(key)
        if node is None:
            digest = xxhash.xxh3_128_digest(self.digest + stable_repr(key).encode())
            node = self.children[key] = TrieNode(out, digest, self.depth + 1, self, key, where)
            if HOOKS.pending:
                HOOKS.new_node(node)
        return node


class TraceTrie:
    """All traces seen in this process, one root per default dtype and ambient state."""

    def __init__(self) -> None:
        self.roots: dict[tuple, TrieNode] = {}
        self._last: tuple[Any, Any, TrieNode | None] = (None, None, None)
        self.entries = 0
        self.entry_list: list[TraceEntry] = []

    def root(self, default_dtype: torch.dtype) -> TrieNode:
        """The root of traces recorded under this default dtype and the current ambient state
        (Note [ambient state]: a flag change is a flush point, and starts another trace)."""
        state = root_state()
        last = self._last
        if last[0] is default_dtype and last[1] is state and last[2] is not None:
            return last[2]  # the common case, once per flush: no hash of the state
        key = (default_dtype, state)
        node = self.roots.get(key)
        if node is None:
            seed = xxhash.xxh3_128_digest(f"adaptive_eager trace v3 {key!r}".encode())
            node = self.roots[key] = TrieNode(None, seed, 0)
            if HOOKS.pending:
                HOOKS.new_node(node)
        self._last = (default_dtype, state, node)
        return node

    def add_entry(self, node: TrieNode, n_ops: int, learn: bool = True) -> TraceEntry:
        entry = node.entry = TraceEntry(node, n_ops)
        self.entries += 1
        self.entry_list.append(entry)
        if learn and HOOKS.new_entry is not None:
            HOOKS.new_entry(entry)  # Note [symbolic dims]: a new trace may show a varying size
        return entry

    def drop_root(self, key: tuple) -> None:
        self.roots.pop(key, None)
        self._last = (None, None, None)

    def clear(self) -> None:
        self.roots.clear()
        self._last = (None, None, None)
        self.entries = 0
        self.entry_list.clear()
        if HOOKS.clear is not None:
            HOOKS.clear()


class _Hooks:
    """Set by shapes.py (which imports this module): learning on new entries, stored
    templates attached when their anchor node is made (``pending``: any stored at all)."""

    new_entry: Any = None
    new_node: Any = None
    clear: Any = None
    meta_put: Any = None
    pending = False


HOOKS = _Hooks()


class MetaCache:
    """Output metadata of ops already run, by op + input metadata (Note [metadata by running])."""

    def __init__(self) -> None:
        self.table: dict[tuple, OutSpec] = {}
        # outputs with storage of their own, by a key without pending inputs' offsets (Note
        # [fresh outputs ignore offsets] in metadata.py)
        self.fresh: dict[tuple, OutSpec] = {}

    def get(self, key: tuple, default: Any = None) -> OutSpec:
        return self.table.get(key, default)

    def put(self, key: tuple, out: OutSpec) -> None:
        self.table[key] = out
        if HOOKS.meta_put is not None:
            HOOKS.meta_put(key, out)  # Note [symbolic dims], single ops (shapes.py)

    def clear(self) -> None:
        self.table.clear()
        self.fresh.clear()


TRIE = TraceTrie()
META_CACHE = MetaCache()
