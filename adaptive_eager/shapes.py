"""Symbolic dimensions: one trie path for every value of a varying size.

Note [symbolic dims]
A trace key holds concrete sizes (an external tensor's metadata, the ints of ``view`` sizes,
``slice`` ends, ``arange`` ends), and every trie node holds the concrete output metadata of its
op (Note [trie of traces]). So a program whose sequence length changes per batch makes a new
trie path per length, and the first sight of each length runs every op eagerly once to learn
its metadata (Note [metadata by running]). Two layers of learning fix both, each fitted from
observations and checked against real outputs before it is trusted for a size.

Fitting (sizefit.py). An observation is reduced to a *skeleton* (its keys and output metadata
with every fittable int replaced by a hole: external and output sizes, strides and offsets, int
arguments; slot references, alias groups, dtypes and the rest stay, so two observations share a
skeleton only if they run the same ops on the same wiring) and the vector of those ints.
Observations of one site at different sizes agree exactly at the site's constant positions, so
the pool of a skeleton (several sites may share one: the q, k and v of attention, every mm of a
backward) is bucketed by (positions that differ from the newest observation, the values where
they agree); a bucket of two earlier observations (three when a position is quadratic, as the
strides of ``[B, H, T, T]`` scores are) is fitted: the first differing key int is the symbol
``s`` and every position is a polynomial in ``s`` of degree at most 2 with rational
coefficients, confirmed by one observation more than it has coefficients. Positions that never
changed stay static, even where they equal ``s`` once. Observations with ``s`` in {0, 1} are
never used (broadcasting and contiguity rules change there). Cost: a pass over the pool per
observation, on the cold path only (an eager metadata run, a new trace).

Single ops (``Family``, ``predict``). The metadata cache learns per skeleton of its keys (op,
input metadata, int arguments): a fitted family predicts the outputs of the next size, so after
three sizes a new size records its whole trace with no eager run (first sights no longer cut
traces into fragments).

Traces (``Template``). New trace entries are fitted the same way over their whole path; the
result hangs on the trie node where the observed paths diverge (the *anchor*, usually the
root). Recording is unchanged until a key misses the trie's concrete children (static traces
pay nothing: the check is on the miss branch of ``engine.record``); at an anchor the key is
matched against each template's first step (longest template first), which binds ``s``; later
keys are matched against the following steps and output metadata is evaluated from the
polynomials (a few integer operations per output), so the trace ends at the template's one
entry for every ``s``: a trie hit. A key that differs in anything but the fitted positions, or a
value that is not a non-negative integer, leaves the template: another template with the same
first steps may go on, else the steps so far become a concrete path below the anchor and the
trace continues as a static one (so it is learnt from, and no static path ever hangs below a
template node where another ``s`` would find it).

Checking (``replay_checked``). The first op-by-op run at each value of ``s`` keeps every value of
the trace and compares the real metadata of every predicted output with the prediction. A
disagreement is counted (``sym_mispredicted``), the template or family is dropped (a template
also on disk), the trie keeps eager's metadata for that op, and the live lazy tensors get the
real metadata (``as_strided_``); their values are eager's for the recorded ops. Python code that
read a mispredicted shape before the flush may have acted on it: that cannot be undone, which is
why a fit needs a confirming observation. Later runs at a verified ``s`` check only what
``check`` checks.

Why fitted formulas and not FakeTensor + ShapeEnv: a fit costs nothing per op beyond matching
the key and evaluating a few integer polynomials, gives the CPU kernels' own strides (fake
kernels disagree for some ops, DESIGN trap 14), and needs no symbolic run of the trace (55-890
µs per op on fake tensors, once per template). It knows only what it saw: piecewise behaviour
outside the observed sizes is caught by the check above, not predicted.

Persistence. A template is stored in the disk cache (a ``stats:symdims-...`` entry: JSON under the
cache's HMAC like every value, Note [cache values are data, verified first]; op names, dtypes and
sizes, nothing executable) keyed by its anchor's digest; the next process attaches it when that
trie node is made, and checks each ``s`` again. Families are not stored (a loaded template
needs none).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import xxhash

from adaptive_eager.cache import memory
from adaptive_eager.cache.memory import TRIE, TraceEntry, TrieNode, stable_repr
from adaptive_eager.dispatch.lazy import METAS_BY_ID, Meta, intern_meta, meta_of
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.sizefit import (MIN_OBS, ExtPat, Poly, arg_kinds, leaf_match, search_fit,
                                    slope_fits)

log = logging.getLogger("adaptive_eager")

_GROUP_MAX = 8  # observations kept per skeleton
_MISSING = object()
_DisableDispatch = torch._C._DisableTorchDispatch
_DisableFunction = torch._C.DisableTorchFunction

ENABLED = True


class _Hole:
    __slots__ = ()

    def __repr__(self) -> str:
        return "?"


HOLE = _Hole()


class OutPat:
    """An output's metadata with fitted sizes, strides and offset."""

    __slots__ = ("size", "stride", "offset", "dtype", "device", "bits", "memo")

    def __init__(self, size: tuple, stride: tuple, offset: Any, dtype: torch.dtype,
                 device: torch.device, bits: int) -> None:
        self.size, self.stride, self.offset = size, stride, offset
        self.dtype, self.device, self.bits = dtype, device, bits
        self.memo: dict[int, Meta | None] = {}  # s -> metadata (sizes recur)

    def eval(self, s: int) -> Meta | None:
        got = self.memo.get(s, _MISSING)
        if got is _MISSING:
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


def _match(t: Any, c: Any, st: list) -> bool:
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
            if a is not b and not _match(a, b, st):
                return False
        return True
    return tt is type(c) and t == c


# ---- key walking: which ints of a key or an output may be fitted --------------------------
def _walk_key(key: tuple, emit: Any) -> tuple:
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


def _walk_out(out: Any, emit: Any) -> Any:
    t = type(out)
    if t is Meta:
        return OutPat(tuple(emit(v) for v in out.size), tuple(emit(v) for v in out.stride),
                      emit(out.offset), out.dtype, out.device, out.bits)
    if t is tuple or t is list:
        return t(_walk_out(o, emit) for o in out)
    return out  # an int (in-place op returns its argument) or None


def _out_skel(out: Any) -> Any:
    t = type(out)
    if t is OutPat:
        return ("M", len(out.size), out.dtype, out.device, out.bits)
    if t is tuple or t is list:
        return (t, tuple(_out_skel(o) for o in out))
    return out


def _key_skel(k: Any) -> Any:
    t = type(k)
    if t is ExtPat:
        return ("X", len(k.size), k.dtype, k.device, k.bits)
    if t is tuple:
        return tuple(_key_skel(x) for x in k)
    return k


def _path(node: TrieNode) -> list[TrieNode]:
    nodes = []
    while node.key is not None:
        nodes.append(node)
        node = node.parent  # type: ignore[assignment]
    nodes.reverse()
    return nodes


class _Obs:
    """One observed trace, reduced: its nodes, and per step the fittable ints (key, out)."""

    __slots__ = ("nodes", "kvals", "ovals", "skel")

    def __init__(self, entry: TraceEntry) -> None:
        self.nodes = _path(entry.node)
        root = entry.node
        while root.parent is not None:
            root = root.parent
        self.kvals: list[list[int]] = []
        self.ovals: list[list[int]] = []
        skel = []
        for node in self.nodes:
            kv: list[int] = []
            ov: list[int] = []
            ks = _walk_key(node.key, lambda v: kv.append(v) or HOLE)  # type: ignore[arg-type]
            os_ = _walk_out(node.out, lambda v: ov.append(v) or HOLE)
            self.kvals.append(kv)
            self.ovals.append(ov)
            skel.append((_key_skel(ks), _out_skel(os_)))
        self.skel = (id(root), tuple(skel))


class Template:
    """A fitted trace: steps from an anchor node to one entry, for every value of s."""

    __slots__ = ("anchor", "steps", "nodes", "entry", "verified", "dead", "where", "dims",
                 "seen", "digest", "first", "memo")

    def __init__(self, anchor: TrieNode, steps: list[tuple], wheres: list[str | None],
                 dims: str, seen: list[int]) -> None:
        self.anchor = anchor
        self.steps = steps  # (key, sym?, out, sym out?) per op after the anchor
        # Note [template memo]: matching a key against a step's pattern walks it in Python
        # (GPT-2's step: 7 ms of 272 matches); the concrete keys of one s recur every run at
        # that s, so a key seen at step i for s gives its output metadata by one tuple compare
        self.first: dict[tuple, tuple[int, Any]] = {}  # first-step key -> (s, outputs)
        self.memo: dict[int, dict[int, tuple[tuple, Any]]] = {}  # s -> step -> (key, outputs)
        self.verified: set[int] = set()
        self.dead = False
        self.dims = dims
        self.seen = sorted(seen)
        self.where = next((w for w in wheres if w), "") or ""
        node = anchor
        self.nodes: list[TrieNode] = []
        for (key, _, _, _), where in zip(steps, wheres):
            digest = xxhash.xxh3_128_digest(node.digest + b"sym:" + stable_repr(key).encode())
            nxt = TrieNode(None, digest, node.depth + 1, node, key, where)  # detached: no parent
            nxt.sym = (self, len(self.nodes) + 1)  # ...children: only templates lead here
            self.nodes.append(nxt)
            node = nxt
        self.digest = node.digest.hex()
        self.entry = TRIE.add_entry(node, node.depth, learn=False)
        self.entry.sym = self

    def label(self) -> str:
        return f"{self.dims} at {self.where or '<unknown>'}"


def _steps_from(obs: list[_Obs], d: int, fits_k: list[list], fits_o: list[list]) -> list:
    steps = []
    for i in range(d, len(obs[0].nodes)):
        node = obs[0].nodes[i]
        kit = iter(fits_k[i])
        oit = iter(fits_o[i])
        ksym = any(type(f) is Poly for f in fits_k[i])
        osym = any(type(f) is Poly for f in fits_o[i])
        key = _canon_key(_walk_key(node.key, lambda v: next(kit))) if ksym else node.key
        out = _walk_out(node.out, lambda v: next(oit)) if osym else node.out
        steps.append((key, ksym, out, osym))
    return steps


def _canon_key(key: tuple) -> tuple:
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


# ---- learning ------------------------------------------------------------------------------
class _State:
    def __init__(self) -> None:
        self.groups: dict[Any, list[_Obs]] = {}
        self.done: set[Any] = set()
        self.templates: list[Template] = []
        self.pending: dict[bytes, list[dict]] = {}  # anchor digest -> stored templates
        self.disk: Any = None
        self.loaded_from: str | None = None
        self.dead_digests: set[str] = set()


STATE = _State()


def on_new_entry(entry: TraceEntry) -> None:
    """Called for every new trace entry (memory.TRIE.add_entry): group it, fit when ready."""
    if not ENABLED or entry.sym is not None or entry.node.key is None:
        return
    try:
        _learn(entry)
    except Exception as err:  # learning is an optimisation: never fail the program
        M.engine_errors += 1
        M.engine_error_kinds[f"{type(err).__name__} in shapes.learn"] += 1
        log.debug("adaptive_eager: symbolic learning failed: %s", err, exc_info=True)


def _learn(entry: TraceEntry) -> None:
    node: TrieNode | None = entry.node
    while node is not None:  # a path through a template is that template's, not new
        if type(node.sym) is tuple:
            return
        node = node.parent
    ob = _Obs(entry)
    if not any(ob.kvals):
        return  # no ints at all: nothing could vary
    key = hash(ob.skel)
    group = STATE.groups.setdefault(key, [])
    group[:] = [g for g in group if g.skel == ob.skel] + [ob]
    if len(group) > _GROUP_MAX:
        del group[0]
    if len(group) >= MIN_OBS:
        tpl = _try_fit(group)
        if tpl is not None:
            _attach(tpl)
            _store(tpl)


def _try_fit(group: list[_Obs]) -> Template | None:
    n_steps = len(group[0].nodes)
    vecs = [[v for kv in ob.kvals for v in kv] + [v for ov in ob.ovals for v in ov]
            for ob in group]
    n_key = sum(len(kv) for kv in group[0].kvals)
    got = search_fit(vecs, n_key)
    if got is None:
        return None
    idx, fits = got
    obs = [group[i] for i in idx]
    for i in sorted(idx, reverse=True):
        del group[i]
    kit = iter(fits[:n_key])
    oit = iter(fits[n_key:])
    fits_k = [[next(kit) for _ in kv] for kv in obs[0].kvals]
    fits_o = [[next(oit) for _ in ov] for ov in obs[0].ovals]
    d = next(i for i in range(n_steps) if any(type(f) is Poly for f in fits_k[i]))
    anchor = obs[0].nodes[d].parent
    assert anchor is not None
    if anchor.sym is not None and type(anchor.sym) is not list:
        return None  # never anchor inside another template
    steps = _steps_from(obs, d, fits_k, fits_o)
    if type(anchor.sym) is list and any(t.steps == steps for t in anchor.sym):
        return None  # learnt already (from other sizes)
    dims = _describe(obs[0].nodes[d].key, fits_k[d])
    wheres = [n.where for n in obs[0].nodes[d:]]
    j0 = next(j for j, f in enumerate(fits_k[d]) if type(f) is Poly)
    xs = sorted({ob.kvals[d][j0] for ob in obs})
    return Template(anchor, steps, wheres, dims, xs)


def _describe(key: tuple, fits: list) -> str:
    """'dim 1 of arg 0 (int64 [2, s]) of aten.embedding.default' for the anchor step."""
    it = iter(fits)
    found: list[str] = []

    def emit(v: int) -> Any:
        return next(it)

    canon = _walk_key(key, emit)
    for j, part in enumerate(canon[1:]):
        if type(part) is tuple and len(part) == 3 and type(part[1]) is ExtPat:
            pat = part[1]
            dims = [str(k) for k, v in enumerate(pat.size) if type(v) is Poly]
            shape = ", ".join(v.text() if type(v) is Poly else str(v) for v in pat.size)
            if dims:
                found.append(f"dim {','.join(dims)} of arg {j} ({pat.dtype} [{shape}])")
        elif type(part) is Poly or (type(part) is tuple and any(
                type(x) is Poly or (type(x) is tuple and len(x) == 2 and type(x[1]) is Poly)
                for x in part)):
            found.append(f"int arg {j}")
    return f"{'; '.join(found) or 'sizes'} of {key[0]}"


def _attach(tpl: Template) -> None:
    anchor = tpl.anchor
    if anchor.sym is None:
        anchor.sym = []
    anchor.sym.append(tpl)
    anchor.sym.sort(key=lambda t: -len(t.steps))  # the longest that matches serves
    STATE.templates.append(tpl)
    M.sym_learned += 1
    M.sym_dims[tpl.label()] = 0
    pruned = _prune_static(tpl)
    log.info("adaptive_eager: symbolic dims: %s (seen s = %s): one trace for every value%s",
             tpl.label(), tpl.seen, f" ({pruned} static paths dropped)" if pruned else "")


def _prune_static(tpl: Template) -> int:
    """Note [static paths below a template]
    Templates are looked at only when a key misses the trie's concrete children, so the sizes
    recorded before the fit (the observations it came from, generate's first lengths) kept
    their static paths: every later run at such a size took it, became hot on its own and
    compiled a program for that size alone (a generation compiled one per cache length).
    The anchor's concrete children that the template's first step matches (s >= 2) are
    dropped, so those sizes meet the template too; another trace that shared such a prefix
    is recorded again and leaves the template as any trace does."""
    k, ksym, _, _ = tpl.steps[0]
    if not ksym:
        return 0
    anchor = tpl.anchor
    guards = M.sym_guard_fallbacks  # probing is not a run: s in {0, 1} here counts nothing
    drop = []
    for key in anchor.children:
        st = [None]
        if _match(k, key, st) and st[0] is not None:
            drop.append(key)
    M.sym_guard_fallbacks = guards
    for key in drop:
        del anchor.children[key]
    return len(drop)


# ---- recording (called from engine.record on a trie miss) --------------------------------
def step(tr: Any, node: TrieNode, key: tuple) -> Any:
    """Output metadata for ``key`` from a template at ``node``, or _MISSING (tr.node moved to a
    detached node when the trace leaves a template: static paths never hang below one).

    The C accelerator takes the common case itself, without calling this (Note [C accelerator]
    in _hot.c): a non-anchor step of the trace's own live template whose memo holds this key
    (``tpl.memo[s][i][0] == key``); a change to that case must be made there too."""
    sym = node.sym
    if type(sym) is list:  # an anchor
        for tpl in sym:
            if tpl.dead:
                continue
            hit = tpl.first.get(key)
            if hit is not None:
                s, got = hit
            else:
                st = [None]
                k, ksym, out, osym = tpl.steps[0]
                if not (_match(k, key, st) if ksym else k == key) or st[0] is None:
                    continue
                s = st[0]
                got = _eval(out, s) if osym else out
                if got is _MISSING:
                    M.sym_guard_fallbacks += 1
                    continue
                if len(tpl.first) < _MEMO_MAX:
                    tpl.first[key] = (s, got)
            if s not in tpl.memo and len(tpl.memo) < _MEMO_MAX:
                _fill_memo(tpl, s)  # Note [template memo at a new size]
            sym_tr = _sym_of(tr)
            sym_tr.tpl, sym_tr.s, sym_tr.first, sym_tr.outs = tpl, s, len(tr.ops), [got]
            sym_tr.keys = [key]
            tr.node = tpl.nodes[0]
            M.sym_ops += 1
            return got
        return _MISSING
    tpl, i = sym
    state = tr.sym
    if state is not None and state.tpl is tpl and not tpl.dead:
        s = state.s
        t2 = tpl
        got = _step_of(tpl, i, key, s) if i < len(tpl.steps) else _MISSING
        if got is _MISSING:  # another template with the same first i steps may go on
            for t2 in _others(tpl, i):
                got = _step_of(t2, i, key, s)
                if got is not _MISSING:
                    break
        if got is not _MISSING:
            state.tpl = t2
            state.outs.append(got)
            state.keys.append(key)
            tr.node = t2.nodes[i]
            M.sym_ops += 1
            return got
    M.sym_left += 1
    if state is not None and state.tpl is not None and len(state.keys) == node.depth - \
            state.tpl.anchor.depth:
        # The trace goes on as a static one: its ops so far become a concrete path below the
        # anchor (their metadata as predicted, checked at the replay), so it is learnt from
        # like any trace, and no static path ever hangs below a template node.
        n = state.tpl.anchor
        for k, o, tn in zip(state.keys, state.outs, state.tpl.nodes):
            n = n.child(k, o, tn.where)
        tr.node = n
    else:
        tr.node = TrieNode(None, xxhash.xxh3_128_digest(node.digest + b"left"), node.depth,
                           node.parent, node.key, node.where)
    return _MISSING


def _step_of(tpl: Template, i: int, key: tuple, s: int) -> Any:
    """Step i of a template for this key at this s: its output metadata, or _MISSING."""
    memo = tpl.memo.get(s)
    if memo is not None:
        hit = memo.get(i)
        if hit is not None and hit[0] == key:  # Note [template memo]
            return hit[1]
    k, ksym, out, osym = tpl.steps[i]
    if not (_match(k, key, [s]) if ksym else k == key):
        return _MISSING
    if not osym:
        got = out
    else:
        got = _eval(out, s)
        if got is _MISSING:
            M.sym_guard_fallbacks += 1
            return got
    if memo is None and len(tpl.memo) < _MEMO_MAX:
        memo = tpl.memo[s] = {}
    if memo is not None:
        memo[i] = (key, got)
    return got


_MEMO_MAX = 256  # values of s (first-step keys) a template remembers matches for


def _fill_memo(tpl: Template, s: int) -> None:
    """Note [template memo at a new size]
    The memo (Note [template memo]) filled as keys arrived, so the first run at each s matched
    every step's pattern in Python and recorded every op in Python too (the C accelerator takes
    memoised steps only): GPT-2's training step at a new sequence length cost 3.4 ms more than
    at a seen one (272 steps), and the varlen benchmark's first 60 steps meet a new length in
    every other step. Once the anchor binds s, every later step's key is known: its pattern
    with s put in (a Poly's value; an external's fitted metadata interned, offset 0, as
    ``Trace.register`` interns it, so its meta id). So the whole memo for s is made here, at
    the anchor, and each op of the run is one tuple compare (in C). A step whose pattern or
    outputs give no value at s (a non-integer, a guard) gets no entry: it is matched in
    Python as before, which counts the fallback. The entries say what ``_match`` says: a key
    equal to the pattern at s is the key ``_match`` accepts (the same ints and meta ids; a
    type test as ``_match``'s stands in the compare's element types, which the op's schema
    fixes per position). A key that differs (another template goes on, an external with a
    storage offset) misses the entry and is matched as before, which replaces it."""
    memo: dict[int, tuple[tuple, Any]] = {}
    steps = tpl.steps
    for i in range(1, len(steps)):
        k, ksym, out, osym = steps[i]
        if ksym:
            k = _inst(k, s)
            if k is _MISSING:
                continue
        if osym:
            out = _eval(out, s)
            if out is _MISSING:
                continue
        memo[i] = (k, out)
    tpl.memo[s] = memo


def _inst(t: Any, s: int) -> Any:
    """A key pattern with s put in: the concrete key part it matches, or _MISSING."""
    tt = type(t)
    if tt is Poly:
        v = t(s)
        return _MISSING if v is None else v
    if tt is tuple:
        parts = []
        for x in t:
            x = _inst(x, s)
            if x is _MISSING:
                return _MISSING
            parts.append(x)
        return tuple(parts)
    if tt is ExtPat:
        size = _eval_all(t.size, s)
        stride = _eval_all(t.stride, s)
        if size is None or stride is None or min(size, default=0) < 0:
            return _MISSING
        return intern_meta(size, stride, 0, t.dtype, t.device, t.bits).mid
    return t


def _others(tpl: Template, i: int) -> list[Template]:
    """Longer templates from the same anchor whose first i steps are tpl's (a trace cut short
    once, whole another time); looked for only when tpl itself does not go on."""
    sym = tpl.anchor.sym
    if type(sym) is not list or len(sym) < 2:
        return []
    return [t for t in sym if t is not tpl and not t.dead and len(t.steps) > i
            and t.steps[:i] == tpl.steps[:i]]


class SymTrace:
    """What a trace took from learnt formulas: a template run and single-op predictions."""

    __slots__ = ("tpl", "s", "first", "outs", "preds", "keys")

    def __init__(self) -> None:
        self.keys: list[tuple] = []  # the concrete keys of the template's steps
        self.tpl: Template | None = None
        self.s = 0
        self.first = 0
        self.outs: list[Any] = []
        self.preds: list[tuple] = []  # (op index, predicted outs, family, s)


def _sym_of(tr: Any) -> SymTrace:
    st = tr.sym
    if st is None:
        st = tr.sym = SymTrace()
    return st


def _eval(out: Any, s: int) -> Any:
    t = type(out)
    if t is OutPat:
        m = out.eval(s)
        return _MISSING if m is None else m
    if t is tuple or t is list:
        got = [_eval(o, s) for o in out]
        return _MISSING if any(g is _MISSING for g in got) else t(got)
    return out


# ---- single ops: metadata off the trie (Note [symbolic dims], single ops) ----------------
# Note [symbolic dims], single ops
# Templates need whole traces at three sizes, but the first sight of a size cuts the trace at
# every op whose metadata is unknown (each runs eagerly once). So the metadata cache learns
# too: its keys (op, input metadata, int arguments) are grouped by skeleton like traces, and a
# family seen at MIN_OBS values of its first varying int predicts its outputs for the next
# value, checked at the replay like a template's. After three sizes a new size records its
# whole trace with no eager run; after three whole traces a template serves it from the trie.
class Family:
    """One call site's fitted metadata formula (a cluster of a skeleton's observations)."""

    __slots__ = ("fits", "out", "first", "verified", "dead")

    def __init__(self, fits: list, out: Any, first: int) -> None:
        self.fits = fits
        self.out = out
        self.first = first
        self.verified: set[int] = set()
        self.dead = False


class _Pool:
    __slots__ = ("obs", "fams")

    def __init__(self) -> None:
        self.obs: list[tuple[list[int], Any]] = []  # (key ints + output ints, output)
        self.fams: list[Family] = []


FAMILIES: dict[Any, _Pool] = {}
_FAMS_MAX = 64  # fitted call sites per skeleton
_POOL_MAX = 32  # observations kept per skeleton (many sites share one: mm in a backward)


def _walk_mkey(key: tuple, emit: Any) -> tuple:
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


def _storable_out(out: Any) -> bool:
    t = type(out)
    if t is Meta or out is None or t is int:
        return True
    return (t is tuple or t is list) and all(_storable_out(o) for o in out)


def on_meta_put(key: tuple, out: Any) -> None:
    """memory.META_CACHE.put: a real run's metadata; learn its family."""
    if not ENABLED or not _storable_out(out):
        return
    try:
        vals: list[int] = []
        skel = _walk_mkey(key, lambda v: vals.append(v) or HOLE)  # type: ignore[func-returns-value]
        if not vals:
            return
        pool = FAMILIES.get(skel)
        if pool is None:
            pool = FAMILIES[skel] = _Pool()
        if len(pool.fams) >= _FAMS_MAX:
            return
        ovals: list[int] = []
        _walk_out(out, lambda v: ovals.append(v) or HOLE)
        pool.obs.append((vals + ovals, out))
        if len(pool.obs) > _POOL_MAX:
            del pool.obs[0]
        if len(pool.obs) >= MIN_OBS:
            vecs = [o[0] for o in pool.obs]
            found = slope_fits(vecs, len(vals))
            known = [f.fits for f in pool.fams]
            for _idx, fits in found:
                # Sites that share a skeleton may also line up with each other (three Linear
                # layers at one length); such a fit is true too, so every fit is kept and
                # observations stay for the fits still to come.
                kf = fits[:len(vals)]
                if kf in known or len(pool.fams) >= _FAMS_MAX:
                    continue
                first = next(j for j, f in enumerate(kf) if type(f) is Poly)
                it = iter(fits[len(vals):])
                pool.fams.append(Family(kf, _walk_out(out, lambda v: next(it)), first))
                known.append(kf)
    except Exception as err:
        M.engine_errors += 1
        M.engine_error_kinds[f"{type(err).__name__} in shapes.on_meta_put"] += 1


def predict(tr: Any, op: Any, key: tuple) -> Any:
    """Output metadata of an op whose metadata key is new, from its family; None if unknown."""
    if not ENABLED or not FAMILIES:
        return None
    vals: list[int] = []
    try:
        skel = _walk_mkey(key, lambda v: vals.append(v) or HOLE)  # type: ignore[func-returns-value]
    except (IndexError, TypeError):
        return None
    pool = FAMILIES.get(skel)
    if pool is None:
        return None
    for fam in pool.fams:
        if fam.dead:
            continue
        s = vals[fam.first]
        if s < 2:
            M.sym_guard_fallbacks += 1
            continue
        for f, v in zip(fam.fits, vals):
            if (f(s) if type(f) is Poly else f) != v:
                break
        else:
            got = _eval(fam.out, s)
            if got is _MISSING:
                continue
            _sym_of(tr).preds.append((len(tr.ops), got, fam, s, op))
            M.sym_ops += 1
            return got
    return None


# ---- checking (called from engine._execute for traces that used a template) -------------
def replay_checked(tr: Any, live: list[int], check: bool, entry: TraceEntry) -> list:
    """Op-by-op replay; where a value of s is not verified yet, compare the real metadata of
    every predicted output with the prediction (Note [symbolic dims], Checking). The metadata
    is taken as each op runs: values nothing reads any more are dropped as in any replay
    (Note [replay liveness] in execute.py)."""
    from adaptive_eager.execute import replay

    st: SymTrace = tr.sym
    tpl = st.tpl
    todo_tpl = tpl is not None and not tpl.dead and st.s not in tpl.verified
    todo_ops = [p for p in st.preds if p[3] not in p[2].verified]
    if not todo_tpl and not todo_ops:
        return replay(tr, live, check, entry)
    watch = {p[0] for p in todo_ops}
    if todo_tpl:
        watch.update(range(st.first, st.first + len(st.outs)))
    metas: list[Any] = [None] * tr.n_slots

    def observe(i: int, env: list) -> None:
        if i in watch:
            _note_metas(tr.ops[i][3], env, metas)

    env = replay(tr, live, check, None, observe)
    with _DisableDispatch(), _DisableFunction():
        if todo_tpl:
            bad: list = []
            for k, pred in enumerate(st.outs):
                n_bad = len(bad)
                _compare(pred, tr.ops[st.first + k][3], metas, bad)
                if len(bad) > n_bad:
                    _fix_trie(entry, st.first + k, tr.ops[st.first + k][3], metas)
            if bad:
                _mispredicted(tpl, tr, bad)
            elif len(st.outs) == len(tpl.steps):  # the whole template ran at this s
                tpl.verified.add(st.s)
                M.sym_verified += 1
        for k, pred, fam, s, op in todo_ops:
            if k >= len(tr.ops) or tr.ops[k][0] is not op:
                continue  # never recorded (the op ran at once after all)
            bad = []
            _compare(pred, tr.ops[k][3], metas, bad)
            if bad:
                _mispredicted(fam, tr, bad)
                _fix_trie(entry, k, tr.ops[k][3], metas)
            else:
                fam.verified.add(s)
    return env


def _note_metas(slots: Any, env: list, metas: list) -> None:
    """The real metadata of an op's output slots, by slot (None where no tensor came)."""
    if type(slots) is int:
        real = env[slots]
        if isinstance(real, torch.Tensor):
            metas[slots] = meta_of(real)
    elif slots is not None:
        for sl in slots:
            _note_metas(sl, env, metas)


def _fix_trie(entry: TraceEntry, k: int, slots: Any, metas: list) -> None:
    """The static trie path of this trace keeps eager's metadata for op k, not the guess."""
    node: TrieNode | None = entry.node
    while node is not None and node.depth > k + 1:
        node = node.parent
    if node is not None and node.depth == k + 1:
        node.out = _real_out(node.out, slots, metas)


def _real_out(out: Any, slots: Any, metas: list) -> Any:
    if type(out) is Meta:
        real = metas[slots]
        return out if real is None else real
    if type(out) in (tuple, list) and slots is not None:
        return type(out)(o if sl is None else _real_out(o, sl, metas)
                         for o, sl in zip(out, slots))
    return out


def _compare(pred: Any, slots: Any, metas: list, bad: list) -> None:
    if type(pred) is Meta:
        real = metas[slots]
        if real is not None and real is not pred:
            bad.append((slots, pred, real))
    elif type(pred) in (tuple, list) and slots is not None:
        for p, sl in zip(pred, slots):
            if sl is not None:
                _compare(p, sl, metas, bad)


def _mispredicted(tpl: Any, tr: Any, bad: list) -> None:
    M.sym_mispredicted += 1
    if type(tpl) is Template:
        drop(tpl, f"predicted {bad[0][1]} for slot {bad[0][0]}, real {bad[0][2]}")
    else:
        tpl.dead = True
    with _DisableDispatch(), _DisableFunction():
        for slot, _pred, real in bad:
            w = tr.refs[slot]()
            if w is None:
                continue
            try:  # the lazy tensor says what eager's tensor says (Python may have read it)
                torch.ops.aten.as_strided_.default(w, real.size, real.stride, real.offset)
                w._ae_meta = real
            except RuntimeError:
                pass
    log.warning("adaptive_eager: a symbolic shape prediction was wrong (%s: %s); the trace's "
                "values are eager's, the learnt dims are dropped. Python code that read that "
                "shape before the flush saw the prediction.", tpl.label(), bad[0][1:])


def drop(tpl: Template, why: str) -> None:
    tpl.dead = True
    STATE.dead_digests.add(tpl.digest)
    if tpl.anchor.sym is not None and type(tpl.anchor.sym) is list and tpl in tpl.anchor.sym:
        tpl.anchor.sym.remove(tpl)
        if not tpl.anchor.sym:
            tpl.anchor.sym = None
    disk = STATE.disk
    if disk is not None:
        try:
            disk.put_stats(_disk_name(tpl.anchor.digest, tpl.digest), {"dead": why})
        except Exception:
            M.disk_errors += 1


def note_hit(entry: TraceEntry) -> None:
    M.sym_hits += 1
    tpl = entry.sym
    if tpl is not None:
        M.sym_dims[tpl.label()] = M.sym_dims.get(tpl.label(), 0) + 1


# ---- persistence --------------------------------------------------------------------------
_PREFIX = "symdims-"


def _disk_name(anchor: bytes, digest: str) -> str:
    return f"{_PREFIX}{anchor.hex()}-{digest[:32]}"


def configure(options: Any) -> None:
    """Engine start: switch learning on or off; load what earlier processes learnt."""
    global ENABLED
    ENABLED = bool(getattr(options, "symbolic_dims", True))
    if not ENABLED or not options.disk_cache:
        return
    from adaptive_eager.cache.disk import DiskCache, resolve_cache_dir

    folder = resolve_cache_dir(options)
    where = str(folder)
    if STATE.loaded_from == where:
        return
    STATE.loaded_from = where
    try:
        STATE.disk = DiskCache.open(folder, options.cache_size_mb << 20)
        if STATE.disk is None:
            return
        for name in STATE.disk.keys():
            if not name.startswith("stats:" + _PREFIX):
                continue
            data = STATE.disk.get_stats(name[len("stats:"):])
            if not data or "dead" in data or "steps" not in data:
                continue
            STATE.pending.setdefault(bytes.fromhex(data["anchor"]), []).append(data)
        memory.HOOKS.pending = bool(STATE.pending)
    except Exception as err:
        M.disk_errors += 1
        log.info("adaptive_eager: stored symbolic dims unreadable: %s", err)
        return
    for root in list(TRIE.roots.values()):
        _attach_pending_below(root)


def _attach_pending_below(node: TrieNode) -> None:
    stack = [node]
    while stack and STATE.pending:
        n = stack.pop()
        on_new_node(n)
        stack.extend(n.children.values())


def on_new_node(node: TrieNode) -> None:
    """A trie node was made (memory.py): attach templates stored for its digest."""
    items = STATE.pending.pop(node.digest, None)
    memory.HOOKS.pending = bool(STATE.pending)
    if not items:
        return
    for data in items:
        try:
            tpl = _decode_template(node, data)
        except Exception as err:  # a torch with other ops, or an entry of another format
            log.info("adaptive_eager: a stored symbolic trace could not be used: %s", err)
            continue
        if tpl.digest in STATE.dead_digests or tpl.digest != data.get("digest"):
            continue
        M.sym_loaded += 1
        _attach(tpl)


def _store(tpl: Template) -> None:
    disk = STATE.disk
    if disk is None or disk.read_only:
        return
    try:
        data = {
            "anchor": tpl.anchor.digest.hex(), "digest": tpl.digest, "dims": tpl.dims,
            "seen": tpl.seen, "where": [n.where for n in tpl.nodes],
            "steps": [[_enc(k), _enc_out(o)] for k, _, o, _ in tpl.steps],
        }
    except _NotStorable as err:
        log.info("adaptive_eager: symbolic trace %s not stored: %s", tpl.digest[:12], err)
        return
    try:
        disk.put_stats(_disk_name(tpl.anchor.digest, tpl.digest), data)
    except Exception as err:
        M.disk_errors += 1
        log.info("adaptive_eager: storing symbolic dims failed: %s", err)


class _NotStorable(Exception):
    pass


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
    raise _NotStorable(f"key part of type {t.__name__}")


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
    raise _NotStorable(f"output of type {t.__name__}")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.split(".", 1)[1])
    if not isinstance(dt, torch.dtype):
        raise ValueError(name)
    return dt


def _dec(p: Any) -> Any:
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
        return ("x", ExtPat(tuple(_dec(x) for x in size), tuple(_dec(x) for x in stride),
                            _dtype(dt), torch.device(dev), int(bits)), int(p["g"]))
    if tag == "T":
        return tuple(_dec(x) for x in v)
    if tag == "t":
        return {"int": int, "float": float, "bool": bool, "complex": complex}[v]
    if tag == "dt":
        return _dtype(v)
    if tag == "dev":
        return torch.device(v)
    if tag == "mf" or tag == "ly":  # memory format, layout: torch.<name>
        return getattr(torch, v.split(".", 1)[1])
    if tag == "op":
        from adaptive_eager.dispatch.opspec import spec_for

        ns, name, overload = v.split(".")
        return spec_for(getattr(getattr(getattr(torch.ops, ns), name), overload))
    raise ValueError(f"bad key tag {tag}")


def _dec_out(o: Any) -> Any:
    if o is None or type(o) is int:
        return o
    (tag, v), = o.items()
    if tag == "M":
        size, stride, off, dt, dev, bits = v
        return intern_meta(tuple(size), tuple(stride), int(off), _dtype(dt), torch.device(dev),
                           int(bits))
    if tag == "O":
        size, stride, off, dt, dev, bits = v
        return OutPat(tuple(_dec(x) for x in size), tuple(_dec(x) for x in stride), _dec(off),
                      _dtype(dt), torch.device(dev), int(bits))
    if tag in ("T", "L"):
        got = [_dec_out(x) for x in v]
        return tuple(got) if tag == "T" else got
    raise ValueError(f"bad output tag {tag}")


def _decode_template(anchor: TrieNode, data: dict) -> Template:
    steps = []
    for k, o in data["steps"]:
        key = _dec(k)
        out = _dec_out(o)
        steps.append((key, _has_poly(key), out, _has_poly_out(out)))
    return Template(anchor, steps, list(data.get("where") or [None] * len(steps)),
                    str(data.get("dims", "")), [int(x) for x in data.get("seen", [])])


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


def reset() -> None:
    """TRIE.clear(): templates live on trie nodes; forget them (and reload from disk)."""
    STATE.groups.clear()
    STATE.done.clear()
    STATE.templates.clear()
    STATE.pending.clear()
    STATE.loaded_from = None
    STATE.dead_digests.clear()
    memory.HOOKS.pending = False
    FAMILIES.clear()


memory.HOOKS.new_entry = on_new_entry
memory.HOOKS.new_node = on_new_node
memory.HOOKS.clear = reset
memory.HOOKS.meta_put = on_meta_put
