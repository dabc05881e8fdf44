"""Bursts: which steps a stage fed by another takes together, learned from how they came.

Pure (no Trio, no llama.cpp). The stage above sends a micro-batch as one message per
session, so its steps arrive close together, and a pause of `gap_s` ends a burst. A stage
that started computing on the first of them would run the rest in a call of their own, so
it waits while a burst is under way (engine/linger.py, `settling`). Waiting out the pause
after the last step costs `gap_s` on every hop, though. So each session remembers who came
with it in its last bursts (its mates): once every mate of every session with a step is
back, or gone, the burst is whole and the stage computes at once; while a mate is still
out, the stage waits for it past the pause too (the caller bounds that wait), since running
the rest without it costs a call of its own. Until the mates are known, the pause decides.

A burst is seen through the event loop, which a stage's own compute may keep from its
socket for a while, so one group's steps are sometimes taken as two bursts. A session's mates
are therefore those of its last two bursts: one group seen in two pieces does not make the
next burst start on a piece (a call of its own for the rest), and two groups seen as one
are told apart again two bursts later.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Container, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.linger import settling
from engine.scheduler import Session

Key = Hashable  # a session's key in the scheduler


@dataclass(slots=True)
class Bursts:
    gap_s: float
    last_at: float = -math.inf  # when the last step came in
    current: set[Key] = field(default_factory=set)  # the sessions of the burst under way
    last: dict[Key, tuple[frozenset[Key], frozenset[Key]]] = field(default_factory=dict)  # two latest bursts

    def arrived(self, key: Key, now: float, alive: Container[Key], decode: bool = True) -> None:
        """A step of `key` came in at `now`: it joins the burst under way, or starts one, and
        the one before becomes its sessions' mates. Only open sessions (`alive`) are counted:
        steps for unknown ones are refused, and must not make anything grow. Only one-token
        steps (`decode`) make up bursts: a prompt comes alone, or in parts, and says nothing
        of the group its session decodes with."""
        if now - self.last_at >= self.gap_s:
            self._finish(alive)
        if key in alive and decode:
            self.current.add(key)
        self.last_at = now

    def _finish(self, alive: Container[Key]) -> None:
        self.last = {k: bursts for k, bursts in self.last.items() if k in alive}
        burst = frozenset(k for k in self.current if k in alive)
        for member in burst:
            self.last[member] = (burst, self.last.get(member, (burst, burst))[0])
        self.current = set()

    def mates(self, key: Key) -> frozenset[Key] | None:
        """Who came with `key` in its last two bursts; None before its first finished one."""
        bursts = self.last.get(key)
        return None if bursts is None else bursts[0] | bursts[1]

    def settle_gap_s(self, sessions: Mapping[Key, Session[Any]], now: float) -> float | None:
        """How long to wait for the next step of the burst under way; None: compute now. A mate
        still out is worth any wait (the caller bounds it); with mates unknown, the pause decides."""
        missing = self.missing({key for key, s in sessions.items() if s.step is not None}, sessions)
        if missing is None:
            return self.gap_s if settling(sessions, now - self.last_at, self.gap_s) else None
        return math.inf if missing else None

    def missing(self, with_steps: Collection[Key], alive: Container[Key]) -> bool | None:
        """Whether some session with a step has a mate that is open and not back yet (True), or
        every one has all of its mates back (False: the burst is whole); None when nobody has a
        step or someone's mates are not known (then the pause decides)."""
        if not with_steps:
            return None
        known = True
        for key in with_steps:
            mates = self.mates(key)
            if mates is None:
                known = False
            elif any(m in alive and m not in with_steps for m in mates):
                return True
        return False if known else None
