"""The engine's presence on a thread's mode stack, and stepping aside when nothing gains.

Note [stepping aside]
A Python dispatch mode costs a few microseconds per op against eager's one; a program whose traces
do not profit from fusion (tiny launch-bound ops, traces that never repeat) pays that for nothing.
When the compile manager's measurements say so, the engine leaves the mode stack. Modes cannot be
popped from inside their own handlers (torch re-pushes them afterwards), so leaving happens at the
next safe point in plain Python: after a module's forward or an optimizer step (global hooks,
installed only while a step-aside is pending or in force), ``sync()``, or leaving the context.
While aside, the optimizer hook counts steps and re-enters after ``probe_every`` of them to measure
again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from adaptive_eager.metrics import METRICS as M

log = logging.getLogger("adaptive_eager")


class Presence:
    """Pushes and pops one engine's modes on its own thread."""

    def __init__(self, engine: Any, modes: tuple[Any, ...]) -> None:
        self.engine = engine
        self.modes = modes
        self.active = False
        self.thread = threading.get_ident()
        self.pending: str | None = None
        self.aside = False
        self.steps_aside = 0
        self._hooks: list[Any] = []
        self._step_hook: Any = None

    def activate(self) -> None:
        if not self.active:
            for m in self.modes:
                m.__enter__()
            self.active = True
            if self.engine.options.step_flush and self._step_hook is None:
                self._step_hook = register_optimizer_step_post_hook(self._after_step)

    def deactivate(self) -> None:
        if self.active:
            for m in reversed(self.modes):
                m.__exit__(None, None, None)
            self.active = False

    def close(self) -> None:
        self.deactivate()
        self._remove_hooks()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    # ---- stepping aside -----------------------------------------------------------------------
    def request_aside(self, reason: str) -> None:
        """Ask to leave the mode stack at the next safe point (Note [stepping aside])."""
        if self.pending is None and not self.aside:
            self.pending = reason
            self._install_hooks()

    def safe_point(self) -> None:
        """Called in plain Python on the engine's thread: act on a pending step-aside."""
        if self.pending is not None and self.active and threading.get_ident() == self.thread:
            reason, self.pending = self.pending, None
            self.engine.flush("step_aside")
            self.deactivate()
            self.aside = True
            self.steps_aside = 0
            M.step_asides += 1
            log.warning("adaptive_eager: stepping aside (%s); this thread runs plain eager, "
                        "probing again after %d optimizer steps", reason,
                        self.engine.options.probe_every)

    def _after_step(self, *args: Any) -> None:
        """After every optimizer step: end the trace there (one trace per training iteration,
        as torch_xla's mark_step), and drive stepping aside and probing."""
        if threading.get_ident() != self.thread:
            return
        if self.active and self.pending is None and self._step_hook is not None:
            self.engine.flush("optimizer_step")
        if self.aside:
            self.steps_aside += 1
            every = self.engine.options.probe_every
            if every and self.steps_aside >= every:
                self.aside = False
                self.engine.compiler.new_probe()
                self.activate()
                log.info("adaptive_eager: probing again after %d steps aside", every)
        else:
            self.safe_point()

    def _after_forward(self, module: Any, inputs: Any, output: Any) -> None:
        if self.pending is not None:
            self.safe_point()

    def _install_hooks(self) -> None:
        if not self._hooks:
            self._hooks = [register_module_forward_hook(self._after_forward)]
            if self._step_hook is None:
                self._step_hook = register_optimizer_step_post_hook(self._after_step)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
