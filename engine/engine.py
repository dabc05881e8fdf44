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
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import trio

from engine.backend import KV_TYPES, DecodeFailed, DecodeOutcome, Segment, SegmentResult, StageBackend
from engine.budgets import BudgetError, Budgets, KvShape, kv_layout
from engine.compute_thread import ComputeThread
from engine.config import EngineConfig
from engine.gguf_facts import ModelFacts, read_facts
from engine.kernels import INVARIANT_PAD_ROWS
from engine.messages import (
    Cleanup,
    Closed,
    CloseRequest,
    DropOwner,
    Failure,
    Opened,
    OpenRequest,
    Output,
    Refused,
    Result,
    Rollback,
    StepDone,
    StepRequest,
)
from engine.pacing import PrefillPace
from engine.scheduler import (
    INVARIANT_MAX_ROWS,
    Call,
    Chunk,
    Plan,
    Rejection,
    Scheduler,
    SchedulerConfig,
    Session,
    Waiter,
)
from engine.telemetry import Telemetry
from protocol.errors import ErrorCode
from protocol.stage import Stage

log = logging.getLogger("neuron_tai.engine")


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One llama_decode call of the loop: (session, pos, rows, is_decode, iterations waited) per chunk."""

    iteration: int
    chunks: tuple[tuple[Any, int, int, bool, int], ...]
    pad_rows: int


class RequesterGone(Exception):
    """The requester stopped waiting: what was made for it has no owner any more."""


@dataclass(slots=True)
class _Reply:
    """Where one request's result goes: the send side of a one-shot channel its requester awaits."""

    channel: trio.MemorySendChannel[Result]

    def deliver(self, result: Opened | StepDone) -> None:
        """Hand over something the requester now owns; RequesterGone when nobody waits for it."""
        try:
            self.channel.send_nowait(result)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            raise RequesterGone from None

    def answer(self, result: Closed | Failure) -> None:
        """Answer with something that left nothing behind: a requester that is gone loses nothing."""
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            self.channel.send_nowait(result)


Asked = OpenRequest | StepRequest | CloseRequest  # what `Engine.request` takes
Queued = OpenRequest | StepRequest  # what goes through the inbox (a close is a cleanup)
ClosedListener = Callable[[bool], None]  # told whether the session a close was for existed


@dataclass(slots=True)
class _PendingCleanup:
    request: Cleanup
    done: trio.Event
    listeners: list[ClosedListener] = field(default_factory=list)


def _cleanup_key(request: Cleanup) -> tuple[Any, ...]:
    if isinstance(request, DropOwner):
        return ("owner", request.owner)
    return ("session", request.owner, request.session)


def _merge(old: Cleanup, new: Cleanup) -> Cleanup:
    """Two cleanups of one session as one: a close covers a rollback; two rollbacks, the earlier pos."""
    if isinstance(old, Rollback) and isinstance(new, Rollback):
        return old if old.pos <= new.pos else new
    return old if isinstance(old, CloseRequest | DropOwner) else new


@dataclass(slots=True)
class _Work:
    """A step's request, where its reply goes, and its outputs so far."""

    request: StepRequest
    reply: _Reply
    hidden: list[np.ndarray] = field(default_factory=list)


def plan_budgets(config: EngineConfig, facts: ModelFacts) -> tuple[Budgets, int]:
    """Weights and KV from the model's shape, before llama.cpp allocates; raises BudgetError."""
    ctx = config.context()
    shape = KvShape(facts.k_widths, facts.v_widths, facts.swa, facts.n_swa)
    layout = kv_layout(shape, ctx.n_ctx, ctx.n_seq_max, ctx.n_ubatch, KV_TYPES[ctx.kv_type][1], ctx.swa_full)
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
        pad_reserve = self.pad_rows if config.batch_invariant else 0
        invariant_rows = [INVARIANT_MAX_ROWS] if config.batch_invariant else []  # prefill chunks stay below the tile
        self.scheduler = Scheduler(
            SchedulerConfig(
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
                pad_rows=self.pad_rows,
                micro_batches=config.micro_batches or 1,
                max_sessions_per_owner=config.max_sessions_per_peer,
                max_waiting_per_owner=config.max_waiting_per_peer,
                compact_held_cells=_compact_held_cells(config, cells - pad_reserve),
            )
        )
        self.queued_per_peer = config.queued_per_peer()
        if not 1 <= self.queued_per_peer <= config.inbox_size:
            raise ValueError(
                f"need 1 <= max_queued_per_peer ({self.queued_per_peer}) <= {config.inbox_size}, the inbox"
            )
        output_rows = config.n_batch if (not self.info.last or config.batch_invariant) else config.max_sessions
        scratch = backend.compute_buffer_bytes + backend.output_buffer_bytes(output_rows)
        self.budgets = Budgets(budgets.weights_bytes, budgets.kv_bytes, scratch)
        self.telemetry = Telemetry()
        self.iterations: deque[IterationRecord] = deque(maxlen=100_000)  # when record_iterations
        self.pad_seq = backend.open_sequence() if config.batch_invariant else None
        self.graveyard = backend.open_sequence() if config.batch_invariant else None
        self._inbox_send, self._inbox = trio.open_memory_channel[tuple[Queued, _Reply]](config.inbox_size)
        self._queued: Counter[Any] = Counter()  # requests in the inbox, by owner
        self._cleanups: dict[tuple[Any, ...], _PendingCleanup] = {}
        # Once: asking llama.cpp about every vocabulary entry takes a while on large vocabularies.
        self.eog_tokens = frozenset(t for t in range(self.info.n_vocab) if backend.model.is_eog(t))
        self.stage = Stage(
            first=facts.first,
            last=facts.last,
            layers=(facts.start, facts.end),
            n_embd=facts.n_embd,
            n_vocab=self.info.n_vocab,  # the loaded vocabulary; the header facts do not count it
            model=facts.name,
            max_step_tokens=self.scheduler.config.max_step_tokens,
            eog_tokens=tuple(sorted(self.eog_tokens))[:16],
        )
        self.draining = False
        self.stopped = trio.Event()
        self._idle_scope: trio.CancelScope | None = None
        # Answered, next step not here yet: kept until their group runs again (then they are late).
        self._coming_back: set[Any] = set()
        self._pace = PrefillPace()
        # Called (owner, session) each time a session is freed, for whatever reason: a chained
        # node closes it on its next stage too. Runs in the engine task: it must not block.
        self.on_close: Callable[[Any, str], None] | None = None

    # -- the API other tasks use ----------------------------------------------------

    async def request(self, request: Asked) -> Result:
        """The engine's answer. A full inbox (or the owner's full share of it) is `busy` at once;
        cancelling the wait is leaving: a session opened or a step computed for a requester that
        left is closed. A close is never refused: it takes the cleanup path (see `close`)."""
        if isinstance(request, CloseRequest):
            return await self.close(request)
        send, recv = trio.open_memory_channel[Result](1)
        with recv:
            refused = self._enqueue(request, _Reply(send))
            if refused is not None:
                await trio.lowlevel.checkpoint()
                return refused
            try:
                return await recv.receive()
            except trio.EndOfChannel:  # unreachable while the loop answers everything; never hang on it
                return self._count(Failure(ErrorCode.SHUTTING_DOWN, "the node stopped"))

    def _enqueue(self, request: Queued, reply: _Reply) -> Failure | None:
        if self.draining:
            return self._count(Failure(ErrorCode.SHUTTING_DOWN, "the node is draining"))
        if self.queued_per_peer < self.config.inbox_size and self._queued[request.owner] >= self.queued_per_peer:
            self.telemetry.quota_refused["queued"] += 1
            return self._count(
                Failure(ErrorCode.BUSY, f"this connection has its quota of {self.queued_per_peer} requests "
                        "queued for the engine", self.scheduler.busy_retry_ms())
            )  # fmt: skip
        try:
            self._inbox_send.send_nowait((request, reply))
        except trio.WouldBlock:
            return self._count(Failure(ErrorCode.BUSY, "the engine's inbox is full", self.scheduler.busy_retry_ms()))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return self._count(Failure(ErrorCode.SHUTTING_DOWN, "the node has stopped"))
        self._queued[request.owner] += 1
        return None

    def _taken(self, request: Queued) -> None:
        """A request left the inbox: its owner's share has room again."""
        self._queued[request.owner] -= 1
        if not self._queued[request.owner]:
            del self._queued[request.owner]

    def cleanup_nowait(self, request: Cleanup, on_closed: ClosedListener | None = None) -> trio.Event:
        """Queue a cleanup; never refused, also while draining. The event is set once it is done
        (or the engine has stopped, which frees everything). One pending per session or owner:
        a second one for the same key is merged into the first. `on_closed` (with a close) is
        called in the engine task once it is done, with whether the session existed; of closes
        merged into one, only the first listener is told it did. It must not block."""
        if self.stopped.is_set():
            done = trio.Event()
            done.set()
            _tell([on_closed] if on_closed else [], False)
            return done
        self.telemetry.cleanups_total += 1
        key = _cleanup_key(request)
        pending = self._cleanups.get(key)
        if pending is not None:
            pending.request = _merge(pending.request, request)
        else:
            pending = self._cleanups[key] = _PendingCleanup(request, trio.Event())
            if self._idle_scope is not None:
                self._idle_scope.cancel()  # wake the loop if it is waiting for work
        if on_closed is not None:
            pending.listeners.append(on_closed)
        return pending.done

    async def cleanup(self, request: Cleanup) -> None:
        """Queue a cleanup and wait until the engine has done it (see `cleanup_nowait`)."""
        await self.cleanup_nowait(request).wait()

    async def close(self, request: CloseRequest) -> Closed:
        """Close a session on the cleanup path (never refused); `existed` as for `on_closed`."""
        existed: list[bool] = []
        await self.cleanup_nowait(request, existed.append).wait()
        return Closed(request.session, any(existed))

    # -- what a node needs to know --------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Callable from any thread, during a decode too: llama.cpp's vocabulary is read-only
        once loaded (its tokenize and detokenize are const and keep no caches)."""
        return self.backend.tokenize(text, add_special)

    def detokenize(self, tokens: list[int]) -> str:
        """Raises Refused (`bad_request`) for ids outside the vocabulary."""
        return self.backend.detokenize(tokens)

    def busy_retry_ms(self) -> int:
        """When a `busy` requester should try again: about one step from now."""
        return self.scheduler.busy_retry_ms()

    def max_tokens_of(self, owner: Any, session: str) -> int | None:
        """An open session's `max_tokens`; None when there is no such session."""
        found = self.scheduler.sessions.get((owner, session))
        return None if found is None else found.max_tokens

    def sessions_of(self, owner: Any) -> int:
        """How many open sessions `owner` holds."""
        return sum(1 for key in self.scheduler.sessions if key[0] == owner)

    def length_of(self, owner: Any, session: str) -> int | None:
        """An open session's length (positions its KV holds); None when there is no such session."""
        found = self.scheduler.sessions.get((owner, session))
        return None if found is None else found.length

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
                    await self._compact()
                self._housekeeping()
                if self.draining:
                    for waiter, why in self.scheduler.begin_shutdown(_now_ms()):
                        self._reject_waiter(waiter, why)
                    if self.scheduler.pending_steps == 0:
                        return
                plan = self.scheduler.plan(self._pace.prefill_budget(self.config.prefill_share))
                if plan is None:
                    await self._wait_for_work()
                    continue
                self._forget_late(plan)
                for call in plan.calls:
                    await self._execute(Plan(plan.iteration, (call,)))
                await self._linger()
        finally:
            self._fail_everything_pending()
            self.stopped.set()

    def _drain_inbox(self, refuse: bool = False) -> None:
        """Handle cleanups, then what waits in the inbox; after the loop stopped, refuse it instead."""
        self._run_cleanups()
        while True:
            try:
                request, reply = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            if not refuse:
                self._take(request, reply)
            else:
                self._taken(request)
                reply.answer(self._count(Failure(ErrorCode.SHUTTING_DOWN, "the node stopped")))

    def _take(self, request: Queued, reply: _Reply) -> None:
        """Handle a request from the inbox, after any cleanup queued before it (a close, then a
        reopen of the same id, is seen in that order)."""
        self._taken(request)
        self._run_cleanups()
        self._handle(request, reply)

    def _run_cleanups(self) -> None:
        while self._cleanups:
            pending = self._cleanups.pop(next(iter(self._cleanups)))
            request = pending.request
            existed = False
            if isinstance(request, CloseRequest):
                existed = self._close((request.owner, request.session), "the session was closed")
            elif isinstance(request, Rollback):
                self._rollback(request)
            else:
                for key in [k for k in self.scheduler.sessions if k[0] == request.owner]:
                    self._close(key, "the session's connection is gone")
                for waiter in self.scheduler.drop_waiting(request.owner):  # nobody reads the answer: no task hangs
                    self._reject_waiter(waiter, Rejection(ErrorCode.UNKNOWN_SESSION, "the connection is gone"))
            pending.done.set()
            _tell(pending.listeners, existed)

    async def _wait_for_work(self) -> None:
        deadlines = [d for d in (self.scheduler.next_deadline_ms(), self._idle_deadline_ms()) if d is not None]
        deadline = trio.current_time() + (min(deadlines) - _now_ms()) / 1000 if deadlines else math.inf
        with trio.CancelScope(deadline=deadline) as self._idle_scope:
            request, reply = await self._inbox.receive()
            self._take(request, reply)
        self._idle_scope = None

    async def _linger(self) -> None:
        """Give the sessions just answered a moment to send their next step, so they run together.

        Lingering ends as soon as some group of sessions (a micro-batch) has work and none of
        its members is still expected: one group's stragglers never hold up another group
        that is ready. A stage fed by another stage does not linger: its upstream sets the
        rhythm, and a session it answered comes back only after the upstream computed again.
        """
        await trio.lowlevel.checkpoint()  # in-process requesters answer within one checkpoint
        self._drain_inbox()
        limit = min(self.config.linger_ms, 0.1 * self.scheduler.estimates.step_ms) / 1000
        if not self.info.first or limit <= 0 or not self._lingering():
            return
        started = time.perf_counter()
        with trio.move_on_after(limit):
            while self._lingering():
                request, reply = await self._inbox.receive()
                self._take(request, reply)
        self.telemetry.linger_seconds_total += time.perf_counter() - started

    def _lingering(self) -> bool:
        """Whether every group with work still expects some of its members back."""
        sessions = self.scheduler.sessions
        expected = {sessions[key].group for key in self._coming_back if key in sessions}
        ready = {s.group for s in sessions.values() if s.step is not None}
        return bool(expected) and ready <= expected

    def _forget_late(self, plan: Plan) -> None:
        """The groups about to run stop waiting for their members that are not back: those are late."""
        sessions = self.scheduler.sessions
        running = {sessions[c.key].group for c in plan.chunks}
        late = {key for key in self._coming_back if key not in sessions or sessions[key].group in running}
        self.telemetry.late_sessions_total += sum(1 for key in late if key in sessions)
        self._coming_back -= late

    def _housekeeping(self) -> None:
        now = _now_ms()
        admitted, expired = self.scheduler.poll_waiting(now)
        for waiter, session in admitted:
            request, reply = cast(tuple[OpenRequest, _Reply], waiter.payload)
            self._bind_and_reply(request, session, reply)
        for waiter, why in expired:
            self._reject_waiter(waiter, why)
        if self.config.idle_timeout_s is not None:
            for key in self.scheduler.idle_sessions(now, self.config.idle_timeout_s * 1000):
                log.info("closing idle session %r", key[1])
                self._close(key, "the session was idle for too long")

    def _idle_deadline_ms(self) -> float | None:
        if self.config.idle_timeout_s is None or not self.scheduler.sessions:
            return None
        oldest = min(s.last_active_ms for s in self.scheduler.sessions.values())
        return oldest + self.config.idle_timeout_s * 1000

    # -- requests ---------------------------------------------------------------------

    def _handle(self, request: Queued, reply: _Reply) -> None:
        if isinstance(request, OpenRequest):
            self._open(request, reply)
        else:
            self._step(request, reply)

    def _open(self, request: OpenRequest, reply: _Reply) -> None:
        if request.max_tokens < 1:
            reply.answer(self._count(Failure(ErrorCode.BAD_REQUEST, "max_tokens must be >= 1")))
            return
        key = (request.owner, request.session)
        outcome = self.scheduler.request_open(
            key, request.max_tokens, request.wait_ms, _now_ms(), (request, reply), owner=request.owner
        )
        if isinstance(outcome, Rejection):
            self._reject(outcome, reply)
        elif not isinstance(outcome, Waiter):
            self._bind_and_reply(request, outcome, reply)

    def _bind_and_reply(self, request: OpenRequest, session: Session, reply: _Reply) -> None:
        session.seq = self.backend.open_sequence(request.sampling)
        self.telemetry.admissions_total += 1
        self.telemetry.kv_reserved_peak = max(self.telemetry.kv_reserved_peak, self.scheduler.kv_reserved)
        try:
            reply.deliver(Opened(request.session, session.max_tokens))
        except RequesterGone:
            self._close(session.key, "the requester is gone")

    def _reject(self, why: Rejection, reply: _Reply) -> None:
        if why.code in (ErrorCode.KV_BUDGET, ErrorCode.SESSION_LIMIT, ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN):
            self.telemetry.rejected[why.code] += 1
        if why.quota is not None:
            self.telemetry.quota_refused[why.quota] += 1
        reply.answer(self._count(Failure(why.code, why.message, why.retry_after_ms)))

    def _reject_waiter(self, waiter: Waiter, why: Rejection) -> None:
        _request, reply = cast(tuple[OpenRequest, _Reply], waiter.payload)
        self._reject(why, reply)

    def _step(self, request: StepRequest, reply: _Reply) -> None:
        key = (request.owner, request.session)
        session = self.scheduler.sessions.get(key)
        if session is None:
            reply.answer(self._count(Failure(ErrorCode.UNKNOWN_SESSION, "no such open session on this connection")))
            return
        try:
            self.backend.check_payload(request.tokens, request.hidden, request.out)
        except Refused as exc:
            reply.answer(self._count(Failure(exc.code, str(exc))))
            return
        if request.n < 1:
            reply.answer(self._count(Failure(ErrorCode.BAD_REQUEST, "a step needs n >= 1")))
            return
        rewind = request.pos < session.length and session.step is None
        if rewind and not self.backend.can_rewind(session.seq, request.pos):
            reply.answer(
                self._count(Failure(ErrorCode.POSITION, f"cannot rewind to {request.pos}: outside the sliding window"))
            )
            return
        self._coming_back.discard(key)
        work = _Work(request, reply)
        outcome = self.scheduler.submit(key, request.pos, request.n, request.nbytes, _now_ms(), work)
        if isinstance(outcome, Rejection):
            self._reject(outcome, reply)
            return
        if rewind:
            self._rewind(session.seq, request.pos)

    def _rollback(self, request: Rollback) -> None:
        """Back to `pos`; a session that cannot go back that far is closed instead."""
        key = (request.owner, request.session)
        session = self.scheduler.sessions.get(key)
        if session is None:
            return
        if self.backend.can_rewind(session.seq, request.pos) and self.scheduler.rollback(key, request.pos):
            self._rewind(session.seq, request.pos)
            return
        log.warning("session %r could not be rolled back to %d: closed", request.session, request.pos)
        self._close(key, "the session could not be rolled back")

    def _rewind(self, seq: int, pos: int) -> None:
        """Drop a session's positions pos..; in batch-invariant mode their cells stay held like a
        closed session's (freed in place, they would take other sessions' next tokens)."""
        if self.graveyard is None:
            self.backend.rewind(seq, pos)
        else:
            self.scheduler.hold(self.backend.rewind(seq, pos, hold_in=self.graveyard))

    def _close(self, key: Any, why: str, code: ErrorCode = ErrorCode.UNKNOWN_SESSION) -> bool:
        """Free a session; a step it had pending is answered `code` ("`why` before this step ran")."""
        self._coming_back.discard(key)
        session = self.scheduler.close(key, _now_ms())
        if session is None:
            return False
        if self.graveyard is None:
            self.backend.close_sequence(session.seq)
        else:
            self.scheduler.hold(self.backend.retire_sequence(session.seq, self.graveyard))
            if not self.scheduler.sessions:  # nobody's layout left to protect
                self.backend.release_graveyard(self.graveyard)
                self.telemetry.kv_cells_reclaimed_total += self.scheduler.release_held()
        if session.step is not None:
            work: _Work = session.step.payload  # type: ignore[assignment]
            work.reply.answer(self._count(Failure(code, f"{why} before this step ran")))
        if self.on_close is not None:
            try:
                self.on_close(key[0], key[1])
            except Exception:  # a listener's bug must not stop the batch loop
                log.exception("on_close failed for session %r", key[1])
        return True

    async def _compact(self) -> None:
        """Free closed sessions' held cells while others stay open (batch-invariant mode).

        Runs between iterations, on the compute thread: every open session's cells are
        copied out and put back packed, each in its own order (engine/kv_compaction.py),
        sessions mid-prefill included. A copy that cannot be taken changes nothing; a
        session whose copy cannot be put back is closed, its pending step answered
        `internal`.
        """
        assert self.graveyard is not None
        t = self.telemetry
        started = time.perf_counter()
        result = await self.compute.run(self.backend.compact, self.graveyard)
        t.kv_compaction_seconds_total += time.perf_counter() - started
        if result.failure is not None:
            t.kv_compactions_failed_total += 1
            self.scheduler.compaction_failed()
            log.error("KV compaction skipped, nothing changed: %s", result.failure)
            return
        t.kv_compactions_total += 1
        t.kv_cells_moved_total += result.cells
        t.kv_cells_reclaimed_total += self.scheduler.release_held()
        by_seq = {session.seq: key for key, session in self.scheduler.sessions.items()}
        for seq in result.lost:
            t.kv_sessions_lost_total += 1
            log.error("session %r: llama.cpp would not put its KV cells back after a compaction", by_seq[seq][1])
            self._close(by_seq[seq], "the session's KV cache could not be restored after a compaction",
                        ErrorCode.INTERNAL)  # fmt: skip

    # -- running a call ----------------------------------------------------------------

    def _segments(self, call: Call) -> list[Segment]:
        segments = []
        for chunk in call.chunks:
            work: _Work = self.scheduler.sessions[chunk.key].step.payload  # type: ignore[union-attr,assignment]
            req = work.request
            rows = slice(chunk.offset, chunk.offset + chunk.count)
            out = req.out if chunk.completes or req.out is Output.HIDDEN else Output.NONE
            tokens = None if req.tokens is None else req.tokens[rows]
            hidden = None if req.hidden is None else req.hidden[rows]
            segments.append(Segment(chunk.seq, chunk.pos, tokens, hidden, out))
        if call.pad_rows and self.pad_seq is not None:
            n = call.pad_rows
            if self.info.first:
                segments.append(Segment(self.pad_seq, 0, tokens=np.zeros(n, np.int32), output=Output.PAD))
            else:
                pad = np.zeros((n, self.info.n_embd), np.float32)
                segments.append(Segment(self.pad_seq, 0, hidden=pad, output=Output.PAD))
        return segments

    def _decode_in_thread(self, segments: list[Segment]) -> list[SegmentResult]:
        try:
            return self.backend.decode(segments)
        finally:
            if self.pad_seq is not None:
                self.backend.rewind(self.pad_seq, 0)

    async def _execute(self, plan: Plan) -> None:
        call = plan.calls[0]
        segments = self._segments(call)
        started = time.perf_counter()
        try:
            results = await self.compute.run(self._decode_in_thread, segments)
        except DecodeFailed as exc:
            if exc.outcome is DecodeOutcome.NO_KV_SLOT:
                await self._no_kv_slot(plan)
                return
            log.error("batch failed: %s", exc)
            self._fail(plan, str(exc))
            return
        except (Refused, RuntimeError, ValueError) as exc:
            log.error("batch failed: %s", exc)
            self._fail(plan, str(exc))
            return
        seconds = time.perf_counter() - started
        now = _now_ms()
        if self.config.record_iterations:
            self.iterations.append(self._record(plan, call))
        decode_rows = sum(c.count for c in call.chunks if self._is_decode(c.key))
        prefill_rows = sum(c.count for c in call.chunks) - decode_rows
        self.telemetry.record_batch(time.monotonic(), call.rows, prefill_rows, decode_rows, seconds)
        self._pace.observe(decode_rows, prefill_rows, seconds * 1000)
        finished: list[tuple[_Work, SegmentResult]] = []
        for chunk, result in zip(call.chunks, results, strict=False):
            work: _Work = self.scheduler.sessions[chunk.key].step.payload  # type: ignore[union-attr,assignment]
            if result.hidden is not None:
                work.hidden.append(result.hidden)
            if chunk.completes:
                finished.append((work, result))
        self.scheduler.commit(plan, now, seconds * 1000)
        for work, result in finished:
            self._coming_back.add((work.request.owner, work.request.session))
            try:
                work.reply.deliver(self._done(work, result))
            except RequesterGone:  # nobody will read this session again
                self._close((work.request.owner, work.request.session), "the requester is gone")

    def _is_decode(self, key: Any) -> bool:
        step = self.scheduler.sessions[key].step
        return step is not None and step.is_decode

    def _record(self, plan: Plan, call: Call) -> IterationRecord:
        chunks = []
        for c in call.chunks:
            step = self.scheduler.sessions[c.key].step
            assert step is not None
            chunks.append((c.key, c.pos, c.count, step.is_decode, plan.iteration - step.submitted_iteration))
        return IterationRecord(plan.iteration, tuple(chunks), call.pad_rows)

    def _done(self, work: _Work, last: SegmentResult) -> StepDone:
        req = work.request
        hidden = None
        if req.out is Output.HIDDEN:
            hidden = work.hidden[0] if len(work.hidden) == 1 else np.concatenate(work.hidden)
        max_tokens = self.scheduler.sessions[(req.owner, req.session)].max_tokens
        return StepDone(req.session, req.pos, req.n, req.out, hidden, last.logits, last.token, req.pos + req.n, max_tokens)

    async def _no_kv_slot(self, plan: Plan) -> None:
        """llama.cpp found no contiguous KV slot for the call (it wrote nothing): a transient outcome.

        A call of several chunks runs again as two smaller calls, which need smaller slots
        (not in batch-invariant mode, whose batch shapes are fixed); a step that still finds
        no slot alone is answered `busy`, its session rolled back to where the step began.
        """
        self.telemetry.no_kv_slot_total += 1
        call = plan.calls[0]
        if len(call.chunks) > 1 and not self.config.batch_invariant:
            half = len(call.chunks) // 2
            for part in (call.chunks[:half], call.chunks[half:]):
                live = tuple(c for c in part if self._still_planned(c))
                if live:
                    await self._execute(Plan(plan.iteration, (Call(live),)))
            return
        self._fail(plan, "llama.cpp found no KV slot for this step; retry", ErrorCode.BUSY)

    def _still_planned(self, chunk: Chunk) -> bool:
        """Whether a chunk's step is still waiting for it (an earlier part may have failed the step)."""
        session = self.scheduler.sessions.get(chunk.key)
        step = None if session is None else session.step
        return step is not None and step.pos + step.done == chunk.pos

    def _fail(self, plan: Plan, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        retry = self.scheduler.busy_retry_ms() if code is ErrorCode.BUSY else None
        for step in self.scheduler.fail(plan):
            session = self.scheduler.sessions[step.key]
            work: _Work = step.payload  # type: ignore[assignment]
            if self.backend.can_rewind(session.seq, step.pos):
                self._rewind(session.seq, step.pos)
                if code is ErrorCode.BUSY:
                    work.reply.answer(self._count(Failure(code, message, retry)))
                    continue
                work.reply.answer(
                    self._count(Failure(ErrorCode.INTERNAL, f"the backend failed; session rolled back: {message}"))
                )
            else:
                self._close(step.key, "the backend failed")
                work.reply.answer(
                    self._count(Failure(ErrorCode.INTERNAL, f"the backend failed; session closed: {message}"))
                )

    def _fail_everything_pending(self) -> None:
        for session in self.scheduler.sessions.values():
            if session.step is not None:
                work: _Work = session.step.payload  # type: ignore[assignment]
                session.step = None
                work.reply.answer(
                    self._count(Failure(ErrorCode.SHUTTING_DOWN, "the node stopped before this step ran"))
                )
        for waiter in list(self.scheduler.waiting):
            self._reject_waiter(waiter, Rejection(ErrorCode.SHUTTING_DOWN, "the node stopped"))
        self._inbox_send.close()
        self._drain_inbox(refuse=True)
        for pending in self._cleanups.values():  # the loop is gone, and with it every session
            pending.done.set()
            request = pending.request
            existed = isinstance(request, CloseRequest) and (request.owner, request.session) in self.scheduler.sessions
            _tell(pending.listeners, existed)
        self._cleanups.clear()

    def _count(self, failure: Failure) -> Failure:
        self.telemetry.errors[failure.code] += 1
        return failure

    # -- telemetry ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        s, t, b = self.scheduler, self.telemetry, self.budgets
        now = time.monotonic()
        used = sum(self.backend.length(x.seq) for x in s.sessions.values() if x.seq >= 0)
        return {
            "sessions_active": len(s.sessions),
            "sessions_max": self.config.max_sessions,
            "sessions_waiting": len(s.waiting),
            "admissions_total": t.admissions_total,
            "admissions_rejected_total": dict(t.rejected),
            "queue_depth": s.pending_steps,
            "queue_bytes": s.queued_bytes,
            "queue_budget_bytes": self.config.queue_budget_bytes,
            "batches_total": t.batches_total,
            "batch_rows_last": t.batch_rows_last,
            "decode_batches_total": t.decode_batches_total,
            "decode_rows_total": t.decode_rows_sum,
            "batch_occupancy": round(t.occupancy(self.config.n_batch), 6),
            "kv_cells_used": used,
            "kv_cells_reserved": s.kv_reserved,
            "kv_cells_held": s.kv_held,
            "kv_compactions_total": t.kv_compactions_total,
            "kv_compactions_failed_total": t.kv_compactions_failed_total,
            "kv_compaction_seconds_total": round(t.kv_compaction_seconds_total, 6),
            "kv_cells_reclaimed_total": t.kv_cells_reclaimed_total,
            "kv_cells_moved_total": t.kv_cells_moved_total,
            "kv_sessions_lost_total": t.kv_sessions_lost_total,
            "kv_cells_total": s.config.kv_cells,
            "kv_pressure": round((s.kv_reserved + s.kv_held) / s.config.kv_cells, 6),
            "prefill_tokens_total": t.prefill_tokens_total,
            "decode_tokens_total": t.decode_tokens_total,
            "prefill_tokens_per_s": round(t.prefill_window.rate(now), 3),
            "decode_tokens_per_s": round(t.decode_window.rate(now), 3),
            "weights_bytes": b.weights_bytes,
            "kv_budget_bytes": b.kv_bytes,
            "scratch_bytes": b.scratch_bytes,
            "kernel_path": self.backend.model.kernel_path.value,
            "pad_rows": self.pad_rows if self.config.batch_invariant else 0,
            "micro_batches": s.config.micro_batches,
            "weight_buffers": dict(self.backend.model.weight_buffers),
            "step_seconds": t.step_seconds.snapshot(),
            "errors_total": dict(t.errors),
            "linger_seconds_total": round(t.linger_seconds_total, 4),
            "late_sessions_total": t.late_sessions_total,
            "decode_no_kv_slot_total": t.no_kv_slot_total,
            "cleanups_total": t.cleanups_total,
            "cleanups_pending": len(self._cleanups),
            "inbox_size": self.config.inbox_size,
            "max_sessions_per_peer": s.config.sessions_per_owner,
            "max_waiting_per_peer": s.config.waiting_per_owner,
            "max_queued_per_peer": self.queued_per_peer,
            "peer_quota_refused_total": {q: t.quota_refused[q] for q in ("sessions", "waiting", "queued")},
            "draining": self.draining,
        }


def _now_ms() -> float:
    return time.monotonic() * 1000


def _tell(listeners: list[ClosedListener], existed: bool) -> None:
    """Tell each close whether its session existed: the first merged close closed it, if anyone did."""
    for listener in listeners:
        try:
            listener(existed)
        except Exception:  # a listener's bug must not stop the batch loop
            log.exception("a close listener failed")
        existed = False


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
        backend = await compute.run(StageBackend, config.model, config.context())
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
