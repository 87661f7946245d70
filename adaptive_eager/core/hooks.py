"""Slots that a higher floor fills for a lower one.

Note [hook slots]
A lower module that must call into a higher one (a lazy tensor's numpy view must flush the
engine's pending trace; an op's classification asks which collectives the distributed layer
defers) would otherwise import it inside a function, which closes an import circle. Instead the
higher module puts its function here when it is imported, and the lower one calls the slot. The
package's ``__init__`` imports every module that fills a slot, so no slot is empty once
``import adaptive_eager`` has returned; a slot read before that is None and its reader says what
it does then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# engine.py: run this thread's pending trace before a value leaves torch's dispatch
flush_before_handoff: Callable[[str], None] | None = None
# dispatch/opspec.py: an op's OpSpec (its policy and aliasing)
spec_for: Callable[[Any], Any] | None = None
# dispatch/mode.py: the engine's TorchDispatchMode class
engine_mode: type | None = None
# distributed.py: the functional collectives deferred into traces (installs their hooks)
collectives: Callable[[], frozenset[str]] | None = None
