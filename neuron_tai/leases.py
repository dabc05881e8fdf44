"""Leases (PROTOCOL.md "Leases"): a connection silent for longer than its lease loses its sessions.

Any message renews the lease of its sender, a broken one too; a connection with a request
in progress is renewed when that request ends, so a long generate never expires its own
session. The task here owns when each connection was last heard from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

log = logging.getLogger("neuron_tai.node")


class Leases:
    def __init__(
        self,
        lease_s: float,
        *,
        busy: Callable[[bytes], bool],
        holds_sessions: Callable[[bytes], int],  # how many sessions the peer holds
        expire: Callable[[bytes], None],
        forget: Callable[[bytes], None],
    ) -> None:
        self.lease_s = lease_s
        self.busy = busy  # the peer has a request in progress
        self.holds_sessions = holds_sessions
        self.expire = expire  # free the peer's sessions
        self.forget = forget  # forget what the socket pump keeps of the peer
        self.last_heard: dict[bytes, float] = {}
        self.expired = 0

    @property
    def lease_ms(self) -> int:
        return round(self.lease_s * 1000)

    def renew(self, peer: bytes) -> None:
        self.last_heard[peer] = trio.current_time()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Free the sessions of every connection silent for longer than the lease."""
        task_status.started()
        while True:
            now = trio.current_time()
            for peer in self._silent(now):
                del self.last_heard[peer]
                self.forget(peer)
                if self.holds_sessions(peer):
                    self.expired += 1
                    log.info("peer %s was silent for over %.1fs: freeing its sessions", peer.hex(), self.lease_s)
                    self.expire(peer)
            idle = [heard for peer, heard in self.last_heard.items() if not self.busy(peer)]
            oldest = min(idle, default=now)  # a peer with work in progress is renewed when it ends
            await trio.sleep_until(max(oldest + self.lease_s, now) + 0.01)

    def _silent(self, now: float) -> list[bytes]:
        return [p for p, heard in self.last_heard.items() if now - heard > self.lease_s and not self.busy(p)]
