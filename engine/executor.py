"""Running one planned llama_decode call: its segments, the decode on the compute thread, the answers.

A call that finds no KV slot is split and run again (not in batch-invariant mode); a call
that fails otherwise sets its sessions back to where their steps began, or closes those
that cannot go back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backend import DecodeFailed, DecodeOutcome, Segment, SegmentResult, StageBackend
from engine.call_split import DecodeCallCosts
from engine.compute_thread import ComputeThread
from engine.messages import EndReason, Output, StepDone
from engine.pacing import PrefillPace
from engine.replies import RequesterGone, Work
from engine.row_blocks import MeasuredFillers
from engine.scheduler import Call, Chunk, Plan, Session, Step
from engine.sessions import Sessions, now_ms
from protocol.errors import ErrorCode, Fault

log = logging.getLogger("neuron_tai.engine")

_EVERY_ROW = (Output.HIDDEN, Output.TOKENS)  # outputs every chunk of a step gives, not only its last


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One llama_decode call of the loop: (session, pos, rows, is_decode, iterations waited) per chunk."""

    iteration: int
    chunks: tuple[tuple[Any, int, int, bool, int], ...]
    pad_rows: int


class Executor:
    """Runs the scheduler's calls on the backend, in the engine task (the decode itself on the compute thread)."""

    def __init__(
        self,
        sessions: Sessions,
        compute: ComputeThread,
        pad_seq: int | None,
        *,
        split_on_no_slot: bool,
        record_iterations: bool,
        halve_decodes: bool = False,
    ) -> None:
        self.sessions = sessions
        self.scheduler = sessions.scheduler
        self.backend: StageBackend = sessions.backend
        self.telemetry = sessions.telemetry
        self.compute = compute
        self.pad_seq = pad_seq  # the sequence padding and filler rows run in
        self.split_on_no_slot = split_on_no_slot
        self.record_iterations = record_iterations
        self.iterations: deque[IterationRecord] = deque(maxlen=100_000)  # when record_iterations
        self.pace = PrefillPace(row_multiple=self.scheduler.config.row_multiple)
        self.call_costs = DecodeCallCosts()
        self.fillers = MeasuredFillers()  # what Scheduler.plan asks of a call of only decodes
        self.halves = self.call_costs.halves if halve_decodes else None  # what Scheduler.plan asks
        self._halved_so_far = (0, 0)  # decode rows and calls computed of the halved iteration under way
        self._call_ended = 0.0  # perf_counter when the last call's compute returned

    async def run_calls(self, plan: Plan, between: Callable[[], Awaitable[None]]) -> None:
        """Each of the plan's calls in turn, awaiting `between` them (the engine's hand-over)."""
        if plan.halved:
            self.telemetry.halved_total += 1
        first_started = time.perf_counter()
        for i, call in enumerate(plan.calls):
            if i:
                await between()
            await self.run(Plan(plan.iteration, (call,), plan.halved))
        self._end_iteration(len(plan.calls), (self._call_ended - first_started) * 1000)

    async def run(self, plan: Plan) -> None:
        """Run the plan's one call and answer the steps it completes."""
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
        except (Fault, RuntimeError, ValueError) as exc:
            log.error("batch failed: %s", exc)
            self._fail(plan, str(exc))
            return
        self._call_ended = time.perf_counter()
        seconds = self._call_ended - started
        self._observe(plan, call, seconds)
        last: dict[Any, SegmentResult] = {}
        for chunk, result in zip(call.chunks, results, strict=False):
            if result.hidden is not None:
                self._step(chunk).payload.hidden.append(result.hidden)
            if result.tokens is not None:
                self._step(chunk).payload.tokens.append(result.tokens)
            if chunk.completes:
                last[chunk.key] = result
        for step in self.scheduler.commit(plan, now_ms(), seconds * 1000):
            self._answer(step, last[step.key])

    def _step(self, chunk: Chunk) -> Step[Work]:
        step = self.scheduler.sessions[chunk.key].step
        assert step is not None, "a planned chunk's step is pending until it completes"
        return step

    def _observe(self, plan: Plan, call: Call, seconds: float) -> None:
        if self.record_iterations:
            self.iterations.append(self._record(plan, call))
        decode_rows = sum(c.count for c in call.chunks if self._step(c).is_decode)
        prefill_rows = sum(c.count for c in call.chunks) - decode_rows
        self.telemetry.record_batch(time.monotonic(), call.rows, prefill_rows, decode_rows, seconds)
        self.telemetry.padding_rows_total += call.pad_rows
        if decode_rows and not prefill_rows:
            if self.scheduler.config.row_blocks:
                self.fillers.observe(decode_rows, call.pad_rows > 0, seconds * 1000)
            if self.halves is not None and not plan.halved:
                self.call_costs.observe(decode_rows, seconds * 1000)
        if plan.halved:  # the sessions of both calls wait for both: one gap, seen once
            rows, calls = self._halved_so_far
            self._halved_so_far = (rows + decode_rows, calls + 1)
        else:
            self.pace.observe(decode_rows, prefill_rows, seconds * 1000)

    def _end_iteration(self, planned: int, ms: float) -> None:
        """After an iteration's `planned` calls, `ms` from the first call's start to the last one's
        end: a halved one is one decode-only gap to the pace and, when every call of it computed,
        one measurement of halving its rows. The span holds the hand-over between the calls and the
        first call's answers: what a second call costs the node, not llama.cpp alone (a whole call
        is measured by its compute, with none of either)."""
        rows, calls = self._halved_so_far
        if rows:
            self.pace.observe(rows, 0, ms)
        if rows and calls == planned:  # only a plan asked `halves` is halved
            self.call_costs.observe_halved(rows, ms)
        self._halved_so_far = (0, 0)

    def _answer(self, step: Step[Work], last: SegmentResult) -> None:
        """A completed step's result, with its session's state after it, to its requester."""
        session = self.scheduler.sessions[step.key]
        self.sessions.answered(step.key, step.is_decode)
        try:
            step.payload.reply.deliver(_done(step.payload, last, session))
        except RequesterGone:  # nobody will read this session again
            self.sessions.close(step.key, EndReason.REQUESTER_GONE, "the requester is gone")

    def _segments(self, call: Call) -> list[Segment]:
        segments = []
        for chunk in call.chunks:
            req = self._step(chunk).payload.request
            rows = slice(chunk.offset, chunk.offset + chunk.count)
            out = req.out if chunk.completes or req.out in _EVERY_ROW else Output.NONE
            tokens = None if req.tokens is None else req.tokens[rows]
            hidden = None if req.hidden is None else req.hidden[rows]
            segments.append(Segment(chunk.seq, chunk.pos, tokens, hidden, out, continues=chunk.offset > 0))
        if call.pad_rows and self.pad_seq is not None:
            segments.append(self._padding(call.pad_rows))
        return segments

    def _padding(self, n: int) -> Segment:
        """`n` rows of the padding sequence: computed as outputs in batch-invariant mode (a
        fixed batch shape), without outputs as fillers (engine/row_blocks.py)."""
        assert self.pad_seq is not None
        out = Output.PAD if self.scheduler.config.batch_invariant else Output.NONE
        if self.backend.info.first:
            return Segment(self.pad_seq, 0, tokens=np.zeros(n, np.int32), output=out)
        return Segment(self.pad_seq, 0, hidden=np.zeros((n, self.backend.info.n_embd), np.float32), output=out)

    def _decode_in_thread(self, segments: list[Segment]) -> list[SegmentResult]:
        try:
            return self.backend.decode(segments)
        finally:
            if segments[-1].seq == self.pad_seq:
                self.backend.rewind(self.pad_seq, 0)

    def _record(self, plan: Plan, call: Call) -> IterationRecord:
        chunks = []
        for c in call.chunks:
            step = self._step(c)
            chunks.append((c.key, c.pos, c.count, step.is_decode, plan.iteration - step.submitted_iteration))
        return IterationRecord(plan.iteration, tuple(chunks), call.pad_rows)

    async def _no_kv_slot(self, plan: Plan) -> None:
        """llama.cpp found no contiguous KV slot for the call (it wrote nothing): a transient outcome.

        A call of several chunks runs again as two smaller calls, which need smaller slots
        (not in batch-invariant mode, whose batch shapes are fixed); a step that still finds
        no slot alone is answered `busy`, its session rolled back to where the step began.
        """
        self.telemetry.no_kv_slot_total += 1
        call = plan.calls[0]
        if len(call.chunks) > 1 and self.split_on_no_slot:
            half = len(call.chunks) // 2
            for part in (call.chunks[:half], call.chunks[half:]):
                live = tuple(c for c in part if self._still_planned(c))
                if live:
                    await self.run(Plan(plan.iteration, (Call(live),)))
            return
        self._fail(plan, "llama.cpp found no KV slot for this step; retry", ErrorCode.BUSY)

    def _still_planned(self, chunk: Chunk) -> bool:
        """Whether a chunk's step is still waiting for it (an earlier part may have failed the step)."""
        session = self.scheduler.sessions.get(chunk.key)
        step = None if session is None else session.step
        return step is not None and step.pos + step.done == chunk.pos

    def _fail(self, plan: Plan, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        """Set each step's session back to where the step began (or close it) and answer the step."""
        counted = self.telemetry.counted
        for step in self.scheduler.fail(plan):
            session = self.scheduler.sessions[step.key]
            reply = step.payload.reply
            if not self.backend.can_rewind(session.seq, step.pos):
                self.sessions.close(step.key, EndReason.BACKEND_FAILED, "the backend failed")
                reply.answer(counted(Fault(ErrorCode.INTERNAL, f"the backend failed; session closed: {message}")))
                continue
            self.sessions.rewind(session.seq, step.pos)
            if code is ErrorCode.BUSY:
                reply.answer(counted(Fault(code, message, self.scheduler.estimates.busy_retry_ms())))
            else:
                reply.answer(counted(Fault(ErrorCode.INTERNAL, f"the backend failed; session rolled back: {message}")))


def _done(work: Work, last: SegmentResult, session: Session[Work]) -> StepDone:
    req = work.request
    hidden = tokens = None
    if req.out is Output.HIDDEN:
        hidden = work.hidden[0] if len(work.hidden) == 1 else np.concatenate(work.hidden)
    if req.out is Output.TOKENS:
        tokens = work.tokens[0] if len(work.tokens) == 1 else np.concatenate(work.tokens)
    return StepDone(
        req.session,
        req.pos,
        req.n,
        req.out,
        session.length,
        session.max_tokens,
        hidden,
        last.logits,
        last.token,
        tokens,
        session.opening,
    )
