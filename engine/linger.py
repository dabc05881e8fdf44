"""Linger: how long the loop waits for answered sessions' next steps, so they share a call.

Pure policy (no Trio, no llama.cpp); the engine task applies it between iterations.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.scheduler import Session, SessionKey

MAX_HEAD_LINGER_MS = 1000.0  # a head never holds a group longer for a member still out


def linger_limit_s(linger_ms: float, step_ms: float, micro_batches: int, turnaround_ms: float = 0.0) -> float:
    """How long to wait for sessions expected back: at most 10% of a step (`linger_ms` caps it),
    except on a chain's head (more than one micro-batch), whose groups come back from the next
    stage together: there a group is worth up to a step of waiting, or as long as its sessions
    usually take to come back (`turnaround_ms`, `Turnarounds.typical_ms`: longer when the
    stages below are slower than this one), since running part of it costs a call of its own
    here and below, and leaves the rest out of phase for good. 0: never."""
    if linger_ms <= 0:
        return 0.0
    if micro_batches > 1:
        return min(max(step_ms, turnaround_ms), MAX_HEAD_LINGER_MS) / 1000
    return min(linger_ms, 0.1 * step_ms) / 1000


@dataclass(slots=True)
class Turnarounds:
    """How long answered sessions take to send their next step: on a chain's head, the stages
    below and the hops, and the requester's own turn (a client's, or server-side generate's)."""

    recent: deque[float] = field(default_factory=lambda: deque(maxlen=Turnarounds.WINDOW))

    WINDOW = 64
    QUANTILE = 0.9
    MARGIN = 1.5  # past the 90th percentile of recent ones: a member this late is late

    def observe(self, ms: float) -> None:
        self.recent.append(ms)

    @property
    def typical_ms(self) -> float:
        """The wait that covers a usual return (0 before any)."""
        if not self.recent:
            return 0.0
        ordered = sorted(self.recent)
        return self.MARGIN * ordered[max(0, math.ceil(self.QUANTILE * len(ordered)) - 1)]


def lingering(sessions: Mapping[SessionKey, Session[Any]], coming_back: Collection[SessionKey]) -> bool:
    """Whether every group with work still expects some of its members back."""
    expected = {sessions[key].group for key in coming_back if key in sessions}
    ready = {s.group for s in sessions.values() if s.step is not None}
    return bool(expected) and ready <= expected


SETTLE_GAP_S = 0.001  # a burst's messages come closer than this; a pause this long ends it


def settling(sessions: Mapping[SessionKey, Session[Any]], since_last_step_s: float, gap_s: float) -> bool:
    """On a stage fed by another: whether to keep taking steps before computing.

    The stage above sends a micro-batch as one message per session, so its steps arrive as a
    burst; a call started on the first of them would hold the core while the rest come in,
    and the rest would need a call of their own. Wait while a burst is under way (the last
    step came less than `gap_s` ago) and some session still has no step here."""
    if since_last_step_s >= gap_s:
        return False
    return any(s.step is None for s in sessions.values()) and any(s.step is not None for s in sessions.values())
