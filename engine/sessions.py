"""Sessions: the scheduler's sessions bound to the backend's sequences, in the engine task.

Opening binds a sequence, a step is checked (its payload here, its session state by the
scheduler) and queued, a rollback or a rewind drops positions, and closing frees the
sequence, answers a step it had pending and posts the end (`SessionEnded`) for the node.
In batch-invariant mode what a session drops stays held in the graveyard sequence until a
compaction (engine/compaction.py) frees it.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from engine.backend import StageBackend
from engine.cleanups import PendingCleanup, tell
from engine.linger import Turnarounds
from engine.messages import (
    CloseAnswered,
    CloseRequest,
    EndReason,
    Opened,
    OpenRequest,
    Rollback,
    SessionEnded,
    StepRequest,
)
from engine.replies import Opening, Reply, RequesterGone, Work
from engine.scheduler import Scheduler, Session, SessionKey, Waiter, idle_sessions
from engine.session_ends import SessionEnds
from engine.telemetry import Telemetry
from protocol.errors import ErrorCode, Fault

log = logging.getLogger("neuron_tai.engine")

EngineScheduler = Scheduler[Work, Opening]
# Refusals of an open counted in `admissions_rejected_total`: those about room, not about the request.
_ADMISSION_CODES = (ErrorCode.KV_BUDGET, ErrorCode.SESSION_LIMIT, ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN)


def now_ms() -> float:
    return time.monotonic() * 1000


class SessionActivity(Protocol):
    """What the engine's owner knows of its sessions beyond the engine: a step still on its way
    (through the stages below, after this stage's part ended) and when each was last answered."""

    def __contains__(self, key: object) -> bool: ...

    def answered_ms(self, key: SessionKey) -> float | None: ...


class Sessions:
    """What happens to sessions, in the engine task only (it owns the scheduler and the backend)."""

    def __init__(
        self,
        scheduler: EngineScheduler,
        backend: StageBackend,
        telemetry: Telemetry,
        ends: SessionEnds,
        graveyard: int | None,
    ) -> None:
        self.scheduler = scheduler
        self.backend = backend
        self.telemetry = telemetry
        self.ends = ends
        self.graveyard = graveyard  # batch-invariant mode: where dropped cells stay held
        # Answered, next step not here yet: kept until their group runs again (then they are late).
        self.coming_back: set[SessionKey] = set()
        self.answered_at: dict[SessionKey, float] = {}  # decodes: ms, until the next step comes (or it ends)
        self.turnarounds = Turnarounds()  # how long that takes: what a chain's head lingers for
        # The node's callback from before `session_ends`, called (owner, session) in the engine
        # task for each session freed; it goes once the node reads `Engine.session_ends`.

    # -- opening -------------------------------------------------------------------

    def open(self, request: OpenRequest, reply: Reply) -> None:
        opening = Opening(request, reply)
        key = (request.owner, request.session)
        wait_ms, owner = request.wait_ms, request.owner
        outcome = self.scheduler.request_open(key, request.max_tokens, wait_ms, now_ms(), opening, owner=owner)
        if isinstance(outcome, Fault):
            self.refuse(outcome, reply)
        elif isinstance(outcome, Session):
            self.bind(opening, outcome)

    def bind(self, opening: Opening, session: Session[Work]) -> None:
        """Give an admitted session its sequence, and its requester the news."""
        session.seq = self.backend.open_sequence(opening.request.sampling)
        # Its requester sends the first step on this news: expected as after an answered prompt,
        # so sessions opened together prefill together.
        self.answered(session.key, decode=False)
        self.telemetry.admissions_total += 1
        self.telemetry.kv_reserved_peak = max(self.telemetry.kv_reserved_peak, self.scheduler.kv_reserved)
        try:
            opening.reply.deliver(Opened(opening.request.session, session.max_tokens))
        except RequesterGone:
            self.close(session.key, EndReason.REQUESTER_GONE, "the requester is gone")

    def admit_waiting(self) -> None:
        """Opens that waited: admit those that fit now, refuse those whose wait is over."""
        admitted, expired = self.scheduler.poll_waiting(now_ms())
        for waiter, session in admitted:
            self.bind(waiter.payload, session)
        for waiter, why in expired:
            self.refuse_waiter(waiter, why)

    def refuse(self, why: Fault, reply: Reply) -> None:
        if why.code in _ADMISSION_CODES:
            self.telemetry.rejected[why.code] += 1
        reply.answer(self.telemetry.counted(why))

    def refuse_waiter(self, waiter: Waiter[Opening], why: Fault) -> None:
        self.refuse(why, waiter.payload.reply)

    # -- steps ---------------------------------------------------------------------

    def answered(self, key: SessionKey, decode: bool) -> None:
        """A step of the session was answered: its next one is expected (for linger), and a
        decode's turnaround is timed (the group's rhythm; a prompt's is its own). A chain's
        head does not hold a group for a session whose prompt it just answered: the stages
        below prefill that prompt before its next step comes, and it does not hold one for a
        session just opened either (`bind`: a group's wait is up to a step, too long for a
        newcomer's first step). A stage fed by another expects
        nobody (its upstream sets the rhythm), so it counts nobody late either. Only a chain's
        head lingers by the turnaround, so only it times one."""
        first, groups = self.backend.info.first, self.scheduler.config.micro_batches
        if first and (decode or groups == 1):
            self.coming_back.add(key)
        if first and decode and groups > 1:
            self.answered_at[key] = now_ms()

    def expects(self, key: SessionKey) -> bool:
        """Whether the session's next step is expected (a step was answered, none came since)."""
        return key in self.coming_back

    def steps_ended(self, key: SessionKey) -> None:
        """The session's requester sends no further step for now: nobody waits for one."""
        self.coming_back.discard(key)
        self.answered_at.pop(key, None)

    def step(self, request: StepRequest, reply: Reply) -> None:
        """Check a step's payload (once: the decode does not scan it again) and queue it; the
        scheduler checks its session's state."""
        try:
            self.backend.check_payload(request.tokens, request.hidden, request.out)
        except Fault as fault:
            reply.answer(self.telemetry.counted(fault))
            return
        key = (request.owner, request.session)
        self.coming_back.discard(key)
        answered = self.answered_at.pop(key, None)
        if answered is not None:
            self.turnarounds.observe(now_ms() - answered)
        session = self.scheduler.sessions.get(key)
        length = 0 if session is None else session.length
        outcome = self.scheduler.submit(
            key, request.pos, request.n, request.nbytes, now_ms(), Work(request, reply), self.backend.can_rewind
        )
        if isinstance(outcome, Fault):
            self.refuse(outcome, reply)
        elif session is not None and request.pos < length:
            self.rewind(session.seq, request.pos)

    def rollback(self, request: Rollback) -> None:
        """Back to `pos`; a session that cannot go back that far is closed instead."""
        key = (request.owner, request.session)
        session = self.scheduler.sessions.get(key)
        if session is None or request.opening not in (None, session.opening):
            return
        if self.backend.can_rewind(session.seq, request.pos) and self.scheduler.rollback(key, request.pos):
            self.rewind(session.seq, request.pos)
            return
        log.warning("session %r could not be rolled back to %d: closed", request.session, request.pos)
        self.close(key, EndReason.ROLLBACK_FAILED, "the session could not be rolled back")

    def rewind(self, seq: int, pos: int) -> None:
        """Drop a session's positions pos..; in batch-invariant mode their cells stay held like a
        closed session's (freed in place, they would take other sessions' next tokens)."""
        if self.graveyard is None:
            self.backend.rewind(seq, pos)
        else:
            self.scheduler.hold(self.backend.rewind(seq, pos, hold_in=self.graveyard))

    # -- ends ----------------------------------------------------------------------

    def close(self, key: SessionKey, reason: EndReason, why: str, code: ErrorCode = ErrorCode.UNKNOWN_SESSION) -> bool:
        """Free a session; a step it had pending is answered `code` ("`why` before this step ran")."""
        self.coming_back.discard(key)
        self.answered_at.pop(key, None)
        session = self.scheduler.close(key, now_ms())
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
            session.step.payload.reply.answer(self.telemetry.counted(Fault(code, f"{why} before this step ran")))
        self.ends.post(SessionEnded(key[0], key[1], reason))
        return True

    def clean(self, pending: PendingCleanup) -> None:
        """Run one cleanup (close, rollback, or a gone connection) and answer its closes."""
        request = pending.request
        existed = False
        if isinstance(request, CloseRequest):
            existed = self.close((request.owner, request.session), EndReason.CLOSED, "the session was closed")
        elif isinstance(request, Rollback):
            self.rollback(request)
        else:
            for key in [k for k in self.scheduler.sessions if k[0] == request.owner]:
                self.close(key, EndReason.OWNER_GONE, "the session's connection is gone")
            for waiter in self.scheduler.drop_waiting(request.owner):  # nobody reads the answer: no task hangs
                self.refuse_waiter(waiter, Fault(ErrorCode.UNKNOWN_SESSION, "the connection is gone"))
        self.answer_closes(pending, existed)

    def answer_closes(self, pending: PendingCleanup, existed: bool) -> None:
        """A cleanup is done: wake who waits for it, and answer each close merged into it."""
        pending.done.set()
        tell(pending.listeners, existed)
        request = pending.request
        if isinstance(request, CloseRequest):
            for i in range(pending.closes):
                self.ends.post(CloseAnswered(request.owner, request.session, existed and i == 0))

    def close_idle(self, idle_ms: float, activity: SessionActivity | None) -> None:
        """Close the sessions quiet for `idle_ms`: no step here, none on its way below, none
        answered since."""
        now = now_ms()
        if activity is not None:
            for key, session in self.scheduler.sessions.items():
                seen = now if key in activity else activity.answered_ms(key)
                session.last_active_ms = max(session.last_active_ms, seen or 0.0)
        for key in idle_sessions(self.scheduler.sessions, now, idle_ms):
            log.info("closing idle session %r", key[1])
            self.close(key, EndReason.IDLE, "the session was idle for too long")

    def fail_everything_pending(self) -> None:
        """The loop stopped: every pending step and waiting open is answered `shutting_down`, and
        every session still open has ended (the backend, closed next, frees them all)."""
        for key, session in self.scheduler.sessions.items():
            self.ends.post(SessionEnded(key[0], key[1], EndReason.SHUTDOWN))
            if session.step is not None:
                work = session.step.payload
                session.step = None
                work.reply.answer(
                    self.telemetry.counted(Fault(ErrorCode.SHUTTING_DOWN, "the node stopped before this step ran"))
                )
        for waiter in list(self.scheduler.waiting):
            self.refuse_waiter(waiter, Fault(ErrorCode.SHUTTING_DOWN, "the node stopped"))
