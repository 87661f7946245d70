"""Inference-mode blocks under the engine: the thread's dispatch keys agree with its mode stack,
and every trace runs under the inference mode its ops were recorded in.

Note [mode stack under inference mode]
Pushing the first mode on a thread's dispatch-mode stack includes the Python and
PythonTLSSnapshot keys in the thread's local dispatch key set; popping the last excludes them
again. ``torch.inference_mode`` saves the whole local key set on entry and puts it back on exit.
The engine changes its stack at safe points in the user's code, and those may be inside an
inference-mode block (``generate()`` under ``torch.inference_mode()``: stepping aside while a
compile runs, coming back once it is done). Leaving the block then restored keys that contradict
the stack: Python included over an empty stack (every later op of the process, eager ones too,
raised "Hit Python dispatch key but no arguments had PyInterpreter"), or the engine's mode on the
stack with the key excluded (the engine silently sees nothing). Forbidding the change inside the
block would keep the engine on for a whole ``generate()``; instead, once the engine has started,
the exit of ``torch.inference_mode`` (the context manager and decorator) sets the two keys as the
stack says (``repair``), which is what they are whenever no such block was crossed. The
outermost context's exit checks the same, so no way in or out leaves them wrong; a repair is
counted (``key_repairs``).

Note [inference-mode boundaries]
Whether a tensor is an inference tensor is fixed when it is made: by the inference mode of the
thread at that moment. A trace's real values are made when it runs, so a trace recorded on one
side of an inference-mode boundary and run on the other made its values of the wrong kind: a
cache made (lazily) before ``torch.inference_mode()`` and flushed inside it became an inference
tensor (``cache._version`` raised, and autograd would refuse it later), and values recorded
inside and run after were normal tensors where eager's are inference tensors. So entering and
leaving ``torch.inference_mode`` (the context manager and the decorator) flush the thread's
pending trace first, under the mode it was recorded in; a trace never spans a boundary. (Torch's
C++ guard used directly, ``torch._C._InferenceMode``, is not seen: compiled code and torch's own
internals use it around code that records nothing.)
"""

from __future__ import annotations

from typing import Any

import torch

from adaptive_eager.engine import owned_engine
from adaptive_eager.metrics import METRICS as M

_KEYS = (torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot)
_included = torch._C._dispatch_tls_is_dispatch_key_included
_set_included = torch._C._dispatch_tls_set_dispatch_key_included
_stack_len = torch._C._len_torch_dispatch_stack


def keys_agree() -> bool:
    """Whether the Python keys are included exactly while a dispatch mode is on the stack."""
    on = _stack_len() > 0
    return _included(_KEYS[0]) is on and _included(_KEYS[1]) is on


def repair() -> bool:
    """Set the Python keys as this thread's dispatch-mode stack says; True if they were wrong."""
    if keys_agree():
        return False
    on = _stack_len() > 0
    for key in _KEYS:
        _set_included(key, on)
    M.key_repairs += 1
    return True


def _flush_pending() -> None:
    """Note [inference-mode boundaries]: run this thread's pending trace before the boundary."""
    eng = owned_engine()
    if eng is not None and eng.trace.ops and not eng.flushing:
        eng.flush("inference_mode")


def install() -> None:
    """Flush at every entry and exit of ``torch.inference_mode`` and repair the keys after each
    exit, from now on (idempotent)."""
    cls = torch.autograd.grad_mode.inference_mode
    orig_enter, orig_exit = cls.__enter__, cls.__exit__
    if getattr(orig_exit, "_ae_boundary", False):
        return

    def __enter__(self: Any) -> None:
        _flush_pending()
        return orig_enter(self)

    def __exit__(self: Any, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            try:
                _flush_pending()
            except Exception as err:
                if exc_value is None:
                    raise
                exc_value.add_note(f"adaptive_eager: flushing at inference mode's exit also "
                                   f"failed: {err!r}")
        finally:
            try:
                orig_exit(self, exc_type, exc_value, traceback)
            finally:
                repair()

    for new, orig in ((__enter__, orig_enter), (__exit__, orig_exit)):
        new._ae_boundary = True  # type: ignore[attr-defined]
        new.__wrapped__ = orig  # type: ignore[attr-defined]
        new.__doc__ = orig.__doc__
    cls.__enter__, cls.__exit__ = __enter__, __exit__
