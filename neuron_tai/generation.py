"""Server-side generation (`generate`): what one run knows, and when it ends.

The handler task for a `generate` owns the run (neuron_tai.generate_run): it steps the
session, feeds each sampled token back as the next step, and streams the tokens. Other requests reach the
run only through `Generation`: `cancel` asks it to stop and is answered once it has
answered `done`; `close` asks it to stop and have the session closed once it has. Either
way their own replies come after the `done`. Neither is a task of its own, so neither is
ever refused for want of room (a run keeps at most `MAX_PENDING_CANCELS` cancels).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import trio


class EndReason(enum.StrEnum):
    """`done.reason`."""

    EOG = "eog"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


MAX_PENDING_CANCELS = 4  # cancels of one run waiting for its end; a client needs one


@dataclass(slots=True)
class Generation:
    """One running `generate`: a stop request from outside, and its end for those who wait on it."""

    cancel: trio.Event = field(default_factory=trio.Event)
    length: int = 0  # the session's length once finished
    then_close: Callable[[], None] | None = None  # a `close` waiting for the run's end: it runs then
    cancels: list[int] = field(default_factory=list)  # rids of the cancels answered at the run's end


@dataclass(frozen=True, slots=True)
class EndRule:
    """When a run ends, apart from `cancel`: the request's limits and the tokens that stop it."""

    max_new: int
    stop: frozenset[int]
    eog: frozenset[int]  # empty with `ignore_eog`

    def reason(self, token: int, generated: int, length: int, max_tokens: int) -> EndReason | None:
        """Why the run ends after `token`, its `generated`-th, left the session at `length`; None: go on.

        The token itself is not in the KV yet: it needs position `length`, which must lie
        below `max_tokens`.
        """
        if token in self.stop:
            return EndReason.STOP
        if token in self.eog:
            return EndReason.EOG
        if generated >= self.max_new or length >= max_tokens:
            return EndReason.LENGTH
        return None
