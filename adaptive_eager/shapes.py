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
The keys and outputs are walked, and their patterns matched, in shapes_keys.py.

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

Persistence (the encoding: shapes_store.py). A template is stored in the disk cache (a
``stats:symdims-...`` entry: JSON under the cache's HMAC like every value,
Note [cache values are data, verified first]; op names, dtypes and sizes, nothing executable)
keyed by its anchor's digest; the next process attaches it when that trie node is made, and
checks each ``s`` again. Families are not stored (a loaded template needs none).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import xxhash

from adaptive_eager.cache import memory
from adaptive_eager.cache.disk import DiskCache, resolve_cache_dir
from adaptive_eager.cache.memory import TRIE, TraceEntry, TrieNode, stable_repr
from adaptive_eager.core.meta import Meta, meta_of
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.shapes_keys import (
    HOLE, MISSING, canon_key, eval_out, instantiate, key_skel, match_part, out_skel, storable_out,
    walk_key, walk_mkey, walk_out,
)
from adaptive_eager.shapes_store import (PREFIX, NotStorable, decode_steps, disk_name,
                                         encode_steps)
from adaptive_eager.sizefit import MIN_OBS, ExtPat, Poly, search_fit, slope_fits

log = logging.getLogger("adaptive_eager")

_GROUP_MAX = 8  # observations kept per skeleton
_DisableDispatch = torch._C._DisableTorchDispatch
_DisableFunction = torch._C.DisableTorchFunction

ENABLED = True


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
            ks = walk_key(node.key, lambda v: kv.append(v) or HOLE)  # type: ignore[arg-type]
            os_ = walk_out(node.out, lambda v: ov.append(v) or HOLE)
            self.kvals.append(kv)
            self.ovals.append(ov)
            skel.append((key_skel(ks), out_skel(os_)))
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
        key = canon_key(walk_key(node.key, lambda v: next(kit))) if ksym else node.key
        out = walk_out(node.out, lambda v: next(oit)) if osym else node.out
        steps.append((key, ksym, out, osym))
    return steps


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

    canon = walk_key(key, emit)
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
        if match_part(k, key, st) and st[0] is not None:
            drop.append(key)
    M.sym_guard_fallbacks = guards
    for key in drop:
        del anchor.children[key]
    return len(drop)


# ---- recording (called from engine.record on a trie miss) --------------------------------
def step(tr: Any, node: TrieNode, key: tuple) -> Any:
    """Output metadata for ``key`` from a template at ``node``, or MISSING (tr.node moved to a
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
                if not (match_part(k, key, st) if ksym else k == key) or st[0] is None:
                    continue
                s = st[0]
                got = eval_out(out, s) if osym else out
                if got is MISSING:
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
        return MISSING
    tpl, i = sym
    state = tr.sym
    if state is not None and state.tpl is tpl and not tpl.dead:
        s = state.s
        t2 = tpl
        got = _step_of(tpl, i, key, s) if i < len(tpl.steps) else MISSING
        if got is MISSING:  # another template with the same first i steps may go on
            for t2 in _others(tpl, i):
                got = _step_of(t2, i, key, s)
                if got is not MISSING:
                    break
        if got is not MISSING:
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
    return MISSING


def _step_of(tpl: Template, i: int, key: tuple, s: int) -> Any:
    """Step i of a template for this key at this s: its output metadata, or MISSING."""
    memo = tpl.memo.get(s)
    if memo is not None:
        hit = memo.get(i)
        if hit is not None and hit[0] == key:  # Note [template memo]
            return hit[1]
    k, ksym, out, osym = tpl.steps[i]
    if not (match_part(k, key, [s]) if ksym else k == key):
        return MISSING
    if not osym:
        got = out
    else:
        got = eval_out(out, s)
        if got is MISSING:
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
    Python as before, which counts the fallback. The entries say what ``match_part`` says: a key
    equal to the pattern at s is the key ``match_part`` accepts (the same ints and meta ids; a
    type test as ``match_part``'s stands in the compare's element types, which the op's schema
    fixes per position). A key that differs (another template goes on, an external with a
    storage offset) misses the entry and is matched as before, which replaces it."""
    memo: dict[int, tuple[tuple, Any]] = {}
    steps = tpl.steps
    for i in range(1, len(steps)):
        k, ksym, out, osym = steps[i]
        if ksym:
            k = instantiate(k, s)
            if k is MISSING:
                continue
        if osym:
            out = eval_out(out, s)
            if out is MISSING:
                continue
        memo[i] = (k, out)
    tpl.memo[s] = memo


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


def on_meta_put(key: tuple, out: Any) -> None:
    """memory.META_CACHE.put: a real run's metadata; learn its family."""
    if not ENABLED or not storable_out(out):
        return
    try:
        vals: list[int] = []
        skel = walk_mkey(key, lambda v: vals.append(v) or HOLE)  # type: ignore[func-returns-value]
        if not vals:
            return
        pool = FAMILIES.get(skel)
        if pool is None:
            pool = FAMILIES[skel] = _Pool()
        if len(pool.fams) >= _FAMS_MAX:
            return
        ovals: list[int] = []
        walk_out(out, lambda v: ovals.append(v) or HOLE)
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
                pool.fams.append(Family(kf, walk_out(out, lambda v: next(it)), first))
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
        skel = walk_mkey(key, lambda v: vals.append(v) or HOLE)  # type: ignore[func-returns-value]
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
            got = eval_out(fam.out, s)
            if got is MISSING:
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
            disk.put_stats(disk_name(tpl.anchor.digest, tpl.digest), {"dead": why})
        except Exception:
            M.disk_errors += 1


def note_hit(entry: TraceEntry) -> None:
    M.sym_hits += 1
    tpl = entry.sym
    if tpl is not None:
        M.sym_dims[tpl.label()] = M.sym_dims.get(tpl.label(), 0) + 1


# ---- persistence (the encoding: shapes_store.py) ------------------------------------------
def configure(options: Any) -> None:
    """Engine start: switch learning on or off; load what earlier processes learnt."""
    global ENABLED
    ENABLED = bool(getattr(options, "symbolic_dims", True))
    if not ENABLED or not options.disk_cache:
        return

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
            if not name.startswith("stats:" + PREFIX):
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
            "steps": encode_steps(tpl.steps),
        }
    except NotStorable as err:
        log.info("adaptive_eager: symbolic trace %s not stored: %s", tpl.digest[:12], err)
        return
    try:
        disk.put_stats(disk_name(tpl.anchor.digest, tpl.digest), data)
    except Exception as err:
        M.disk_errors += 1
        log.info("adaptive_eager: storing symbolic dims failed: %s", err)


def _decode_template(anchor: TrieNode, data: dict) -> Template:
    from adaptive_eager.dispatch.opspec import spec_for

    steps = decode_steps(data["steps"], spec_for)
    return Template(anchor, steps, list(data.get("where") or [None] * len(steps)),
                    str(data.get("dims", "")), [int(x) for x in data.get("seen", [])])


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
