"""Session ends, from the engine task to one consumer task, never lost and never blocking the engine mid-step.

The engine posts a `SessionEnded` for every session it frees (whatever the reason) and a
`CloseAnswered` for every CloseRequest it ran, in the order they happened, into a backlog
it owns. At one safe point of each loop iteration (no request half-handled, no decode
running) it moves the backlog into a bounded Trio memory channel, awaiting `send` while
the channel is full. So the bound holds without losing anything: a slow consumer slows
the engine down, it never makes it drop an end. The backlog between two safe points is
bounded by what one iteration can free (every open session at most once, one answer per
close request), and by the buffer's size: an iteration that lingers for requests (sessions
opened and closed meanwhile free a slot again and again) stops lingering once the backlog
holds a channel's worth (`due`, `until_due`).

The consumer must never wait for the engine (an `Engine.request`, say) while the channel
may be full: it only drains and reacts with non-blocking calls (`cleanup_nowait`), or the
engine, awaiting room, and the consumer, awaiting the engine, would wait for each other.

Nothing is posted until someone takes the channel (`subscribe`): an engine whose ends
nobody reads must not fill a channel and stop.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import trio

from engine.messages import SessionEnd

log = logging.getLogger("neuron_tai.engine")

SESSION_ENDS_BUFFER = 64  # ends the channel holds before the engine waits for its consumer


class SessionEnds:
    """The engine's side of the session-ends channel: a backlog, flushed at safe points."""

    def __init__(self, buffer: int = SESSION_ENDS_BUFFER) -> None:
        self._send, self._receive = trio.open_memory_channel[SessionEnd](buffer)
        self._buffer = buffer
        self._backlog: deque[SessionEnd] = deque()
        self._subscribed = False

    def subscribe(self) -> trio.MemoryReceiveChannel[SessionEnd]:
        """The receive side, for the one consumer; ends are posted from now on."""
        self._subscribed = True
        return self._receive

    def post(self, end: SessionEnd) -> None:
        """Keep an end for the next flush (engine task; never blocks)."""
        if self._subscribed:
            self._backlog.append(end)

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    @property
    def due(self) -> bool:
        """Whether the backlog holds a channel's worth: the engine must reach its safe point
        before it takes more requests."""
        return len(self._backlog) >= self._buffer

    def until_due(self, gap_s: Callable[[], float | None]) -> Callable[[], float | None]:
        """`gap_s` (how long to wait for the next request), but None (stop waiting) once `due`."""
        return lambda: None if self.due else gap_s()

    async def flush(self) -> None:
        """Move the backlog into the channel, waiting for room while it is full."""
        while self._backlog:
            try:
                await self._send.send(self._backlog[0])
            except (trio.BrokenResourceError, trio.ClosedResourceError):  # the consumer is gone for good
                self._backlog.clear()
                self._subscribed = False
                return
            self._backlog.popleft()

    async def close(self, timeout_s: float) -> None:
        """The engine stopped: deliver what is left (at most `timeout_s`, shielded), then end the channel."""
        with trio.CancelScope(shield=True), trio.move_on_after(timeout_s):
            await self.flush()
        if self._backlog:
            log.warning("%d session ends were not read before the engine stopped", len(self._backlog))
            self._backlog.clear()
        self._send.close()
