"""Which replica of the next layer range a session goes to: pure bookkeeping, no Trio, no sockets.

A stage may have several next-stage replicas serving the same layers. Each new session
is placed on the least-loaded replica that can take it (connected, not in backoff, of
the same model and layers) and stays there. A replica that fails a request is marked
down for a backoff that doubles with each failure in a row (from `base_backoff_s` up to
`max_backoff_s`); a success resets it. While another replica is up, one in backoff gets
no new session; when every connected replica is in backoff, the one whose backoff ends
first is tried all the same (with a single next stage, backoff never refuses a request
that the stage could still answer). A replica found to serve other layers or another
model is never used.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class ReplicaState(enum.StrEnum):
    UP = "up"  # connected and not in backoff: takes sessions
    DOWN = "down"  # not connected, or failed recently: takes none until its backoff has passed
    MISMATCH = "mismatch"  # serves other layers or another model: never used


@dataclass(slots=True)
class ReplicaRecord:
    sessions: int = 0
    placed: int = 0  # sessions placed here, in total: how evenly load was spread
    failures: int = 0  # in total
    failed_in_a_row: int = 0
    down_until: float = 0.0
    mismatch: bool = False


class ReplicaBook:
    def __init__(self, count: int, *, base_backoff_s: float = 0.5, max_backoff_s: float = 15.0) -> None:
        if count < 1:
            raise ValueError("a replica set needs at least one replica")
        self.records = [ReplicaRecord() for _ in range(count)]
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s

    def state(self, index: int, now: float, connected: bool) -> ReplicaState:
        record = self.records[index]
        if record.mismatch:
            return ReplicaState.MISMATCH
        return ReplicaState.UP if connected and now >= record.down_until else ReplicaState.DOWN

    def choose(self, now: float, connected: Sequence[bool], exclude: frozenset[int] = frozenset()) -> int | None:
        """The least-loaded replica that is up (fewest failures, then lowest index, break ties);
        else the connected one whose backoff ends first; None: no replica is connected."""
        candidates = [i for i in range(len(self.records)) if i not in exclude and not self.records[i].mismatch]
        up = [i for i in candidates if self.state(i, now, connected[i]) is ReplicaState.UP]
        if up:
            return min(up, key=lambda i: (self.records[i].sessions, self.records[i].failures, i))
        waiting = [i for i in candidates if connected[i]]
        return min(waiting, key=lambda i: (self.records[i].down_until, i), default=None)

    def place(self, index: int) -> None:
        self.records[index].sessions += 1
        self.records[index].placed += 1

    def release(self, index: int) -> None:
        record = self.records[index]
        record.sessions = max(0, record.sessions - 1)

    def failed(self, index: int, now: float) -> float:
        """Mark the replica down; returns how long it stays down."""
        record = self.records[index]
        record.failures += 1
        record.failed_in_a_row += 1
        backoff = min(self.max_backoff_s, self.base_backoff_s * 2 ** (record.failed_in_a_row - 1))
        record.down_until = max(record.down_until, now + backoff)
        return record.down_until - now

    def succeeded(self, index: int) -> None:
        self.records[index].failed_in_a_row = 0

    def mismatched(self, index: int) -> None:
        self.records[index].mismatch = True

    def matched(self, index: int) -> None:
        """The replica (re)connected and serves what the others do: a fresh start, no backoff."""
        record = self.records[index]
        record.mismatch, record.failed_in_a_row, record.down_until = False, 0, 0.0
