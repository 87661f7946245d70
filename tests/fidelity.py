"""Fidelity harness: every OpInfo op, in plain eager and under adaptive_eager, must agree bitwise.

    python tests/fidelity.py                      # the quick subset (QUICK_OPS)
    python tests/fidelity.py --full               # every op in op_db (CPU)
    python tests/fidelity.py --ops add,mul --out report.md [--json report.json] [--jobs 2]

For every op (CPU), float32 (or the op's float dtype) and one integer or bool dtype it supports,
and each of its sample inputs, for the function variant and (if any) the in-place variant:

* plain eager, twice (if the two disagree, e.g. ``empty``, only metadata is compared; a value
  mismatch with the engine also triggers a few more eager runs to rule out eager nondeterminism);
* under ``adaptive_eager(check=True)``: a warm-up run, then the checked run. The first sight of an
  (op, input metadata) pair runs eagerly to learn output metadata, so only the second run exercises
  the deferred path; both are compared with eager (``--warmups N`` adds warm-up runs).

Every run gets fresh clones of the sample's tensors (same storage layout and aliasing) and the same
RNG seed. Compared: outputs (dtype, shape, stride, storage offset, requires_grad, conj/neg bits,
values with ``torch.equal``, NaNs equal; which outputs are the inputs themselves or share their
storage), the inputs afterwards (in-place effects), the gradients of the inputs (float32 and
``supports_autograd``: the sum of the outputs' float parts, backward), and raised errors (same
exception type; errors the engine raises later than eager, at a flush, are counted as late).

Per op: ``pass`` (every sample matched; ops ran deferred or legitimately eagerly: allocations,
random ops, metadata reads), ``fallback`` (matched, but the engine ran some aten op through its
fallback/sync path: ``metrics()["fallback_ops"]``), ``fail`` (a mismatch or an engine crash),
``skipped`` (a sample took more than the per-sample CPU-time limit, the op hung or had no CPU
samples).

The CLI runs ops in worker subprocesses (``--jobs``), so a hang or a crash costs one op, not the
sweep; the library part (``check_op``) runs in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch

import adaptive_eager as ae

SEED = 1234
# Ops whose outputs are uninitialised memory: only their metadata is compared. (Ops that are
# nondeterministic in eager are also found at run time: see ``_eager_is_stable``.)
UNINITIALIZED_OUTPUT_OPS = frozenset({
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
})

def eager_nondeterministic(name: str, sample: Any) -> bool:
    """Samples whose eager results are not reproducible, for reasons in PyTorch itself."""
    # linalg.lstsq(driver='gelsy') hands LAPACK an uninitialised pivot array (jpvt = at::empty in
    # BatchLinearAlgebraKernel.cpp); gelsy reads it on entry, so eager differs from eager.
    return name.startswith("linalg.lstsq") and sample.kwargs.get("driver") == "gelsy"


# Options of every engine run. Op-by-op replay is the path that must equal eager bitwise (fused
# programs are held to dtype tolerance only, DESIGN); stepping aside would run plain eager and test
# nothing; the user's disk cache is left alone. Options this engine version lacks are dropped.
ENGINE_OPTIONS: dict[str, Any] = {
    "check": True, "log_level": "ERROR", "backend": "replay", "step_aside": False,
    "disk_cache": False, "compile_async": False,
}
_engine_overrides: dict[str, Any] = {}


def set_engine_options(overrides: dict[str, Any]) -> None:
    """Override ENGINE_OPTIONS (values may be strings, parsed like the environment variables)."""
    _engine_overrides.clear()
    _engine_overrides.update(overrides)


def engine_options() -> dict[str, Any]:
    opts = {**ENGINE_OPTIONS, **_engine_overrides}
    try:
        from adaptive_eager.config import SETTINGS
    except ImportError:  # pragma: no cover - config layout changed
        return opts
    known = {st.name for st in SETTINGS}
    return {k: v for k, v in opts.items() if k in known or k in _engine_overrides}


EXTRA_EAGER_RUNS = 4  # eager reruns, on a mismatch, to tell engine bugs from eager nondeterminism
DEFAULT_SAMPLE_TIMEOUT = 10.0  # CPU seconds per sample (all variants and runs together)
DEFAULT_OP_TIMEOUT = 600.0  # seconds per op in a worker (hard kill)
MAX_DETAILS = 6  # failure details kept per op

# ~60+ representative ops for the default (quick) suite: elementwise, reductions, views, indexing,
# matmul, conv, norms, softmax, cat/stack/split, scatter/gather, in-place variants; no random ops.
QUICK_OPS: tuple[str, ...] = (
    # elementwise (in-place variants are run too where the OpInfo has one: add_, mul_, ...)
    "add", "sub", "mul", "div.no_rounding_mode", "div.floor_rounding", "abs", "neg", "exp", "log",
    "sin", "tanh", "sigmoid", "pow", "clamp", "where", "maximum", "lerp", "addcmul",
    "nn.functional.relu", "nn.functional.gelu", "bitwise_and", "eq", "logical_not", "to",
    # reductions
    "sum", "mean", "amax", "argmax", "var", "prod", "cumsum", "logsumexp", "linalg.vector_norm",
    "any",
    # views and layout
    "view", "reshape", "permute", "transpose", "t", "expand", "squeeze", "unsqueeze", "narrow",
    "select", "flatten", "contiguous", "clone", "resize_", "zero_",
    # indexing, scatter/gather
    "index_select", "index_add", "index_put", "__getitem__", "masked_fill", "masked_select",
    "gather", "scatter", "scatter_add", "take_along_dim", "nonzero",
    # matmul, conv, norms, softmax, losses, pooling
    "matmul", "mm", "bmm", "addmm", "nn.functional.linear", "nn.functional.conv2d",
    "nn.functional.layer_norm", "nn.functional.batch_norm", "softmax", "log_softmax",
    "nn.functional.cross_entropy", "nn.functional.max_pool2d", "nn.functional.embedding",
    # cat/stack/split and friends
    "cat", "stack", "split", "chunk", "unbind", "tril", "topk", "sort", "flip", "roll",
    "nn.functional.pad.constant", "full_like", "arange",
)


class SampleTimeout(BaseException):
    """A sample ran past its time limit (a BaseException: the engine's fallbacks let it through)."""


# ---- ops and dtypes ------------------------------------------------------------------------------
def op_db() -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db as db
    return db


def op_name(op: Any) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def ops_by_name() -> dict[str, Any]:
    return {op_name(o): o for o in op_db()}


_INT_PREFERENCE = (torch.int64, torch.bool, torch.int32, torch.uint8, torch.int16, torch.int8)
_FLOAT_PREFERENCE = (torch.float32, torch.float64, torch.complex64, torch.bfloat16,
                     torch.float16)


def pick_dtypes(op: Any) -> list[torch.dtype]:
    """float32 (else another float/complex dtype) and one integer or bool dtype the op supports."""
    try:
        supported = set(op.supported_dtypes("cpu"))
    except TypeError:
        supported = set(op.supported_dtypes(torch.device("cpu")))
    out = []
    for d in _FLOAT_PREFERENCE:
        if d in supported:
            out.append(d)
            break
    for d in _INT_PREFERENCE:
        if d in supported:
            out.append(d)
            break
    if not out and supported:
        out.append(min(supported, key=str))
    return out


# ---- tensors: cloning, flattening, snapshots ---------------------------------------------------
def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _flatten(x: Any, acc: list | None = None) -> list:
    """Leaves of nested lists/tuples/dicts, in order."""
    if acc is None:
        acc = []
    if isinstance(x, (list, tuple)):
        for v in x:
            _flatten(v, acc)
    elif isinstance(x, dict):
        for v in x.values():
            _flatten(v, acc)
    else:
        acc.append(x)
    return acc


def _clone_tensor(t: torch.Tensor, memo: dict, requires_grad: bool | None) -> torch.Tensor:
    """A fresh leaf with the same storage layout; tensors sharing a storage still share one."""
    rg = t.requires_grad if requires_grad is None else requires_grad
    with torch.no_grad():
        if (t.layout is not torch.strided or t.is_conj() or t.is_neg() or t.is_quantized
                or t.is_nested or type(t) is not torch.Tensor and
                type(t) is not torch.nn.Parameter):
            new = t.detach().clone()
        else:
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes()) if st.nbytes() else ("empty", id(t))
            new_st = memo.get(key)
            if new_st is None:
                new_st = memo[key] = st.clone()
            new = torch.empty((0,), dtype=t.dtype, device=t.device)
            new.set_(new_st, t.storage_offset(), t.size(), t.stride())
    if rg and (new.is_floating_point() or new.is_complex()):
        new.requires_grad_(True)
    return new


def _clone_tree(x: Any, memo: dict, requires_grad: bool | None) -> Any:
    if _is_tensor(x):
        return _clone_tensor(x, memo, requires_grad)
    if isinstance(x, list):
        return [_clone_tree(v, memo, requires_grad) for v in x]
    if type(x) is tuple:
        return tuple(_clone_tree(v, memo, requires_grad) for v in x)
    if isinstance(x, dict):
        return {k: _clone_tree(v, memo, requires_grad) for k, v in x.items()}
    return x


def clone_sample(sample: Any, requires_grad: bool | None = None) -> tuple[Any, tuple, dict]:
    memo: dict = {}
    inp = _clone_tree(sample.input, memo, requires_grad)
    args = _clone_tree(tuple(sample.args), memo, requires_grad)
    kwargs = _clone_tree(dict(sample.kwargs), memo, requires_grad)
    return inp, args, kwargs


def _real(t: torch.Tensor) -> torch.Tensor:
    """A lazy tensor's value (it was materialized when its engine context closed)."""
    if isinstance(t, ae.LazyTensor):
        try:
            from adaptive_eager.dispatch.lazy import materialize
        except ImportError:  # pragma: no cover - internal layout changed
            real = getattr(t, "_ae_real", None)
            if real is None:
                raise
            return real
        return materialize(t)
    return t


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        with torch.no_grad():
            st = _real(t).untyped_storage()
            return st.data_ptr() if st.nbytes() else None
    except Exception:
        return None


@dataclasses.dataclass
class TensorSnap:
    meta: tuple
    value: torch.Tensor | None  # None when the value could not be read
    read_error: str | None
    is_input: int | None  # index of the input tensor this very object is
    aliases: tuple[int, ...]  # indexes of inputs whose storage it shares


def _meta(t: torch.Tensor) -> tuple:
    m: list[Any] = [t.dtype, tuple(t.shape), t.layout, t.device.type, t.requires_grad]
    if t.layout is torch.strided:
        m += [tuple(t.stride()), t.storage_offset(), t.is_conj(), t.is_neg()]
    return tuple(m)


def _snap(x: Any, inputs: list[torch.Tensor], input_keys: list[int | None]) -> Any:
    if _is_tensor(x):
        meta = _meta(x)
        is_input = next((i for i, t in enumerate(inputs) if t is x), None)
        try:
            with torch.no_grad():
                value = _real(x).detach()
            err = None
        except Exception as e:  # a poisoned lazy tensor
            value, err = None, f"{type(e).__name__}: {e}"
        key = _storage_key(x) if value is not None else None
        aliases = tuple(i for i, k in enumerate(input_keys) if k is not None and k == key)
        return TensorSnap(meta, value, err, is_input, aliases)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_snap(v, inputs, input_keys) for v in x])
    if isinstance(x, dict):
        return ("dict", {k: _snap(v, inputs, input_keys) for k, v in x.items()})
    return x


def _values_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    with torch.no_grad():
        if a.layout is not torch.strided:
            a, b = a.to_dense(), b.to_dense()
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype in _UPCAST:  # no equal/isnan kernels on CPU for these: compare exactly upcast
            a, b = a.to(_UPCAST[a.dtype]), b.to(_UPCAST[b.dtype])
        a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
        if torch.equal(a, b):
            return True
        if a.is_floating_point() or a.is_complex():
            na, nb = a.isnan(), b.isnan()
            if not torch.equal(na, nb):
                return False
            zero = torch.zeros((), dtype=a.dtype)
            return torch.equal(torch.where(na, zero, a), torch.where(nb, zero, b))
        return False


_UPCAST = {torch.complex32: torch.complex64}


def _compare(a: Any, b: Any, path: str, values: bool, out: list[str]) -> None:
    """Append to ``out`` every difference between eager snapshot ``a`` and engine snapshot ``b``."""
    if isinstance(a, TensorSnap) or isinstance(b, TensorSnap):
        if not (isinstance(a, TensorSnap) and isinstance(b, TensorSnap)):
            out.append(f"{path}: eager {type(a).__name__}, engine {type(b).__name__}")
            return
        if a.meta != b.meta:
            out.append(f"{path}: metadata eager {a.meta} vs engine {b.meta}")
            return
        if b.read_error is not None:
            out.append(f"{path}: engine value unreadable: {b.read_error}")
            return
        if a.is_input != b.is_input:
            out.append(f"{path}: eager returns input #{a.is_input}, engine #{b.is_input}")
        if a.aliases != b.aliases:
            out.append(f"{path}: shares storage with inputs {a.aliases} in eager, "
                       f"{b.aliases} under the engine")
        if values and a.value is not None and b.value is not None and not _values_equal(
                a.value, b.value):
            out.append(f"{path}: values differ")
        return
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], list):
        if not (isinstance(b, tuple) and len(b) == 2 and b[0] == a[0] and len(b[1]) == len(a[1])):
            out.append(f"{path}: eager {a[0]} of {len(a[1])}, engine {_describe(b)}")
            return
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            _compare(x, y, f"{path}[{i}]", values, out)
        return
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "dict":
        if not (isinstance(b, tuple) and len(b) == 2 and b[0] == "dict" and
                b[1].keys() == a[1].keys()):
            out.append(f"{path}: eager dict, engine {_describe(b)}")
            return
        for k in a[1]:
            _compare(a[1][k], b[1][k], f"{path}[{k!r}]", values, out)
        return
    if type(a) is not type(b):
        out.append(f"{path}: eager {type(a).__name__} {a!r}, engine {type(b).__name__} {b!r}")
        return
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return
    try:
        same = bool(a == b)
    except Exception:
        same = repr(a) == repr(b)
    if not same and values:
        out.append(f"{path}: eager {a!r}, engine {b!r}")


def _describe(x: Any) -> str:
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
        return f"{x[0]} of {len(x[1])}"
    return type(x).__name__


# ---- one run ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    error: str | None = None  # exception type name
    error_msg: str = ""
    stage: str = ""  # call | backward | sync | exit | snapshot
    out: Any = None
    inputs: Any = None
    grads: Any = None
    metrics: dict | None = None


def _backward(out: Any, sample: Any, inputs: list[torch.Tensor]) -> Any:
    proc = getattr(sample, "output_process_fn_grad", None)
    outs = proc(out) if proc is not None else out
    parts = []
    for t in _flatten(outs):
        if _is_tensor(t) and t.requires_grad and (t.is_floating_point() or t.is_complex()):
            parts.append(t.real.sum() + t.imag.sum() if t.is_complex() else t.sum())
    leaves = [t for t in inputs if t.requires_grad]
    if not parts or not leaves:
        return None
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return torch.autograd.grad(total, leaves, allow_unused=True)


def run_once(fn: Callable, sample: Any, *, engine: bool, backward: bool,
             requires_grad: bool | None) -> Outcome:
    """Run ``fn`` on fresh clones of ``sample``, in eager or under the engine."""
    inp, args, kwargs = clone_sample(sample, requires_grad)
    inputs = [t for t in _flatten((inp, args, kwargs)) if _is_tensor(t)]
    input_keys = [_storage_key(t) for t in inputs]
    o = Outcome()
    out = grads = None
    if engine:
        ae.reset_metrics()
        ctx: Any = ae.adaptive_eager(**engine_options())
    else:
        ctx = contextlib.nullcontext()
    torch.manual_seed(SEED)
    stage = "call"
    try:
        with ctx:
            try:
                out = fn(inp, *args, **kwargs)
                if backward:
                    stage = "backward"
                    grads = _backward(out, sample, inputs)
                if engine:
                    stage = "sync"
                    ae.sync()
            except Exception as e:
                o.error, o.error_msg, o.stage = type(e).__name__, str(e)[:300], stage
    except Exception as e:  # the flush at exit
        if o.error is None:
            o.error, o.error_msg, o.stage = type(e).__name__, str(e)[:300], "exit"
    if engine:
        o.metrics = ae.metrics()
    if o.error is None:
        try:
            o.out = _snap(out, inputs, input_keys)
            o.inputs = _snap(inputs, inputs, input_keys)
            o.grads = _snap(list(grads) if grads is not None else None, inputs, input_keys)
        except Exception as e:
            o.error, o.error_msg, o.stage = type(e).__name__, str(e)[:300], "snapshot"
    return o


def compare_outcomes(eager: Outcome, got: Outcome, values: bool) -> list[str]:
    diffs: list[str] = []
    if eager.error != got.error:
        if eager.error is None:
            diffs.append(f"engine raised {got.error} at {got.stage}: {got.error_msg}")
        elif got.error is None:
            diffs.append(f"eager raised {eager.error} ({eager.error_msg[:120]}), engine did not")
        else:
            diffs.append(f"eager raised {eager.error}, engine {got.error} at {got.stage}: "
                         f"{got.error_msg}")
        return diffs
    if eager.error is not None:
        return diffs
    _compare(eager.out, got.out, "out", values, diffs)
    _compare(eager.inputs, got.inputs, "inputs", values, diffs)
    _compare(eager.grads, got.grads, "grads", values, diffs)
    return diffs


# ---- one op -------------------------------------------------------------------------------------
@dataclasses.dataclass
class OpResult:
    name: str
    status: str = "pass"  # pass | fallback | fail | skipped
    dtypes: list[str] = dataclasses.field(default_factory=list)
    samples: int = 0  # (dtype, sample, variant) triples run
    deferred: int = 0  # checked run deferred at least one op, no fallback
    eager: int = 0  # checked run deferred nothing and fell back on nothing
    fallback: int = 0  # checked run used a fallback/sync path
    failed: int = 0
    nondeterministic: int = 0  # eager differed from eager: only metadata compared
    error_samples: int = 0  # samples where eager raised (the engine must raise the same type)
    late_errors: int = 0  # eager raised at the call, the engine at a later flush
    ops_deferred: int = 0
    meta_misses_checked: int = 0  # first-sight misses left in checked runs (should be 0)
    fallback_ops: dict[str, str] = dataclasses.field(default_factory=dict)  # aten op -> reason
    engine_errors: dict[str, int] = dataclasses.field(default_factory=dict)
    details: list[str] = dataclasses.field(default_factory=list)
    skip_reason: str = ""
    seconds: float = 0.0


def _policy_reason(name: str) -> str:
    """The engine's static policy for an aten op name like 'aten.nonzero.default'."""
    try:
        from adaptive_eager.dispatch.opspec import POLICY_NAMES, spec_for
        ns, op, overload = name.split(".")
        spec = spec_for(getattr(getattr(getattr(torch.ops, ns), op), overload))
        return f"{POLICY_NAMES[spec.policy]}: {spec.reason}"
    except Exception:
        return "?"


def _fallback_reasons(m: dict) -> dict[str, str]:
    out = {}
    for name in m.get("fallback_ops", {}):
        dyn = [k[: -len(name) - 1] for k in m.get("flush_reasons", {}) if k.endswith(":" + name)]
        dyn = [d for d in dyn if d not in ("sync", "fallback")]
        reason = _policy_reason(name)
        if reason.startswith("defer"):
            reason = ("deferrable, but this call ran eagerly (RunNow/Unsupported at record, "
                      "e.g. a boolean-mask index)")
        if dyn:
            reason = "; ".join(sorted(set(dyn)))
        out[name] = reason
    return out


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise SampleTimeout(f"sample took more than {seconds:g}s of CPU time")

    # CPU time, not wall time: a busy machine must not turn slow samples into skips. Hangs that
    # burn no CPU are caught by the per-op wall-clock limit of the worker pool (run_ops).
    old = signal.signal(signal.SIGPROF, on_alarm)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


def _variants(op: Any) -> list[tuple[str, Callable]]:
    vs: list[tuple[str, Callable]] = [("fn", op.op)]
    inplace = op.inplace_variant
    if inplace is not None:
        vs.append(("inplace", inplace))
    return vs


def check_sample(op: Any, sample: Any, dtype: torch.dtype, grad: bool, res: OpResult,
                 sample_idx: int, warmups: int = 1) -> None:
    """Run one sample in every variant; fold the verdicts into ``res``."""
    for vname, fn in _variants(op):
        backward = grad and vname == "fn"
        rg = None if vname == "fn" else False
        res.samples += 1
        e1 = run_once(fn, sample, engine=False, backward=backward, requires_grad=rg)
        e2 = run_once(fn, sample, engine=False, backward=backward, requires_grad=rg)
        values = (res.name not in UNINITIALIZED_OUTPUT_OPS and not eager_nondeterministic(
            res.name, sample) and not compare_outcomes(e1, e2, True))
        warm = run_once(fn, sample, engine=True, backward=backward, requires_grad=rg)
        for _ in range(warmups - 1):
            run_once(fn, sample, engine=True, backward=backward, requires_grad=rg)
        got = run_once(fn, sample, engine=True, backward=backward, requires_grad=rg)
        diffs = [f"warm-up: {d}" for d in compare_outcomes(e1, warm, values)]
        diffs += compare_outcomes(e1, got, values)
        if diffs and values and not _eager_is_stable(e1, fn, sample, backward, rg):
            values = False
            diffs = [f"warm-up: {d}" for d in compare_outcomes(e1, warm, values)]
            diffs += compare_outcomes(e1, got, values)
        if not values:
            res.nondeterministic += 1
        if e1.error is not None:
            res.error_samples += 1
            if e1.stage == "call" and got.error == e1.error and got.stage != "call":
                res.late_errors += 1
        m = got.metrics or {}
        res.ops_deferred += m.get("ops_deferred", 0)
        if e1.error is None:  # an op that raises is never learned: it misses every time
            res.meta_misses_checked += m.get("meta_misses", 0)
        for kind, n in (m.get("engine_error_kinds") or {}).items():
            res.engine_errors[kind] = res.engine_errors.get(kind, 0) + n
        for kind, n in ((warm.metrics or {}).get("engine_error_kinds") or {}).items():
            res.engine_errors[kind] = res.engine_errors.get(kind, 0) + n
        if diffs:
            res.failed += 1
            if len(res.details) < MAX_DETAILS:
                desc = _describe_sample(sample)
                res.details.append(f"[{dtype} sample {sample_idx} {vname}] {desc}: "
                                   + "; ".join(diffs[:3]))
        elif m.get("fallback_ops"):
            res.fallback += 1
            res.fallback_ops.update(_fallback_reasons(m))
        elif m.get("ops_deferred", 0):
            res.deferred += 1
        else:
            res.eager += 1


def _eager_is_stable(e1: Outcome, fn: Callable, sample: Any, backward: bool,
                     rg: bool | None) -> bool:
    """Rerun eager a few times, with freed junk-filled memory around, and see if it agrees."""
    for k in range(EXTRA_EAGER_RUNS):
        junk = [torch.full((n,), float("nan")) for n in (1, 7, 64, 1000, 1 << 14)]
        junk += [torch.full((n,), -1, dtype=torch.int64) for n in (3, 100, 4096)]
        keep = junk[k % 2::2]  # free half of it, keep the other half alive during the run
        del junk
        ek = run_once(fn, sample, engine=False, backward=backward, requires_grad=rg)
        del keep
        if compare_outcomes(e1, ek, True):
            return False
    return True


def _describe_sample(sample: Any) -> str:
    def d(x: Any) -> str:
        if _is_tensor(x):
            s = f"T{list(x.shape)}"
            if x.layout is torch.strided and not x.is_contiguous():
                s += f"s{tuple(x.stride())}"
            return s
        if isinstance(x, (list, tuple)):
            inner = ",".join(d(v) for v in x[:6]) + (",..." if len(x) > 6 else "")
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        r = repr(x)
        return r if len(r) < 40 else r[:37] + "..."
    parts = [d(sample.input)] + [d(a) for a in sample.args]
    parts += [f"{k}={d(v)}" for k, v in sample.kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def check_op(op: Any, *, sample_timeout: float | None = DEFAULT_SAMPLE_TIMEOUT,
             max_samples: int | None = None, warmups: int = 1) -> OpResult:
    """Run every sample of one OpInfo op (in this process) and classify the op."""
    res = OpResult(op_name(op))
    t0 = time.perf_counter()
    ae.clear_caches()
    ae.reset_metrics()
    prev_grad = torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    try:
        for dtype in pick_dtypes(op):
            res.dtypes.append(str(dtype).replace("torch.", ""))
            grad = bool(op.supports_autograd) and dtype == torch.float32
            try:
                with _time_limit(sample_timeout):
                    samples = iter(op.sample_inputs("cpu", dtype, requires_grad=grad))
            except SampleTimeout as e:
                res.status = "skipped"
                res.skip_reason = f"{dtype} sample_inputs: {e}"
                return res
            except Exception as e:
                res.details.append(f"[{dtype}] sample_inputs raised {type(e).__name__}: {e}")
                continue
            i = 0
            while max_samples is None or i < max_samples:
                try:
                    with _time_limit(sample_timeout):
                        torch.manual_seed(SEED + i)
                        sample = next(samples, None)
                        if sample is None:
                            break
                        check_sample(op, sample, dtype, grad, res, i, warmups)
                except SampleTimeout as e:
                    res.status = "skipped"
                    res.skip_reason = f"{dtype} sample {i}: {e}"
                    return res
                i += 1
            ae.clear_caches()
    except Exception as e:  # a harness fault: report it, do not hide it
        res.failed += 1
        res.details.append(f"harness error {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        torch.set_grad_enabled(prev_grad)
        ae.clear_caches()
        res.seconds = round(time.perf_counter() - t0, 2)
    if res.status != "skipped":
        if res.failed:
            res.status = "fail"
        elif not res.samples:
            res.status = "skipped"
            res.skip_reason = ("no CPU sample inputs" if res.dtypes else "no CPU dtypes")
        elif res.failed:
            res.status = "fail"
        elif res.fallback:
            res.status = "fallback"
    return res


# ---- workers, reports, CLI ---------------------------------------------------------------------
def _worker_main(sample_timeout: float, max_samples: int | None, warmups: int = 1) -> None:
    """Read op names on stdin, write one JSON result per line on the original stdout."""
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints from ops must not corrupt the protocol
    out = os.fdopen(out_fd, "w", buffering=1)
    torch.set_num_threads(1)
    logging.getLogger("adaptive_eager").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    by_name = ops_by_name()
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        res = check_op(by_name[name], sample_timeout=sample_timeout, max_samples=max_samples,
                       warmups=warmups)
        out.write(json.dumps(dataclasses.asdict(res)) + "\n")
        if res.status == "skipped" and "took more than" in res.skip_reason:
            return  # the timed-out sample may have left the engine in a bad state: start afresh


class _Worker:
    def __init__(self, sample_timeout: float, max_samples: int | None, warmups: int) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker",
               "--sample-timeout", str(sample_timeout), "--warmups", str(warmups)]
        for k, v in _engine_overrides.items():
            cmd += ["--option", f"{k}={v}"]
        if max_samples is not None:
            cmd += ["--max-samples", str(max_samples)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self.ready = False
        self.op: str | None = None
        self.deadline = 0.0
        self.started = 0.0

    def send(self, name: str, timeout: float) -> None:
        self.op = name
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(5)


def run_ops(names: list[str], *, jobs: int = 2, sample_timeout: float = DEFAULT_SAMPLE_TIMEOUT,
            op_timeout: float = DEFAULT_OP_TIMEOUT, max_samples: int | None = None,
            warmups: int = 1,
            progress: Callable[[OpResult, int, int], None] | None = None) -> list[OpResult]:
    """Check ``names`` in ``jobs`` worker processes; a hang or crash costs only that op."""
    pending = list(names)
    results: dict[str, OpResult] = {}
    workers: list[_Worker] = []
    startup = 180.0

    def spawn() -> _Worker:
        w = _Worker(sample_timeout, max_samples, warmups)
        w.deadline = time.monotonic() + startup
        return w

    def finish(w: _Worker, res: OpResult) -> None:
        results[res.name] = res
        if progress is not None:
            progress(res, len(results), len(names))
        w.op = None

    n_workers = max(1, min(jobs, len(pending)))
    workers = [spawn() for _ in range(n_workers)]
    try:
        while len(results) < len(names):
            for i, w in enumerate(workers):
                if w.ready and w.op is None and pending:
                    w.send(pending.pop(0), op_timeout)
            fds = {w.proc.stdout.fileno(): w for w in workers if w.proc.stdout is not None
                   and (not w.ready or w.op is not None)}
            if not fds:
                if not pending:
                    break
                continue
            now = time.monotonic()
            wait = max(0.05, min(w.deadline for w in fds.values()) - now)
            ready, _, _ = select.select(list(fds), [], [], min(wait, 5.0))
            for fd in ready:
                w = fds[fd]
                line = w.proc.stdout.readline()  # type: ignore[union-attr]
                if not line:  # the worker died
                    rc = w.proc.wait()
                    if w.op is not None:
                        res = OpResult(w.op, status="fail", failed=1)
                        res.details.append(f"worker died (exit code {rc}) while running the op")
                        res.seconds = round(time.monotonic() - w.started, 2)
                        finish(w, res)
                    elif not w.ready:
                        raise RuntimeError(f"fidelity worker failed to start (exit code {rc})")
                    workers[workers.index(w)] = spawn()
                    continue
                msg = json.loads(line)
                if msg.get("ready"):
                    w.ready = True
                    continue
                finish(w, OpResult(**msg))
                if msg["status"] == "skipped" and "took more than" in msg["skip_reason"]:
                    w.kill()
                    workers[workers.index(w)] = spawn()
            now = time.monotonic()
            for w in list(workers):
                if now > w.deadline and (w.op is not None or not w.ready):
                    w.kill()
                    if w.op is not None:
                        res = OpResult(w.op, status="skipped",
                                       skip_reason=f"op took more than {op_timeout:g}s (killed)")
                        res.seconds = round(now - w.started, 2)
                        finish(w, res)
                    else:
                        raise RuntimeError("fidelity worker did not start in time")
                    workers[workers.index(w)] = spawn()
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                assert w.proc.stdin is not None
                w.proc.stdin.close()
            w.kill()
    return [results[n] for n in names if n in results]


def totals(results: Iterable[OpResult]) -> dict[str, int]:
    rs = list(results)
    t = Counter(r.status for r in rs)
    return {
        "ops": len(rs), "pass": t["pass"], "fallback": t["fallback"], "fail": t["fail"],
        "skipped": t["skipped"],
        "samples": sum(r.samples for r in rs), "samples_deferred": sum(r.deferred for r in rs),
        "samples_eager": sum(r.eager for r in rs),
        "samples_fallback": sum(r.fallback for r in rs),
        "samples_failed": sum(r.failed for r in rs),
        "samples_nondeterministic": sum(r.nondeterministic for r in rs),
        "samples_eager_error": sum(r.error_samples for r in rs),
        "late_errors": sum(r.late_errors for r in rs),
        "ops_deferred": sum(r.ops_deferred for r in rs),
    }


def format_report(results: list[OpResult], wall: float | None = None) -> str:
    t = totals(results)
    lines = ["# adaptive_eager OpInfo fidelity report", ""]
    lines.append(f"torch {torch.__version__}, adaptive_eager {ae.__version__}, CPU"
                 + (f", wall time {wall:.0f}s" if wall is not None else ""))
    lines.append("")
    lines.append(f"engine options: {engine_options()}")
    lines.append("")
    lines.append("## Totals")
    lines.append("")
    for k, v in t.items():
        lines.append(f"- {k}: {v}")
    lines.append("")
    lines.append("Samples are (dtype, sample input, variant) triples; a sample is `deferred` if "
                 "its "
                 "checked run deferred ops without any fallback, `eager` if it deferred nothing "
                 "(random ops, allocations, metadata reads), `fallback` if the engine used its "
                 "fallback/sync path.")
    lines.append("")
    engine_errors: Counter[str] = Counter()
    for r in results:
        engine_errors.update(r.engine_errors)
    if engine_errors:
        lines.append("## Internal engine errors (answered by falling back to eager)")
        lines.append("")
        for k, v in engine_errors.most_common():
            lines.append(f"- {k}: {v}")
        lines.append("")
    lines.append("## Per op")
    lines.append("")
    lines.append("| op | status | dtypes | samples | deferred | eager | fallback | failed | "
                 "nondet | err | late err | s | notes |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = {"fail": 0, "skipped": 1, "fallback": 2, "pass": 3}
    for r in sorted(results, key=lambda r: (order.get(r.status, 9), r.name)):
        notes = []
        if r.skip_reason:
            notes.append(r.skip_reason)
        if r.fallback_ops:
            notes.append("falls back: " + ", ".join(f"{k} ({v})"
                                                    for k, v in sorted(r.fallback_ops.items())))
        if r.engine_errors:
            notes.append("engine errors: " + ", ".join(f"{k} x{v}"
                                                       for k, v in r.engine_errors.items()))
        if r.meta_misses_checked:
            notes.append(f"{r.meta_misses_checked} metadata misses in checked runs")
        notes += r.details
        note = "<br>".join(n.replace("|", "\\|").replace("\n", " ") for n in notes)
        lines.append(f"| {r.name} | {r.status} | {','.join(r.dtypes)} | {r.samples} | "
                     f"{r.deferred} | {r.eager} | {r.fallback} | {r.failed} | "
                     f"{r.nondeterministic} | {r.error_samples} | {r.late_errors} | "
                     f"{r.seconds} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="every op in op_db")
    p.add_argument("--ops", default="", help="comma-separated OpInfo names (name.variant)")
    p.add_argument("--out", default="", help="write the markdown report here")
    p.add_argument("--json", default="", help="write per-op results as JSON here")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--sample-timeout", type=float, default=DEFAULT_SAMPLE_TIMEOUT)
    p.add_argument("--op-timeout", type=float, default=DEFAULT_OP_TIMEOUT)
    p.add_argument("--max-samples", type=int, default=None, help="per op and dtype")
    p.add_argument("--warmups", type=int, default=1,
                   help="engine runs before the checked one (first sight runs eagerly)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine option over ENGINE_OPTIONS (e.g. backend=inductor); repeatable")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    overrides = {}
    for item in a.option:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--option {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = value.strip()
    set_engine_options(overrides)
    if a.worker:
        _worker_main(a.sample_timeout, a.max_samples, a.warmups)
        return 0
    if a.ops:
        names = [n.strip() for n in a.ops.split(",") if n.strip()]
    elif a.full:
        names = [op_name(o) for o in op_db()]
    else:
        names = list(QUICK_OPS)
    if a.ops or not a.full:
        known = set(ops_by_name())
        unknown = [n for n in names if n not in known]
        if unknown:
            p.error(f"unknown OpInfo names: {', '.join(unknown)}")

    def progress(r: OpResult, done: int, total: int) -> None:
        if not a.quiet:
            extra = f" ({r.skip_reason})" if r.skip_reason else ""
            print(f"[{done}/{total}] {r.name}: {r.status} samples={r.samples} failed={r.failed} "
                  f"fallback={r.fallback} {r.seconds}s{extra}", flush=True)
            for d in r.details[:2] if r.status == "fail" else ():
                print(f"    {d[:400]}", flush=True)

    t0 = time.monotonic()
    results = run_ops(names, jobs=a.jobs, sample_timeout=a.sample_timeout,
                      op_timeout=a.op_timeout, max_samples=a.max_samples, warmups=a.warmups,
                      progress=progress)
    wall = time.monotonic() - t0
    report = format_report(results, wall)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    t = totals(results)
    print("TOTALS " + " ".join(f"{k}={v}" for k, v in t.items()) + f" wall={wall:.0f}s")
    for status in ("fail", "skipped", "fallback"):
        names_s = [r.name for r in results if r.status == status]
        if names_s:
            print(f"{status} ({len(names_s)}): {', '.join(names_s)}")
    return 1 if t["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
