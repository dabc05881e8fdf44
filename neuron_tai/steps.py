"""A `step` through this stage and, with a next stage, the rest of the chain.

The step runs in the engine; on a chain's head its hidden states go on to the next
stage, whose answer is the step's. If the next stage does not take the step, it is
undone here (rolled back to its `pos`) before the requester hears why: a failed step
leaves the session exactly as it was, on every stage. The outcome stays a typed value,
carrying the session's length and `max_tokens`, until the edge writes it to a socket.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.engine import Engine
from engine.messages import Output, Rollback, StepDone, StepRequest
from neuron_tai.forwarding import BrokenRoute, Forwarder
from neuron_tai.recovery import Recovery
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

    def __init__(self) -> None:
        self.in_flight: Counter[Key] = Counter()

    def enter(self, key: Key) -> None:
        self.in_flight[key] += 1

    def leave(self, key: Key) -> None:
        self.in_flight[key] -= 1
        if not self.in_flight[key]:
            del self.in_flight[key]

    def __contains__(self, key: Key) -> bool:
        return self.in_flight[key] > 0


@dataclass(frozen=True, slots=True)
class RecoveryLimits:
    """How hard a chain's head tries to recover a session whose route broke (0 attempts: never)."""

    attempts: int = 3
    deadline_s: float = 30.0


class StepRunner:
    def __init__(
        self, engine: Engine, stage: Stage, forwarder: Forwarder | None, recovery: RecoveryLimits = RecoveryLimits()
    ) -> None:
        self.engine = engine
        self.stage = stage
        self.forwarder = forwarder
        self.recovery: Recovery[StepOutcome] | None = None
        if forwarder is not None and stage.first and recovery.attempts > 0:  # only the head sees tokens
            self.recovery = Recovery(
                forwarder,
                self._once,
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
        if self.recovery is not None and self.engine.max_tokens_of(peer, session) is not None:
            self.recovery.histories.record((peer, session), pos, tokens)

    def session_freed(self, peer: bytes, session: str) -> None:
        """The engine freed the session. Its end is read a little later than it happened: a
        session of the same name opened again meanwhile is left alone."""
        if self.engine.max_tokens_of(peer, session) is not None:
            return
        if self.recovery is not None:
            self.recovery.histories.forget((peer, session))
        if self.forwarder is not None:
            self.forwarder.session_freed(peer, session)

    async def _once(self, peer: bytes, req: wire.Step) -> StepOutcome | Fault | BrokenRoute:
        """One step through this stage and the chain; a step the chain did not take is rolled back."""
        local_out = _OUT[req.out] if self.forwarder is None else Output.HIDDEN
        request = StepRequest(peer, req.session, req.pos, local_out, tokens=req.tokens, hidden=req.hidden)
        done = await self.engine.request(request)
        if isinstance(done, Fault):
            return done
        assert isinstance(done, StepDone)
        if self.forwarder is None:
            return _local(done, req)
        assert done.hidden is not None
        reply = await self.forwarder.step(peer, req, done.hidden)
        if isinstance(reply, Fault | BrokenRoute):
            await self.engine.cleanup(Rollback(peer, req.session, req.pos))
            return reply
        return StepOutcome(reply, done.length, done.max_tokens)  # its shape was checked on arrival
