"""Plain eager to stay within the learning budget: when a presence goes aside on its account and
when it comes back (Note [learning budget] in budget.py, which keeps the account itself)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from adaptive_eager.budget import Account
from adaptive_eager.compile import policy
from adaptive_eager.metrics import METRICS as M

log = logging.getLogger("adaptive_eager")

GRACE_ROUNDS = 32  # rounds to time a landed program and try it (Note [learning budget])


class LearningBudget:
    """One presence's learning account and its stints in plain eager on it. At each round end
    the presence hands it the clock; it accounts the round, holds compiles the allowance cannot
    cover, and moves its presence off the mode stack or back on (Note [learning budget])."""

    def __init__(self, presence: Any, distributed: Callable[[], Any]) -> None:
        engine = presence.engine
        opts = engine.options
        self.presence = presence
        self.distributed = distributed  # the distributed module, imported late (Note [ranks agree])
        self.account = Account(opts.budget / 100.0 if opts.step_aside else 0.0)
        self.round_on = False  # the engine was on during the round now running
        self.landing = False  # aside on the budget with a compile in flight (a core lent)
        self.held = False  # aside on the budget after a stint that held a compile back
        self.grace = 0  # rounds after a landing in which the account does not send it aside
        self.held_mark = M.compiles_held  # when the engine last went aside on the budget
        self.saving = bool(self.account.share) and not engine.compiler.programs.warm \
            and not distributed().active()  # aside to stay within the budget
        if not self.saving:
            self.account.share = 0.0
        policy.hold_compiles(self.saving)  # this thread's (a presence is made on its thread)

    def round_ended(self, now: float) -> bool:
        """At a round end (``now``): account the round that ended; True if the budget took this
        round end (aside on it, or coming back from it)."""
        p = self.presence
        acc = self.account
        acc.round_ended(now, p.ticks_from,
                        self.round_on or p.active or p.waiting or M.compiles_pending > 0)
        self.round_on = p.active
        trials = p.trials
        if trials.side is not None or p.aside or p.probing or trials.verdict == "engine":
            return False
        if self.saving:
            M.budget_rounds += 1
            if not self.landing and now < acc.due:
                return True  # the common round aside: nothing to pay for yet
        if acc.base is None:
            return self.saving  # no eager round measured yet: nothing to weigh against
        if self.distributed().active():  # Note [ranks agree]: no account in a distributed job
            acc.share = 0.0
            policy.hold_compiles(False)
            if self.saving:
                self.come_back("a distributed job")
            return False
        spent, allowance = acc.spent(), acc.allowance(now)
        policy.hold_compiles(spent + policy.compile_cost() > allowance)
        if self.saving:
            if self.landing and (not M.compiles_pending or (M.budget_rounds & 15) == 0) \
                    and not p.engine.compiler.compiling():
                self.grace = GRACE_ROUNDS
                self.come_back("a program landed")
            elif acc.affords_a_round(now, policy.compile_cost() if self.held else 0.0):
                self.come_back(f"{spent * 1e3:.1f} ms spent of {allowance * 1e3:.1f} allowed")
            return True
        if p.waiting:
            self.grace = GRACE_ROUNDS  # counted down from the compile's landing
            return False
        if self.grace:  # a program that landed is timed (and tried) before the account speaks
            self.grace -= 1
            return False
        if spent > allowance and p.active and p.pending is None:
            p.engine.flush("budget")
            p.deactivate()
            self.saving = True
            # Note [compile cores]: a compile in flight stalls a full OpenMP team even at the
            # lowest priority (2.6 s of eager's became 11 s): the core is lent while aside too
            self.landing = M.compiles_pending > 0
            if self.landing and p.engine.options.lend_core:
                p.loan.lend()
            # a compile held in this stint: come back when it is affordable too
            self.held, self.held_mark = M.compiles_held != self.held_mark, M.compiles_held
            M.budget_asides += 1
            log.info("adaptive_eager: plain eager within the learning budget (%.1f ms spent "
                     "beyond eager's, %.1f ms allowed)", spent * 1e3, allowance * 1e3)
            return True
        return False

    def come_back(self, why: str) -> None:
        self.saving = False
        self.landing = False
        p = self.presence
        p.loan.give_back()
        p.activate()
        log.info("adaptive_eager: in the engine again (learning budget: %s)", why)
