"""The engine's inbox: a bounded channel of requests, each owner's share of it counted.

Other tasks put requests in without waiting (a full inbox, or an owner's full share of
it, is their requester's `busy`); the engine task takes them out between iterations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from contextlib import suppress

import trio

from engine.messages import OpenRequest, Result, StepRequest, StepsEnded
from engine.replies import Reply

Queued = OpenRequest | StepRequest | StepsEnded  # what goes through the inbox (a close is a cleanup)


class Inbox:
    """The channel and the per-owner counts: one object, so a count never drifts from the channel."""

    def __init__(self, size: int, per_owner: int) -> None:
        self.size, self.per_owner = size, per_owner
        self._send, self.receiver = trio.open_memory_channel[tuple[Queued, Reply]](size)
        self._queued: Counter[Hashable] = Counter()  # requests in the inbox, by owner
        nowhere, _ = trio.open_memory_channel[Result](0)
        nowhere.close()
        self._no_reply = Reply(nowhere)  # a hint's: answering it does nothing

    def owner_full(self, owner: Hashable) -> bool:
        """Whether the owner holds its whole share (a share as large as the inbox is no limit)."""
        return self.per_owner < self.size and self._queued[owner] >= self.per_owner

    def put(self, request: OpenRequest | StepRequest, reply: Reply) -> None:
        """Queue a request; trio.WouldBlock when the inbox is full, ClosedResourceError once closed."""
        self._send.send_nowait((request, reply))
        self._queued[request.owner] += 1

    def hint(self, hint: StepsEnded) -> None:
        """Queue a hint, in order with the requests, outside any owner's share; dropped when full."""
        with suppress(trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self._send.send_nowait((hint, self._no_reply))

    def taken(self, request: Queued) -> None:
        """A request left the inbox: its owner's share has room again."""
        if isinstance(request, StepsEnded):
            return  # took none
        self._queued[request.owner] -= 1
        if not self._queued[request.owner]:
            del self._queued[request.owner]

    def close(self) -> None:
        self._send.close()
