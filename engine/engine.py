"""The engine: one Trio task owns the scheduler and the backend and runs the batch loop.

Other tasks `await engine.request(...)` for a result: an open or a step goes through
a bounded inbox (a full inbox is `busy` at once, and so is an owner, a connection, past
its share of it) and the caller waits on a one-shot channel; a caller that stops
waiting (cancelled) is seen by the engine as a closed channel, and whatever was made
for it is freed. Cleanups (close, rollback, a gone connection) take a second path that
is never refused: at most one pending per session or connection, so it is bounded by
what exists.

Between decode steps the engine task drains cleanups and the inbox, compacts the KV
cache when closed sessions' held cells are wanted (batch-invariant mode), admits and
expires waiting opens, plans the next iteration, and runs each llama_decode call (and
each compaction) in one dedicated compute thread (one OpenMP team: see compute_thread).
Nothing else touches the backend meanwhile, so a decode never races a rewind, a close or
a compaction.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from engine.backend import KV_TYPES, StageBackend
from engine.budgets import BudgetError, Budgets, KvShape, kv_layout
from engine.bursts import Bursts
from engine.cleanups import CleanupQueue, ClosedListener, tell
from engine.compaction import compact
from engine.compute_thread import ComputeThread
from engine.config import EngineConfig
from engine.executor import Executor, IterationRecord
from engine.gguf_facts import ModelFacts, read_facts
from engine.inbox import Inbox, Queued
from engine.inbox_wait import take_while
from engine.kernels import CALL_ROW_BLOCKS, INVARIANT_PAD_ROWS
from engine.linger import SETTLE_GAP_S, linger_limit_s, lingering
from engine.messages import (
    Cleanup,
    Closed,
    CloseRequest,
    OpenRequest,
    Owner,
    Result,
    SessionEnd,
    StepRequest,
    StepsEnded,
)
from engine.open_sessions import OpenSessions
from engine.process_memory import resident_memory
from engine.replies import Reply
from engine.scheduler import INVARIANT_MAX_ROWS, Plan, Scheduler, SchedulerConfig
from engine.session_ends import SessionEnds
from engine.sessions import EngineScheduler, SessionActivity, Sessions, now_ms
from engine.statistics import (
    EngineStatistics,
    MemoryStatistics,
    QueueStatistics,
    batch_statistics,
    frozen,
    kv_statistics,
    quota_statistics,
    session_statistics,
    wire_stats,
)
from engine.telemetry import Telemetry
from engine.window_pins import context_sequences
from protocol.errors import ErrorCode, Fault
from protocol.stage import Stage

__all__ = ["Engine", "IterationRecord", "open_engine", "plan_budgets"]

log = logging.getLogger("neuron_tai.engine")

Asked = OpenRequest | StepRequest | CloseRequest  # what `Engine.request` takes


def plan_budgets(config: EngineConfig, facts: ModelFacts) -> tuple[Budgets, int]:
    """Weights and KV from the model's shape, before llama.cpp allocates; raises BudgetError."""
    ctx = config.context(facts)
    shape = KvShape(facts.k_widths, facts.v_widths, facts.swa, facts.n_swa)
    n_seqs = context_sequences(ctx.n_seq_max, facts.n_swa)  # the backend's: a window pin per sequence
    layout = kv_layout(shape, ctx.n_ctx, n_seqs, ctx.n_ubatch, KV_TYPES[ctx.kv_type][1], ctx.swa_full)
    budgets = Budgets(facts.weights_bytes, layout.bytes, scratch_bytes=0)
    problems = budgets.violations(config.limits)
    if problems:
        raise BudgetError("configuration does not fit: " + "; ".join(problems))
    return budgets, layout.cells


class Engine:
    """Sessions of one stage, batched continuously. Use `open_engine`."""

    def __init__(
        self,
        config: EngineConfig,
        facts: ModelFacts,
        backend: StageBackend,
        budgets: Budgets,
        cells: int,
        compute: ComputeThread,
    ) -> None:
        self.config = config
        self.compute = compute
        self.backend = backend
        self.info = backend.info
        self.pad_rows = config.pad_rows or INVARIANT_PAD_ROWS[backend.model.kernel_path.value]
        row_blocks = CALL_ROW_BLOCKS[backend.model.kernel_path.value]
        self.scheduler: EngineScheduler = Scheduler(scheduler_config(config, cells, self.pad_rows, row_blocks))
        self.open_sessions = OpenSessions(self.scheduler)
        self.queued_per_peer = config.queued_per_peer()
        if not 1 <= self.queued_per_peer <= config.inbox_size:
            raise ValueError(
                f"need 1 <= max_queued_per_peer ({self.queued_per_peer}) <= {config.inbox_size}, the inbox"
            )
        self.compute_bytes = backend.compute_buffer_bytes
        self.output_buffer_bytes = backend.output_buffer_bytes()
        scratch = self.compute_bytes + self.output_buffer_bytes
        self.budgets = Budgets(budgets.weights_bytes, budgets.kv_bytes, scratch)
        self.telemetry = Telemetry()
        pad_seq = backend.open_sequence()  # padding (batch-invariant mode) or filler rows
        graveyard = backend.open_sequence() if config.batch_invariant else None
        self._ends = SessionEnds()
        self.sessions = Sessions(self.scheduler, backend, self.telemetry, self._ends, graveyard)
        self.executor = Executor(
            self.sessions,
            compute,
            pad_seq,
            split_on_no_slot=not config.batch_invariant,
            record_iterations=config.record_iterations,
            halve_decodes=config.split_decodes and self.scheduler.config.may_halve,
        )
        self.iterations = self.executor.iterations
        self._inbox = Inbox(config.inbox_size, self.queued_per_peer)
        self._bursts = Bursts(SETTLE_GAP_S)  # how steps come in from a stage above
        self._cleanups = CleanupQueue()
        # Once: asking llama.cpp about every vocabulary entry takes a while on large vocabularies.
        self.eog_tokens = frozenset(t for t in range(self.info.n_vocab) if backend.model.is_eog(t))
        self.stage = stage_of(facts, self.info.n_vocab, self.scheduler.config.max_step_tokens, self.eog_tokens)
        self.draining = False
        self.stopped = trio.Event()
        self._idle_scope: trio.CancelScope | None = None
        self.activity: SessionActivity | None = None  # the node's, for the idle clock

    # -- the API other tasks use ----------------------------------------------------

    async def request(self, request: Asked) -> Result:
        """The engine's answer. A full inbox (or the owner's full share of it) is `busy` at once;
        cancelling the wait is leaving: a session opened or a step computed for a requester that
        left is closed. A close is never refused: it takes the cleanup path (see `close`)."""
        if isinstance(request, CloseRequest):
            return await self.close(request)
        send, recv = trio.open_memory_channel[Result](1)
        with recv:
            refused = self._enqueue(request, Reply(send))
            if refused is not None:
                await trio.lowlevel.checkpoint()
                return refused
            try:
                return await recv.receive()
            except trio.EndOfChannel:  # unreachable while the loop answers everything; never hang on it
                return self.telemetry.counted(Fault(ErrorCode.SHUTTING_DOWN, "the node stopped"))

    def _enqueue(self, request: OpenRequest | StepRequest, reply: Reply) -> Fault | None:
        counted = self.telemetry.counted
        if self.draining:
            return counted(Fault(ErrorCode.SHUTTING_DOWN, "the node is draining"))
        if self._inbox.owner_full(request.owner):
            self.telemetry.quota_refused["queued"] += 1
            quota = f"this connection has its quota of {self.queued_per_peer} requests queued for the engine"
            return counted(Fault(ErrorCode.BUSY, quota, self.busy_retry_ms()))
        try:
            self._inbox.put(request, reply)
        except trio.WouldBlock:
            return counted(Fault(ErrorCode.BUSY, "the engine's inbox is full", self.busy_retry_ms()))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return counted(Fault(ErrorCode.SHUTTING_DOWN, "the node has stopped"))
        if isinstance(request, StepRequest):
            key = (request.owner, request.session)
            self._bursts.arrived(key, trio.current_time(), self.scheduler.sessions, decode=request.n == 1)
        return None

    def steps_ended(self, owner: Owner, session: str) -> None:
        """A `StepsEnded` hint for the session, in order with its steps (`Inbox.hint`), if the
        engine expects it back: a run that had no step answered leaves nothing to forget, and
        puts nothing in the inbox every peer shares."""
        if self.sessions.expects((owner, session)):
            self._inbox.hint(StepsEnded(owner, session))

    def cleanup_nowait(self, request: Cleanup, on_closed: ClosedListener | None = None) -> trio.Event:
        """Queue a cleanup; never refused, also while draining. The event is set once it is done
        (or the engine has stopped, which frees everything). One pending per session or owner:
        a second one for the same key is merged into the first. `on_closed` (with a close) is
        called in the engine task once it is done, with whether the session existed; of closes
        merged into one, only the first listener is told it did. It must not block. (The same
        answer reaches `session_ends` as a `CloseAnswered`.)"""
        if self.stopped.is_set():
            done = trio.Event()
            done.set()
            tell([on_closed] if on_closed else [], False)
            return done
        self.telemetry.cleanups_total += 1
        pending, new = self._cleanups.add(request, on_closed)
        if new and self._idle_scope is not None:
            self._idle_scope.cancel()  # wake the loop if it is waiting for work
        return pending.done

    async def cleanup(self, request: Cleanup) -> None:
        """Queue a cleanup and wait until the engine has done it (see `cleanup_nowait`)."""
        await self.cleanup_nowait(request).wait()

    async def close(self, request: CloseRequest) -> Closed:
        """Close a session on the cleanup path (never refused); `existed` as for `on_closed`."""
        existed: list[bool] = []
        await self.cleanup_nowait(request, existed.append).wait()
        return Closed(request.session, any(existed))

    @property
    def session_ends(self) -> trio.MemoryReceiveChannel[SessionEnd]:
        """Every session the engine frees (`SessionEnded`) and every close it ran (`CloseAnswered`),
        for ONE consumer task that never waits for the engine (engine/session_ends.py). Ends are
        posted from the first time this is read: read it before opening sessions."""
        return self._ends.subscribe()

    # -- what a node needs to know --------------------------------------------------

    @property
    def unpinned_window(self) -> int:
        """The sliding window a step's drafts must stay inside (0: none): this stage pins what
        undoing a step needs (engine/window_pins.py) unless llama.cpp lacks the sequence ids."""
        return 0 if self.backend.pins is not None else self.info.n_swa

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Callable from any thread, during a decode too: llama.cpp's vocabulary is read-only
        once loaded (its tokenize and detokenize are const and keep no caches)."""
        return self.backend.tokenize(text, add_special)

    def detokenize(self, tokens: list[int]) -> str:
        """Raises Fault (`bad_request`) for ids outside the vocabulary."""
        return self.backend.detokenize(tokens)

    def busy_retry_ms(self) -> int:
        """When a `busy` requester should try again: about one step from now."""
        return self.scheduler.estimates.busy_retry_ms()

    def count_error(self, code: ErrorCode) -> None:
        """Count an error answered outside the engine (wire, chaining) in `errors_total`."""
        self.telemetry.errors[code] += 1

    def begin_shutdown(self) -> None:
        """Refuse new work; in-flight steps still complete."""
        if self.draining:
            return
        self.draining = True
        if self._idle_scope is not None:
            self._idle_scope.cancel()  # wake the loop if it is waiting for work

    # -- the loop -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                self._drain_inbox()
                if not self.draining and self.scheduler.wants_compaction():
                    await compact(self.sessions, self.compute)
                self._housekeeping()
                if self.draining:
                    for waiter, why in self.scheduler.begin_shutdown(now_ms()):
                        self.sessions.refuse_waiter(waiter, why)
                    if self.scheduler.pending_steps == 0:
                        return
                await self._ends.flush()  # the safe point: nothing half-done (engine/session_ends.py)
                budget = self.executor.pace.prefill_budget(
                    self.config.prefill_share, self.config.itl_target_ms, self.scheduler.demand()
                )
                plan = self.scheduler.plan(budget, self.executor.halves, self.executor.fillers.pays)
                if plan is None:
                    await self._wait_for_work()
                    await self._linger()  # a group coming back (from the next stage) comes back whole
                    continue
                self._forget_late(plan)
                await self.executor.run_calls(plan, self._hand_over)
                await self._linger()
        finally:
            self._fail_everything_pending()
            self.stopped.set()
            await self._ends.close(self.config.drain_timeout_s)

    def _drain_inbox(self, refuse: bool = False) -> None:
        """Handle cleanups, then what waits in the inbox; after the loop stopped, refuse it instead."""
        self._run_cleanups()
        while True:
            try:
                request, reply = self._inbox.receiver.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            if not refuse:
                self._take(request, reply)
            elif not isinstance(request, StepsEnded):  # a hint is not answered
                self._inbox.taken(request)
                reply.answer(self.telemetry.counted(Fault(ErrorCode.SHUTTING_DOWN, "the node stopped")))

    def _take(self, request: Queued, reply: Reply) -> None:
        """Handle a request from the inbox, after any cleanup queued before it (a close, then a
        reopen of the same id, is seen in that order)."""
        self._inbox.taken(request)
        self._run_cleanups()
        if isinstance(request, StepsEnded):
            self.sessions.steps_ended((request.owner, request.session))
        elif isinstance(request, OpenRequest):
            self.sessions.open(request, reply)
        else:
            self.sessions.step(request, reply)

    def _run_cleanups(self) -> None:
        for pending in self._cleanups.take_all():
            self.sessions.clean(pending)

    async def _wait_for_work(self) -> None:
        if self._cleanups or self.draining:  # came while the loop handed over session ends: look again
            await trio.lowlevel.checkpoint()
            return
        deadlines = [d for d in (self.scheduler.next_deadline_ms(), self._idle_deadline_ms()) if d is not None]
        deadline = trio.current_time() + (min(deadlines) - now_ms()) / 1000 if deadlines else math.inf
        with trio.CancelScope(deadline=deadline) as self._idle_scope:
            request, reply = await self._inbox.receiver.receive()
            self._take(request, reply)
        self._idle_scope = None

    async def _hand_over(self) -> None:
        """Between the calls of one iteration (micro-batches): let the steps just answered go on
        (their requesters forward them to the next stage, the socket's task sends them) before the
        next call's decode takes the core, so the next stage starts on them at once. Two scheduler
        turns: one for the requesters, one for the socket's task they wake."""
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()

    async def _linger(self) -> None:
        """Give the sessions just answered a moment to send their next step, so they run together.

        Lingering ends as soon as some group of sessions (a micro-batch) has work and none of
        its members is still expected: one group's stragglers never hold up another group
        that is ready. A stage fed by another stage does not wait for its sessions (its
        upstream sets the rhythm): it only takes the rest of a burst under way (`settling`).
        """
        await trio.lowlevel.checkpoint()  # in-process requesters answer within one checkpoint
        self._drain_inbox()
        micro_batches = self.scheduler.config.micro_batches if self.info.first else 1
        turnaround = self.sessions.turnarounds.typical_ms  # 0 but on a micro-batched head (the only one timing them)
        limit = linger_limit_s(self.config.linger_ms, self.scheduler.estimates.step_ms, micro_batches, turnaround)
        sessions = self.scheduler.sessions
        if self.info.first:
            await self._take_while(lambda: math.inf if lingering(sessions, self.sessions.coming_back) else None, limit)
        else:
            await self._take_while(lambda: self._bursts.settle_gap_s(sessions, trio.current_time()), limit)

    async def _take_while(self, gap_s: Callable[[], float | None], limit_s: float) -> None:
        gap_s = self._ends.until_due(gap_s)  # the ends' bound holds while lingering, too
        if limit_s <= 0 or gap_s() is None:
            return
        started = time.perf_counter()
        await take_while(self._inbox.receiver, lambda got: self._take(*got), gap_s, limit_s)
        self.telemetry.linger_seconds_total += time.perf_counter() - started

    def _forget_late(self, plan: Plan) -> None:
        """The groups about to run stop waiting for their members that are not back: those are late."""
        sessions, coming_back = self.scheduler.sessions, self.sessions.coming_back
        running = {sessions[c.key].group for c in plan.chunks}
        late = {key for key in coming_back if key not in sessions or sessions[key].group in running}
        # A session opened but never stepped is not late: only one whose answer went out is.
        self.telemetry.late_sessions_total += sum(1 for key in late if key in sessions and sessions[key].length > 0)
        coming_back -= late

    def _housekeeping(self) -> None:
        self.sessions.admit_waiting()
        if self.config.idle_timeout_s is not None:
            self.sessions.close_idle(self.config.idle_timeout_s * 1000, self.activity)

    def _idle_deadline_ms(self) -> float | None:
        if self.config.idle_timeout_s is None or not self.scheduler.sessions:
            return None
        oldest = min(s.last_active_ms for s in self.scheduler.sessions.values())
        return oldest + self.config.idle_timeout_s * 1000

    def _fail_everything_pending(self) -> None:
        """The loop stopped: answer every step, open and request still waiting, run every cleanup."""
        self.sessions.fail_everything_pending()
        self._inbox.close()
        self._drain_inbox(refuse=True)  # runs the cleanups still queued, too

    # -- telemetry ------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's state and counters (frozen values; `stats` flattens it)."""
        s, t, b, config = self.scheduler, self.telemetry, self.budgets, self.config
        used = sum(self.backend.length(x.seq) for x in s.sessions.values() if x.seq >= 0)
        pad_rows = self.pad_rows if config.batch_invariant else 0
        return EngineStatistics(
            sessions=session_statistics(s, t),
            queue=QueueStatistics(
                depth=s.pending_steps,
                bytes=s.queued_bytes,
                budget_bytes=config.queue_budget_bytes,
                inbox_size=config.inbox_size,
                cleanups_total=t.cleanups_total,
                cleanups_pending=len(self._cleanups),
            ),
            batches=batch_statistics(t, self.backend, config.n_batch, pad_rows, s.config.micro_batches),
            kv=kv_statistics(s, t, used),
            memory=MemoryStatistics(
                b.weights_bytes,
                b.kv_bytes,
                b.scratch_bytes,
                self.compute_bytes,
                self.output_buffer_bytes,
                frozen(self.backend.model.weight_buffers),
                resident_memory(),
            ),
            quotas=quota_statistics(s, t, self.queued_per_peer),
            errors_total=frozen(t.errors),
            draining=self.draining,
        )

    def stats(self) -> dict[str, Any]:
        """`statistics()` flattened as the wire and Prometheus carry it (what `stats` replies hold)."""
        return wire_stats(self.statistics())


def scheduler_config(
    config: EngineConfig, cells: int, pad_rows: int, row_blocks: tuple[int, ...] = ()
) -> SchedulerConfig:
    """The scheduler's limits from the engine's configuration and the KV cells llama.cpp has."""
    fillers = row_blocks if config.filler_rows and not config.batch_invariant else ()
    # Cells the padding or filler rows take during a call (engine/row_blocks.py: fewer than the smallest block).
    pad_reserve = pad_rows if config.batch_invariant else (fillers[-1] - 1 if fillers else 0)
    # Prefill chunks, padded to a multiple of pad_rows, stay below the flash-attention tile.
    invariant_rows = [INVARIANT_MAX_ROWS // pad_rows * pad_rows] if config.batch_invariant else []
    return SchedulerConfig(
        max_sessions=config.max_sessions,
        kv_cells=cells - pad_reserve,
        n_batch=config.n_batch,
        max_prefill_tokens=min(config.max_prefill_tokens, config.n_batch, *invariant_rows),
        max_step_tokens=min(config.max_step_tokens, cells),
        queue_budget_bytes=config.queue_budget_bytes,
        max_waiting_opens=config.max_waiting_opens,
        max_wait_ms=config.max_wait_ms,
        max_overtakes=config.max_overtakes,
        batch_invariant=config.batch_invariant,
        pad_rows=pad_rows,
        micro_batches=config.micro_batches or 1,
        max_sessions_per_owner=config.max_sessions_per_peer,
        max_waiting_per_owner=config.max_waiting_per_peer,
        compact_held_cells=_compact_held_cells(config, cells - pad_reserve),
        row_multiple=row_blocks[0] if row_blocks else 1,
        row_blocks=fillers,
    )


def stage_of(facts: ModelFacts, n_vocab: int, max_step_tokens: int, eog_tokens: frozenset[int]) -> Stage:
    """What this stage tells its peers about itself."""
    return Stage(
        first=facts.first,
        last=facts.last,
        layers=(facts.start, facts.end),
        n_embd=facts.n_embd,
        n_vocab=n_vocab,  # the loaded vocabulary; the header facts do not count it
        model=facts.name,
        max_step_tokens=max_step_tokens,
        eog_tokens=tuple(sorted(eog_tokens))[:16],
    )


def _compact_held_cells(config: EngineConfig, cells: int) -> int | None:
    """Held cells that call for a compaction on their own (`compact_at` of the cells sessions reserve from)."""
    if not config.batch_invariant or config.compact_at is None:
        return None
    if not 0 < config.compact_at <= 1:
        raise ValueError(f"compact_at is a share of the KV cells in (0, 1], not {config.compact_at}")
    return max(1, math.ceil(config.compact_at * cells))


@asynccontextmanager
async def open_engine(config: EngineConfig) -> AsyncIterator[Engine]:
    """Load the stage, run its batch loop in a nursery, and drain it on exit."""
    facts = read_facts(config.model)
    budgets, cells = plan_budgets(config, facts)
    compute = ComputeThread()
    try:
        backend = await compute.run(StageBackend, config.model, config.context(facts))
        model = backend.model
        buffers = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in model.weight_buffers.items())
        log.info("weights on the %s kernel path (asked: %s; %s)", model.kernel_path.value, config.kernels, buffers)
        try:
            engine = Engine(config, facts, backend, budgets, cells, compute)
            problems = engine.budgets.violations(config.limits)
            if problems:
                raise BudgetError("configuration does not fit: " + "; ".join(problems))
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                try:
                    yield engine
                finally:
                    engine.begin_shutdown()
                    with trio.move_on_after(config.drain_timeout_s):
                        await engine.stopped.wait()
                    nursery.cancel_scope.cancel()
        finally:
            backend.close()
    finally:
        compute.close()
