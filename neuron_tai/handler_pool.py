"""Requests in progress: one task each, capped per connection and in total, in number and bytes.

An open, a step, a generate, a tokenize or a detokenize waits (on the engine, the next
stage or the tokenizer) as a task of its own in the node's nursery. Beyond a cap it is
answered `busy` at once instead, so one connection cannot hold up the others and ping
and stats are never queued. What a request holds (its payload and, on a chain's head,
the hidden states it sends on) counts until it ends; one request is always taken when
nothing is held, so none is refused for its size alone.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from protocol.errors import ErrorCode, Fault

log = logging.getLogger("neuron_tai.node")


@dataclass(frozen=True, slots=True)
class PoolLimits:
    max_handlers: int
    max_handlers_per_peer: int
    max_request_bytes: int
    max_peer_request_bytes: int


@dataclass(slots=True)
class Held:
    """The bytes one request in progress holds: counted in the pool's totals until it ends."""

    size: int = 0


Work = Callable[[], Awaitable[None]]
Refuse = Callable[[bytes, int, Fault, str | None], None]  # peer, rid, why, the request's session


class HandlerPool:
    """Owns the counts of requests in progress; `spawn` is the only way a request becomes a task."""

    def __init__(self, limits: PoolLimits, on_refused: Refuse) -> None:
        self.limits = limits
        self.on_refused = on_refused  # answers the request refused for room
        self.on_ended: Callable[[bytes], None] = lambda _peer: None  # a peer's request ended (lease)
        self.active = 0
        self.by_peer: Counter[bytes] = Counter()
        self.refused = 0
        self.bytes = 0
        self.bytes_peak = 0
        self.bytes_by_peer: Counter[bytes] = Counter()
        self.bytes_refused = 0
        self.idle = trio.Event()
        self.idle.set()
        self._nursery: trio.Nursery | None = None
        self.stopping = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every request's task lives in this nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()
        self._nursery = None

    def stop_all(self) -> None:
        """The node stops and the drain is over: every request still in progress is cancelled,
        and answered `shutting_down` (its replies go out before the node's socket closes)."""
        if self._nursery is not None:
            self.stopping = True
            self._nursery.cancel_scope.cancel()

    def spawn(
        self,
        peer: bytes,
        rid: int,
        work: Work,
        *,
        held: Held | None = None,
        on_exit: Callable[[], None] | None = None,
        session: str | None = None,
    ) -> bool:
        """Run `work()` as a task that holds `held` bytes, or refuse it `busy` (False). `session`
        goes into the refusals of a request whose replies all carry it (`generate`)."""
        held = held or Held()
        if self._nursery is None or self.stopping:
            self.on_refused(peer, rid, Fault(ErrorCode.SHUTTING_DOWN, "the node is stopping"), session)
            return False
        why = self._no_room_for(peer, held.size)
        if why is not None:
            self.on_refused(peer, rid, Fault(ErrorCode.BUSY, why), session)
            return False
        self.active += 1
        self.by_peer[peer] += 1
        self._take(peer, held.size)
        self.idle = trio.Event() if self.active == 1 else self.idle
        self._nursery.start_soon(self._run, peer, rid, session, work, held, on_exit)
        return True

    def release(self, peer: bytes, held: Held, size: int) -> None:
        """`held` now holds `size` bytes (fewer than before): let the rest go."""
        freed, held.size = held.size - size, size
        if freed:
            self.bytes -= freed
            self.bytes_by_peer[peer] -= freed
            if not self.bytes_by_peer[peer]:
                del self.bytes_by_peer[peer]

    def busy_with(self, peer: bytes) -> bool:
        return self.by_peer[peer] > 0

    def _no_room_for(self, peer: bytes, size: int) -> str | None:
        limits = self.limits
        if self.active >= limits.max_handlers or self.by_peer[peer] >= limits.max_handlers_per_peer:
            self.refused += 1
            return "the node has too many requests in progress"
        held = self.bytes_by_peer[peer]
        why = None
        if held and held + size > limits.max_peer_request_bytes:
            why = "this connection's requests in progress hold too many bytes"
        elif self.bytes and self.bytes + size > limits.max_request_bytes:
            why = "the node's requests in progress hold too many bytes"
        if why is not None:
            self.bytes_refused += 1
        return why

    def _take(self, peer: bytes, size: int) -> None:
        if size:
            self.bytes += size
            self.bytes_peak = max(self.bytes_peak, self.bytes)
            self.bytes_by_peer[peer] += size

    async def _run(
        self, peer: bytes, rid: int, session: str | None, work: Work, held: Held, on_exit: Callable[[], None] | None
    ) -> None:
        try:
            await work()
        except trio.Cancelled:
            if self.stopping:
                why = Fault(ErrorCode.SHUTTING_DOWN, "the node stopped before this request was done")
                self.on_refused(peer, rid, why, session)
            raise
        except Exception as exc:  # a bug must cost one request, never the node
            log.exception("request %d failed", rid)
            self.on_refused(peer, rid, Fault(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"), session)
        finally:
            if on_exit is not None:
                on_exit()
            self.active -= 1
            self.by_peer[peer] -= 1
            if not self.by_peer[peer]:
                del self.by_peer[peer]
            self.release(peer, held, 0)
            self.on_ended(peer)
            if not self.active:
                self.idle.set()

    def stats(self) -> dict[str, Any]:
        limits = self.limits
        return {
            "handlers_active": self.active,
            "handlers_refused_total": self.refused,
            "request_bytes": self.bytes,
            "request_bytes_peak": self.bytes_peak,
            "max_request_bytes": limits.max_request_bytes,
            "peer_request_bytes": max(self.bytes_by_peer.values(), default=0),
            "max_peer_request_bytes": limits.max_peer_request_bytes,
            "request_bytes_refused_total": self.bytes_refused,
        }
