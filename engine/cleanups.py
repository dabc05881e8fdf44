"""Cleanups waiting for the engine task: at most one per session or owner, merged as they come.

A cleanup (close, rollback, a gone connection) is never refused, so it needs a bound that
does not depend on a queue's size: merging one key's cleanups into one keeps what waits
bounded by what exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import trio

from engine.messages import Cleanup, CloseRequest, DropOwner, Owner, Rollback

log = logging.getLogger("neuron_tai.engine")

ClosedListener = Callable[[bool], None]  # told whether the session a close was for existed
CleanupKey = tuple[str, Owner] | tuple[str, Owner, str]


@dataclass(slots=True)
class PendingCleanup:
    """One key's cleanup; `closes` counts the CloseRequests merged into it (each is answered)."""

    request: Cleanup
    done: trio.Event
    listeners: list[ClosedListener] = field(default_factory=list)
    closes: int = 0


def cleanup_key(request: Cleanup) -> CleanupKey:
    """What cleanups merge on: a connection's drop, or one session's close or rollback."""
    if isinstance(request, DropOwner):
        return ("owner", request.owner)
    return ("session", request.owner, request.session)


def merge(old: Cleanup, new: Cleanup) -> Cleanup:
    """Two cleanups of one session as one: a close covers a rollback; two rollbacks, the earlier
    pos, unless they undo steps of different openings (the older one's session is gone)."""
    if isinstance(old, Rollback) and isinstance(new, Rollback):
        if old.opening is not None and new.opening is not None and old.opening != new.opening:
            return old if old.opening > new.opening else new
        return old if old.pos <= new.pos else new
    return old if isinstance(old, CloseRequest | DropOwner) else new


class CleanupQueue:
    """Pending cleanups by key, in arrival order of their first request."""

    def __init__(self) -> None:
        self._pending: dict[CleanupKey, PendingCleanup] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request: Cleanup, on_closed: ClosedListener | None) -> tuple[PendingCleanup, bool]:
        """Queue or merge a cleanup; returns its pending entry and whether it is new."""
        key = cleanup_key(request)
        pending = self._pending.get(key)
        new = pending is None
        if pending is None:
            pending = self._pending[key] = PendingCleanup(request, trio.Event())
        else:
            pending.request = merge(pending.request, request)
        if isinstance(request, CloseRequest):
            pending.closes += 1
        if on_closed is not None:
            pending.listeners.append(on_closed)
        return pending, new

    def pop(self) -> PendingCleanup | None:
        """The oldest pending cleanup, taken off the queue; None when there is none."""
        if not self._pending:
            return None
        return self._pending.pop(next(iter(self._pending)))

    def take_all(self) -> Iterator[PendingCleanup]:
        """Every pending cleanup, oldest first, the queue left empty."""
        while (pending := self.pop()) is not None:
            yield pending


def tell(listeners: list[ClosedListener], existed: bool) -> None:
    """Tell each close whether its session existed: the first merged close closed it, if anyone did."""
    for listener in listeners:
        try:
            listener(existed)
        except Exception:  # a listener's bug must not stop the batch loop
            log.exception("a close listener failed")
        existed = False
