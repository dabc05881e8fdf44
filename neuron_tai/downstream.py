"""The link from a node to the next stage of its chain: a client of that stage.

Built on the same request/reply core as `neuron_tai.client` (transport.requester):
one DEALER socket owned by its pump task, rids of our own matched to replies, a
timeout per request. With CURVE it authenticates with the node's own key pair,
like any client. A request the next stage does not answer within `timeout_s`,
or that cannot be sent, comes back as None and counts as a failure; so does a reply
that is not what the request expects (wire.answer_to: an `error`, or the answer to
that op with its keys and payload shape), which also counts in `malformed`.

The link is watched, so a next stage that is down is noticed within seconds rather
than after `timeout_s`:
- ZeroMQ heartbeats (every 0.25 s; 1 s without an answer drops the connection) find a
  peer that went silent without closing its TCP connection. The heartbeat is answered by
  the peer's ZeroMQ I/O thread, not its event loop, so a stage busy in a long
  `llama_decode` still answers it: only a hung process or a cut link stays silent;
- a socket monitor reports the connection up (handshake done) or down; while it is
  down, requests are answered None at once (after a short wait for a first connection,
  so a node started just before its next stage does not refuse its first requests),
  and the requests waiting for replies are given up at once;
- ZMQ_IMMEDIATE: nothing is queued for a connection that is not up, and what was
  queued in the pipe of a connection that went down is dropped with it. The pump holds
  its outbox while the link is down and drops it when the link goes down or comes up,
  so no forwarded work is replayed into a restarted stage after its timeout. Closes of forwarded sessions
  made while the link is down are remembered and sent once it is up.
What waits for the next stage is bounded in bytes: ZeroMQ's pipe holds at most `send_hwm`
messages, the outbox behind it at most `max_outbox_bytes` (beyond that a request fails at once).
What comes back is bounded too: no frame of a reply may be larger than the largest a step of
`max_rows` rows can need (`largest_reply_frame`); ZeroMQ drops a link that sends one, like a
link that went down, so a faulty or hostile next stage cannot make this node take in more.
ZeroMQ never reconnects a connection it dropped for breaking its protocol (such a frame, a
refused handshake), so a link that went down and then saw no connection attempt for
`REDIAL_S` is dialled again, at doubling waits up to `REDIAL_MAX_S` while dials keep failing:
a next stage that comes back is found, and a slow handshake is never cut short.
The DEALER has one routing id for the node's lifetime (ZMQ_ROUTING_ID, random), so the
next stage sees a reconnect as the same connection: the sessions forwarded there stay
this node's. A `LeaseKeeper` pings while this node holds forwarded sessions there.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from neuron_tai.security import ClientCurve
from transport.keepalive import LeaseKeeper
from transport.memory_bounds import MAX_OUTBOX_BYTES
from transport.requester import ClientClosed, OutboxFull, Requester
from transport.trio_zmq import TrioSocket
from transport.wire import (
    NEXT_STAGE_REPLY_LIMITS,
    REQUEST_HEADER_EXTRA,
    Close,
    Fault,
    Open,
    Opened,
    Reply,
    Request,
    answer_to,
    op_of,
)

log = logging.getLogger("neuron_tai.downstream")

HEARTBEAT_IVL_MS = 250
HEARTBEAT_TIMEOUT_MS = 1000
CONNECT_WAIT_S = 2.0  # how long a request waits for the link to come up before it fails
CLOSE_RETRY_S = 0.1  # how often closes the outbox had no room for are tried again
REDIAL_S = 2.0  # a link dropped and left without an attempt this long is dialled again
REDIAL_MAX_S = 30.0  # the longest wait between dials that keep failing
FRAME_OVERHEAD = 64  # bytes a frame grows on the wire, where ZMQ_MAXMSGSIZE counts: CURVE adds 33

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_TRYING = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_DELAYED | zmq.EVENT_CONNECT_RETRIED  # ZeroMQ at work


def largest_reply_frame(max_rows: int, n_embd: int, n_vocab: int) -> int:
    """The largest frame a next stage's reply needs, as ZeroMQ counts it: a header
    (request-sized, NEXT_STAGE_REPLY_LIMITS), f32 hidden states for each of `max_rows` rows,
    or one row of f32 logits (an `out: "tokens"` reply, 4 bytes a row, is never larger than
    the hidden), plus what encryption adds to a frame."""
    return max(REQUEST_HEADER_EXTRA, max_rows * n_embd * 4, n_vocab * 4) + FRAME_OVERHEAD


def _set_up(sock: zmq.Socket[bytes], curve: ClientCurve | None, hwm: int, send_hwm: int, max_frame_bytes: int) -> None:
    """A link's DEALER: its own routing id, heartbeats, no linger, the high-water marks and
    the largest frame it takes in."""
    if curve is not None:  # the node's own key pair, and the next stage's public key
        curve.apply(sock)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)


def _stop_monitor(sock: zmq.Socket[bytes], monitor: TrioSocket) -> None:
    """Stop the socket's events before closing their reader. The other way round, events still
    on their way (a connection closing, a reconnect attempt) have no reader, and ZeroMQ's I/O
    thread, which sends them, could stop there for good: seen with libzmq 4.3.5 after links
    that had been dropped and dialled again, no later socket of the context connected."""
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    monitor.close()


def _open_dealer(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    curve: ClientCurve | None,
    hwm: int,
    send_hwm: int,
    max_frame_bytes: int,
) -> tuple[zmq.Socket[bytes], TrioSocket]:
    """A link's DEALER, connecting to `address`, and the reader of its connection events.
    ValueError when ZeroMQ refuses; nothing is left open then (an open socket would keep the
    context, and the process, from ever ending)."""
    sock = ctx.socket(zmq.DEALER)
    monitor: TrioSocket | None = None
    try:
        _set_up(sock, curve, hwm, send_hwm, max_frame_bytes)
        monitor = TrioSocket(sock.get_monitor_socket(_UP | _DOWN | _TRYING))
        sock.connect(address)
    except BaseException as exc:
        if monitor is not None:
            _stop_monitor(sock, monitor)
        sock.close(linger=0)
        if isinstance(exc, zmq.ZMQError):
            reason = zmq.strerror(exc.errno or 0)
            raise ValueError(f"cannot connect to the next stage {address}: {reason}") from None
        raise
    return sock, monitor


class NextStage:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        timeout_s: float,
        hwm: int,
        n_embd: int,
        n_vocab: int,
        *,
        curve: ClientCurve | None = None,
        connect_wait_s: float = CONNECT_WAIT_S,
        send_hwm: int | None = None,
        max_outbox_bytes: int = MAX_OUTBOX_BYTES,
        max_rows: int = 512,
    ) -> None:
        """`max_rows`: the most rows one request sends (this node's `max_step_tokens`)."""
        max_frame_bytes = largest_reply_frame(max_rows, n_embd, n_vocab)
        sock, monitor = _open_dealer(ctx, address, curve, hwm, hwm if send_hwm is None else send_hwm, max_frame_bytes)
        self.routing_id = sock.getsockopt(zmq.ROUTING_ID)
        self.monitor = monitor
        self.address = address
        self.timeout_s = timeout_s
        self.connect_wait_s = connect_wait_s
        self.sock = TrioSocket(sock)
        self.core = Requester(
            self.sock, max_outbox=hwm, max_outbox_bytes=max_outbox_bytes, limits=NEXT_STAGE_REPLY_LIMITS
        )
        self.core.pump.holding = True  # until the first handshake: nothing is sent before the link is up
        self.keeper = LeaseKeeper(self.core)
        self.connected = False
        self._up = trio.Event()
        self._down = trio.Event()  # set when the connection that is up goes down
        self._dropped = trio.Event()  # set when a connection (or its handshake) ends
        self._trying = trio.Event()  # set when ZeroMQ connects or plans to, since the last drop
        self._redial_wait = REDIAL_S
        self._closes_pending: set[str] = set()
        self._close_waits = trio.Event()  # set while a close waits to be sent
        self.failures = 0
        self.malformed = 0
        self.disconnects = 0
        self.redials = 0
        self.n_embd = n_embd  # the model's, the same on every stage: the shape replies must have
        self.n_vocab = n_vocab
        self.max_frame_bytes = max_frame_bytes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The socket's pump, the link watcher and the lease keeper."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.core.run)
            nursery.start_soon(self._watch)
            nursery.start_soon(self.keeper.run)
            nursery.start_soon(self._retry_closes)
            nursery.start_soon(self._redial)
            task_status.started()

    async def _redial(self) -> None:
        """Dial again after a drop that ZeroMQ follows with no attempt of its own."""
        while True:
            await self._dropped.wait()
            self._dropped = trio.Event()
            with trio.move_on_after(self._redial_wait):
                await self._trying.wait()
            if not self._trying.is_set():
                self._dial_again()
                self._redial_wait = min(REDIAL_MAX_S, 2 * self._redial_wait)

    def _dial_again(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # ZeroMQ had let the connection go already
            self.sock.sock.disconnect(self.address)
        try:
            self.sock.sock.connect(self.address)
        except zmq.ZMQError as exc:
            log.warning("next stage %s: cannot dial again: %s", self.address, exc)
            self._dropped.set()  # try again after the next wait
            return
        self.redials += 1
        log.info("next stage %s: dialled again", self.address)

    async def _retry_closes(self) -> None:
        """Closes that found the outbox full go out as it drains: a close that is lost would
        leave the session's KV below until its lease, and the lease is kept for the others."""
        while True:
            await self._close_waits.wait()
            while self._closes_pending:
                await (trio.sleep(CLOSE_RETRY_S) if self.connected else self._up.wait())
                if self.connected:
                    self._send_pending_closes()
            self._close_waits = trio.Event()

    def _send_pending_closes(self) -> None:
        for session in list(self._closes_pending):
            if not self.core.send_nowait(Close(0, session)):
                return
            self._closes_pending.discard(session)

    async def _watch(self) -> None:
        """Follow the connection's state from the socket monitor's events."""
        while True:
            event = parse_monitor_message(await self.monitor.recv())["event"]
            if event & (_UP | _TRYING):
                self._trying.set()
            if event & _UP:
                self._came_up()
            elif event & _DOWN:
                self._trying = trio.Event()
                self._dropped.set()
                if self.connected:
                    self._went_down()

    def _came_up(self) -> None:
        if not self.connected:
            log.info("next stage %s connected", self.address)
            self.core.pump.drop_outbox()  # queued while down: too old to send now
            self.core.pump.hold(False)
            self._send_pending_closes()
            self._down = trio.Event()
        self.connected = True
        self._redial_wait = REDIAL_S
        self._up.set()

    def _went_down(self) -> None:
        self.connected = False
        self._up = trio.Event()
        self._down.set()
        self.disconnects += 1
        self.core.pump.hold(True)
        dropped = self.core.pump.drop_outbox()
        self.core.fail_waiting()
        log.warning("next stage %s disconnected (%d unsent dropped)", self.address, dropped)

    async def wait_connected(self) -> None:
        await self._up.wait()

    async def wait_disconnected(self) -> None:
        if self.connected:
            await self._down.wait()

    async def call(self, request: Request) -> Reply | None:
        """The next stage's reply to `request` (`error` replies included), checked against it;
        None when it failed, did not answer, or the link is down."""
        op = op_of(request)
        if self.connected and self._closes_pending:  # closes go first: an open may reuse their ids
            self._send_pending_closes()
        if not self.connected:
            with trio.move_on_after(min(self.connect_wait_s, self.timeout_s)):
                await self._up.wait()
            if not self.connected:
                log.warning("next stage %s is not connected: %r not sent", self.address, op)
                self.failures += 1
                return None
        try:
            raw = await self.core.request(request, self.timeout_s)
            reply = answer_to(request, *raw, self.n_embd, self.n_vocab)
        except Fault as exc:
            self.malformed += 1
            log.warning("next stage %s: %s", self.address, exc.message)
        except TimeoutError:
            log.warning("next stage %s did not answer %r within %.1fs", self.address, op, self.timeout_s)
        except (OutboxFull, ClientClosed) as exc:
            log.warning("next stage %s: %s", self.address, exc)
        else:
            if isinstance(request, Open) and isinstance(reply, Opened):
                self.keeper.opened(request.session, reply.lease_ms)
            return reply
        self.failures += 1
        return None

    def close_soon(self, session: str) -> None:
        """Close a forwarded session there without waiting for the answer (never blocks)."""
        self.keeper.closed(session)
        # Else sent once the link is up again, or once the outbox has room; bounded by the
        # sessions forwarded.
        if not (self.connected and self.core.send_nowait(Close(0, session))):
            self._closes_pending.add(session)
            self._close_waits.set()

    def stats(self) -> dict[str, Any]:
        return {
            "failures_total": self.failures,
            "connected": self.connected,
            "disconnects_total": self.disconnects,
            "redials_total": self.redials,
            "sessions": len(self.keeper.sessions),
            "pings_total": self.keeper.pings,
            "outbox_bytes": self.core.pump.queued_bytes,
            "max_outbox_bytes": self.core.pump.max_bytes,
            "max_reply_frame_bytes": self.max_frame_bytes,
        }

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long ZeroMQ may still try to deliver what was sent (on stopping)."""
        _stop_monitor(self.sock.sock, self.monitor)
        self.sock.close(linger_ms)
