"""Where the engine's answers go: one-shot channels its requesters await, and what it keeps per request."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field

import numpy as np
import trio

from engine.messages import Closed, Opened, OpenRequest, Result, StepDone, StepRequest
from protocol.errors import Fault


class RequesterGone(Exception):
    """The requester stopped waiting: what was made for it has no owner any more."""


@dataclass(slots=True)
class Reply:
    """Where one request's result goes: the send side of a one-shot channel its requester awaits."""

    channel: trio.MemorySendChannel[Result]

    def deliver(self, result: Opened | StepDone) -> None:
        """Hand over something the requester now owns; RequesterGone when nobody waits for it."""
        try:
            self.channel.send_nowait(result)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            raise RequesterGone from None

    def answer(self, result: Closed | Fault) -> None:
        """Answer with something that left nothing behind: a requester that is gone loses nothing."""
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            self.channel.send_nowait(result)


@dataclass(slots=True)
class Work:
    """A step's request, where its reply goes, and its outputs so far (the scheduler's step payload)."""

    request: StepRequest
    reply: Reply
    hidden: list[np.ndarray] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)  # `Output.TOKENS`, chunk by chunk


@dataclass(frozen=True, slots=True)
class Opening:
    """An open waiting for room, and where its reply goes (the scheduler's waiter payload)."""

    request: OpenRequest
    reply: Reply
