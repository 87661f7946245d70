"""Symbolic sizes: where a dynamic-size program may run unchecked (Note [trusting a size]), and the
checked sizes stored with it (Note [verified sizes]).

The manager owns one ``Sizes`` and hands it what it needs from the layers above (op-by-op replay,
the fused tolerance, a run's program inputs, quarantine, storing statistics) as ``SizeHooks``:
this module imports nothing of the engine, so it sits below the compiler. Trace entries, traces
and graphs are passed through as values (typed ``Any`` here for the same reason).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from adaptive_eager.metrics import METRICS as M

log = logging.getLogger("adaptive_eager")

SYM_CHECKED_SIZES = 3  # sizes a symbolic program must agree at before a new size whose
# guards hold runs unchecked, as a static program does (Note [trusting a size])
SYM_SIZES_KEPT = 256  # checked sizes kept per program in its statistics (Note [verified sizes])
SYM_GUARD_MEMO = 4096  # sizes whose guard verdict is remembered per program


# Note [trusting a size]
# A dynamic-size program (Note [symbolic programs] in symbolic_plan.py) runs a size s unchecked,
# as a static program runs, only when both hold:
# - its own shape guards hold at s (Note [program shape guards] in backends/inductor.py: what
#   Inductor assumed, such as two inputs' lengths being equal, s >= 2, or s <= 4096 where the
#   CPU sum kernel skipped its chunked accumulator), evaluated on this run's program inputs by
#   ShapeGuards, once per s (the inputs' metadata is a function of s on a template: the
#   verdict is memoized per s); and
# - SYM_CHECKED_SIZES sizes agreed with op-by-op replay (_CheckedSize) and none disagreed: the
#   guards say where the program applies, the checks that it computes what the trace does
#   (a wrong lowering is caught at the first sizes, before anything runs unchecked).
# A size whose guards fail never runs the program, not even on copies (it may read past a
# buffer): it runs op by op (a template entry's static path), and is counted in
# ``sym_guard_refused``; the program stays trusted for other sizes. Guards that cannot be read
# or evaluated (a backend that gives none, a node the interpreter does not know, a corrupt
# block) trust no size by guards: every new size is checked as the first ones are, and this is
# counted in ``sym_guards_unknown``. A size that raised or differed stays op by op, and two
# such sizes quarantine the trace. Earlier versions trusted only sizes between the smallest and
# the largest agreed size, so a growing KV cache was checked at every new length.
#
# Note [verified sizes]
# Checked sizes are facts about one program: they are stored in the trace's statistics with
# the program's key (``sym_sizes``: agreed and bad sizes, at most SYM_SIZES_KEPT each, merged
# with what other processes stored) and read back when that same program is loaded from the
# disk cache, so a later process needs no new checks for them (a different program, say after
# a recompile, starts over). The values are verified data like every cache value: ints only,
# anything else ignored and counted in ``disk_errors``.
class _SymSizes:
    """Per symbolic program: sizes checked against replay, and the guard verdict per size."""

    __slots__ = ("checked", "fits", "guards", "key", "trusted", "prog")

    def __init__(self, prog: Any = None) -> None:
        self.prog = prog  # the program these verdicts are about (a recompile starts over)
        self.checked: dict[int, bool] = {}  # s -> agreed with op-by-op replay?
        self.trusted: set[int] = set()  # sizes run unchecked (by the guards)
        self.fits: dict[int, bool | None] = {}  # s -> guards hold (None: cannot say)
        self.guards: Any = _UNREAD  # ShapeGuards, or None (unknown)
        self.key: str | None = None  # the program these facts are about


_UNREAD = object()


class ShapeGuards:
    """A program's shape guards, decoded from data and evaluated with integer arithmetic
    (Note [program shape guards] in backends/inductor.py). Decoding validates every node
    against a fixed table and raises ValueError on anything else; nothing is executed."""

    __slots__ = ("locs", "exprs")
    _NARY = frozenset(("+", "*", "min", "max", "and", "or"))
    _BINARY = frozenset(("//", "%", "cdiv", "pow", "==", "!=", "<", "<=", ">", ">="))
    _MAX_NODES = 200_000  # a GPT-2 training step's set: a few thousand

    def __init__(self, locs: list[tuple], exprs: list[Any]) -> None:
        self.locs, self.exprs = locs, exprs

    @classmethod
    def decode(cls, data: Any) -> ShapeGuards:
        if type(data) is not dict or data.get("v") != 1:
            raise ValueError("guards of another format")
        if "unknown" in data:
            raise ValueError(f"unknown guards: {str(data['unknown'])[:200]}")
        syms, guards = data.get("syms"), data.get("guards")
        if type(syms) is not list or type(guards) is not list:
            raise ValueError("malformed guards")
        locs = []
        for loc in syms:
            if (type(loc) is list and len(loc) == 3 and loc[0] in ("size", "stride")
                    and all(type(x) is int and x >= 0 for x in loc[1:])):
                locs.append((loc[0], loc[1], loc[2]))
            elif (type(loc) is list and len(loc) == 2 and loc[0] == "offset"
                  and type(loc[1]) is int and loc[1] >= 0):
                locs.append(("offset", loc[1], 0))
            else:
                raise ValueError(f"bad symbol location {str(loc)[:80]}")
        budget = [cls._MAX_NODES]
        return cls(locs, [cls._node(g, len(locs), 0, budget) for g in guards])

    @classmethod
    def _node(cls, n: Any, n_syms: int, depth: int, budget: list[int]) -> Any:
        budget[0] -= 1
        if budget[0] < 0 or depth > 64:
            raise ValueError("guards too large")
        t = type(n)
        if t is bool:
            return n
        if t is int:  # JSON ints are unbounded: a product of a few thousand would never end
            if not -_GUARD_INT_MAX <= n <= _GUARD_INT_MAX:
                raise ValueError("guard constant out of range")
            return n
        if t is not list or not n or type(n[0]) is not str:
            raise ValueError(f"bad guard node {str(n)[:80]}")
        op, args = n[0], n[1:]
        if op == "v":
            if len(args) != 1 or type(args[0]) is not int or not 0 <= args[0] < n_syms:
                raise ValueError("bad symbol reference")
            return ("v", args[0])
        if op == "not":
            if len(args) != 1:
                raise ValueError("bad not")
        elif op in cls._BINARY:
            if len(args) != 2:
                raise ValueError(f"{op} needs two operands")
        elif op not in cls._NARY or not args:
            raise ValueError(f"unknown guard operator {op[:20]!r}")
        return (op, *(cls._node(a, n_syms, depth + 1, budget) for a in args))

    def holds(self, inputs: list[Any]) -> bool:
        """Whether every guard holds for these program inputs; ValueError: cannot say."""
        vals = []
        for kind, i, d in self.locs:
            t = inputs[i] if i < len(inputs) else None
            if not isinstance(t, torch.Tensor) or (kind != "offset" and d >= t.dim()):
                raise ValueError("a guard names an input the program does not have")
            vals.append(t.size(d) if kind == "size" else t.stride(d) if kind == "stride"
                        else t.storage_offset())
        for g in self.exprs:
            v = _ev(g, vals)
            if type(v) is not bool:
                raise ValueError("a guard that is not a relation")
            if not v:
                return False
        return True


# Sizes, strides and guard constants are far below this; a stored block (data) that leaves it
# is refused rather than evaluated (big-int products of stored constants grow without bound).
_GUARD_INT_MAX = 1 << 128


def _ev(n: Any, vals: list[int]) -> int | bool:
    """Evaluate a decoded guard node (ShapeGuards._node's tuples): ints and bools only."""
    t = type(n)
    if t is int or t is bool:
        return n
    op = n[0]
    if op == "v":
        return vals[n[1]]
    a = [_ev(x, vals) for x in n[1:]]
    if op in ("and", "or", "not"):
        if any(type(x) is not bool for x in a):
            raise ValueError("logic on numbers")
        return all(a) if op == "and" else any(a) if op == "or" else not a[0]
    if any(type(x) is not int for x in a):
        raise ValueError("arithmetic on truth values")
    if op == "+":
        r = sum(a)
    elif op == "*":
        r = 1
        for x in a:
            r *= x
            if not -_GUARD_INT_MAX <= r <= _GUARD_INT_MAX:  # bounded before the next product
                raise ValueError("guard arithmetic out of range")
    else:
        r = None
    if r is not None:
        if not -_GUARD_INT_MAX <= r <= _GUARD_INT_MAX:
            raise ValueError("guard arithmetic out of range")
        return r
    if op == "min":
        return min(a)
    if op == "max":
        return max(a)
    x, y = a
    if op in ("//", "%", "cdiv"):
        if y == 0:
            raise ValueError("division by zero in a guard")
        return x // y if op == "//" else x % y if op == "%" else -(-x // y)
    if op == "pow":
        if not 0 <= y <= 64 or (abs(x) > 1 and y * (abs(x).bit_length() - 1) > 128):
            raise ValueError("power out of range")
        return x ** y
    return (x == y if op == "==" else x != y if op == "!=" else x < y if op == "<"
            else x <= y if op == "<=" else x > y if op == ">" else x >= y)


@dataclass(frozen=True)
class SizeHooks:
    """What the sizes need from the layers above, handed in by the manager."""

    replay: Callable[[Any, list[int]], list[Any]]  # (trace, live): op-by-op values per slot
    close: Callable[[Any, Any], bool]  # (fused, op by op): within the fused tolerance
    program_inputs: Callable[[Any, Any], list[Any] | None]  # (graph, trace): None if unformable
    quarantine: Callable[[Any, str], None]  # (entry, why)
    untimed: Callable[[Any], None]  # (entry): this run checked a size, it is no program timing
    save: Callable[[Any], None]  # (entry): its statistics, with its program's key, to disk


class _CheckedSize:
    """A symbolic program's first fused run at one size (Note [trusting a size]): the program
    runs on copies of the inputs, the trace op by op on the real ones, and the op-by-op values
    are returned; agreement within the fused tolerance lets later runs at this size run fused
    (and, once SYM_CHECKED_SIZES sizes agreed, new sizes whose guards hold run unchecked). A
    raise or a difference is counted; that size stays op by op, and a trace with two bad sizes
    is quarantined. The verdict is stored with the program (Note [verified sizes])."""

    def __init__(self, sizes: Sizes, entry: Any, trace: Any, prog: Any, s: int,
                 rec: _SymSizes) -> None:
        self.owner, self.entry, self.trace, self.prog, self.s, self.rec = (
            sizes, entry, trace, prog, s, rec)
        self.sizes = rec.checked

    def __call__(self, *inputs: Any) -> list[Any]:
        hooks = self.owner.hooks
        g = self.entry.graph
        copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        try:
            outs = list(self.prog(*copies))
        except Exception as err:
            outs = None
            why = f"raised {type(err).__name__}: {str(err)[:200]}"
        env = hooks.replay(self.trace, list(g.live))
        if outs is not None:
            bad = [f"output slot {s}" for s, o in zip(g.live, outs)
                   if env[s] is not None and not hooks.close(o, env[s])]
            bad += [f"input {i}" for i, (c, r) in enumerate(zip(copies, inputs))
                    if isinstance(c, torch.Tensor) and not hooks.close(c, r)]
            why = ", ".join(bad[:4])
        ok = outs is not None and not bad
        self.sizes[self.s] = ok
        hooks.untimed(self.entry)
        if ok:
            M.sym_checked += 1
        else:
            M.sym_program_fallbacks += 1
            self.rec.trusted.clear()  # no size runs unchecked once one disagreed
            log.warning("adaptive_eager: the dynamic-size program of trace %s at s=%d: %s; "
                        "that size runs op by op", self.entry.digest[:12], self.s, why)
            if sum(1 for v in self.sizes.values() if not v) >= 2:
                hooks.quarantine(self.entry, f"dynamic-size program wrong at two sizes ({why})")
        self.owner.store(self.entry)
        return [env[s] for s in g.live]


class Sizes:
    """The size verdicts of every symbolic trace of one manager (by trace digest)."""

    def __init__(self, hooks: SizeHooks) -> None:
        self.hooks = hooks
        self._sym_sizes: dict[str, _SymSizes] = {}  # symbolic trace -> its sizes' verdicts

    def program(self, entry: Any, trace: Any, prog: Any) -> Any:
        """Note [trusting a size]: the program for this size, unchecked when enough sizes
        agreed and its guards hold here; a _CheckedSize run beside op-by-op replay while not;
        None (op by op) for a size whose guards fail or whose check failed."""
        st = trace.sym
        g = entry.graph
        if st is None or st.tpl is not entry.sym or st.s < 2 or g is None or not g.dynamic:
            return None
        s = st.s
        rec = self._sym_sizes.get(entry.digest)
        if rec is None or rec.prog is not prog:
            rec = self._sym_sizes[entry.digest] = _SymSizes(prog)
        elif s in rec.trusted:
            return prog
        fits = rec.fits.get(s, _UNREAD)
        if fits is _UNREAD:
            fits = self._guards_hold(entry, rec, trace, prog, g, s)
            if fits is _UNREAD:
                return None  # aliased inputs moved: this run goes op by op (as run_fused)
        if fits is False:
            return None
        checked = rec.checked
        ok = checked.get(s)
        if ok is not None:
            return prog if ok else None
        if fits is True and len(checked) >= SYM_CHECKED_SIZES and all(checked.values()):
            M.sym_trusted += 1
            if len(rec.trusted) >= SYM_GUARD_MEMO:
                rec.trusted.clear()
            rec.trusted.add(s)
            return prog
        return _CheckedSize(self, entry, trace, prog, s, rec)

    def _guards_hold(self, entry: Any, rec: _SymSizes, trace: Any, prog: Any, g: Any,
                     s: int) -> Any:
        """The guard verdict at a new size (memoized in rec.fits): True, False (refused:
        counted), None (cannot say: counted; the size is checked), or _UNREAD when this run's
        inputs cannot be formed (the caller replays)."""
        if rec.guards is _UNREAD:
            data = getattr(prog, "ae_shape_guards", None)
            try:
                if data is None:
                    raise ValueError("the program carries no shape guards")
                rec.guards = ShapeGuards.decode(data)
            except ValueError as err:
                rec.guards = None
                M.sym_guards_unknown += 1
                log.info("adaptive_eager: trace %s: %s; every new size is checked against "
                         "op-by-op replay", entry.digest[:12], err)
        if rec.guards is None:
            fits: bool | None = None
        else:
            inputs = self.hooks.program_inputs(g, trace)
            if inputs is None:
                return _UNREAD
            try:
                fits = rec.guards.holds(inputs)
            except (ValueError, IndexError, TypeError, OverflowError) as err:
                fits = None
                M.sym_guards_unknown += 1
                log.info("adaptive_eager: trace %s: its shape guards could not be evaluated at "
                         "s=%d (%s); that size is checked", entry.digest[:12], s, err)
            if fits is False:
                M.sym_guard_refused += 1
                log.info("adaptive_eager: trace %s: s=%d violates its program's shape guards; "
                         "that size runs op by op", entry.digest[:12], s)
        if len(rec.fits) >= SYM_GUARD_MEMO:
            rec.fits.clear()
        rec.fits[s] = fits
        return fits

    def store(self, entry: Any) -> None:
        """Note [verified sizes]: after a check, the sizes go to the trace's statistics."""
        if entry.graph is None or entry.in_process:
            return
        try:
            self.hooks.save(entry)
        except Exception as err:  # never fails the run: the sizes are checked again later
            M.disk_errors += 1
            log.info("adaptive_eager: storing checked sizes failed: %s", err)

    def record(self, entry: Any, key: str | None, old: Any) -> Any:
        """The ``sym_sizes`` statistics field: this process's checked sizes for the program
        ``key``, merged with the stored ones for the same program (Note [verified sizes])."""
        rec = self._sym_sizes.get(entry.digest)
        if rec is None or not rec.checked or key is None:
            return old
        agreed = {s for s, ok in rec.checked.items() if ok}
        bad = {s for s, ok in rec.checked.items() if not ok}
        if type(old) is dict and old.get("program") == key:
            agreed |= {s for s in old.get("agreed", ()) if type(s) is int}
            bad |= {s for s in old.get("bad", ()) if type(s) is int}
        agreed -= bad
        return {"program": key, "agreed": sorted(agreed)[:SYM_SIZES_KEPT],
                "bad": sorted(bad)[:SYM_SIZES_KEPT]}

    def load(self, entry: Any, stats: dict, key: str, program: Any) -> None:
        """Seed the checked sizes of a program loaded from disk (Note [verified sizes])."""
        got = stats.get("sym_sizes")
        if got is None:
            return
        try:
            if type(got) is not dict or got.get("program") != key:
                return  # sizes of another program of this trace (a recompile)
            agreed, bad = got.get("agreed", []), got.get("bad", [])
            if (type(agreed) is not list or type(bad) is not list
                    or not all(type(x) is int and x >= 2 for x in agreed + bad)):
                raise ValueError("checked sizes that are not sizes")
        except ValueError as err:
            M.disk_errors += 1
            log.info("adaptive_eager: stored checked sizes of %s ignored: %s", entry.digest[:12],
                     err)
            return
        rec = self._sym_sizes[entry.digest] = _SymSizes(program)
        for x in agreed[:SYM_SIZES_KEPT]:
            rec.checked.setdefault(x, True)
        for x in bad[:SYM_SIZES_KEPT]:
            rec.checked[x] = False
        rec.key = key
        M.sym_sizes_loaded += len(agreed[:SYM_SIZES_KEPT]) + len(bad[:SYM_SIZES_KEPT])
