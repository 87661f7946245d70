"""Process-wide settings that decide what recorded ops compute: their changes are flush points.

Note [ambient state]
An op deferred into a trace runs later, at the flush, under whatever global settings hold then:
``torch.backends.mkldnn.enabled = False`` around a convolution, restored before the flush, ran
the convolution with oneDNN (results differ from eager's). The same holds for every setting an
aten kernel reads when it runs: torch.backends flags (cudnn, mkldnn/onednn, cuBLAS reduced
precision, fp32 precision, nnpack, sdp kernels, preferred BLAS/linalg libraries, quantized
engine), deterministic algorithms, float32 matmul precision, the thread count (the chunking of
parallel reductions), flush-denormal, and the default dtype (Note [default dtype]).

Two designs keep eager's results: record the state with each op and restore it around the op's
replay, or make each change of such a setting a flush point. Recording costs a read of every
setting on the per-op hot path, or a comparison at every flush, for changes that real programs
make a handful of times (a ``with torch.backends.cudnn.flags(...)`` block, a validation phase in
deterministic mode). So changes are flush points: the setters (the ``torch._C`` functions that
``torch.backends`` properties, their ``flags()`` context managers, ``use_deterministic_algorithms``,
``set_float32_matmul_precision`` and friends call, and ``torch.set_num_threads`` /
``set_flush_denormal``) are wrapped once, at install. A wrapped setter called while this
thread's engine has ops pending, with a value that differs from the current one, flushes them
first: they run under the settings they were recorded under. Off the engine a setter costs one
read of the dispatch-stack length more.

The settings are also a part of what a trace is: the trie has one root per ambient state (as per
default dtype), so a trace recorded under other settings is another trace with its own program
and decisions, and the state is a named part of the program key (Note [program key]). ``state()``
reads every setting (tens of C calls): done where a graph is built (a compile, a load), and for
the trie root only after a wrapped setter ran (``root_state`` caches it until then).

Known gap: the settings are process-wide, but only the calling thread's pending trace is flushed
(another thread's trace cannot be run from here); that thread's ops recorded before the change
run under the new settings, as with the default dtype.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

_C = torch._C
_len_dispatch = _C._len_torch_dispatch_stack

# (state name, torch._C getter, its arguments)
_GETTERS: tuple[tuple[str, str, tuple], ...] = (
    ("matmul_precision", "_get_float32_matmul_precision", ()),
    ("deterministic", "_get_deterministic_algorithms", ()),
    ("deterministic_warn_only", "_get_deterministic_algorithms_warn_only", ()),
    ("deterministic_fill", "_get_deterministic_fill_uninitialized_memory", ()),
    ("cudnn.enabled", "_get_cudnn_enabled", ()),
    ("cudnn.benchmark", "_get_cudnn_benchmark", ()),
    ("cudnn.deterministic", "_get_cudnn_deterministic", ()),
    ("cudnn.allow_tf32", "_get_cudnn_allow_tf32", ()),
    ("cudnn.depthwise_kernel", "_get_cudnn_depthwise_kernel", ()),
    ("cudnn.benchmark_limit", "_cuda_get_cudnn_benchmark_limit", ()),
    ("miopen.immediate", "_get_miopen_immediate", ()),
    ("mkldnn.enabled", "_get_mkldnn_enabled", ()),
    ("mkldnn.deterministic", "_get_mkldnn_deterministic", ()),
    ("mkldnn.allow_tf32", "_get_onednn_allow_tf32", ()),
    ("nnpack.enabled", "_get_nnpack_enabled", ()),
    ("cpu.fp16_reduced_precision", "_get_cpu_allow_fp16_reduced_precision_reduction", ()),
    ("cuda.matmul.allow_tf32", "_get_cublas_allow_tf32", ()),
    ("cuda.matmul.fp16_reduced", "_get_cublas_allow_fp16_reduced_precision_reduction", ()),
    ("cuda.matmul.bf16_reduced", "_get_cublas_allow_bf16_reduced_precision_reduction", ()),
    ("cuda.matmul.fp16_accumulation", "_get_cublas_allow_fp16_accumulation", ()),
    ("sdp.flash", "_get_flash_sdp_enabled", ()),
    ("sdp.mem_efficient", "_get_mem_efficient_sdp_enabled", ()),
    ("sdp.math", "_get_math_sdp_enabled", ()),
    ("sdp.cudnn", "_get_cudnn_sdp_enabled", ()),
    ("sdp.math_fp16_bf16_reduction", "_get_math_sdp_allow_fp16_bf16_reduction", ()),
    ("linalg_backend", "_get_linalg_preferred_backend", ()),
    ("blas_backend", "_get_blas_preferred_backend", ()),
    ("qengine", "_get_qengine", ()),
    ("num_threads", "get_num_threads", ()),
    *((f"fp32_precision.{b}.{op}", "_get_fp32_precision_getter", (b, op))
      for b in ("generic", "mkldnn", "cuda") for op in ("all", "matmul", "conv", "rnn")),
)

# torch._C setters whose changes are flush points, with the getter that says whether a call
# changes anything (None: any call counts as a change)
_SETTERS: dict[str, str | None] = {
    "_set_float32_matmul_precision": "_get_float32_matmul_precision",
    "_set_deterministic_algorithms": None,
    "_set_deterministic_fill_uninitialized_memory":
        "_get_deterministic_fill_uninitialized_memory",
    "_set_cudnn_enabled": "_get_cudnn_enabled",
    "_set_cudnn_benchmark": "_get_cudnn_benchmark",
    "_set_cudnn_deterministic": "_get_cudnn_deterministic",
    "_set_cudnn_allow_tf32": "_get_cudnn_allow_tf32",
    "_set_cudnn_depthwise_kernel": "_get_cudnn_depthwise_kernel",
    "_set_miopen_immediate": "_get_miopen_immediate",
    "_set_mkldnn_enabled": "_get_mkldnn_enabled",
    "_set_mkldnn_deterministic": "_get_mkldnn_deterministic",
    "_set_onednn_allow_tf32": "_get_onednn_allow_tf32",
    "_set_nnpack_enabled": "_get_nnpack_enabled",
    "_set_cpu_allow_fp16_reduced_precision_reduction":
        "_get_cpu_allow_fp16_reduced_precision_reduction",
    "_set_cublas_allow_tf32": "_get_cublas_allow_tf32",
    "_set_cublas_allow_fp16_reduced_precision_reduction": None,
    "_set_cublas_allow_bf16_reduced_precision_reduction": None,
    "_set_cublas_allow_fp16_accumulation": "_get_cublas_allow_fp16_accumulation",
    "_set_fp32_precision_setter": "_get_fp32_precision_getter",
    "_cuda_set_cudnn_benchmark_limit": "_cuda_get_cudnn_benchmark_limit",
    "_set_sdp_use_flash": "_get_flash_sdp_enabled",
    "_set_sdp_use_mem_efficient": "_get_mem_efficient_sdp_enabled",
    "_set_sdp_use_math": "_get_math_sdp_enabled",
    "_set_sdp_use_cudnn": "_get_cudnn_sdp_enabled",
    "_set_sdp_use_fa3": None,
    "_set_sdp_use_overrideable": None,
    "_set_sdp_priority_order": None,
    "_set_math_sdp_allow_fp16_bf16_reduction": "_get_math_sdp_allow_fp16_bf16_reduction",
    "_set_linalg_preferred_backend": "_get_linalg_preferred_backend",
    "_set_blas_preferred_backend": "_get_blas_preferred_backend",
    "_set_rocm_fa_preferred_backend": None,
    "_set_qengine": "_get_qengine",
    "_set_sm_carveout_experimental": None,
    "set_num_threads": "get_num_threads",
    "set_flush_denormal": None,
}

_flush_denormal: list[Any] = [None]  # as last set through the wrapper (torch has no getter)
_root: list[Any] = [None]  # root_state's cached value; None: read again
_lock = threading.Lock()
_installed = [False]


_SCALARS = (bool, int, float, str, type(None))


def _plain(value: Any) -> Any:
    if type(value) in _SCALARS:
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return str(value)


def state() -> tuple[tuple[str, Any], ...]:
    """Every ambient setting, by name (plain values: loggable, hashable, picklable)."""
    out: list[tuple[str, Any]] = [
        ("default_dtype", str(torch.get_default_dtype()).removeprefix("torch.")),
        ("flush_denormal", _flush_denormal[0])]
    for name, fn, args in _getters():
        try:
            out.append((name, _plain(fn(*args))))
        except Exception:
            out.append((name, "?"))
    return tuple(out)


@functools.cache
def _getters() -> tuple[tuple[str, Callable[..., Any], tuple], ...]:
    """The getters this build has (an unknown backend/op pair raises, slowly: probed once)."""
    found = []
    for name, getter, args in _GETTERS:
        fn = getattr(_C, getter, None)
        if fn is None:
            continue
        try:
            fn(*args)
        except Exception:
            continue
        found.append((name, fn, args))
    return tuple(found)


# Not a part of the trie root: ranks of one job on machines of other core counts must name their
# traces alike (Note [ranks agree] in distributed.py). A change is still a flush point, and the
# program key has it (as Inductor's options do).
_NOT_ROOT = ("num_threads",)


def root_state() -> tuple[tuple[str, Any], ...]:
    """``state()`` as of the last wrapped setter call, for the trie root (cheap)."""
    got = _root[0]
    if got is None:
        got = _root[0] = tuple(kv for kv in state() if kv[0] not in _NOT_ROOT)
    return got


def _changes(getter: Callable[..., Any] | None, args: tuple, kwargs: dict) -> bool:
    """Whether a setter call changes its setting: its getter takes the setter's arguments but
    the last (``_set_fp32_precision_setter("cuda", "all", v)``: the getter's are the first two)."""
    if getter is None or kwargs or not args:
        return True
    try:
        return bool(getter(*args[:-1]) != args[-1])
    except Exception:
        return True


def flush_point(reason: str, getter: Callable[[], Any] | None, args: tuple,
                kwargs: dict) -> Any:
    """Flush this thread's pending trace before a setting changes; returns its engine."""
    from adaptive_eager.dispatch.regions import active_engine

    engine = active_engine()
    if (engine is not None and engine.trace.ops and not engine.busy and not engine.flushing
            and _changes(getter, args, kwargs)):
        engine.flush(reason)
    return engine


def changed(engine: Any) -> None:
    """After a setting changed: the trie root is read again, and this thread's empty trace
    starts at the new root."""
    _root[0] = None
    if engine is not None:
        from adaptive_eager.cache.memory import TRIE

        tr = engine.trace
        if not tr.ops and tr.node is tr.start:
            tr.start = tr.node = TRIE.root(torch.get_default_dtype())


def _wrap(fn: Callable[..., Any], getter: Callable[[], Any] | None, name: str) -> \
        Callable[..., Any]:
    if getattr(fn, "_ae_ambient", False):
        return fn

    @functools.wraps(fn)
    def set_ambient(*args: Any, **kwargs: Any) -> Any:
        engine = flush_point("ambient:" + name, getter, args, kwargs) if _len_dispatch() else None
        out = fn(*args, **kwargs)
        if name == "set_flush_denormal" and args:
            _flush_denormal[0] = bool(args[0])
        changed(engine)
        return out

    set_ambient._ae_ambient = True  # type: ignore[attr-defined]
    set_ambient._ae_original = fn  # type: ignore[attr-defined]
    return set_ambient


def install() -> None:
    """Wrap the setters (idempotent): ``torch._C``'s, the ``torch`` aliases of them, and the
    ``torch.backends`` properties that hold the original functions."""
    with _lock:
        if _installed[0]:
            return
        _installed[0] = True
        wrapped: dict[int, Callable[..., Any]] = {}
        for name, getter_name in _SETTERS.items():
            fn = getattr(_C, name, None)
            if fn is None:
                continue
            getter = getattr(_C, getter_name, None) if getter_name else None
            new = wrapped[id(fn)] = _wrap(fn, getter, name)
            setattr(_C, name, new)
            if getattr(torch, name, None) is fn:  # torch.set_num_threads, set_flush_denormal
                setattr(torch, name, new)
        _wrap_backend_props(wrapped)
        _root[0] = None


def _wrap_backend_props(wrapped: dict[int, Callable[..., Any]]) -> None:
    """``torch.backends.X.flag = v`` calls the setter its ContextProp captured at import."""
    import sys

    from torch.backends import ContextProp

    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("torch.backends.") or mod is None:
            continue
        for value in vars(type(mod)).values():
            if isinstance(value, ContextProp) and id(value.setter) in wrapped:
                value.setter = wrapped[id(value.setter)]


# settings a compile helper takes from a request (Note [ambient state]): the boolean flags that
# kernels read (matmul precision, determinism and the default dtype are applied by name)
_APPLY: dict[str, str] = {
    "cudnn.enabled": "_set_cudnn_enabled", "cudnn.benchmark": "_set_cudnn_benchmark",
    "cudnn.deterministic": "_set_cudnn_deterministic",
    "cudnn.allow_tf32": "_set_cudnn_allow_tf32", "mkldnn.enabled": "_set_mkldnn_enabled",
    "mkldnn.deterministic": "_set_mkldnn_deterministic",
    "mkldnn.allow_tf32": "_set_onednn_allow_tf32", "nnpack.enabled": "_set_nnpack_enabled",
    "cuda.matmul.allow_tf32": "_set_cublas_allow_tf32",
    "cuda.matmul.fp16_accumulation": "_set_cublas_allow_fp16_accumulation",
    "cpu.fp16_reduced_precision": "_set_cpu_allow_fp16_reduced_precision_reduction",
    "sdp.flash": "_set_sdp_use_flash", "sdp.mem_efficient": "_set_sdp_use_mem_efficient",
    "sdp.math": "_set_sdp_use_math", "sdp.cudnn": "_set_sdp_use_cudnn",
}


def apply(named: tuple[tuple[str, Any], ...]) -> None:
    """Take the boolean settings of ``named`` (a compile helper, before it compiles)."""
    for name, value in named:
        setter = getattr(_C, _APPLY.get(name, ""), None)
        if setter is not None and isinstance(value, bool):
            try:
                setter(value)
            except Exception:  # a flag this build cannot take (no CUDA): nothing to compile
                pass
