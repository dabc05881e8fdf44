"""`neuron-tai stats`: a node's stats map as a person reads it (the map itself is `--json`).

Every line reads keys that may be missing (a node of another version, a stage without a
next one), so the summary never fails on what it does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MiB = 2**20


def mib(n: object) -> str:
    return f"{float(n) / MiB:.1f} MiB" if isinstance(n, int | float) else "?"


def counts(table: object) -> str:
    """`{"busy": 2, "kv_budget": 0}` as "busy 2"; "none" when nothing was counted."""
    if not isinstance(table, Mapping):
        return "none"
    shown = [f"{name} {n}" for name, n in table.items() if n]
    return ", ".join(shown) or "none"


def summary(address: str, stats: Mapping[str, Any]) -> list[str]:
    """The lines `neuron-tai stats` prints."""
    rows = [
        ("node", f"{address}, up {stats.get('uptime_s', '?')} s{', draining' if stats.get('draining') else ''}"),
        ("model", _model(stats)),
        ("next stage", _next_stage(stats)),
        ("sessions", _sessions(stats)),
        ("KV cells", _kv(stats)),
        ("queue", _queue(stats)),
        ("throughput", _throughput(stats)),
        ("errors", _errors(stats)),
        ("memory", _memory(stats)),
        ("links", _links(stats)),
    ]
    width = max(len(name) for name, _ in rows)
    return [f"{name.ljust(width)}  {text}" for name, text in rows]


def _model(stats: Mapping[str, Any]) -> str:
    reported = stats.get("stage")
    stage: Mapping[str, Any] = reported if isinstance(reported, Mapping) else {}
    name, layers = stats.get("model", stage.get("model")), stats.get("layers", stage.get("layers"))
    if name is None:
        return "not reported (a node started without the neuron-tai command)"
    if isinstance(layers, list | tuple) and len(layers) == 2:
        total = stats.get("model_layers")
        return f"{name}, layers {layers[0]}-{layers[1] - 1}" + (f" of {total}" if total else "")
    return str(name)


def _next_stage(stats: Mapping[str, Any]) -> str:
    down = stats.get("downstream")
    if not isinstance(down, Mapping):
        return "none (this node ends the chain)"
    where = f" at {down['address']}" if "address" in down else ""
    state = "connected" if down.get("connected") else "NOT CONNECTED"
    replicas = down.get("replicas")
    if isinstance(replicas, list) and len(replicas) > 1:
        up = sum(1 for r in replicas if isinstance(r, Mapping) and r.get("state") == "up")
        state += f" ({up} of {len(replicas)} replicas up)"
    recovered = f"; {stats['recoveries_total']} sessions recovered" if stats.get("recoveries_total") else ""
    return (
        f"{state}{where}; {down.get('sessions', 0)} sessions there, {down.get('disconnects_total', 0)} disconnects, "
        f"{down.get('failures_total', 0)} failed requests, {down.get('malformed_total', 0)} malformed replies"
        f"{recovered}"
    )


def _sessions(stats: Mapping[str, Any]) -> str:
    return (
        f"{stats.get('sessions_active', '?')} of {stats.get('sessions_max', '?')} active, "
        f"{stats.get('sessions_waiting', 0)} waiting; {stats.get('admissions_total', 0)} admitted; "
        f"generations running {stats.get('generations_active', 0)}; lease {stats.get('lease_ms', '?')} ms"
    )


def _kv(stats: Mapping[str, Any]) -> str:
    pressure = stats.get("kv_pressure")
    share = f" ({pressure:.0%} reserved)" if isinstance(pressure, int | float) else ""
    return (
        f"{stats.get('kv_cells_used', '?')} used, {stats.get('kv_cells_reserved', '?')} reserved, "
        f"{stats.get('kv_cells_held', 0)} held of {stats.get('kv_cells_total', '?')}{share}; "
        f"{stats.get('kv_compactions_total', 0)} compactions"
    )


def _queue(stats: Mapping[str, Any]) -> str:
    return (
        f"{stats.get('queue_depth', '?')} requests, {mib(stats.get('queue_bytes'))} of "
        f"{mib(stats.get('queue_budget_bytes'))}; {stats.get('handlers_active', 0)} requests in progress"
    )


def _throughput(stats: Mapping[str, Any]) -> str:
    occupancy = stats.get("batch_occupancy")
    full = f", {occupancy:.0%} full" if isinstance(occupancy, int | float) else ""
    return (
        f"prefill {stats.get('prefill_tokens_per_s', '?')} tok/s, decode {stats.get('decode_tokens_per_s', '?')} "
        f"tok/s (recent); {stats.get('generated_tokens_total', 0)} tokens generated; "
        f"{stats.get('batches_total', 0)} batches{full}"
    )


def _errors(stats: Mapping[str, Any]) -> str:
    parts = [f"replies {counts(stats.get('errors_total'))}"]
    parts.append(f"opens refused {counts(stats.get('admissions_rejected_total'))}")
    for key, what in (
        ("messages_failed_total", "failed messages"),
        ("handlers_refused_total", "requests refused for room"),
        ("leases_expired_total", "leases expired"),
        ("peers_gone_total", "connections gone"),
        ("auth_failures_total", "refused keys"),
    ):
        if stats.get(key):
            parts.append(f"{what} {stats[key]}")
    return "; ".join(parts)


def _memory(stats: Mapping[str, Any]) -> str:
    return (
        f"weights {mib(stats.get('weights_bytes'))}, KV {mib(stats.get('kv_budget_bytes'))}, "
        f"compute {mib(stats.get('compute_bytes', stats.get('scratch_bytes')))}, "
        f"output buffer {mib(stats.get('output_buffer_bytes'))}; resident {mib(stats.get('rss_bytes'))} "
        f"(private {mib(stats.get('rss_anon_bytes'))}, mapped files {mib(stats.get('rss_file_bytes'))}; "
        f"peak {mib(stats.get('rss_peak_bytes'))}); replies queued {mib(stats.get('reply_bytes'))} "
        f"(peak {mib(stats.get('reply_bytes_peak'))}), requests held {mib(stats.get('request_bytes'))} "
        f"(peak {mib(stats.get('request_bytes_peak'))})"
    )


def _links(stats: Mapping[str, Any]) -> str:
    if not stats.get("curve"):
        return "plain (no CURVE): anyone who reaches the port may use the node"
    return f"CURVE, {stats.get('curve_allowed_keys', '?')} keys allowed"
