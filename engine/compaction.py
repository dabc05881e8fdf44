"""Compacting the KV cache between iterations (batch-invariant mode): held cells freed, open sessions kept."""

from __future__ import annotations

import logging
import time

from engine.compute_thread import ComputeThread
from engine.messages import EndReason
from engine.sessions import Sessions
from protocol.errors import ErrorCode

log = logging.getLogger("neuron_tai.engine")


async def compact(sessions: Sessions, compute: ComputeThread) -> None:
    """Free closed sessions' held cells while others stay open.

    Runs between iterations, on the compute thread: every open session's cells are
    copied out and put back packed, each in its own order (engine/kv_compaction.py),
    sessions mid-prefill included. A copy that cannot be taken changes nothing; a
    session whose copy cannot be put back is closed, its pending step answered
    `internal`.
    """
    assert sessions.graveyard is not None, "only batch-invariant mode holds cells"
    t, scheduler = sessions.telemetry, sessions.scheduler
    started = time.perf_counter()
    result = await compute.run(sessions.backend.compact, sessions.graveyard)
    t.kv_compaction_seconds_total += time.perf_counter() - started
    if result.failure is not None:
        t.kv_compactions_failed_total += 1
        scheduler.compaction_failed()
        log.error("KV compaction skipped, nothing changed: %s", result.failure)
        return
    t.kv_compactions_total += 1
    t.kv_cells_moved_total += result.cells
    t.kv_cells_reclaimed_total += scheduler.release_held()
    by_seq = {session.seq: key for key, session in scheduler.sessions.items()}
    for seq in result.lost:
        t.kv_sessions_lost_total += 1
        log.error("session %r: llama.cpp would not put its KV cells back after a compaction", by_seq[seq][1])
        why = "the session's KV cache could not be restored after a compaction"
        sessions.close(by_seq[seq], EndReason.COMPACTION_LOST, why, ErrorCode.INTERNAL)
