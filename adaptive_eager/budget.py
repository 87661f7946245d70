"""The learning budget: the account that keeps the engine's learning within a share of the run.

Note [learning budget]
Until a program pays, everything the engine does costs the user time: a round recorded and
replayed op by op costs 3-15x eager's round (metadata of new ops, cold replays), the round that
sends a trace to the compiler 100-250 ms (the graph, the service), and a compile beside the
program slows its rounds (a core lent to it). A run of a few seconds, over before any program
lands, paid all of that for nothing: 1.21x eager's whole time (geomean; 0.88-1.56x) on the
graph-break programs (200 steps, 2 threads, quiet), and nobody tells the engine how long a run
will be. So each
presence keeps an account, in time: since it started, and what it spent beyond eager's - every
round that ran (partly) in the engine or beside a compile, less eager's round (the lower quartile
of its last BUDGET_PLAIN clean plain rounds, once there are BUDGET_PLAIN_MIN: the first rounds
of a program are its slowest, and a median of two of them once read 9.6 ms for a 5 ms round, so
the engine stayed in at twice eager's time on an account that looked even). It may spend
``budget`` percent of the time since its first round ended (not since the engine started: the
program's imports and set-up are no rounds of it), eager's round measured anew when the rounds
change kind (the module calls before a first optimizer step are rounds of another length). It
starts aside, in plain eager, timing its rounds; it comes in for a round once the allowance
covers what its rounds in the engine cost on average (BUDGET_GUESS eager rounds before it has
measured one), and goes back aside at a round end where the account is over the allowance
(never during a trial, which alternates on its own and is bounded, and never once a trial found
for the engine: fused rounds that win pay into the account). A compile in flight gets a core lent
whether the engine waits for it or is aside on the budget (an OpenMP team of all cores beside a
compile, even one at the lowest priority, ran 4x slower: Note [compile cores] in cores.py); a
program that lands while it is aside brings it back at once. The run stays within about
``budget`` of eager's time plus one round's cost, at any length: a short run never pays for a
compile it cannot use (it sends none), a long run reaches its programs later (its first round in
the engine after about 320 rounds, its first compile after about 20x the compile's expected
cost). Where earlier runs of the script stored programs (the warm-start prefetch found some), and
in a distributed job (ranks would record different rounds, Note [ranks agree] in
distributed.py), it starts in the engine without an account.
A program that never ends a round (no module call, optimizer step or second context) stays in
plain eager under a budget; ``budget=0`` records from the first op as before.

A compile is the dearest item: its seconds of a core, taken from the program for as long as it
runs. So a hot trace is not sent while the allowance cannot also cover a compile's expected cost
(``policy.compile_cost``: the seconds of this process's compiles, else COMPILE_GUESS_S, divided
by the cores); the presence sets this thread's hold (``policy.hold_compiles``) at each round end,
the compile manager counts each hot run it held (``compiles_held``), and disk loads go on.

Rounds in the engine teach nothing more once a trace is hot and only its compile is held: coming
back for them spent the allowance the compile waited for (the `chain` program, 60,000 steps,
recorded 3,856 rounds op by op in 166 s and never sent its compile). So after a stint in which
a compile was held, the engine comes back only when the allowance covers a round and the compile
too; that round's hot run sends it.

A program that lands is the point of all that spending, but the compile's rounds beside the
program had used the allowance: the `chain` run sent its compile, got its program, ran it once
and went aside on the account before it was timed. So for GRACE_ROUNDS rounds after a landing
the account does not send the engine aside: the program is timed against op by op, and the
measured trial (Note [measured trial] in trial.py) that follows decides, with no account after a
verdict for the engine.

The first round in the engine is the dearest: every op is new (its metadata computed, its first
replay cold), 8-30x an eager round on the whole-run programs (scan: 5 ms eager, 150-250 ms the
first time). With a guess of 4 eager rounds the engine came in about 0.4 s into scan's 1.2 s run
and that one round overshot the 5% by 2-5x (1.12-1.33x eager's whole time over three repeats);
the guess is 16 rounds, and once a round was measured its cost replaces the guess.

The account is bookkeeping only (times in, decisions out); ``aside.Presence`` keeps one, feeds it
each round end with the clock it reads, and acts on what it says.
"""

from __future__ import annotations

BUDGET_GUESS = 16.0  # a first round in the engine, in eager rounds, before one was measured
BUDGET_PLAIN = 15  # recent clean plain rounds: eager's round is their lower quartile
BUDGET_PLAIN_MIN = 5  # ... once there are this many


class Account:
    """One presence's learning account (Note [learning budget])."""

    __slots__ = ("share", "started", "due", "base", "_last", "_kind", "_plain", "_plain_new",
                 "_costly_s", "_costly_n", "_spent0")

    def __init__(self, share: float) -> None:
        self.share = share  # of the time since the first round end; 0: no account
        self.started = 0.0  # the first round's end
        self.due = 0.0  # aside: the account is not looked at again before this time
        self.base: float | None = None  # eager's round: the lower quartile of ``_plain``
        self._last: float | None = None  # the last round end
        self._kind: object = None  # the kind of rounds measured (Presence.ticks_from)
        self._plain: list[float] = []  # recent clean plain rounds
        self._plain_new = 0  # plain rounds since ``base`` was taken
        self._costly_s = 0.0  # rounds in the engine or beside a compile: time, count
        self._costly_n = 0
        self._spent0 = 0.0  # spent in rounds of earlier kinds

    def round_ended(self, now: float, kind: object, costly: bool) -> None:
        """A round of ``kind`` ended at ``now``; ``costly``: it ran (partly) in the engine or
        beside a compile, else it was a clean plain round."""
        start, self._last = self._last, now
        if start is None:
            self.started = now  # counted from the first round's end: set-up is no round
        if kind != self._kind:  # rounds of another kind: eager's round is measured anew
            self._kind = kind
            self._new_kind()
            return
        if start is None:
            return
        if costly:
            self._costly_s += now - start
            self._costly_n += 1
            return
        plain = self._plain
        plain.append(now - start)
        if len(plain) > BUDGET_PLAIN:
            del plain[0]
            self._plain_new += 1
            if self._plain_new < BUDGET_PLAIN:  # renewed once the window is all new rounds
                return  # (a sort every round costs about a microsecond)
        if len(plain) >= BUDGET_PLAIN_MIN:
            self._plain_new = 0
            self.base = sorted(plain)[len(plain) // 4]

    def _new_kind(self) -> None:
        """What was spent is priced at the old kind's eager round; eager's round anew."""
        if self.base is not None:
            self._spent0 += self._costly_s - self._costly_n * self.base
            self._costly_s, self._costly_n = 0.0, 0
        self._plain.clear()
        self.base, self._plain_new = None, 0

    def spent(self) -> float:
        """Seconds spent beyond eager's so far (``base`` known)."""
        assert self.base is not None
        return self._spent0 + self._costly_s - self._costly_n * self.base

    def allowance(self, now: float) -> float:
        return self.share * (now - self.started)

    def affords_a_round(self, now: float, extra: float = 0.0) -> bool:
        """Whether the allowance covers what a round in the engine costs on average (a guess of
        BUDGET_GUESS eager rounds before one was measured) plus ``extra`` (the compile a held
        hot trace waits for); if not, ``due`` is when it will, if eager's round holds."""
        assert self.base is not None
        n = self._costly_n
        cost = max(self._costly_s / n - self.base, 0.0) if n else BUDGET_GUESS * self.base
        need = self.spent() + cost + extra
        if need <= self.allowance(now):
            return True
        self.due = self.started + need / self.share
        return False
