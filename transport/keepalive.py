"""Renewing a node's lease: a `ping` whenever a connection that holds sessions has been quiet.

A node frees the sessions of a connection it has heard nothing from for `lease_ms`
(PROTOCOL.md, "Leases"). Any request renews the lease, so the keeper only pings when
nothing else was sent for a quarter of the lease (inside the contract's `lease_ms / 3`),
and never while the connection holds no session. This project's nodes tell the lease in
each `opened` reply (`lease_ms`, an extension key); for a node whose `opened` does not,
the keeper asks its `stats` once, where the contract puts it. A node that tells none
there either does not expire sessions, and gets no pings.
"""

from __future__ import annotations

import trio

from transport.requester import Abandoned, ClientClosed, OutboxFull, Requester
from transport.wire import Ping, Stats

STATS_WAIT_S = 10.0  # for the `stats` that tells the lease of a node whose `opened` did not


class LeaseKeeper:
    """The sessions one connection holds, and the task that keeps them alive."""

    def __init__(self, core: Requester) -> None:
        self.core = core
        self.sessions: set[str] = set()
        self.lease_ms: int | None = None
        self.pings = 0
        self._changed = trio.Event()
        self._ask_stats = False  # an `opened` told no lease, and `stats` has not been asked yet
        self._asked_stats = False  # it was (a node whose `stats` tells none has no lease)

    def opened(self, session: str, lease_ms: object) -> None:
        """A session is open there; `lease_ms` is what its `opened` reply said (None: not said)."""
        self.sessions.add(session)
        if not self._learn(lease_ms) and self.lease_ms is None and not self._asked_stats:
            self._ask_stats = True
        self._changed.set()

    def _learn(self, lease_ms: object) -> bool:
        """Take a lease the node told; whether it told one."""
        if not (isinstance(lease_ms, int) and not isinstance(lease_ms, bool) and lease_ms > 0):
            return False
        self.lease_ms = lease_ms if self.lease_ms is None else min(self.lease_ms, lease_ms)
        return True

    def closed(self, session: str) -> None:
        self.sessions.discard(session)

    @property
    def interval_s(self) -> float | None:
        return None if self.lease_ms is None else self.lease_ms / 4000

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ping while sessions are held and the connection is quiet; ends when the requester closes."""
        task_status.started()
        while True:
            if self.sessions and self._ask_stats:
                if not await self._lease_from_stats():
                    return
                continue
            interval = self.interval_s
            if not self.sessions or interval is None:
                self._changed = trio.Event()
                await self._changed.wait()
                continue
            due = self.core.last_sent + interval
            if trio.current_time() < due:
                await trio.sleep_until(due)
                continue
            try:
                await self.core.request(Ping(0), interval)
                self.pings += 1
            except (TimeoutError, OutboxFull, Abandoned):
                continue  # the send itself renewed `last_sent`: the next one is due a quarter lease on
            except ClientClosed:
                return

    async def _lease_from_stats(self) -> bool:
        """Ask the node's `stats` for its `lease_ms` (asked again a second later if it does not
        answer); False when the requester closed."""
        try:
            header, _ = await self.core.request(Stats(0), STATS_WAIT_S)
        except (TimeoutError, OutboxFull, Abandoned):
            await trio.sleep(1.0)
            return True
        except ClientClosed:
            return False
        self._ask_stats, self._asked_stats = False, True
        stats = header.get("stats")
        self._learn(stats.get("lease_ms") if isinstance(stats, dict) else None)
        return True
