"""The token loop of server-side `generate`: step, sample, feed the token back, stream.

Every pass is one ordinary step (so it batches with every other session's), fed the
token the step before it sampled; the step's outcome says the session's length and
`max_tokens`, so the loop never asks the engine where the session stands. Tokens are held
back (and later sent several to a message) while the peer's pipe is full, so a slow
reader costs one growing list bounded by `max_new`, not a message queue.

Speculation (`speculate` > 0): a pass may carry draft tokens after the fed one
(neuron_tai.drafting) and ask for `out: "tokens"`; it yields the drafts the model agrees
with and the model's own next token, each checked against the end rule in order exactly
as if it had come from a pass of its own. The next pass starts after the last token kept,
which rewinds the rejected drafts on every stage of the chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import trio

from engine.engine import Engine
from engine.messages import Rollback
from neuron_tai.drafting import MAX_SPECULATE, Drafter, accepted, window_room
from neuron_tai.generation import MAX_PENDING_CANCELS, EndReason, EndRule, Generation
from neuron_tai.handler_pool import HandlerPool, Held
from neuron_tai.outbox import Outbox
from neuron_tai.steps import SessionGate, StepOutcome, StepRunner
from protocol.errors import ErrorCode, Fault
from transport import wire

Key = tuple[bytes, str]


@dataclass(slots=True)
class _Progress:
    """Where one run stands: the next step's position and input, what it produced, what is unsent."""

    pos: int
    feed: npt.NDArray[np.int32]
    produced: list[int] = field(default_factory=list)
    unsent: int = 0  # the last `unsent` tokens of `produced` are not streamed yet
    passes: int = 0  # steps through the chain that went through
    kv_length: int = 0  # what the session holds after the last pass (past `pos` by rejected drafts)
    max_tokens: int = 0
    busy_since: float | None = None  # when the passes began to be answered `busy` in a row


# How long a run waits out `busy` passes in a row before it fails with it, and the longest
# single wait, whatever `retry_after_ms` a stage below says (it may be anyone's number).
BUSY_PATIENCE_S = 30.0
BUSY_RETRY_MAX_S = 1.0


class Generations:
    """Owns the running generates, by session."""

    def __init__(
        self,
        engine: Engine,
        steps: StepRunner,
        gate: SessionGate,
        pool: HandlerPool,
        outbox: Outbox,
        speculate: int = 0,
    ) -> None:
        self.speculate = speculate  # the node's default for a generate that does not say
        self.engine = engine
        self.steps = steps
        self.gate = gate
        self.pool = pool
        self.outbox = outbox
        self.runs: dict[Key, Generation] = {}
        self.tokens_total = 0

    def start(self, peer: bytes, req: wire.Generate) -> None:
        """Refuse at once what needs no engine; otherwise the run holds the session until `done`."""
        stage, key = self.steps.stage, (peer, req.session)
        fault = None
        if not stage.first:
            where = f"this stage (layers {stage.layers}) takes hidden input: generate at the chain's head"
            fault = Fault(ErrorCode.WRONG_STAGE, where)
        elif self.steps.forwarder is None and not stage.last:
            why = f"this stage (layers {stage.layers}) cannot sample tokens and has no next stage"
            fault = Fault(ErrorCode.WRONG_STAGE, why)
        else:
            fault = self.steps.too_large(req.n)
        if fault is not None:
            self.outbox.error(peer, req.rid, fault, req.session)
            return
        if key in self.gate and self.engine.open_sessions.max_tokens_of(peer, req.session) is not None:
            self.outbox.busy(peer, req.rid, "the session already has a step in flight", req.session)
            return
        run, hold = Generation(), Held(self.steps.held_bytes(req.n, req.tokens.nbytes))

        async def work() -> None:
            await self._run(peer, req, run, hold)

        if self.pool.spawn(peer, req.rid, work, held=hold, on_exit=lambda: self._ended(key, run), session=req.session):
            self.gate.enter(key)
            self.runs[key] = run

    def cancel(self, peer: bytes, req: wire.Cancel) -> None:
        """A session that is not generating is answered at once; otherwise once its `done` is out
        (the run answers its cancels as it ends: no task, so a cancel is never refused for room)."""
        run = self.runs.get((peer, req.session))
        if run is None:
            self.outbox.send(
                peer, _cancelled(req.rid, req.session, self.engine.open_sessions.length_of(peer, req.session) or 0)
            )
        elif len(run.cancels) >= MAX_PENDING_CANCELS:
            why = f"this session's generation already has {MAX_PENDING_CANCELS} cancels waiting for its end"
            self.outbox.busy(peer, req.rid, why)
        else:
            run.cancels.append(req.rid)
            run.cancel.set()

    def stop_all(self, peer: bytes) -> None:
        """The peer is gone: its runs end at their next token."""
        for key, run in self.runs.items():
            if key[0] == peer:
                run.cancel.set()

    def _ended(self, key: Key, run: Generation) -> None:
        self.engine.steps_ended(*key)  # before a later run's first step can be queued
        for rid in run.cancels:  # after the run's `done`
            self.outbox.send(key[0], _cancelled(rid, key[1], run.length))
        if self.runs.get(key) is run:
            del self.runs[key]
        self.gate.leave(key)
        if run.then_close is not None:  # its `done` is out: now the close it was stopped for
            run.then_close()

    async def _waits_out(self, outcome: object, progress: _Progress, cancel: trio.Event) -> bool:
        """Whether a `busy` mid-run was waited out, to try the pass again. A full queue is this
        node's own congestion (or a stage's below): the run waits its turn (a one-token step
        always fits again) instead of failing the client's generation, for up to
        `BUSY_PATIENCE_S` in a row; a stage busy for longer fails the run with it. A wait is at
        most `BUSY_RETRY_MAX_S` whatever `retry_after_ms` says, and a `cancel` ends it."""
        if not (isinstance(outcome, Fault) and outcome.code is ErrorCode.BUSY and progress.produced):
            progress.busy_since = None
            return False
        now = trio.current_time()
        progress.busy_since = now if progress.busy_since is None else progress.busy_since
        if now - progress.busy_since >= BUSY_PATIENCE_S:
            return False
        with trio.move_on_after(min(max(outcome.retry_after_ms or 0, 1) / 1000, BUSY_RETRY_MAX_S)):
            await cancel.wait()
        return True

    async def _run(self, peer: bytes, req: wire.Generate, run: Generation, hold: Held) -> None:
        """Step until a token or `cancel` ends the run; then `done` (or the error that ended it)."""
        rule = EndRule(req.max_new, req.stop, frozenset() if req.ignore_eog else self.engine.eog_tokens)
        progress = _Progress(req.pos, req.tokens)
        speculate = self._speculate(req)
        drafter = Drafter.of(req.tokens, speculate) if speculate else None
        reason: EndReason | None = None
        while reason is None:
            if run.cancel.is_set():
                reason = EndReason.CANCELLED
                break
            drafts = self._drafts(drafter, progress, rule)
            outcome = await self.steps.run(peer, _pass(req, progress, drafts))
            if await self._waits_out(outcome, progress, run.cancel):
                continue
            if isinstance(outcome, Fault):
                await self._failed(peer, req, run, progress, outcome)
                return
            if not progress.produced:  # from now on each step is one token and its drafts
                self.pool.release(peer, hold, self.steps.held_bytes(1 + speculate, req.tokens.nbytes))
            reason = self._advance(progress, outcome, rule, drafts, drafter)
            if not self._stream(peer, req, progress, flush=False):
                return  # the peer is gone: its session is being freed
        if not self._stream(peer, req, progress, flush=True):  # what a full pipe held back, whatever ended the run
            return
        # Drafts a last pass left past the run's end leave this stage's KV now, so its length is the
        # `done`'s; stages below drop theirs with the session's next step.
        if progress.produced:
            await self._cut(peer, req.session, progress.kv_length, progress.pos)
        self._done(peer, req, run, progress, reason, passes=progress.passes if self._requested(req) else None)

    def _requested(self, req: wire.Generate) -> int:
        """The drafts per pass asked for: the request's, or the node's default (`done` then counts passes)."""
        return self.speculate if req.speculate is None else req.speculate

    def _speculate(self, req: wire.Generate) -> int:
        """Draft tokens per pass for this run: those asked for, within what one step carries on
        every stage this node has reached below it (a stage below refuses a longer step)."""
        max_step = self.steps.stage.max_step_tokens
        forwarder = self.steps.forwarder
        if forwarder is not None and forwarder.chain_max_step_tokens is not None:
            max_step = min(max_step, forwarder.chain_max_step_tokens)
        return max(0, min(self._requested(req), MAX_SPECULATE, max_step - 1))

    def _drafts(self, drafter: Drafter | None, progress: _Progress, rule: EndRule) -> list[int]:
        """Drafts for the next pass: none on the prompt's pass, none past `max_new` or `max_tokens`,
        none that an unpinned sliding-window cache could not undo."""
        if drafter is None or not progress.produced:
            return []
        room = min(rule.max_new - len(progress.produced), progress.max_tokens - progress.pos) - 1
        room = window_room(room, progress.pos, self.engine.unpinned_window)
        return drafter.draft(room) if room > 0 else []

    def _advance(
        self, progress: _Progress, outcome: StepOutcome, rule: EndRule, drafts: list[int], drafter: Drafter | None
    ) -> EndReason | None:
        """Take a pass's tokens in order, each as if it had come from a pass of its own, until one ends the run."""
        tokens = accepted(drafts, outcome.result.data.tolist()) if drafts else [outcome.token]
        if drafter is not None:
            drafter.passed(drafts, tokens)
        progress.passes += 1
        progress.kv_length, progress.max_tokens = outcome.length, outcome.max_tokens
        first_length = outcome.length - len(drafts)  # where the pass's first token goes
        reason = None
        for i, token in enumerate(tokens):
            progress.produced.append(token)
            progress.unsent += 1
            self.tokens_total += 1
            progress.pos, progress.feed = first_length + i, np.array([token], np.int32)
            reason = rule.reason(token, len(progress.produced), progress.pos, outcome.max_tokens)
            if reason is not None:
                break
        return reason

    async def _cut(self, peer: bytes, session: str, length: int, keep: int) -> int:
        """This stage's KV of the session cut back to `keep` positions if it holds more (`length`);
        the length it holds after."""
        if length <= keep:
            return length
        await self.engine.cleanup(Rollback(peer, session, keep))
        return keep

    def _stream(self, peer: bytes, req: wire.Generate, progress: _Progress, *, flush: bool) -> bool:
        """Stream the unsent tokens as one `generated` message unless the peer's pipe is full."""
        if not req.stream or not progress.unsent or not (flush or not self.outbox.pump.backlog(peer)):
            return True
        first = len(progress.produced) - progress.unsent
        progress.unsent = 0
        ids = np.array(progress.produced[first:], np.int32)
        generated = wire.Generated(req.rid, req.session, req.pos + req.n + first, ids)
        return self.outbox.deliver(peer, req.session, wire.encode_reply(generated))

    async def _failed(
        self, peer: bytes, req: wire.Generate, run: Generation, progress: _Progress, fault: Fault
    ) -> None:
        """The session keeps every token streamed before the error (a run that does not stream
        delivered none: it keeps the prompt); `length` says where it stands."""
        if not self._stream(peer, req, progress, flush=True):
            return
        # Where the session stands now (a failed recovery rebuilt it to the pass's `pos`, or as
        # far as it could); never past the last token kept (a pass's rejected drafts may still
        # be in the KV).
        kept = progress.pos if req.stream else req.pos + req.n
        run.length = self.engine.open_sessions.length_of(peer, req.session) or 0
        if progress.produced:
            run.length = await self._cut(peer, req.session, run.length, kept)
        self.outbox.send(peer, wire.encode_reply(wire.ErrorReply.of(fault, req.rid, req.session, run.length)))

    def _done(
        self,
        peer: bytes,
        req: wire.Generate,
        run: Generation,
        progress: _Progress,
        reason: EndReason | None,
        passes: int | None,
    ) -> None:
        produced = progress.produced
        run.length = progress.pos if produced else (self.engine.open_sessions.length_of(peer, req.session) or 0)
        tokens = None if req.stream else np.array(produced, np.int32)
        done = wire.Done(req.rid, req.session, str(reason), len(produced), run.length, tokens, passes)
        self.outbox.deliver(peer, req.session, wire.encode_reply(done))


def _pass(req: wire.Generate, progress: _Progress, drafts: list[int]) -> wire.Step:
    """The step of one pass: the fed token(s), then any drafts to verify (`out: "tokens"`)."""
    if not drafts:
        feed = progress.feed
        return wire.Step(req.rid, req.session, progress.pos, len(feed), "tokens", "token", "f32", tokens=feed)
    feed = np.concatenate([progress.feed, np.array(drafts, np.int32)])
    return wire.Step(req.rid, req.session, progress.pos, len(feed), "tokens", "tokens", "f32", tokens=feed)


def _cancelled(rid: int, session: str, length: int) -> list[bytes]:
    return wire.encode_reply(wire.Cancelled(rid, session, length))
