"""Requests over one DEALER socket, each matched to its reply by `rid`, each with a timeout.

The core both the client library and a node's link to its next stage are built on.
One pump task owns the socket; every waiting request holds a one-shot channel keyed
by the rid it was sent with. A reply nobody waits for any more (timed out, cancelled)
is dropped, and so is one that is not a msgpack map within the reply limits or has
no integer `rid` (counted in `dropped`). A streamed request (`stream`) takes every reply
with its rid until a final one, into a buffer its caller sizes to the most replies it
can get. When the pump stops, for whatever reason, every waiting request and every later
one raises `ClientClosed` at once instead of waiting out its timeout.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import AsyncGenerator, Collection
from dataclasses import dataclass
from typing import Any

import trio

from transport.memory_bounds import MAX_OUTBOX_BYTES
from transport.pump import SocketPump
from transport.trio_zmq import TrioSocket
from transport.wire import REPLY_LIMITS, Fault, HeaderLimits, Request, encode_request, op_of, parse_reply

RawReply = tuple[dict[str, Any], list[bytes]]  # a reply's parsed header and payload frames, its keys unread
Reply = RawReply  # the node's name for it, until it reads typed replies


class ClientClosed(ConnectionError):
    """The requester's socket task has stopped: no reply can arrive any more."""


class OutboxFull(Exception):
    """The socket's outbox is full (in messages or bytes): the request was not sent."""


class Abandoned(ClientClosed):
    """The request was given up while waiting (the link went down, or the peer sent more
    replies than the request can take): its reply can no longer arrive."""


@dataclass(slots=True)
class _Waiting:
    """Where the replies to one rid go; with `final_ops`, every reply until one of those ops."""

    send: trio.MemorySendChannel[RawReply]
    final_ops: Collection[str] | None = None


class Requester:
    def __init__(
        self,
        sock: TrioSocket,
        *,
        max_outbox: int = 4096,
        max_outbox_bytes: int = MAX_OUTBOX_BYTES,
        limits: HeaderLimits = REPLY_LIMITS,
    ) -> None:
        self.sock = sock
        self.limits = limits
        self.pump = SocketPump(sock, self._on_message, max_outbox=max_outbox, max_bytes=max_outbox_bytes)
        self._rids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}
        self.closed = False
        self.dropped = 0  # replies that could not be read or matched
        self.last_sent = -math.inf  # trio time a request was last queued: any request renews a lease

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the socket; when this stops, the waiting requests fail."""
        try:
            await self.pump.run(task_status=task_status)
        finally:
            self.closed = True
            for waiting in self._waiting.values():
                waiting.send.close()

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            header, payload = parse_reply(frames, self.limits)
        except Fault:  # a broken reply is the peer's fault; there is nothing to match it to
            self.dropped += 1
            return
        rid = header.get("rid")
        if type(rid) is not int:
            self.dropped += 1
            return
        waiting = self._waiting.get(rid)
        if waiting is None:
            self.dropped += 1
            return
        if waiting.final_ops is None or header.get("op") in waiting.final_ops or header.get("op") == "error":
            del self._waiting[rid]
        try:
            waiting.send.send_nowait((header, payload))
        except trio.WouldBlock:  # more replies than the caller said it could get: the peer broke the contract
            del self._waiting[rid]
            waiting.send.close()

    def fail_waiting(self) -> None:
        """Give up every waiting request (the link went down): each raises `Abandoned` at once."""
        waiting, self._waiting = self._waiting, {}
        for entry in waiting.values():
            entry.send.close()

    def _frames(self, request: Request, rid: int) -> list[bytes]:
        return encode_request(dataclasses.replace(request, rid=rid))

    def send_nowait(self, request: Request) -> bool:
        """Send a request whose reply nobody waits for (its own `rid` is replaced); False when it
        could not be queued."""
        if self.closed:
            return False
        sent = self.pump.send_nowait(self._frames(request, next(self._rids)))
        if sent:
            self.last_sent = trio.current_time()
        return sent

    def _gone(self, op: str, what: str) -> ConnectionError:
        if self.closed:
            return ClientClosed(f"{op!r}: {what}")
        return Abandoned(f"{op!r}: given up while waiting (the link went down?)")

    async def request(self, request: Request, timeout_s: float) -> RawReply:
        """The reply to `request` (sent with a rid of this requester's own), `error` replies
        included. TimeoutError, ClientClosed or OutboxFull otherwise."""
        op = op_of(request)
        if self.closed:
            await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller sees Cancelled
            raise ClientClosed(f"{op!r}: the client is closed")
        rid = next(self._rids)
        send, recv = trio.open_memory_channel[RawReply](1)
        self._waiting[rid] = _Waiting(send)
        try:
            if not self.pump.send_nowait(self._frames(request, rid)):
                await trio.lowlevel.checkpoint()
                raise OutboxFull(f"{op!r}: the outbox is full")
            self.last_sent = trio.current_time()
            with trio.move_on_after(timeout_s):
                try:
                    return await recv.receive()
                except trio.EndOfChannel:
                    await trio.lowlevel.checkpoint_if_cancelled()
                    raise self._gone(op, "the client closed while waiting") from None
            raise TimeoutError(f"no reply to {op!r} within {timeout_s:g} s")
        finally:
            self._waiting.pop(rid, None)

    async def stream(
        self, request: Request, timeout_s: float, *, final_ops: Collection[str], most: int
    ) -> AsyncGenerator[RawReply, None]:
        """Every reply to one request up to and including the first whose op is in `final_ops` (or
        an `error`). At most `most` replies are buffered; each must come within `timeout_s` of the
        one before. TimeoutError, ClientClosed or OutboxFull otherwise."""
        op = op_of(request)
        if self.closed:
            await trio.lowlevel.checkpoint_if_cancelled()
            raise ClientClosed(f"{op!r}: the client is closed")
        rid = next(self._rids)
        send, recv = trio.open_memory_channel[RawReply](most)
        self._waiting[rid] = _Waiting(send, final_ops)
        try:
            if not self.pump.send_nowait(self._frames(request, rid)):
                await trio.lowlevel.checkpoint()
                raise OutboxFull(f"{op!r}: the outbox is full")
            self.last_sent = trio.current_time()
            while True:
                reply = None
                with trio.move_on_after(timeout_s):  # never across a yield: the caller runs in between
                    try:
                        reply = await recv.receive()
                    except trio.EndOfChannel:
                        await trio.lowlevel.checkpoint_if_cancelled()
                        raise self._gone(op, "the reply stream ended early") from None
                if reply is None:
                    raise TimeoutError(f"no reply to {op!r} within {timeout_s:g} s")
                yield reply
                if reply[0].get("op") in final_ops or reply[0].get("op") == "error":
                    return
        finally:
            self._waiting.pop(rid, None)
