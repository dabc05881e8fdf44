"""Sample nodes' `stats` during a sweep, labelled with what the bench was doing then."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import trio

from neuron_tai.client import NodeError, open_client

KEPT = (
    "sessions_active",
    "sessions_waiting",
    "queue_depth",
    "queue_bytes",
    "decode_batches_total",
    "decode_rows_total",
    "kv_cells_used",
    "kv_pressure",
    "decode_tokens_per_s",
    "prefill_tokens_per_s",
)


@dataclass(slots=True)
class StatsSampler:
    """Polls every node every `period_s`; `phase` is set by the bench as it moves on."""

    addresses: dict[str, str]
    period_s: float = 0.25
    phase: str = "idle"
    samples: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for name, address in self.addresses.items():
                await nursery.start(self._poll, name, address)
            task_status.started()

    async def _poll(self, name: str, address: str, *, task_status: trio.TaskStatus[None]) -> None:
        async with open_client(address, timeout_s=10) as client:
            task_status.started()
            while True:
                try:
                    stats = await client.stats()
                except (NodeError, TimeoutError):
                    stats = None
                if stats is not None:
                    row = {k: stats.get(k) for k in KEPT}
                    self.samples.append(
                        {"t": round(time.perf_counter() - self.t0, 3), "node": name, "phase": self.phase, **row}
                    )
                await trio.sleep(self.period_s)
