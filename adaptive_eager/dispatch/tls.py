"""The thread's dispatch keys agree with its dispatch-mode stack, whatever the engine did.

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
"""

from __future__ import annotations

from typing import Any

import torch

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


def install() -> None:
    """Repair at every exit of ``torch.inference_mode`` from now on (idempotent)."""
    cls = torch.autograd.grad_mode.inference_mode
    orig = cls.__exit__
    if getattr(orig, "_ae_repairs_keys", False):
        return

    def __exit__(self: Any, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            return orig(self, exc_type, exc_value, traceback)
        finally:
            repair()

    __exit__._ae_repairs_keys = True  # type: ignore[attr-defined]
    __exit__.__wrapped__ = orig  # type: ignore[attr-defined]
    __exit__.__doc__ = orig.__doc__
    cls.__exit__ = __exit__
