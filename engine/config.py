"""What an engine is built from: the model, its budgets and the scheduler's knobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.backend import ContextConfig
from engine.budgets import Limits


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: Path
    max_sessions: int = 8
    kv_cells: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 2
    kv_type: str = "f16"
    flash_attn: bool | None = None
    kernels: str = "auto"  # weight kernel path (engine/kernels.py): never AMX unless asked for
    swa_full: bool = False
    max_prefill_tokens: int = 256
    max_step_tokens: int = 512
    queue_budget_bytes: int = 64 * 2**20
    inbox_size: int = 256
    max_waiting_opens: int = 64
    max_wait_ms: int = 60_000  # an open's wait_ms is capped to this
    max_overtakes: int = 4  # opens admitted ahead of a waiting one before it holds admission
    batch_invariant: bool = False
    pad_rows: int | None = None  # batch-invariant padding; None: what the kernel path needs (engine/kernels.py)
    idle_timeout_s: float | None = None
    drain_timeout_s: float = 10.0
    limits: Limits = field(default_factory=Limits)
    record_iterations: bool = False
    # After answering a step, wait this long (at most 10% of the recent step time) for that
    # session's next step, so sessions stay in phase and share batches instead of drifting apart.
    linger_ms: float = 6.0
    # While sessions decode, an iteration's prefill rows may add about this many decode steps'
    # time (sized from measured step times; engine/pacing.py), so decode latency stays bounded.
    prefill_share: float = 1.0
    # Session groups run in calls of their own, each answered as soon as it is computed: at a
    # chain's head, one group's hidden states travel on (and compute downstream) while the next
    # group computes here. 1 runs every session in one call (nothing to overlap on a single node);
    # None: 1, or 2 when a node has a next stage (the node decides).
    micro_batches: int | None = None
    # Per connection (the owner of a request): open sessions, waiting opens, and opens and steps
    # in the inbox at once. None: sessions and waiting opens as the node's own limits (a chain's
    # head sends all its sessions over one connection); queued requests, half the inbox but at
    # least max_sessions (a head sends one request per session at a time: they always fit).
    max_sessions_per_peer: int | None = None
    max_waiting_per_peer: int | None = None
    max_queued_per_peer: int | None = None
    # Batch-invariant mode: once closed sessions hold this share of the KV cells, they are freed
    # by a compaction even when no open waits for them (held cells lengthen every attention
    # walk). None: only when an open needs them.
    compact_at: float | None = 0.5

    def queued_per_peer(self) -> int:
        """Requests one connection may have in the inbox at once."""
        if self.max_queued_per_peer is not None:
            return self.max_queued_per_peer
        return min(self.inbox_size, max(self.inbox_size // 2, self.max_sessions))

    def context(self) -> ContextConfig:
        return ContextConfig(
            n_seq_max=self.max_sessions + (2 if self.batch_invariant else 0),  # + padding, graveyard
            n_ctx=self.kv_cells,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_threads=self.n_threads,
            swa_full=self.swa_full,
            kv_type=self.kv_type,
            flash_attn=self.flash_attn,
            kernels=self.kernels,
        )
