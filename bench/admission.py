"""A burst beyond a node's limits: what is refused is counted with its reason, nothing accepted is lost.

The burst node admits `max_sessions` sessions, lets `max_waiting` more wait, and queues
at most `queue_budget` bytes of step payloads. Every client opens at once with a long
wait; refused opens are tallied by error code, `busy` steps are retried after the
node's `retry_after_ms`. Every accepted session must then produce all its tokens: any
other failure propagates and fails the bench.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import trio

from bench.latency import Trace
from bench.node_driver import OpenRefused, generate
from bench.workload import Request
from neuron_tai.client import open_client

STATS_KEPT = (
    "admissions_total",
    "admissions_rejected_total",
    "errors_total",
    "sessions_active",
    "sessions_waiting",
    "queue_bytes",
    "queue_budget_bytes",
    "sessions_max",
)


async def burst(address: str, requests: Sequence[Request]) -> dict[str, Any]:
    refused: Counter[str] = Counter()
    busy: list[int] = []
    done: list[Trace] = []
    async with open_client(address, timeout_s=300) as client:
        before = await client.stats()

        async def one(req: Request) -> None:
            try:
                done.append(await generate(client, req, f"burst-{req.rid}", busy=busy))
            except OpenRefused as exc:
                refused[str(exc.code)] += 1

        async with trio.open_nursery() as nursery:
            for req in requests:
                nursery.start_soon(one, req)
        after = await client.stats()
    wanted = {r.rid: r.max_new for r in requests}
    return {
        "clients": len(requests),
        "accepted": len(done),
        "refused": dict(refused),
        "busy_retries": len(busy),
        "busy_retry_after_ms_max": max(busy, default=0),
        "tokens_expected": sum(wanted[t.rid] for t in done),
        "tokens_received": sum(len(t.tokens) for t in done),
        "incomplete_sessions": [t.rid for t in done if len(t.tokens) != wanted[t.rid]],
        "stats_before": {k: before.get(k) for k in STATS_KEPT},
        "stats_after": {k: after.get(k) for k in STATS_KEPT},
    }
