"""Prometheus text endpoint with the telemetry names of `stats`.

Plain HTTP, unauthenticated: it binds to 127.0.0.1 unless told otherwise. The HTTP
server runs in prometheus_client's own thread; it reads a snapshot that the node
refreshes once a second, never the engine's live state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

PREFIX = "neuron_tai_"
COUNTERS = ("auth_failures_total", "admissions_total", "batches_total", "prefill_tokens_total", "decode_tokens_total")
LABELLED = {"admissions_rejected_total": "reason", "errors_total": "code", "peer_quota_refused_total": "quota"}


class SnapshotCollector(Collector):
    def __init__(self, prefix: str = PREFIX) -> None:
        self.snapshot: dict[str, Any] = {}
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        snap, prefix = self.snapshot, self.prefix
        for name, value in snap.items():
            if name in LABELLED:
                family = CounterMetricFamily(prefix + name.removesuffix("_total"), name, labels=[LABELLED[name]])
                for label, count in value.items():
                    family.add_metric([label], count)
                yield family
            elif name == "step_seconds":
                buckets = [(b, v) for b, v in value["buckets"].items()]
                yield HistogramMetricFamily(
                    prefix + name, "llama_decode call time", buckets=buckets, sum_value=value["sum"]
                )
            elif name in COUNTERS:
                yield CounterMetricFamily(prefix + name.removesuffix("_total"), name, value=value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(prefix + name, name, value=value)


async def serve_metrics(
    node: Any, port: int, bind: str = "127.0.0.1", *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    from prometheus_client import start_http_server  # noqa: PLC0415

    collector = SnapshotCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    collector.snapshot = node.stats()
    server, thread = start_http_server(port, addr=bind, registry=registry)
    task_status.started()
    try:
        while True:
            collector.snapshot = node.stats()
            await trio.sleep(1.0)
    finally:
        server.shutdown()
        thread.join(timeout=2)
