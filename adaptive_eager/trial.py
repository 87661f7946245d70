"""The measured trial: does the engine pay, timed against plain eager on the program's own rounds.

Note [measured trial]
The cost estimate behind stepping aside (Decisions.step_aside_reason) under-counts real models:
recording an op inside a module's forward or autograd's backward costs several times what the
calibration loop of tiny adds measures. So once the compile manager has settled (every hot trace
compiled and decided), the engine runs a trial: rounds alternate between the engine and plain
eager (E, G, E, G, ...) until each side has ``TRIAL_TICKS`` of them, and the engine stays only if
the median of the pairs' ratios (engine round / the eager round after it) is under
``TRIAL_MARGIN``. Timing the two sides in separate phases (8 engine rounds, then 8 eager ones)
mis-decided on a loaded machine, where load changes over seconds: mid-size Llama kept an engine
that ran 0.73x eager; alternating rounds see the same load, as Note [paired timing]
does for keep decisions. A round is the time between two ticks: the ends of optimizer steps,
or, in programs without an optimizer, the ends of outermost ``nn.Module`` calls, contexts, or
syncs (Note [syncs are rounds] in aside.py). A probe after ``probe_every`` rounds aside
starts the question over, and so does a new keep/drop decision after a verdict for the engine
(the engine the trial timed is not the engine that runs any more).

The trial is bookkeeping (times in, decisions out): the presence (aside.py) reads the clock at
each round end, switches sides, and acts on the verdict (``aside.trial_verdict``, where a
distributed job's ranks agree on it).
"""

from __future__ import annotations

from adaptive_eager.compile.policy import _median
from adaptive_eager.metrics import METRICS as M

TRIAL_TICKS = 8  # rounds timed each way in a trial
TRIAL_MARGIN = 0.97  # the engine stays only if its median round is at least 3% shorter
TRIAL_CLEAR_PAIRS = 3  # pairs after which a clear verdict ends a trial (Note [clear trials])
TRIAL_CLEAR = 2.0  # every pair this many times faster (or slower) one way is a clear verdict


# Note [clear trials]
# A trial times TRIAL_TICKS rounds each way because a small difference (a few percent) needs
# them to rise above the noise of a shared machine. A large one does not: a fused chain ran 0.02 s
# a round against eager's 1.27 s, and the trial still ran every second round plain for 16 rounds
# (more when a new decision started it over), half the steps at eager's speed. So from
# TRIAL_CLEAR_PAIRS pairs on, a trial ends as soon as every pair so far says the same by at least
# TRIAL_CLEAR either way; noise that moves a whole paired round by 2x in every pair is not
# plausible, and the verdict is the one the full trial would reach.
def clear_ratio(periods: list[float], eager_periods: list[float]) -> float | None:
    """The median engine/eager ratio of the pairs so far when they all agree clearly, else None."""
    n = min(len(periods), len(eager_periods))
    if n < TRIAL_CLEAR_PAIRS:
        return None
    ratios = [a / b for a, b in zip(periods[:n], eager_periods[:n]) if b > 0]
    if len(ratios) < n:
        return None
    if max(ratios) * TRIAL_CLEAR <= 1.0 or min(ratios) >= TRIAL_CLEAR:
        return _median(ratios)
    return None


class Trial:
    """One presence's measured trials (Note [measured trial]): the side the running round is
    timed on, the rounds timed so far, and the last trial's verdict."""

    __slots__ = ("eager_periods", "last_tick", "periods", "side", "verdict", "verdict_decisions")

    def __init__(self) -> None:
        self.side: str | None = None  # the side being timed: "engine", "eager" or None
        self.periods: list[float] = []  # engine rounds of the trial
        self.eager_periods: list[float] = []  # eager rounds, each after an engine round
        self.last_tick: float | None = None
        self.verdict: str | None = None  # the last trial's outcome, until a probe reopens it
        self.verdict_decisions = 0  # the compile manager's decisions when it was given

    def anew(self) -> None:
        """Forget the rounds timed so far (the rounds changed meaning, or a verdict was given)."""
        self.periods, self.eager_periods, self.last_tick = [], [], None

    def note_round(self, now: float) -> bool:
        """At a tick during a trial: note the round that ended at ``now`` on the current side;
        True when the trial has its verdict (Note [clear trials]: a clear one ends it early)."""
        if self.last_tick is None and not self.periods and not self.eager_periods \
                and not M.trials_running:
            M.trials += 1  # counted from the first tick: a program without rounds has no trial
            M.trials_running = 1
        if self.last_tick is None:
            return False
        (self.periods if self.side == "engine" else self.eager_periods).append(
            now - self.last_tick)
        return (len(self.periods) >= TRIAL_TICKS and len(self.eager_periods) >= TRIAL_TICKS) or (
            self.side == "eager" and clear_ratio(self.periods, self.eager_periods) is not None)

    def end(self) -> tuple[float, str]:
        """The trial is over: the median ratio of its pairs and how it was reached, in words."""
        engine, eager = _median(self.periods), _median(self.eager_periods)
        ratios = [a / b for a, b in zip(self.periods, self.eager_periods) if b > 0]
        ratio = _median(ratios) if ratios else float("inf")
        self.anew()
        self.side = None
        M.trials_running = 0
        return ratio, (f"median round {engine * 1e3:.3f} ms under the engine, "
                       f"{eager * 1e3:.3f} ms in plain eager, {ratio:.3f}x eager's time over "
                       f"alternating rounds")

    def for_engine(self, decisions: int) -> None:
        """A verdict for the engine, given with the compile manager's ``decisions`` so far."""
        self.verdict = "engine"
        self.verdict_decisions = decisions

    def stop(self) -> None:
        """The presence closes with a trial running: no trial runs any more."""
        if self.side is not None:
            self.side = None
            M.trials_running = 0
