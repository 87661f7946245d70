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

# What an output of a recorded op is: a Meta (new lazy tensor), an int (the positional argument an
# in-place op returns), None, or a tuple/list of those.
OutSpec = Any


def stable_repr(key: Any) -> str:
    """A process-independent text for a key (op names, dtypes, ints; types by name)."""
    if isinstance(key, tuple):
        return "(" + ",".join(stable_repr(k) for k in key) + ")"
    if isinstance(key, type):
        return key.__name__
    return repr(key)


class TraceEntry:
    """A trace that has ended at least once, with its statistics."""

    __slots__ = ("digest", "runs", "n_ops", "node")

    def __init__(self, node: TrieNode, n_ops: int) -> None:
        self.node = node
        self.digest = node.digest.hex()
        self.runs = 0
        self.n_ops = n_ops


class TrieNode:
    __slots__ = ("children", "out", "digest", "entry", "depth")

    def __init__(self, out: OutSpec, digest: bytes, depth: int) -> None:
        self.children: dict[tuple, TrieNode] = {}
        self.out = out
        self.digest = digest
        self.entry: TraceEntry | None = None
        self.depth = depth

    def child(self, key: tuple, out: OutSpec) -> TrieNode:
        node = self.children.get(key)
        if node is None:
            digest = xxhash.xxh3_128_digest(self.digest + stable_repr(key).encode())
            node = self.children[key] = TrieNode(out, digest, self.depth + 1)
        return node


class TraceTrie:
    """All traces seen in this process, one root per ambient default dtype."""

    def __init__(self) -> None:
        self.roots: dict[torch.dtype, TrieNode] = {}
        self.entries = 0

    def root(self, default_dtype: torch.dtype) -> TrieNode:
        node = self.roots.get(default_dtype)
        if node is None:
            seed = xxhash.xxh3_128_digest(f"adaptive_eager trace v1 {default_dtype}".encode())
            node = self.roots[default_dtype] = TrieNode(None, seed, 0)
        return node

    def clear(self) -> None:
        self.roots.clear()
        self.entries = 0


class MetaCache:
    """Output metadata of ops already run, keyed by op + input metadata (Note [metadata by running])."""

    def __init__(self) -> None:
        self.table: dict[tuple, OutSpec] = {}

    def get(self, key: tuple, default: Any = None) -> OutSpec:
        return self.table.get(key, default)

    def put(self, key: tuple, out: OutSpec) -> None:
        self.table[key] = out

    def clear(self) -> None:
        self.table.clear()


TRIE = TraceTrie()
META_CACHE = MetaCache()
