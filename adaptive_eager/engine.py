"""The per-thread engine: records deferred ops, flushes traces, runs what cannot be deferred.

Stages, in the order an op meets them: ``record`` (key the op against the trace, take its output
metadata from the trie or the metadata cache, hand out lazy outputs), ``flush`` (end the trace,
note hit or miss, replay it), and ``run_eager`` (everything that must run now). The dispatch-mode
glue lives in ``dispatch/mode.py``; the replay loop in ``execute.py``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import torch

from adaptive_eager.spans import span
from adaptive_eager.cache.memory import META_CACHE, TRIE, TraceEntry
from adaptive_eager.config import Options
from adaptive_eager.core import hooks
from adaptive_eager.core.errors import Unsupported
from adaptive_eager.core.meta import Meta
from adaptive_eager.dispatch.lazy import (
    LazyTensor, ValueUnavailable, materialize, _set_bits, rebind_aliases, resolve_all,
)
from adaptive_eager.dispatch.opspec import INPLACE_VIEW, RANDOM, OpSpec
from adaptive_eager.explain import explain_miss, note_flush_site, user_frame
from adaptive_eager.compiler import manager_for, run_size
from adaptive_eager.execute import live_slots, poison, publish, replay
from adaptive_eager.fused import run_fused
from adaptive_eager.events import RUN_LOG
from adaptive_eager.metadata import (
    EAGER_ONLY, fresh, metadata_key, output_spec, refresh_wrapper, resizes_what_it_writes,
    view_metadata, written_layouts,
)
from adaptive_eager.metrics import METRICS as M
from adaptive_eager.trace import SLOTS, Trace, loop_period, slot_marker
from adaptive_eager.shapes import configure as configure_shapes
from adaptive_eager.shapes import note_hit as sym_note_hit, predict as sym_predict
from adaptive_eager.shapes import replay_checked, step as sym_step
from adaptive_eager.shapes_keys import MISSING as _SYM_MISS

log = logging.getLogger("adaptive_eager")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_DisableDispatch = torch._C._DisableTorchDispatch
_DisableFunction = torch._C.DisableTorchFunction
_weakref = weakref.ref
_get_ident = threading.get_ident
_transforms_active = torch._C._are_functorch_transforms_active
_DisableFuncTorch = torch._C._DisableFuncTorch
_MISSING = object()
_make_wrapper = torch.Tensor._make_wrapper_subclass
_MAX_TRIE_ENTRIES = 100_000  # a program whose traces never repeat must not grow memory forever
# Note [bool keys]
# ``True == 1`` and ``hash(True) == hash(1)``: keyed by value, ``bool_tensor + True`` and
# ``bool_tensor + 1`` (an ``other`` that is a Scalar in a Tensor overload) were one trie path, so
# the second replayed the first's output dtype (bool instead of int64; DESIGN trap 6). Ints keyed
# by value stay plain (sizes, dims: no allocation); a bool is keyed by one of these two constant
# tuples, which equal no int. The C accelerator keys with equal tuples (``value_key``).
BOOL_KEYS = {False: (bool, False), True: (bool, True)}


class _Owned(threading.local):
    engine: Engine | None = None  # the engine this thread records into (the last one made)


_OWNED = _Owned()


def owned_engine() -> Engine | None:
    """The engine whose trace this thread records into, if any."""
    return _OWNED.engine


# Note [threads and lazy tensors]
# An engine belongs to the thread that made it (``owner``): only that thread records into its
# trace, with no lock (the hot path). Two things cross threads:
# - A lazy tensor read or used on another thread (plain eager, or under its own engine): that
#   thread runs the owner's trace itself (``_flush_foreign``), so it never waits for the owner,
#   which may be blocked on it (a bounded queue). It takes ``lock`` (the owner's own flushes
#   take it too), sets ``foreign``, and waits while ``busy`` says the owner is inside
#   ``record``. The owner sets ``busy`` before it looks at ``foreign``, the reader sets
#   ``foreign`` before it looks at ``busy``, so one of them always sees the other (Dekker's
#   handshake; the GIL orders the stores), and an owner that sees ``foreign`` records under
#   ``lock`` instead, after the reader is done. The owner never blocks while ``busy`` (an input
#   pending on a third thread makes the op run at once instead, outside ``record``), so the
#   wait is microseconds. Cost on the hot path: two attribute stores and a load per op. The
#   trace stays the engine's pending trace until its values are published, so the owner's
#   eager ops that touch its pending writes wait on ``lock`` meanwhile. Another thread reads a
#   lazy tensor's value only under ``lock`` (lazy.materialize), so it never sees a flush of the
#   owner half done; once one has, the engine stops turning lazy tensors into plain ones at
#   publish (``shared``: other threads may hold those very objects).
# - A deferred in-place write to a real tensor that another thread reads after a handoff:
#   eager makes the write visible before the handoff. ``threading.Condition.notify`` and
#   ``Condition.wait`` (which ``Event.set``/``wait``, ``queue.Queue.put``/``get``,
#   ``Semaphore``, ``Barrier.wait`` and multiprocessing queues go through) and ``Thread.start``
#   flush the calling thread's pending trace first (an attribute load when no engine is
#   pending on that thread; never inside record or a flush of that thread). A bare
#   ``threading.Lock``/``RLock`` release is C code and cannot be seen: a program that hands
#   tensors written under the engine to another thread through a bare lock calls
#   ``adaptive_eager.sync()`` before releasing it.


_sync_installed = False


def install_thread_sync() -> None:
    """Make thread handoffs flush the handing thread's pending trace (idempotent)."""
    global _sync_installed
    if _sync_installed:
        return
    _sync_installed = True
    notify = threading.Condition.notify
    wait = threading.Condition.wait
    start = threading.Thread.start

    def _notify(self: threading.Condition, n: int = 1) -> None:
        _flush_before_handoff("thread_sync:notify")
        notify(self, n)

    def _wait(self: threading.Condition, timeout: float | None = None) -> bool:
        _flush_before_handoff("thread_sync:wait")  # it releases the lock: another may read
        return wait(self, timeout)

    def _start(self: threading.Thread) -> None:
        _flush_before_handoff("thread_sync:start")
        start(self)

    _notify.__doc__, _wait.__doc__, _start.__doc__ = notify.__doc__, wait.__doc__, start.__doc__
    threading.Condition.notify = _notify  # type: ignore[method-assign]
    threading.Condition.wait = _wait  # type: ignore[method-assign]
    threading.Thread.start = _start  # type: ignore[method-assign]
    # A storage resized in place (FSDP2 frees and reallocates its unsharded parameters with
    # ``untyped_storage().resize_``) ends pending reads and writes of every tensor on it: they
    # run first, as in eager they already have (the read guard is not always armed to see the
    # ``untyped_storage()`` call: Note [read guard] in dispatch/mode.py).
    resize = torch.UntypedStorage.resize_

    def _resize(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        _flush_before_handoff("storage_resize")
        return resize(self, size)

    _resize.__doc__ = resize.__doc__
    torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]


def _flush_before_handoff(reason: str) -> None:
    eng = _OWNED.engine
    if eng is not None and eng.trace.ops and not eng.busy and not eng.flushing:
        eng.flush(reason)


hooks.flush_before_handoff = _flush_before_handoff  # Note [hook slots] in core/hooks.py


# Note [grad-mode kernels]
# A few kernels below autograd read the grad mode themselves: mkldnn_rnn_layer (nn.LSTM/GRU/RNN
# on CPU) returns its workspace, which its backward needs, only when grad mode is on. A trace
# records forward, backward (the autograd engine runs nodes with grad mode off) and optimizer
# (under no_grad) ops alike, and replays them wherever the flush happens, so such an op replays
# under the grad mode it was recorded in, and that mode is part of its key and of its metadata
# key (its outputs differ). These ops get their own policy (opspec.py); nothing else pays.


# Note [hot path costs]
# Per intercepted op on a known trace (add16 of benchmarks/op_overhead.py, CPython 3.11, torch
# 2.13 CPU; instructions counted by callgrind, eager's own torch.add = 9.6k): the
# TorchFunctionMode round trip 9.9k; torch's dispatch-mode plumbing (arguments to Python and
# back, its per-op torch_dispatch_rule lookup) about 6k; a wrapper-subclass output about 15k all
# told (6.2k in _make_wrapper_subclass, the rest its instance dict, its weak reference, its
# deallocation, and torch's __torch_function__ lookups on every later op that takes it); the
# engine's own Python in this file and dispatch/mode.py about 13k. Shortcuts taken: the key
# starts with the op's OpSpec (an OpOverload hashes through a Python __hash__, twice per op); the
# mode reads the spec off the op (``op._ae_spec``); outputs are made inline, from per-Meta
# wrapper arguments, with class defaults for the attributes a new lazy tensor lacks; ops without
# kwargs share one empty dict. Together 64.6k -> 53.9k instructions per recorded op. Then the
# TorchFunctionMode went off the stack while nothing needs it (Note [read guard] in
# dispatch/mode.py): 54.3k -> 44.5k on add16, 58.4k -> 47.6k on the mixed chain. Then the
# common case of record and of the mode's front part moved to C (Note [C accelerator] in
# _hot.c; ADAPTIVE_EAGER_ACCEL=0 keeps this Python path): 44.5k -> 34.8k on add16 (3.7x eager's
# 9.4k), 47.6k -> 37.4k on the mixed chain (3.0x eager's 12.5k); counted inside a marker C
# function (callgrind --toggle-collect), PYTHONHASHSEED=0. Of add16's 34.8k the C handler is
# 13.9k: _make_wrapper_subclass 6.2k, the wrapper's attributes and weak reference about 1.7k,
# key, trie step and bookkeeping about 6k; the other 20k are torch's (eager's op, the dispatch
# to the mode, which builds the attribute name string anew per op, its dispatch-rule lookup,
# boxing, the output's deallocation and __torch_function__ lookups): C cannot reach them.
# First uses of externals moved to C (Note [first uses in C] in _hot.c): about
# 14.5k instructions each, nearly all torch's Python-level getters (layout, is_quantized,
# is_nested, device, shape, stride(), storage_offset(), is_conj(), is_neg(), the storage's
# data_ptr()).


class NeedRun(Exception):
    """Output metadata unknown for this (op, input metadata): run the op once for real."""

    def __init__(self, key: tuple) -> None:
        self.key = key


class RunNow(Exception):
    """This call of a deferrable op must run eagerly (e.g. indexing with a boolean mask)."""


def _mark_user(err: BaseException) -> None:
    """Errors that come from the user's own values propagate; the engine never swallows them."""
    try:
        err._ae_user = True  # type: ignore[attr-defined]
    except AttributeError:
        pass


def is_user_error(err: BaseException) -> bool:
    return isinstance(err, ValueUnavailable) or getattr(err, "_ae_user", False)


class Engine:
    """One thread's recorder and executor."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.check = options.check
        self.cap = options.max_trace_ops
        self.lock = threading.RLock()
        # Note [threads and lazy tensors]
        self.owner = _get_ident()  # the thread whose mode stack records into this engine
        self.busy = False  # the owner is inside record (mutating the trace); never blocks there
        self.foreign = False  # another thread holds ``lock`` to run this engine's trace
        self.flushing = 0  # depth of flushes in progress on the owner thread
        self.shared = False  # another thread has read this engine's lazy tensors
        self.trace = Trace(self)
        _OWNED.engine = self
        install_thread_sync()
        self.compiler = manager_for(options)
        configure_shapes(options)  # Note [symbolic dims]: learn, or load what was learnt
        self.presence: Any = None  # set by the context that activates this engine (aside.py)
        # Note [read guard] in dispatch/mode.py: the engine's ReadGuardMode, armed while the
        # pending trace writes a tensor from outside it (``ext_writes``)
        self.guard: Any = None
        self.ext_writes = False
        self._decisions_seen = 0
        self._errors_logged: set[str] = set()

    # ---- record (the hot path: one call per deferrable aten op) ----------------------------
    def record(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict,
               grad: bool | None = None) -> Any:
        """Defer one op: key it, find its output metadata, hand out lazy outputs.

        The trace keeps ``margs``: the arguments with each pending lazy input replaced by its
        ``Slot`` marker, so the trace never holds the user's lazy tensors (liveness is read from
        weak references at flush). Python numbers keyed by type only are collected, in order, in
        ``trace.scalars``: they are the per-run inputs of a compiled program. ``grad`` is the
        grad mode of an op whose kernel reads it (Note [grad-mode kernels]).

        The C accelerator (Note [C accelerator] in _hot.c) records the common case without
        calling this (a trie hit, or a memoised template step: shapes.step's non-anchor memo
        hit): a change here must be made there too (tests/test_accel.py compares them).
        """
        self.busy = True  # Note [threads and lazy tensors]: announce, then look
        if self.foreign:
            self.busy = False
            with self.lock:  # another thread is running this trace: wait for it, then record
                return self.record(op, spec, args, kwargs, grad)
        tr = self.trace
        n_ext, n_scalars = len(tr.ext), len(tr.scalars)
        try:
            # The key starts with the op's OpSpec, not the op: an OpOverload hashes in Python
            # (a frame per dict lookup), an OpSpec by identity (Note [hot path costs]).
            key: list[Any] = [spec]
            ap = key.append
            margs: list[Any] = []
            mp = margs.append
            ext_ids = tr.ext_ids
            n_op = len(tr.ops)
            i = 0
            for a in args:
                t = type(a)
                if t is LazyTensor:
                    if a._ae_trace is tr and a._ae_real is None:
                        s = a._ae_slot
                        ap(s)
                        mp(SLOTS[s])
                        tr.last[s] = n_op
                        i += 1
                        continue
                    ap(self._external(a, tr))
                elif t is _Tensor or t is _Parameter:
                    idx = ext_ids.get(id(a))
                    ap(~idx if idx is not None else tr.register(a))
                elif t is float or t is complex:
                    if spec.structural:
                        ap((t, a))
                    else:
                        ap(t)
                        tr.scalars.append(a)
                elif t is int or t is bool:
                    if spec.structural:
                        ap((t, a))
                    elif i in spec.scalar_pos:
                        ap(t)
                        tr.scalars.append(a)
                    else:
                        ap(a if t is int else BOOL_KEYS[a])  # Note [bool keys]
                elif t is list or t is tuple:
                    k, a = self._key_seq(a, tr, spec, n_op)
                    ap(k)
                elif isinstance(a, _Tensor):
                    raise Unsupported(f"tensor subclass {t.__name__}")
                else:
                    ap(a)
                mp(a)
                i += 1
            if kwargs:
                kwargs = self._key_kwargs(kwargs, key, tr, spec, n_op)
            if grad is not None:
                ap(("grad_enabled", grad))
            key_t = tuple(key)

            node = tr.node
            child = node.children.get(key_t) if node is not None else None
            if child is not None:
                tr.node = child
                out_spec = child.out
            elif node is not None and node.sym is not None and (
                    out_spec := sym_step(tr, node, key_t)) is not _SYM_MISS:
                pass  # a fitted template gave the metadata (Note [symbolic dims], shapes.py)
            else:
                node = tr.node  # sym_step may have moved a trace off a template
                if node is not None:
                    tr.leave_trie()
                    where = user_frame()
                    if not tr.after_warmup:  # fragments cut by learning new ops are not misses
                        self._note_miss(tr, explain_miss(node, key_t, where))
                else:
                    where = user_frame()
                out_spec = self._metadata(op, spec, args, kwargs)
                tr.off_keys.append(key_t)
                tr.off_outs.append(out_spec)
                tr.off_where.append(where)
            if type(out_spec) is Meta:  # one new lazy tensor: _outputs inlined
                slots = tr.n_slots
                tr.n_slots = slots + 1
                if slots >= len(SLOTS):
                    slot_marker(slots)
                out = _make_wrapper(LazyTensor, *out_spec.wrapper_args)
                out._ae_trace = tr
                out._ae_slot = slots
                out._ae_meta = out_spec
                if out_spec.bits:
                    _set_bits(out, out_spec)
                tr.refs.append(_weakref(out))
                tr.last.append(-1)
            else:
                out, slots = _outputs(out_spec, args, tr)
            if grad is not None:
                tr.grad_ops[n_op] = grad
            tr.ops.append((op, tuple(margs), kwargs, slots))
            if spec.writes is not None and not self.ext_writes:
                self._note_writes(spec, args, kwargs, tr)
            M.ops_deferred += 1
        except BaseException:
            # Note [unrecorded op's inputs]: an op that is not recorded numbers no input
            if len(tr.ops) == n_op and (len(tr.ext) != n_ext or len(tr.scalars) != n_scalars):
                tr.forget(n_ext, n_scalars)
            raise
        finally:
            self.busy = False
        if n_op + 1 >= self.cap:
            most = self.options.max_trace_ops  # Note [cap at the loop's period] in trace.py
            period = loop_period(tr.ops, most // 2)
            self.cap = most // period * period if period else most
            self.flush("trace_cap")
        return out

    def _note_writes(self, spec: OpSpec, args: tuple, kwargs: dict, tr: Trace) -> None:
        """An op that writes an argument was recorded: if that is a tensor from outside the
        trace (real, or lazy with a value), arm the read guard (Note [read guard], mode.py)."""
        for w in spec.writes:
            a = (args[w] if w < len(args) else None) if type(w) is int else kwargs.get(w)
            for x in (a if type(a) is list or type(a) is tuple else (a,)):
                if isinstance(x, _Tensor) and (type(x) is not LazyTensor or x._ae_trace is not tr
                                               or x._ae_real is not None):
                    self.ext_writes = True
                    if self.guard is not None:
                        self.guard.sync()
                    return

    def _external(self, a: torch.Tensor, tr: Trace) -> Any:
        if type(a) is LazyTensor and a._ae_real is None:
            if a._ae_error is None:
                # Pending in another thread's trace: running that one from inside record
                # (busy) could wait on a thread that waits on this one; run this op at once.
                raise RunNow("input pending in another thread's trace")
            try:
                materialize(a)  # poisoned: raises the error of its trace
            except BaseException as err:
                _mark_user(err)
                raise
        idx = tr.ext_ids.get(id(a))
        if idx is not None:
            return ~idx
        return tr.register(a)

    def _tensor_ref(self, a: torch.Tensor, tr: Trace, n_op: int) -> tuple[Any, Any]:
        """Key part of a tensor inside a list or kwargs, and its Slot marker if it is pending."""
        t = type(a)
        if t is LazyTensor and a._ae_trace is tr and a._ae_real is None:
            s = a._ae_slot
            tr.last[s] = n_op
            return s, SLOTS[s]
        if t is not LazyTensor and t is not _Tensor and t is not _Parameter:
            raise Unsupported(f"tensor subclass {t.__name__}")
        return self._external(a, tr), None

    def _key_seq(self, seq: list | tuple, tr: Trace, spec: OpSpec, n_op: int
                 ) -> tuple[tuple, list | tuple]:
        """Key a list argument (tensors, sizes, ScalarList); return it with Slot markers."""
        key: list[Any] = []
        marked: list[Any] | None = None
        for j, a in enumerate(seq):
            t = type(a)
            if isinstance(a, _Tensor):
                if spec.bool_index and a.dtype in (torch.bool, torch.uint8):
                    raise RunNow("boolean-mask index (output shape depends on values)")
                k, marker = self._tensor_ref(a, tr, n_op)
                key.append(k)
                if marker is not None:
                    if marked is None:
                        marked = list(seq)
                    marked[j] = marker
            elif t is float or t is complex:
                if spec.structural:
                    key.append((t, a))
                else:
                    key.append(t)  # ScalarList: values vary per run
                    tr.scalars.append(a)
            elif t is int or t is bool:
                key.append((t, a))  # sizes and dims
            else:
                key.append(a)
        return tuple(key), (seq if marked is None else type(seq)(marked))

    def _key_kwargs(self, kwargs: dict, key: list, tr: Trace, spec: OpSpec, n_op: int) -> dict:
        marked: dict | None = None
        for name, a in kwargs.items():
            key.append(name)
            t = type(a)
            if isinstance(a, _Tensor):
                k, marker = self._tensor_ref(a, tr, n_op)
                key.append(k)
                if marker is not None:
                    if marked is None:
                        marked = dict(kwargs)
                    marked[name] = marker
            elif t is float or t is complex or t is int or t is bool:
                if spec.structural:
                    key.append((t, a))
                elif t is float or t is complex or name in spec.scalar_kw:
                    key.append(t)
                    tr.scalars.append(a)
                else:
                    key.append(a if t is int else BOOL_KEYS[a])  # Note [bool keys]
            elif t is list or t is tuple:
                k, m = self._key_seq(a, tr, spec, n_op)
                key.append(k)
                if m is not a:
                    if marked is None:
                        marked = dict(kwargs)
                    marked[name] = m
            else:
                key.append(a)
        return kwargs if marked is None else marked

    def _metadata(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict) -> Any:
        """Output metadata off the trie: from the metadata cache, or NeedRun (run it for real)."""
        mkey = metadata_key(op, spec, args, kwargs)
        out = META_CACHE.get(mkey, _MISSING)
        if out is _MISSING:
            out = view_metadata(op, spec, args, kwargs)
            if out is None:  # Note [fresh outputs ignore offsets]
                out = META_CACHE.fresh.get(metadata_key(op, spec, args, kwargs, False))
            if out is None:
                out = sym_predict(self.trace, op, mkey)  # Note [symbolic dims], single ops
                if out is None:
                    raise NeedRun(mkey)
            else:
                META_CACHE.put(mkey, out)
        if out is EAGER_ONLY:
            raise RunNow("its output is not a strided tensor")
        return out

    # ---- flush ------------------------------------------------------------------------------
    def flush(self, reason: str) -> None:
        """Run the pending trace (a sync point). Cheap when nothing is pending."""
        if _get_ident() != self.owner:
            self._flush_foreign(reason)  # even with nothing pending: waits for a running flush
            return
        tr = self.trace
        if not tr.ops:
            if tr.ext or tr.node is not tr.start:
                self.trace = tr = Trace(self)
            if reason.startswith("new_op:"):
                tr.after_warmup = True
            if self.guard is not None and self.guard.pushed:
                self.guard.sync()  # a disarm left for later (Note [read guard])
            return
        with self.lock, span("adaptive_eager.flush"):
            tr = self.trace  # re-read: another thread may have run it while this one waited
            if not tr.ops:
                return
            self.trace = Trace(self)
            M.flushes += 1
            M.flush_reasons[reason] += 1
            self.trace.after_warmup = reason.startswith("new_op:")
            self.flushing += 1
            self.ext_writes = False
            if self.guard is not None and self.guard.pushed:
                self.guard.sync()  # disarm before the run (Note [guard off while a trace runs], mode.py)
            n_ops, replayed, start = len(tr.ops), M.replayed_runs, time.perf_counter()
            try:
                self._run_trace(tr, True)
            finally:
                self.flushing -= 1
                if self.guard is not None and self.guard.pushed:
                    self.guard.sync()  # disarm (Note [read guard] in dispatch/mode.py)
                note_flush_site(reason, n_ops, M.replayed_runs != replayed,
                                time.perf_counter() - start)

    def _run_trace(self, tr: Trace, owner: bool) -> None:
        if _transforms_active():
            # Recorded below every functorch transform: run it there too, or its outputs would
            # be wrapped at the level of the transform this flush happens in.
            with _DisableFuncTorch():
                self._run_trace_now(tr, owner)
        else:
            self._run_trace_now(tr, owner)

    def _run_trace_now(self, tr: Trace, owner: bool) -> None:
        entry = self._finish(tr)
        live = live_slots(tr)
        try:
            env = self._execute(entry, tr, live, owner)
            publish(tr, env, self.check, owner and not self.shared)
        except BaseException as err:
            if isinstance(err, Exception):  # an interrupt is not an error of the trace
                M.replay_errors += 1
            poison(tr, err)
            _mark_user(err)
            raise
        finally:
            tr.ops.clear()
            tr.ext.clear()

    def _flush_foreign(self, reason: str) -> None:
        """Run this engine's trace from a thread that does not own it (Note [threads and lazy
        tensors]): under ``lock``, once the owner is out of ``record``. The trace stays
        ``self.trace`` until its values are published, so the owner, which may keep running
        ops that need no recording meanwhile, still sees its pending writes and waits on
        ``lock`` before touching them."""
        with self.lock:
            self.shared = True
            self.foreign = True
            try:
                while self.busy:  # the owner leaves record within microseconds
                    time.sleep(0)
                tr = self.trace
                if not tr.ops:
                    return
                M.flushes += 1
                M.flush_reasons[f"other_thread:{reason}"] += 1
                try:
                    self._run_trace(tr, False)
                finally:
                    self.trace = Trace(self)
                    self.ext_writes = False  # the owner's guard disarms at its next flush
            finally:
                self.foreign = False

    def _execute(self, entry: TraceEntry, tr: Trace, live: list[int], owner: bool) -> list:
        """Run the trace: its fused program when one is ready and usable, else op by op."""
        mgr = self.compiler
        dec = mgr.decisions  # Note [adaptive decisions] in compile/policy.py
        program = None
        if mgr.backend.compiles:
            if entry.state == "new":
                dec.observe(entry, tr)
            program = mgr.program_for(entry, tr, live)
            dec.note_flush(tr.node is not None and entry.runs > 1, len(tr.ops), entry.state)
            # stepping aside pushes and pops modes: only on the owner's own thread
            if owner and self.presence is not None and ((dec.flushes & 15) == 0
                                              or len(dec.decided) != self._decisions_seen):
                self._decisions_seen = len(dec.decided)
                self._consider_step_aside()
        if program is not None:
            env = run_fused(mgr, entry, program, tr, self.options.crosscheck)
            if env is not None:
                return env
        start = time.perf_counter()
        with span("adaptive_eager.replay"):
            if tr.sym is None:
                env = replay(tr, live, self.check, entry)
            else:  # predicted metadata is checked once per size (Note [symbolic dims])
                env = replay_checked(tr, live, self.check, entry)
        dec.record_replay(entry, time.perf_counter() - start, run_size(entry, tr))
        M.replayed_runs += 1
        return env

    def _note_miss(self, tr: Trace, miss: dict) -> None:
        """Log why a trace left the known ones (cold path: once per miss)."""
        RUN_LOG.add_miss(miss["prefix"], len(tr.ops), miss)
        if log.isEnabledFor(logging.INFO):
            log.info("trace miss %s at op %d: %s %s at %s", miss["prefix"][:12], miss["index"],
                     miss.get("cause"), miss.get("op"), miss.get("where"))

    def _finish(self, tr: Trace) -> TraceEntry:
        """Note the trace in the trie: a hit if it ended where a known trace ended."""
        node = tr.node
        if node is None:
            node = tr.off_node
            assert node is not None
            for key, out, where in zip(tr.off_keys, tr.off_outs, tr.off_where):
                node = node.child(key, out, where)
        entry = node.entry
        if entry is not None and tr.node is not None:
            M.trace_hits += 1
            entry.hits += 1
            if entry.sym is not None:  # a template's entry: fused or op by op, any size
                sym_note_hit(entry)
        else:
            M.trace_misses += 1
            if entry is None:
                if TRIE.entries >= _MAX_TRIE_ENTRIES:
                    log.warning("adaptive_eager: %d distinct traces seen; clearing the trace trie",
                                TRIE.entries)
                    TRIE.clear()
                entry = TRIE.add_entry(node, len(tr.ops))

        entry.runs += 1
        return entry

    def _consider_step_aside(self) -> None:
        try:
            self.presence.consider_sync_rounds()  # Note [syncs are rounds] in aside.py
            reason = self.compiler.step_aside_reason()
            if reason is not None:
                self.presence.request_aside(reason)
            elif self.compiler.settled():
                self.presence.start_trial()  # Note [measured trial] in trial.py
        except Exception as err:  # bookkeeping must never fail the user's program
            self._internal_fault(err, "step_aside")

    def _internal_fault(self, err: BaseException, where: str) -> None:
        kind = f"{type(err).__name__} in {where}"
        M.engine_errors += 1
        M.engine_error_kinds[kind] += 1
        if kind not in self._errors_logged:
            self._errors_logged.add(kind)
            log.warning("adaptive_eager: internal error (%s: %s); continuing",
                        type(err).__name__, err, exc_info=log.isEnabledFor(logging.DEBUG))

    # ---- ops that run now -------------------------------------------------------------------
    def run_eager(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict, reason: str,
                  learn: tuple | None = None) -> Any:
        """Flush, then run the op on real values; with ``learn``, remember its output metadata."""
        self.flush(reason)
        M.ops_eager += 1
        rargs = resolve_all(args)
        rkwargs = {k: resolve_all(v) for k, v in kwargs.items()} if kwargs else {}
        user_op = learn is not None and getattr(op, "namespace", "aten") != "aten"
        rng = torch.get_rng_state() if user_op else None
        # Note [in-place ops that resize]; ``t_``-like ops refresh in run_inplace_view
        before = (written_layouts(spec, rargs)
                  if spec.writes and spec.policy != INPLACE_VIEW else None)
        with _DisableFunction():
            out = op(*rargs, **rkwargs)
            if before is not None and before != written_layouts(spec, rargs):
                resizes_what_it_writes(spec, args)
            elif learn is not None:
                out_spec = output_spec(out, spec.ret_alias)
                META_CACHE.put(learn, out_spec)
                if out_spec is not EAGER_ONLY and fresh(out, rargs, rkwargs):
                    # Note [fresh outputs ignore offsets]
                    META_CACHE.fresh[metadata_key(op, spec, args, kwargs, False)] = out_spec
        if rng is not None and not torch.equal(rng, torch.get_rng_state()):
            # A user op that draws from the global generator without the nondeterministic_seeded
            # tag: deferred, its draws would move to the flush, out of program order. From now
            # on it runs at once, in order, as random ops do (Note [custom ops] in opspec.py).
            spec.policy, spec.reason = RANDOM, "custom op draws random numbers"
        if learn is not None and self.presence is not None and (M.meta_misses & 255) == 0:
            self._consider_step_aside()
        return rebind_aliases(spec.ret_alias, args, out)

    def run_view(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict) -> Any:
        """Note [views of real tensors]
        A view of a real tensor (a batch sliced from a dataset, ``weight.t()``) is made at once:
        it costs less than recording, reads no data (so needs no flush), and its result enters
        traces as an external input whose storage offset is not part of the key. Deferred views
        then only ever have lazy bases, whose offsets follow from the trace itself; so a loop over
        ``data[i:i + 64]`` is one repeating trace, not a new one per batch. Composite ops that
        only may return a view (``to``, ``reshape``, ``contiguous``; they reach this mode under
        inference mode) copy when they must, so they wait for pending writes to their input."""
        if self.trace.ops and _may_copy(spec) and self._touches_trace(args, kwargs):
            self.flush(f"copy_input:{spec.name}")
        M.ops_eager += 1
        with _DisableDispatch(), _DisableFunction():
            return op(*resolve_all(args), **kwargs)

    def run_host_scalar(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict) -> Any:
        """Real CPU scalars (Note [host scalars] in mode.py): at once, unless the pending trace
        reads or writes them (then the order of effects needs the trace)."""
        if self.trace.ops and self._touches_trace(args, kwargs):
            try:
                return self.record(op, spec, args, kwargs)
            except NeedRun as miss:
                M.meta_misses += 1
                return self.run_eager(op, spec, args, kwargs, f"new_op:{spec.name}", miss.key)
        M.ops_eager += 1
        with _DisableDispatch(), _DisableFunction():
            out = op(*args, **kwargs)
        if spec.host_learns < _HOST_LEARNS:
            # The same op on a pending scalar next time (autograd's seed once the loss is lazy)
            # then defers at once instead of needing a run of its own to learn its metadata.
            spec.host_learns += 1
            try:
                mkey = metadata_key(op, spec, args, kwargs)
                if META_CACHE.get(mkey, _MISSING) is _MISSING:
                    META_CACHE.put(mkey, output_spec(out, spec.ret_alias))
            except (RuntimeError, Unsupported):  # e.g. sparse inputs: nothing to learn
                pass
        return rebind_aliases(spec.ret_alias, args, out)

    def run_sync(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict) -> Any:
        """``.item()`` and other value reads: flush first only if the pending trace touches the
        inputs (an untouched real tensor already holds its value)."""
        if self.trace.ops and self._touches_trace(args, kwargs):
            return self.run_fallback(op, spec, args, kwargs, "sync")
        M.fallbacks += 1
        M.fallback_ops[spec.name] += 1
        M.ops_eager += 1
        rargs = resolve_all(args)
        with _DisableDispatch(), _DisableFunction():
            out = op(*rargs, **kwargs)
        return rebind_aliases(spec.ret_alias, args, out)

    def run_fallback(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict, why: str) -> Any:
        M.fallbacks += 1
        M.fallback_ops[spec.name] += 1
        return self.run_eager(op, spec, args, kwargs, f"{why}:{spec.name}")

    def run_random(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict) -> Any:
        """Random ops run in program order so the generator advances exactly as in eager."""
        if self.trace.ops and self._touches_trace(args, kwargs):
            self.flush(f"random_input:{spec.name}")
        M.ops_eager += 1
        rargs = resolve_all(args)
        rkwargs = {k: resolve_all(v) for k, v in kwargs.items()} if kwargs else {}
        with _DisableFunction():
            out = op(*rargs, **rkwargs)
        return rebind_aliases(spec.ret_alias, args, out)

    def _touches_trace(self, args: tuple, kwargs: dict) -> bool:
        tr = self.trace
        for a in (*args, *kwargs.values()):
            items = a if type(a) is list or type(a) is tuple else (a,)
            for x in items:
                if type(x) is LazyTensor:
                    if x._ae_real is None or tr.touches_storage(x._ae_real):
                        return True
                elif isinstance(x, _Tensor) and tr.touches_storage(x):
                    return True
        return False

    def run_inplace_view(self, op: Any, spec: OpSpec, args: tuple, kwargs: dict) -> Any:
        """Metadata-changing in-place ops: run for real, then make the wrapper follow (trap 3).
        ``detach_`` (under inference mode it reaches this mode) changes autograd metadata only:
        it runs on the wrapper itself, with no flush."""
        if spec.name == "aten.detach_.default":
            M.ops_eager += 1
            with _DisableDispatch(), _DisableFunction():
                return op(*args, **kwargs)
        out = self.run_fallback(op, spec, args, kwargs, "inplace_view")
        for i in spec.writes or (0,):
            target = args[i] if type(i) is int and i < len(args) else None
            if type(target) is LazyTensor and target._ae_real is not None:
                refresh_wrapper(target)
        return out

    def engine_error(self, err: BaseException, spec: OpSpec) -> str:
        """Count an internal fault, log it once per kind, and name the fallback reason."""
        self._internal_fault(err, f"{spec.name} (ran eagerly)")
        return "engine_error"


def _outputs(spec: Any, args: tuple, tr: Trace) -> tuple[Any, Any]:
    """Make the lazy outputs an op's metadata calls for; return them and their slot numbers."""
    t = type(spec)
    if t is Meta:
        s = tr.n_slots
        tr.n_slots = s + 1
        if s >= len(SLOTS):
            slot_marker(s)
        w = LazyTensor(spec, tr, s)
        tr.refs.append(_weakref(w))
        tr.last.append(-1)
        return w, s
    if t is int:
        return args[spec], None  # an in-place op returns its argument
    if spec is None:
        return None, None
    pairs = [_outputs(x, args, tr) for x in spec]
    return t(p[0] for p in pairs), t(p[1] for p in pairs)


_HOST_LEARNS = 16  # host-scalar runs per op whose output metadata is learned
_MAY_COPY: dict[OpSpec, bool] = {}
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


def _may_copy(spec: OpSpec) -> bool:
    """Whether a view op is composite (may copy instead of viewing: reshape, to, contiguous)."""
    may = _MAY_COPY.get(spec)
    if may is None:
        may = _MAY_COPY[spec] = spec.op.has_kernel_for_dispatch_key(_COMPOSITE)
    return may
