"""A `step` through this stage and, with a next stage, the rest of the chain.

The step runs in the engine; on a chain's head its hidden states go on to the next
stage, whose answer is the step's. A step longer than `part_rows` (a prompt) goes on in
parts (neuron_tai/step_parts.py): part k is sent while part k+1 computes here. If the next
stage does not take the step, it is undone here (rolled back to its `pos`) before the
requester hears why: a failed step leaves the session here as it was, and the next stage
drops what it took of it at the session's next step, which rewinds there. The outcome
stays a typed value, carrying the session's length and `max_tokens`, until the edge
writes it to a socket.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import trio

from engine.engine import Engine
from engine.messages import Output, Rollback, StepDone, StepRequest
from engine.sessions import now_ms
from neuron_tai.forwarding import BrokenRoute, Forwarder
from neuron_tai.recovery import Recovery
from neuron_tai.step_parts import step_parts
from protocol.errors import ErrorCode, Fault
from protocol.stage import Stage
from transport import wire

Key = tuple[bytes, str]

_OUT = {"hidden": Output.HIDDEN, "token": Output.TOKEN, "logits": Output.LOGITS, "tokens": Output.TOKENS}


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """A step's `result` from the last stage it reached, with where the session stands here."""

    result: wire.Result
    length: int  # the session's length after the step
    max_tokens: int

    @property
    def token(self) -> int:
        return self.result.token

    def frames(self, rid: int, session: str) -> list[bytes]:
        """The `result` reply to the request `rid` (this side's session name)."""
        return wire.encode_reply(replace(self.result, rid=rid, session=session))


def _local(done: StepDone, req: wire.Step) -> StepOutcome:
    data: npt.NDArray[Any]
    if done.hidden is not None:
        data = done.hidden
    elif done.logits is not None:
        data = done.logits
    elif done.tokens is not None:
        data = done.tokens
    else:
        data = np.array([done.token], np.int32)
    result = wire.Result(req.rid, req.session, req.pos, req.n, req.out, data, req.out_dtype)
    return StepOutcome(result, done.length, done.max_tokens)


class SessionGate:
    """Sessions with a step (or a generate) between arrival and reply, through the whole chain.

    While one is in flight another is `busy`. A count, not a flag: steps for a session that
    does not exist all go on, to be answered `unknown_session` by the engine.
    """

    def __init__(self, is_open: Callable[[Key], bool]) -> None:
        self.in_flight: Counter[Key] = Counter()
        self.is_open = is_open  # whether the engine holds the session (else nothing is kept for it)
        self._answered_ms: dict[Key, float] = {}  # open sessions only: forgotten when they end

    def enter(self, key: Key) -> None:
        self.in_flight[key] += 1

    def leave(self, key: Key) -> None:
        self.in_flight[key] -= 1
        if not self.in_flight[key]:
            del self.in_flight[key]
            if self.is_open(key):
                self._answered_ms[key] = now_ms()

    def answered_ms(self, key: tuple[Any, str]) -> float | None:
        """When the session's last step was answered (the engine's clock)."""
        return self._answered_ms.get(key)

    def forget(self, key: Key) -> None:
        """The session ended."""
        self._answered_ms.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return self.in_flight[key] > 0  # type: ignore[index]


@dataclass(frozen=True, slots=True)
class RecoveryLimits:
    """How hard a chain's head tries to recover a session whose route broke (0 attempts: never)."""

    attempts: int = 3
    deadline_s: float = 30.0


class StepRunner:
    def __init__(
        self,
        engine: Engine,
        stage: Stage,
        forwarder: Forwarder | None,
        recovery: RecoveryLimits = RecoveryLimits(),
        part_rows: int = 0,
    ) -> None:
        self.engine = engine
        self.stage = stage
        self.forwarder = forwarder
        self.part_rows = part_rows  # a longer step goes on in parts of this many rows (0: whole)
        self.recovery: Recovery[StepOutcome] | None = None
        if forwarder is not None and stage.first and recovery.attempts > 0:  # only the head sees tokens
            self.recovery = Recovery(
                forwarder,
                self._once,
                self._here,
                max_step_tokens=stage.max_step_tokens,
                attempts=recovery.attempts,
                deadline_s=recovery.deadline_s,
            )

    def refusal(self, req: wire.Step) -> Fault | None:
        """What this stage refuses before any work: input or output it does not serve, or too many tokens."""
        stage = self.stage
        if req.input == "tokens" and not stage.first:
            return Fault(ErrorCode.WRONG_STAGE, f"this stage (layers {stage.layers}) takes hidden input")
        if req.input == "hidden" and stage.first:
            return Fault(ErrorCode.WRONG_STAGE, "this is a first stage: it takes token input")
        if self.forwarder is None and (req.out == "hidden") == stage.last:
            want = "'token', 'tokens' or 'logits'" if stage.last else "'hidden'"
            return Fault(ErrorCode.WRONG_STAGE, f"this stage (layers {stage.layers}) gives out={want}")
        return self.too_large(req.n)

    def too_large(self, n: int) -> Fault | None:
        """A step (or a generate's first) longer than this stage takes is refused before it holds anything."""
        limit = self.stage.max_step_tokens
        return Fault(ErrorCode.TOO_LARGE, f"n={n} exceeds max_step_tokens {limit}") if n > limit else None

    def held_bytes(self, n: int, payload: int) -> int:
        """What a step of `n` positions holds while in progress: its payload, and with a next
        stage the hidden states (f32) it sends there and keeps until that stage answers."""
        return payload + (n * self.stage.n_embd * 4 if self.forwarder is not None else 0)

    async def run(self, peer: bytes, req: wire.Step) -> StepOutcome | Fault:
        """The step's outcome, or the fault to answer instead (the session left as it was).
        A fault decided here was counted here; the engine's and the next stage's, where decided.
        At a chain's head a broken route is recovered first (neuron_tai.recovery)."""
        outcome = await self._once(peer, req)
        if isinstance(outcome, BrokenRoute):
            if self.recovery is None:
                self.engine.count_error(outcome.fault.code)
                return outcome.fault
            outcome = await self.recovery.recover(peer, req, outcome)
        if self.recovery is not None and isinstance(outcome, StepOutcome) and req.tokens is not None:
            self._remember(peer, req.session, req.pos, req.tokens)
        return outcome

    def _remember(self, peer: bytes, session: str, pos: int, tokens: npt.NDArray[np.int32]) -> None:
        """Keep a step's tokens for recovery, unless the session was freed while it was below."""
        if self.recovery is not None and self.engine.open_sessions.max_tokens_of(peer, session) is not None:
            self.recovery.histories.record((peer, session), pos, tokens)

    def session_freed(self, peer: bytes, session: str) -> None:
        """The engine freed the session. Its end is read a little later than it happened: a
        session of the same name opened again meanwhile is left alone."""
        if self.engine.open_sessions.max_tokens_of(peer, session) is not None:
            return
        if self.recovery is not None:
            self.recovery.histories.forget((peer, session))
        if self.forwarder is not None:
            self.forwarder.session_freed(peer, session)

    async def _once(self, peer: bytes, req: wire.Step) -> StepOutcome | Fault | BrokenRoute:
        """One step through this stage and the chain; a step the chain did not take is rolled back."""
        if self.forwarder is not None:
            return await self._through_chain(peer, req, self._parts(req))
        request = StepRequest(peer, req.session, req.pos, _OUT[req.out], tokens=req.tokens, hidden=req.hidden)
        done = await self.engine.request(request)
        if isinstance(done, Fault):
            return done
        assert isinstance(done, StepDone)
        return _local(done, req)

    def _parts(self, req: wire.Step) -> list[wire.Step]:
        """The step as the parts it goes on in: itself unless it is long and ends in one row's result
        (`out: "tokens"` needs every row's; batch-invariant mode fixes chunks by position)."""
        if req.out not in ("token", "logits") or self.engine.config.batch_invariant:
            return [req]
        cuts = step_parts(req.pos, req.n, self.part_rows)
        return [_part(req, pos, n, last=i == len(cuts) - 1) for i, (pos, n) in enumerate(cuts)]

    async def _through_chain(
        self, peer: bytes, req: wire.Step, parts: list[wire.Step]
    ) -> StepOutcome | Fault | BrokenRoute:
        """The step here and on the next stage, part by part: each part goes on while the next one
        computes here. The answer is the last part's reply, as the whole step's."""
        first = await self._here(peer, parts[0])
        if isinstance(first, Fault):
            return first
        computed = first
        for part, following in zip(parts, [*parts[1:], None], strict=True):
            reply, after = await self._overlapped(peer, part, computed, following)
            if not isinstance(reply, wire.Result):
                return await self._undone(peer, req, first.opening, reply)
            if isinstance(after, Fault):
                return await self._undone(peer, req, first.opening, after)
            if after is None:  # its shape was checked on arrival
                return StepOutcome(replace(reply, pos=req.pos, n=req.n), computed.length, computed.max_tokens)
            computed = after
        raise AssertionError("the last part returns")

    async def _undone(
        self, peer: bytes, req: wire.Step, opening: int | None, why: Fault | BrokenRoute
    ) -> Fault | BrokenRoute:
        """The parts done here rolled back: the session as it was before the step (unless it was
        closed meanwhile: one opened again under its name is not this step's to undo)."""
        await self.engine.cleanup(Rollback(peer, req.session, req.pos, opening))
        return why

    async def _overlapped(
        self, peer: bytes, part: wire.Step, computed: StepDone, following: wire.Step | None
    ) -> tuple[wire.Result | Fault | BrokenRoute, StepDone | Fault | None]:
        """The next stage's reply to `part` (computed here), and `following` computed here meanwhile."""
        assert self.forwarder is not None and computed.hidden is not None
        if following is None:  # the last part (a decode step's only one): nothing to overlap
            return await self.forwarder.step(peer, part, computed.hidden), None
        sent: list[wire.Result | Fault | BrokenRoute] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_send, self.forwarder, peer, part, computed.hidden, sent)
            after = await self._here(peer, following)
        return sent[0], after

    async def _here(self, peer: bytes, part: wire.Step) -> StepDone | Fault:
        """`part` through this stage's layers alone: its hidden states, to send on."""
        request = StepRequest(peer, part.session, part.pos, Output.HIDDEN, tokens=part.tokens, hidden=part.hidden)
        done = await self.engine.request(request)
        assert isinstance(done, StepDone | Fault)
        return done


def _part(req: wire.Step, pos: int, n: int, *, last: bool) -> wire.Step:
    """Rows pos..pos+n of `req`; a part before the last asks the last stage for a token it drops
    (a row of output, not the vocabulary's logits)."""
    a, b = pos - req.pos, pos - req.pos + n
    tokens = None if req.tokens is None else req.tokens[a:b]
    hidden = None if req.hidden is None else req.hidden[a:b]
    return replace(req, pos=pos, n=n, out=req.out if last else "token", tokens=tokens, hidden=hidden)


async def _send(
    forwarder: Forwarder,
    peer: bytes,
    part: wire.Step,
    hidden: npt.NDArray[np.float32],
    into: list[wire.Result | Fault | BrokenRoute],
) -> None:
    into.append(await forwarder.step(peer, part, hidden))
