"""The replicas of the next layer range: one link each, sessions placed on one and kept there.

Placement and backoff are the pure `ReplicaBook`'s; this module owns the links and which
replica each forwarded session lives on. Every `opened` a replica answers must name the same
model, the same layers and the same shard fingerprint as the first one seen; where there are
several replicas, each is asked so as soon as it connects, with a probe session of one
position opened and closed again, so a replica started with another shard is refused before
it gets a session (and says so in the log and in `stats`). A single next stage is not probed:
there is nothing to compare it with, and a stage of someone else's making sees only the
requests it is sent. A replica that fails a request
(no answer, the link down, or `downstream`/`internal`) is marked down with backoff, and
the sessions on it are released: it is the head's to recover them elsewhere.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import trio

from neuron_tai.downstream import NextStage
from neuron_tai.replica_book import ReplicaBook
from protocol.errors import ErrorCode
from transport import wire

log = logging.getLogger("neuron_tai.replicas")

_FAILED_CODES = frozenset({ErrorCode.DOWNSTREAM, ErrorCode.INTERNAL})
# An open refused for want of room (or because the replica is stopping) may fit on another.
_FULL_CODES = frozenset({ErrorCode.KV_BUDGET, ErrorCode.SESSION_LIMIT, ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN})
PROBE_RETRY_S = 1.0  # between probes of a connected replica that did not answer one


def identity(opened: wire.Opened) -> tuple[str, tuple[int, int], str]:
    """What must be equal across replicas of one layer range. A stage of someone else's making
    may leave out the model or the fingerprint: what it leaves out is compared as absent."""
    stage = opened.stage
    return stage.model, stage.layers, stage.fingerprint


class Replicas:
    def __init__(self, links: list[NextStage], book: ReplicaBook | None = None) -> None:
        self.links = links
        self.book = book or ReplicaBook(len(links))
        self.checked = [len(links) == 1] * len(links)  # probed since its last connection
        self.reference: tuple[Any, ...] | None = None  # the identity every replica must have
        self.placed: dict[str, int] = {}  # forwarded session -> replica
        self.connect_wait_s = min(link.connect_wait_s for link in links)
        self._checked = trio.Event()  # set whenever a replica passes its check

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for index, link in enumerate(self.links):
                await nursery.start(link.run)
                if len(self.links) > 1:
                    nursery.start_soon(self._check_each_connection, index)
            task_status.started()

    def _connected(self) -> list[bool]:
        return [link.connected and ok for link, ok in zip(self.links, self.checked, strict=True)]

    def any_up(self) -> bool:
        return self.book.choose(trio.current_time(), self._connected()) is not None

    async def wait_up(self, timeout_s: float) -> bool:
        """Whether a replica is up, waiting up to `timeout_s` for one to connect and pass its check."""
        with trio.move_on_after(timeout_s):
            while not self.any_up():
                self._checked = trio.Event()
                with trio.move_on_after(0.1):  # or a backoff runs out
                    await self._checked.wait()
        return self.any_up()

    async def open(self, session: str, request: wire.Open) -> wire.Reply | None:
        """Open `session` on the least-loaded replica that is up, trying the others while one
        fails or has no room; the reply of the replica that opened it, else the last refusal
        (None: none answered)."""
        await self.wait_up(self.connect_wait_s)
        tried: set[int] = set()
        refused: wire.Reply | None = None
        while (index := self.book.choose(trio.current_time(), self._connected(), frozenset(tried))) is not None:
            tried.add(index)
            self.book.place(index)  # counted before the reply: opens at once spread over the replicas
            try:
                reply = await self.links[index].call(request)
            except BaseException:  # cancelled: the open may still land there; its close follows it
                self.book.release(index)
                self.links[index].close_soon(session)
                raise
            if self._failed(index, reply) or reply is None:
                self.book.release(index)
                if reply is None:  # no answer in time: the open may still land there
                    self.links[index].close_soon(session)
                continue
            if not isinstance(reply, wire.Opened):
                self.book.release(index)
                if isinstance(reply, wire.ErrorReply) and reply.code in _FULL_CODES:
                    refused = reply
                    continue
                return reply
            if not self._same(index, reply):
                self.book.release(index)
                self.links[index].close_soon(session)
                continue
            self.placed[session] = index
            return reply
        return refused

    async def request(self, session: str, request: wire.Request) -> wire.Reply | None:
        """A request for a session on the replica it lives on (None: it has none, or that replica failed)."""
        index = self.placed.get(session)
        if index is None:
            return None
        reply = await self.links[index].call(request)
        if self._failed(index, reply):
            self.release(session)  # the head recovers it elsewhere; what is left there is closed
            return None
        return reply

    def _failed(self, index: int, reply: wire.Reply | None) -> bool:
        now = trio.current_time()
        if reply is not None and not (isinstance(reply, wire.ErrorReply) and reply.code in _FAILED_CODES):
            self.book.succeeded(index)
            return False
        backoff = self.book.failed(index, now)
        log.warning("replica %s failed: down for %.1fs", self.links[index].address, backoff)
        return True

    def release(self, session: str) -> None:
        """Forget where the session lives and close it there (best effort, never waits)."""
        index = self.placed.pop(session, None)
        if index is not None:
            self.book.release(index)
            self.links[index].close_soon(session)

    async def _check_each_connection(self, index: int) -> None:
        """Ask the replica what it serves each time it (re)connects, before it takes sessions."""
        link = self.links[index]
        seen = -1
        while True:
            await link.wait_connected()
            if seen == link.disconnects:
                await link.wait_disconnected()
                continue
            self.checked[index] = False
            seen = link.disconnects
            passed = False
            while link.connected:
                passed = await self._probe(index)
                if passed or self.book.records[index].mismatch:
                    break
                await trio.sleep(PROBE_RETRY_S)  # no answer yet (still loading its model?): ask again
            self.checked[index] = link.connected and passed
            if self.checked[index]:
                self.book.matched(index)  # a fresh start: no backoff left from before
                self._checked.set()

    async def _probe(self, index: int) -> bool:
        """Open and close a session of one position; a replica too busy to open one is taken
        on trust until its first real `opened` (which is checked as well)."""
        link, probe = self.links[index], f"replica-check-{os.urandom(6).hex()}"
        reply = await link.call(wire.Open(0, probe, 1))
        if reply is None:  # no answer in time: the probe may still open there
            link.close_soon(probe)
            return False
        if not isinstance(reply, wire.Opened):
            return True
        link.close_soon(probe)
        return self._same(index, reply)

    def _same(self, index: int, opened: wire.Opened) -> bool:
        """Whether an `opened` from this replica names what the others serve (else it is never used)."""
        address, theirs = self.links[index].address, identity(opened)
        if self.reference is None or theirs == self.reference:
            self.reference = theirs
            return True
        else:
            log.error("replica %s serves %s where the others serve %s: not used", address, theirs, self.reference)
        self.book.mismatched(index)
        return False

    def stats(self) -> list[dict[str, Any]]:
        now, up = trio.current_time(), self._connected()
        return [
            {
                "address": link.address,
                "state": str(self.book.state(i, now, up[i])),
                "sessions": self.book.records[i].sessions,
                "placed_total": self.book.records[i].placed,
                "failures_total": self.book.records[i].failures,
                "connected": link.connected,
            }
            for i, link in enumerate(self.links)
        ]
