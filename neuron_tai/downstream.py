"""The connection from a node to the next stage of its chain.

One DEALER socket, owned by its pump task. Forwarded requests get rids of our own;
a reply is matched back and handed to the callback that sent it. A request the next
stage does not answer within `timeout_s` is answered for it with `downstream`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
import zmq

from transport.pump import SocketPump
from transport.trio_zmq import TrioSocket
from transport.wire import decode_reply, encode

log = logging.getLogger("neuron_tai.downstream")

# Called with the reply's header and payload frames, or (None, []) when the next stage failed.
OnReply = Callable[[dict[str, Any] | None, list[bytes]], None]


@dataclass(slots=True)
class _Pending:
    on_reply: OnReply
    deadline: float


class Downstream:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, timeout_s: float, hwm: int) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.connect(address)
        self.address = address
        self.timeout_s = timeout_s
        self.sock = TrioSocket(sock)
        self.pump = SocketPump(self.sock, self._on_message, max_outbox=hwm)
        self._rids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._new_deadline = trio.Event()
        self.failures = 0

    def forward(self, header: dict[str, Any], payload: list[bytes], on_reply: OnReply) -> None:
        """Send a request on; `on_reply` gets the answer (or None on failure), exactly once."""
        rid = next(self._rids)
        if not self.pump.send_nowait(encode({**header, "rid": rid}, *payload)):
            self.failures += 1
            on_reply(None, [])
            return
        self._pending[rid] = _Pending(on_reply, trio.current_time() + self.timeout_s)
        self._new_deadline.set()

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            header, payload = decode_reply(frames)
        except Exception:  # a broken reply is the next stage's fault; nothing to match it to
            log.warning("undecodable reply from %s", self.address)
            return
        pending = self._pending.pop(header.get("rid", -1), None)
        if pending is not None:
            pending.on_reply(header, payload)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.pump.run)
            task_status.started()
            while True:
                self._expire()
                soonest = min((p.deadline for p in self._pending.values()), default=math.inf)
                self._new_deadline = trio.Event()
                with trio.move_on_at(soonest):
                    await self._new_deadline.wait()

    def _expire(self) -> None:
        now = trio.current_time()
        for rid in [r for r, p in self._pending.items() if p.deadline <= now]:
            self.failures += 1
            log.warning("next stage %s did not answer within %.1fs", self.address, self.timeout_s)
            self._pending.pop(rid).on_reply(None, [])

    def close(self) -> None:
        for pending in self._pending.values():
            pending.on_reply(None, [])
        self._pending.clear()
        self.sock.close()
