"""The task that owns a zmq socket: it sends what other tasks queue and hands over what arrives.

Other tasks never touch the socket: they call `send_nowait`, which queues the frames
(bounded) and wakes the pump. Incoming messages go to `on_message` synchronously, so
the handler must not block (it queues work elsewhere). On a ROUTER with
ROUTER_MANDATORY, a peer whose pipe is full (`EAGAIN`) has its messages parked and
retried without holding up other peers; a peer that is gone (`EHOSTUNREACH`), or
whose parked backlog passes `max_parked`, is reported through `on_peer_gone`.
An exception `on_message` lets escape costs that message only: it is logged and
counted in `failed`, and the pump goes on.
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable

import trio
import zmq

from transport.trio_zmq import TrioSocket

RETRY_PARKED_S = 0.005

log = logging.getLogger("neuron_tai.pump")


class SocketPump:
    def __init__(
        self,
        sock: TrioSocket,
        on_message: Callable[[list[bytes]], None],
        *,
        max_outbox: int = 4096,
        routed: bool = False,
        max_parked: int = 256,
        on_peer_gone: Callable[[bytes], None] | None = None,
    ) -> None:
        self.sock = sock
        self.on_message = on_message
        self.max_outbox = max_outbox
        self.routed = routed  # frames[0] is a peer identity (ROUTER)
        self.max_parked = max_parked
        self.on_peer_gone = on_peer_gone or (lambda _peer: None)
        self._outbox: deque[list[bytes]] = deque()
        self._parked: dict[bytes, deque[list[bytes]]] = {}
        self.gone: set[bytes] = set()
        self.failed = 0  # messages whose handler raised
        # While set, queued messages wait in the outbox instead of going out (a link that is
        # not up: its owner drops them or lets them go once it is).
        self.holding = False

    def send_nowait(self, frames: list[bytes]) -> bool:
        """Queue frames for sending; False when the outbox is full or the peer is known gone."""
        if len(self._outbox) >= self.max_outbox or (self.routed and frames[0] in self.gone):
            return False
        self._outbox.append(frames)
        self.sock.wake()
        return True

    def drop_outbox(self) -> int:
        """Forget every message not sent yet (the link is down: never send them late); how many."""
        dropped = len(self._outbox)
        self._outbox.clear()
        return dropped

    def hold(self, holding: bool) -> None:
        """Keep queued messages back (True), or let them go (False)."""
        self.holding = holding
        self.sock.wake()

    def forget(self, peer: bytes) -> None:
        """Stop remembering that `peer` is gone (its lease ran out: nothing refers to it any more)."""
        self.gone.discard(peer)

    def backlog(self, peer: bytes) -> int:
        """Messages held back for `peer` because its pipe is full (0 while it keeps up)."""
        queue = self._parked.get(peer)
        return 0 if queue is None else len(queue)

    @property
    def queued(self) -> int:
        return len(self._outbox) + sum(len(q) for q in self._parked.values())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._retry_parked()
            self._flush()
            received = 0
            while received < 64:
                frames = self.sock.try_recv()
                if frames is None:
                    break
                if self.routed:
                    self.gone.discard(frames[0])  # it is back (a stable identity that reconnected)
                received += 1
                try:
                    self.on_message(frames)
                except Exception:  # the handler's bug costs this message, never the socket
                    self.failed += 1
                    log.exception("a message's handler failed; message dropped")
            if received:
                await trio.lowlevel.checkpoint()
            elif self._outbox and not self.holding:  # the pipe is full, or (ZMQ_IMMEDIATE) no peer is up
                await self.sock.wait(for_send=True)
            elif self._parked:
                with trio.move_on_after(RETRY_PARKED_S):
                    await self.sock.wait()
            else:
                await self.sock.wait()

    def _send(self, frames: list[bytes]) -> bool | None:
        """True sent, False would block, None peer gone."""
        try:
            return self.sock.try_send(frames)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH and self.routed:
                return None
            raise

    def _flush(self) -> None:
        while self._outbox and not self.holding:
            frames = self._outbox.popleft()
            peer = frames[0] if self.routed else b""
            if peer in self._parked:  # keep a slow peer's replies in order
                self._park(peer, frames)
                continue
            sent = self._send(frames)
            if sent is None:
                self._peer_gone(peer)
            elif not sent:
                if not self.routed:
                    self._outbox.appendleft(frames)
                    return
                self._park(peer, frames)

    def _park(self, peer: bytes, frames: list[bytes]) -> None:
        queue = self._parked.setdefault(peer, deque())
        queue.append(frames)
        if len(queue) > self.max_parked:
            self._peer_gone(peer)

    def _retry_parked(self) -> None:
        for peer in list(self._parked):
            queue = self._parked[peer]
            while queue:
                sent = self._send(queue[0])
                if sent is None:
                    self._peer_gone(peer)
                    break
                if not sent:
                    break
                queue.popleft()
            if not queue:
                self._parked.pop(peer, None)

    def _peer_gone(self, peer: bytes) -> None:
        self._parked.pop(peer, None)
        if peer not in self.gone:
            self.gone.add(peer)
            self.on_peer_gone(peer)
