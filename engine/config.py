"""What an engine is built from: the model, its budgets and the scheduler's knobs.

Each field a node's operator may set carries its command-line help in `metadata`
(neuron_tai/cli_options.py reads it): the default and type here are the only copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine.budgets import Limits

if TYPE_CHECKING:  # engine.backend loads llama.cpp: `neuron-tai` builds its parser from this class without it
    from engine.backend import ContextConfig
    from engine.gguf_facts import ModelFacts

_BUDGET = "refuse to start if the {} take more bytes than this"

# A chain's last stage computes prompts in micro-batches of 64 rows, not llama-server's 512: its
# compute buffer is sized for a micro-batch's worth of logits rows (64 x the vocabulary), and the
# pages a call touches there are resident. A head sends a prompt on in parts of 64 rows
# (`--part-rows`), so each part is one micro-batch either way. On the 1B shape's 11:16, 128 rows
# held 57 MiB less than 512 and 64 rows 9.6 MiB less again; whole 512-row prefill calls took
# -1% to +7% longer at 64 than 128, within the host's noise (evidence/tail-ubatch/,
# evidence/tail-memory/). Elsewhere (a whole model, a head, a middle stage) the node computes
# as llama-server does.
N_UBATCH = 512
TAIL_N_UBATCH = 64


def default_n_ubatch(facts: ModelFacts) -> int:
    """Micro-batch rows of a stage whose operator set none."""
    return TAIL_N_UBATCH if facts.last and not facts.first else N_UBATCH


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: Path = field(metadata={"help": "the GGUF model or shard to serve", "group": "start"})
    max_sessions: int = field(default=8, metadata={"help": "sessions served at once", "group": "start", "min": 1})
    kv_cells: int = field(
        default=4096, metadata={"help": "KV cells shared by all sessions", "group": "start", "min": 1}
    )
    n_batch: int = field(
        default=512, metadata={"help": "rows one llama_decode call may carry", "group": "tuning", "min": 1}
    )
    n_ubatch: int | None = field(
        default=None,
        metadata={
            "help": "rows llama.cpp computes at once (at most --n-batch)",
            "group": "tuning",
            "min": 1,
            "shown": "512, 64 on a chain's last stage",
        },
    )
    n_threads: int = field(
        default_factory=lambda: os.cpu_count() or 2,
        metadata={
            "help": "llama.cpp threads",
            "flag": "threads",
            "group": "start",
            "min": 1,
            "shown": "this machine's cores",
        },
    )
    kv_type: str = field(
        default="f16", metadata={"help": "KV cache element type", "group": "start", "choices": ("f16", "f32")}
    )
    flash_attn: bool | None = field(
        default=None,
        metadata={"help": "flash attention", "group": "tuning", "choices": {"auto": None, "on": True, "off": False}},
    )
    # The weight kernel path (engine/kernels.py).
    kernels: str = field(
        default="auto",
        metadata={
            "help": "weight kernel path: auto = repacked CPU kernels where llama.cpp offers them, else plain; "
            "never AMX unless asked (its kernels crash on quantized models on some hosts)",
            "group": "tuning",
            "choices": ("auto", "repack", "plain", "amx"),
        },
    )
    swa_full: bool = False
    max_prefill_tokens: int = field(
        default=256,
        metadata={"help": "most prefill tokens per iteration", "flag": "max-prefill", "group": "tuning", "min": 1},
    )
    max_step_tokens: int = field(
        default=512, metadata={"help": "most tokens one step may carry", "group": "limits", "min": 1}
    )
    queue_budget_bytes: int = field(
        default=64 * 2**20,
        metadata={
            "help": "bytes of queued step payloads",
            "flag": "queue-budget",
            "group": "limits",
            "kind": "bytes",
            "min": 0,
        },
    )
    inbox_size: int = 256
    max_waiting_opens: int = field(
        default=64,
        metadata={
            "help": "opens that may wait for room (with wait_ms)",
            "flag": "max-waiting",
            "group": "limits",
            "min": 0,
        },
    )
    max_wait_ms: int = field(default=60_000, metadata={"help": "cap on an open's wait_ms", "group": "limits", "min": 0})
    max_overtakes: int = field(
        default=4,
        metadata={
            "help": "opens admitted ahead of a waiting open before it holds admission",
            "group": "tuning",
            "min": 0,
        },
    )
    batch_invariant: bool = field(
        default=False,
        metadata={"help": "pad decode batches: outputs that do not depend on the load", "group": "tuning"},
    )
    pad_rows: int | None = field(
        default=None,
        metadata={
            "help": "batch-invariant mode pads decode rows to a multiple of this",
            "group": "tuning",
            "min": 1,
            "shown": "what the kernel path needs",
        },
    )
    idle_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "close a session with no step or open this long, even if its client is alive (s; 0: off)",
            "flag": "idle-timeout",
            "group": "limits",
            "min": 0,
            "zero_is_none": True,
            "shown": "off",
        },
    )
    drain_timeout_s: float = 10.0
    limits: Limits = field(
        default_factory=Limits,
        metadata={
            "nested": {
                "weights": {
                    "help": _BUDGET.format("weights"),
                    "flag": "weight-budget",
                    "group": "limits",
                    "kind": "bytes",
                    "min": 0,
                    "shown": "no limit",
                },
                "kv": {
                    "help": _BUDGET.format("KV cache"),
                    "flag": "kv-budget",
                    "group": "limits",
                    "kind": "bytes",
                    "min": 0,
                    "shown": "no limit",
                },
                "scratch": {
                    "help": _BUDGET.format("compute buffers"),
                    "flag": "scratch-budget",
                    "group": "limits",
                    "kind": "bytes",
                    "min": 0,
                    "shown": "no limit",
                },
            }
        },
    )
    record_iterations: bool = False
    # After answering a step, wait this long (at most 10% of the recent step time) for that
    # session's next step, so sessions stay in phase and share batches instead of drifting apart.
    linger_ms: float = field(
        default=6.0,
        metadata={
            "help": "wait this long (at most 10% of a step; a chain's head: up to a step, 0: never) for "
            "answered sessions' next steps, so they share the next batch",
            "group": "tuning",
            "min": 0,
        },
    )
    # While sessions decode, an iteration's prefill rows may stretch the gap between their tokens
    # to a target: `itl_target_ms`, else 1 + `prefill_share` undisturbed gaps. The budget
    # adapts to the recent gaps' p99 and to how many sessions wait to prefill (engine/pacing.py).
    prefill_share: float = field(
        default=1.0,
        metadata={
            "help": "while sessions decode, an iteration's prefill may add this many decode steps' time to "
            "the gap between their tokens, when --itl-target-ms is not set (higher: prompts join the "
            "decode batch sooner, more throughput, longer gaps)",
            "group": "tuning",
            "min": 0,
        },
    )
    itl_target_ms: float | None = field(
        default=None,
        metadata={
            "help": "the inter-token gap (p99, ms) that prefill beside decodes may stretch decoding sessions "
            "to; prefill grows while the recent p99 is under it and shrinks when over (0: from the "
            "measured undisturbed gaps)",
            "group": "tuning",
            "min": 0,
            "zero_is_none": True,
            "shown": "1 + --prefill-share undisturbed gaps (decode-only calls)",
        },
    )
    # A call gets filler rows where the weights' kernel takes rows in blocks (engine/row_blocks.py).
    filler_rows: bool = field(
        default=True,
        metadata={
            "help": "add the few rows of a sequence of its own that make a call cheaper where the weights' "
            "kernel takes rows in blocks (15 rows run as 16; not with --batch-invariant)",
            "group": "tuning",
        },
    )
    # An iteration of only decodes runs as two calls of half the rows where two such calls were
    # measured cheaper than one (llama.cpp's kernels change with the rows: engine/call_split.py).
    split_decodes: bool = field(
        default=True,
        metadata={
            "help": "run an iteration's decodes as two calls of half the rows where that measured cheaper "
            "than one call (not with --batch-invariant or micro-batches)",
            "group": "tuning",
        },
    )
    # Session groups run in calls of their own, each answered as soon as it is computed: at a
    # chain's head, one group's hidden states travel on (and compute downstream) while the next
    # group computes here. 1 runs every session in one call (nothing to overlap on a single node);
    # None: the node decides (2 on a chain's head, else 1).
    micro_batches: int | None = field(
        default=None,
        metadata={
            "help": "run sessions in this many groups, each sent on to the next stage while the next "
            "computes (a chain of N stages keeps all busy with N)",
            "group": "tuning",
            "min": 1,
            "shown": "2 on a chain's head (--next, first layer), else 1 = off",
        },
    )
    # Per connection (the owner of a request): open sessions, waiting opens, and opens and steps
    # in the inbox at once. None: sessions and waiting opens as the node's own limits (a chain's
    # head sends all its sessions over one connection); queued requests, half the inbox but at
    # least max_sessions (a head sends one request per session at a time: they always fit).
    max_sessions_per_peer: int | None = field(
        default=None,
        metadata={
            "help": "sessions one connection may hold open (a chain's head sends all its sessions over one "
            "connection: a next stage must not cap it below the head's --max-sessions)",
            "group": "limits",
            "min": 1,
            "shown": "--max-sessions",
        },
    )
    max_waiting_per_peer: int | None = field(
        default=None,
        metadata={
            "help": "opens of one connection that may wait",
            "group": "limits",
            "min": 0,
            "shown": "--max-waiting",
        },
    )
    max_queued_per_peer: int | None = field(
        default=None,
        metadata={
            "help": "opens and steps of one connection queued for the engine at once; beyond it, busy",
            "group": "limits",
            "min": 1,
            "shown": "half the engine's inbox of 256, at least --max-sessions",
        },
    )
    # Batch-invariant mode: once closed sessions hold this share of the KV cells, they are freed
    # by a compaction even when no open waits for them (held cells lengthen every attention
    # walk). None: only when an open needs them.
    compact_at: float | None = field(
        default=0.5,
        metadata={
            "help": "batch-invariant mode: compact the KV cache once closed sessions hold this share of its "
            "cells (0: only when an open needs them)",
            "group": "tuning",
            "min": 0,
            "max": 1,
            "zero_is_none": True,
        },
    )

    def queued_per_peer(self) -> int:
        """Requests one connection may have in the inbox at once."""
        if self.max_queued_per_peer is not None:
            return self.max_queued_per_peer
        return min(self.inbox_size, max(self.inbox_size // 2, self.max_sessions))

    def context(self, facts: ModelFacts) -> ContextConfig:
        """llama.cpp's context for the stage `facts` describes."""
        from engine.backend import ContextConfig  # noqa: PLC0415

        return ContextConfig(
            # + the padding or filler rows' sequence, and batch-invariant mode's graveyard
            n_seq_max=self.max_sessions + (2 if self.batch_invariant else 1),
            n_ctx=self.kv_cells,
            n_batch=self.n_batch,
            n_ubatch=min(self.n_batch, self.n_ubatch or default_n_ubatch(facts)),
            n_threads=self.n_threads,
            swa_full=self.swa_full,
            kv_type=self.kv_type,
            flash_attn=self.flash_attn,
            kernels=self.kernels,
        )
