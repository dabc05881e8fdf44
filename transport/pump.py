"""The task that owns a zmq socket: it sends what other tasks queue and hands over what arrives.

Other tasks never touch the socket: they call `send_nowait`, which queues the frames
(bounded) and wakes the pump. Incoming messages go to `on_message` synchronously, so
the handler must not block (it queues work elsewhere). On a ROUTER with
ROUTER_MANDATORY, a peer whose pipe is full (`EAGAIN`) has its messages parked and
retried without holding up other peers; a peer that is gone (`EHOSTUNREACH`), or that
is behind by more than `max_parked` messages or `max_peer_bytes` bytes, is reported
through `on_peer_gone` and everything queued for it is dropped.
An exception `on_message` lets escape costs that message only: it is logged and
counted in `failed`, and the pump goes on.

What waits here is bounded in bytes, not only in messages: the outbox and the parked
messages hold at most `max_bytes` together. When a message would pass that, the peers
that are behind are cut off (furthest behind first) to make room; only when no peer is
behind is the message refused. One message is always taken when nothing is queued (and
a peer that is behind may have one message of any size), so no message is too large
for the pump. A gone peer's messages are refused at once until it sends again, its
owner calls `forget`, or `max_gone` peers that went later push it out of the record.
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable

import trio
import zmq

from transport.memory_bounds import MAX_PEER_REPLY_BYTES, MAX_REPLY_BYTES
from transport.trio_zmq import TrioSocket

RETRY_PARKED_S = 0.005

log = logging.getLogger("neuron_tai.pump")

Entry = tuple[list[bytes], int]  # a message's frames and its size in bytes


def message_bytes(frames: list[bytes]) -> int:
    return sum(len(frame) for frame in frames)


class SocketPump:
    def __init__(
        self,
        sock: TrioSocket,
        on_message: Callable[[list[bytes]], None],
        *,
        max_outbox: int = 4096,
        max_bytes: int = MAX_REPLY_BYTES,
        routed: bool = False,
        max_parked: int = 256,
        max_peer_bytes: int = MAX_PEER_REPLY_BYTES,
        max_gone: int = 4096,
        on_peer_gone: Callable[[bytes], None] | None = None,
    ) -> None:
        self.sock = sock
        self.on_message = on_message
        self.max_outbox = max_outbox
        self.max_bytes = max_bytes
        self.routed = routed  # frames[0] is a peer identity (ROUTER)
        self.max_parked = max_parked
        self.max_peer_bytes = max_peer_bytes
        self.max_gone = max_gone
        self.on_peer_gone = on_peer_gone or (lambda _peer: None)
        self._outbox: deque[Entry] = deque()
        self._parked: dict[bytes, deque[Entry]] = {}
        self._held: dict[bytes, int] = {}  # bytes queued (outbox and parked) per peer; b"" unrouted
        self.queued_bytes = 0
        self.peak_bytes = 0  # the most `queued_bytes` has been
        self.gone: dict[bytes, None] = {}  # peers reported gone, oldest first
        self.cut_off = 0  # peers reported gone for being too far behind
        self.failed = 0  # messages whose handler raised
        # While set, queued messages wait in the outbox instead of going out (a link that is
        # not up: its owner drops them or lets them go once it is).
        self.holding = False

    def send_nowait(self, frames: list[bytes]) -> bool:
        """Queue frames for sending; False when they do not fit or the peer is known gone
        (or is cut off now: it is behind and this would put it past its bound)."""
        peer = frames[0] if self.routed else b""
        if peer in self.gone or len(self._outbox) >= self.max_outbox:
            return False
        size = message_bytes(frames)
        if peer in self._parked and self._held[peer] + size > self.max_peer_bytes:
            self._cut_off(peer)
            return False
        if not self._room_for(size) or peer in self.gone:  # making room may have cut off this peer
            return False
        self._outbox.append((frames, size))
        self._hold(peer, size)
        self.sock.wake()
        return True

    def drop_outbox(self) -> int:
        """Forget every message not sent yet (the link is down: never send them late); how many."""
        dropped = len(self._outbox)
        while self._outbox:
            frames, size = self._outbox.popleft()
            self._release(frames[0] if self.routed else b"", size)
        return dropped

    def hold(self, holding: bool) -> None:
        """Keep queued messages back (True), or let them go (False)."""
        self.holding = holding
        self.sock.wake()

    def forget(self, peer: bytes) -> None:
        """`peer`'s lease ran out (nothing refers to it any more): drop what still waits for it,
        and stop remembering whether it is gone."""
        self.gone.pop(peer, None)
        self._drop(peer)

    def backlog(self, peer: bytes) -> int:
        """Messages held back for `peer` because its pipe is full (0 while it keeps up)."""
        queue = self._parked.get(peer)
        return 0 if queue is None else len(queue)

    def peer_bytes(self, peer: bytes) -> int:
        """Bytes queued for `peer` (in the outbox and parked)."""
        return self._held.get(peer, 0)

    @property
    def most_peer_bytes(self) -> int:
        """The bytes queued for the peer with the most."""
        return max(self._held.values(), default=0)

    @property
    def queued(self) -> int:
        return len(self._outbox) + sum(len(q) for q in self._parked.values())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self.send_pending()
            received = 0
            while received < 64:
                frames = self.sock.try_recv()
                if frames is None:
                    break
                if self.routed:
                    self.gone.pop(frames[0], None)  # it is back (a stable identity that reconnected)
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

    def send_pending(self) -> None:
        """Send what can go now: parked messages first (each peer's in order), then the outbox.
        The pump's own turn; only its task calls it, as only it touches the socket."""
        self._retry_parked()
        self._flush()

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
            entry = self._outbox.popleft()
            frames, size = entry
            peer = frames[0] if self.routed else b""
            if peer in self._parked:  # keep a slow peer's replies in order
                self._park(peer, entry)
                continue
            sent = self._send(frames)
            if sent is None:
                self._release(peer, size)
                self._peer_gone(peer)
            elif sent:
                self._release(peer, size)
            elif not self.routed:
                self._outbox.appendleft(entry)
                return
            else:
                self._park(peer, entry)

    def _park(self, peer: bytes, entry: Entry) -> None:
        queue = self._parked.setdefault(peer, deque())
        queue.append(entry)
        if len(queue) > self.max_parked or self._held[peer] > max(self.max_peer_bytes, entry[1]):
            self._cut_off(peer)

    def _retry_parked(self) -> None:
        for peer in list(self._parked):
            queue = self._parked[peer]
            while queue:
                frames, size = queue[0]
                sent = self._send(frames)
                if sent is None:
                    self._peer_gone(peer)
                    break
                if not sent:
                    break
                queue.popleft()
                self._release(peer, size)
            if not queue:
                self._parked.pop(peer, None)

    def _room_for(self, size: int) -> bool:
        """Whether `size` more bytes fit; to make room, peers that are behind are cut off,
        the one with the most queued first."""
        while self.queued_bytes and self.queued_bytes + size > self.max_bytes:
            if not self._parked:
                return False
            self._cut_off(max(self._parked, key=self.peer_bytes))
        return True

    def _hold(self, peer: bytes, size: int) -> None:
        self._held[peer] = self._held.get(peer, 0) + size
        self.queued_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.queued_bytes)

    def _release(self, peer: bytes, size: int) -> None:
        left = self._held[peer] - size
        if left:
            self._held[peer] = left
        else:
            del self._held[peer]
        self.queued_bytes -= size

    def _drop(self, peer: bytes) -> None:
        """Forget every message queued for `peer`, parked or not."""
        parked = self._parked.pop(peer, ())
        held = self._held.pop(peer, 0)
        self.queued_bytes -= held
        if held > sum(size for _frames, size in parked):  # some are in the outbox too
            self._outbox = deque(entry for entry in self._outbox if entry[0][0] != peer)

    def _cut_off(self, peer: bytes) -> None:
        log.info("peer %s is too far behind (%d bytes queued): treating it as gone", peer.hex(), self.peer_bytes(peer))
        self.cut_off += 1
        self._peer_gone(peer)

    def _peer_gone(self, peer: bytes) -> None:
        self._drop(peer)
        if peer not in self.gone:
            self.gone[peer] = None
            if len(self.gone) > self.max_gone:
                del self.gone[next(iter(self.gone))]
            self.on_peer_gone(peer)
