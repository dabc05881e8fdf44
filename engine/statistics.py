"""The engine's statistics as frozen values (Trio's `statistics()` is the model), and the one
edge function that flattens them to the wire's and Prometheus's `stats` dict.

The values are raw; `wire_stats` rounds, names and nests them as PROTOCOL.md's `stats` reply
has them, so that dict is written in one place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from engine.process_cpu import preemptions
from engine.process_memory import ResidentMemory
from engine.scheduler import Scheduler
from engine.telemetry import Histogram, Telemetry

if TYPE_CHECKING:
    from engine.backend import StageBackend

QUOTAS = ("sessions", "waiting", "queued")


def frozen(counts: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy: a statistics value must not change under its reader."""
    return MappingProxyType(dict(counts))


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    active: int
    max: int
    waiting: int
    admissions_total: int
    admissions_rejected_total: Mapping[str, int]  # by error code
    late_total: int  # answered sessions whose next step missed the next batch


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    depth: int  # steps accepted and not yet answered
    bytes: int
    budget_bytes: int
    inbox_size: int
    cleanups_total: int
    cleanups_pending: int


@dataclass(frozen=True, slots=True)
class StepTimes:
    """A cumulative-bucket histogram of llama_decode call times, in the Prometheus layout."""

    buckets: Mapping[str, int]
    sum: float
    count: int

    @classmethod
    def of(cls, histogram: Histogram) -> StepTimes:
        buckets, running = {}, 0
        for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts, strict=True):
            running += count
            buckets["+Inf" if bound == float("inf") else str(bound)] = running
        return cls(frozen(buckets), histogram.total, histogram.n)


@dataclass(frozen=True, slots=True)
class BatchStatistics:
    batches_total: int
    rows_last: int
    decode_batches_total: int
    decode_rows_total: int
    occupancy: float  # mean rows per batch over n_batch
    prefill_tokens_total: int
    decode_tokens_total: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    step_seconds: StepTimes
    llama_decode_seconds_total: float  # inside llama_decode alone (a step also samples and hands off)
    preemptions_total: int  # the process's involuntary context switches (engine/process_cpu.py)
    linger_seconds_total: float
    no_kv_slot_total: int
    halved_total: int
    padding_rows_total: int
    kernel_path: str
    pad_rows: int
    micro_batches: int


@dataclass(frozen=True, slots=True)
class KvStatistics:
    cells_used: int
    cells_reserved: int
    cells_held: int
    cells_total: int
    compactions_total: int
    compactions_failed_total: int
    compaction_seconds_total: float
    cells_reclaimed_total: int
    cells_moved_total: int
    sessions_lost_total: int

    @property
    def pressure(self) -> float:
        """Reserved and held cells over the cells sessions may reserve."""
        return (self.cells_reserved + self.cells_held) / self.cells_total


@dataclass(frozen=True, slots=True)
class MemoryStatistics:
    """What the stage reserved, part by part, and what the process actually holds."""

    weights_bytes: int
    kv_budget_bytes: int
    scratch_bytes: int  # compute_bytes + output_buffer_bytes
    compute_bytes: int  # llama.cpp's compute buffer, as reserved for the worst-case graph
    output_buffer_bytes: int  # the logits buffer llama.cpp grows to
    weight_buffers: Mapping[str, int]  # llama.cpp buffer name -> bytes
    resident: ResidentMemory  # the process: VmRSS, VmHWM, private and file-backed


@dataclass(frozen=True, slots=True)
class QuotaStatistics:
    """Per-connection quotas and how often each refused."""

    sessions: int
    waiting: int
    queued: int
    refused: Mapping[str, int]  # by quota: sessions, waiting, queued


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    sessions: SessionStatistics
    queue: QueueStatistics
    batches: BatchStatistics
    kv: KvStatistics
    memory: MemoryStatistics
    quotas: QuotaStatistics
    errors_total: Mapping[str, int]  # by error code
    draining: bool


def session_statistics(scheduler: Scheduler[Any, Any], telemetry: Telemetry) -> SessionStatistics:
    return SessionStatistics(
        active=len(scheduler.sessions),
        max=scheduler.config.max_sessions,
        waiting=len(scheduler.waiting),
        admissions_total=telemetry.admissions_total,
        admissions_rejected_total=frozen(telemetry.rejected),
        late_total=telemetry.late_sessions_total,
    )


def kv_statistics(scheduler: Scheduler[Any, Any], telemetry: Telemetry, cells_used: int) -> KvStatistics:
    t = telemetry
    return KvStatistics(
        cells_used=cells_used,
        cells_reserved=scheduler.kv_reserved,
        cells_held=scheduler.kv_held,
        cells_total=scheduler.config.kv_cells,
        compactions_total=t.kv_compactions_total,
        compactions_failed_total=t.kv_compactions_failed_total,
        compaction_seconds_total=t.kv_compaction_seconds_total,
        cells_reclaimed_total=t.kv_cells_reclaimed_total,
        cells_moved_total=t.kv_cells_moved_total,
        sessions_lost_total=t.kv_sessions_lost_total,
    )


def quota_statistics(scheduler: Scheduler[Any, Any], telemetry: Telemetry, queued: int) -> QuotaStatistics:
    refused = scheduler.quota_refused + telemetry.quota_refused
    return QuotaStatistics(
        sessions=scheduler.config.sessions_per_owner,
        waiting=scheduler.config.waiting_per_owner,
        queued=queued,
        refused=frozen({q: refused[q] for q in QUOTAS}),
    )


def wire_stats(s: EngineStatistics) -> dict[str, Any]:
    """The engine's part of the `stats` reply (PROTOCOL.md) and of the Prometheus metrics."""
    return {
        **_sessions_and_queue(s),
        **_kv(s.kv),
        **_throughput_and_memory(s),
        "step_seconds": {
            "buckets": dict(s.batches.step_seconds.buckets),
            "sum": round(s.batches.step_seconds.sum, 6),
            "count": s.batches.step_seconds.count,
        },
        "errors_total": dict(s.errors_total),
        "llama_decode_seconds_total": round(s.batches.llama_decode_seconds_total, 4),
        "preemptions_total": s.batches.preemptions_total,
        "linger_seconds_total": round(s.batches.linger_seconds_total, 4),
        "late_sessions_total": s.sessions.late_total,
        "decode_no_kv_slot_total": s.batches.no_kv_slot_total,
        "decode_halved_total": s.batches.halved_total,
        "padding_rows_total": s.batches.padding_rows_total,
        "cleanups_total": s.queue.cleanups_total,
        "cleanups_pending": s.queue.cleanups_pending,
        "inbox_size": s.queue.inbox_size,
        "max_sessions_per_peer": s.quotas.sessions,
        "max_waiting_per_peer": s.quotas.waiting,
        "max_queued_per_peer": s.quotas.queued,
        "peer_quota_refused_total": dict(s.quotas.refused),
        "draining": s.draining,
    }


def _sessions_and_queue(s: EngineStatistics) -> dict[str, Any]:
    b = s.batches
    return {
        "sessions_active": s.sessions.active,
        "sessions_max": s.sessions.max,
        "sessions_waiting": s.sessions.waiting,
        "admissions_total": s.sessions.admissions_total,
        "admissions_rejected_total": dict(s.sessions.admissions_rejected_total),
        "queue_depth": s.queue.depth,
        "queue_bytes": s.queue.bytes,
        "queue_budget_bytes": s.queue.budget_bytes,
        "batches_total": b.batches_total,
        "batch_rows_last": b.rows_last,
        "decode_batches_total": b.decode_batches_total,
        "decode_rows_total": b.decode_rows_total,
        "batch_occupancy": round(b.occupancy, 6),
    }


def _kv(kv: KvStatistics) -> dict[str, Any]:
    return {
        "kv_cells_used": kv.cells_used,
        "kv_cells_reserved": kv.cells_reserved,
        "kv_cells_held": kv.cells_held,
        "kv_compactions_total": kv.compactions_total,
        "kv_compactions_failed_total": kv.compactions_failed_total,
        "kv_compaction_seconds_total": round(kv.compaction_seconds_total, 6),
        "kv_cells_reclaimed_total": kv.cells_reclaimed_total,
        "kv_cells_moved_total": kv.cells_moved_total,
        "kv_sessions_lost_total": kv.sessions_lost_total,
        "kv_cells_total": kv.cells_total,
        "kv_pressure": round(kv.pressure, 6),
    }


def _throughput_and_memory(s: EngineStatistics) -> dict[str, Any]:
    b, m = s.batches, s.memory
    return {
        "prefill_tokens_total": b.prefill_tokens_total,
        "decode_tokens_total": b.decode_tokens_total,
        "prefill_tokens_per_s": round(b.prefill_tokens_per_s, 3),
        "decode_tokens_per_s": round(b.decode_tokens_per_s, 3),
        "weights_bytes": m.weights_bytes,
        "kv_budget_bytes": m.kv_budget_bytes,
        "scratch_bytes": m.scratch_bytes,
        "compute_bytes": m.compute_bytes,
        "output_buffer_bytes": m.output_buffer_bytes,
        "rss_bytes": m.resident.rss,
        "rss_peak_bytes": m.resident.peak,
        "rss_anon_bytes": m.resident.anon,
        "rss_file_bytes": m.resident.file,
        "kernel_path": b.kernel_path,
        "pad_rows": b.pad_rows,
        "micro_batches": b.micro_batches,
        "weight_buffers": dict(m.weight_buffers),
    }


def batch_statistics(
    telemetry: Telemetry, backend: StageBackend, n_batch: int, pad_rows: int, micro_batches: int
) -> BatchStatistics:
    """The batch loop's counters, and what the backend knows of its calls (time inside them, kernels)."""
    t, now = telemetry, time.monotonic()
    return BatchStatistics(
        batches_total=t.batches_total,
        rows_last=t.batch_rows_last,
        decode_batches_total=t.decode_batches_total,
        decode_rows_total=t.decode_rows_sum,
        occupancy=t.occupancy(n_batch),
        prefill_tokens_total=t.prefill_tokens_total,
        decode_tokens_total=t.decode_tokens_total,
        prefill_tokens_per_s=t.prefill_window.rate(now),
        decode_tokens_per_s=t.decode_window.rate(now),
        step_seconds=StepTimes.of(t.step_seconds),
        llama_decode_seconds_total=backend.decode_seconds,
        preemptions_total=preemptions(),
        linger_seconds_total=t.linger_seconds_total,
        no_kv_slot_total=t.no_kv_slot_total,
        halved_total=t.halved_total,
        padding_rows_total=t.padding_rows_total,
        kernel_path=backend.model.kernel_path.value,
        pad_rows=pad_rows,
        micro_batches=micro_batches,
    )
