"""A `step` through this stage and, with a next stage, the rest of the chain.

The step runs in the engine; on a chain's head its hidden states go on to the next
stage, whose answer is the step's. If the next stage does not take the step, it is
undone here (rolled back to its `pos`) before the requester hears why: a failed step
leaves the session exactly as it was, on every stage. The outcome stays a typed value,
carrying the session's length and `max_tokens`, until the edge writes it to a socket.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine.engine import Engine
from engine.messages import Output, Rollback, StepDone, StepRequest
from neuron_tai.forwarding import Forwarder
from protocol.errors import ErrorCode, Fault
from protocol.stage import Stage
from transport import wire
from transport.requester import Reply

Key = tuple[bytes, str]

_OUT = {"hidden": Output.HIDDEN, "token": Output.TOKEN, "logits": Output.LOGITS}


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """A step's result from the last stage it reached: exactly one of hidden, logits, token."""

    pos: int
    n: int
    out: str
    length: int  # the session's length after the step
    max_tokens: int
    hidden: npt.NDArray[np.floating] | None = None
    logits: npt.NDArray[np.float32] | None = None
    token: int | None = None

    def frames(self, rid: int, session: str, out_dtype: str) -> list[bytes]:
        """The `result` reply."""
        header = {"op": "result", "rid": rid, "session": session, "pos": self.pos, "n": self.n, "out": self.out}
        if self.hidden is not None:
            return wire.encode({**header, "dtype": out_dtype}, wire.hidden_frame(self.hidden, out_dtype))
        if self.logits is not None:
            return wire.encode(header, np.asarray(self.logits, "<f4").tobytes())
        return wire.encode(header, np.array([self.token], "<i4").tobytes())


def _local(done: StepDone, out: str) -> StepOutcome:
    return StepOutcome(done.pos, done.n, out, done.length, done.max_tokens, done.hidden, done.logits, done.token)


def _relayed(done: StepDone, req: wire.Step, reply: Reply) -> StepOutcome:
    """The next stage's `result` (its shape checked on arrival) with this session's length."""
    header, frames = reply
    data, common = frames[0], (req.pos, req.n, req.out, done.length, done.max_tokens)
    if req.out == "hidden":
        dtype = wire.DTYPES[str(header.get("dtype", "f32"))]
        return StepOutcome(*common, hidden=np.frombuffer(data, dtype).reshape(req.n, -1))
    if req.out == "logits":
        return StepOutcome(*common, logits=np.frombuffer(data, "<f4"))
    return StepOutcome(*common, token=int(np.frombuffer(data, "<i4")[0]))


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


class StepRunner:
    def __init__(self, engine: Engine, stage: Stage, forwarder: Forwarder | None) -> None:
        self.engine = engine
        self.stage = stage
        self.forwarder = forwarder

    def refusal(self, req: wire.Step) -> Fault | None:
        """What this stage refuses before any work: input or output it does not serve, or too many tokens."""
        stage = self.stage
        if req.input == "tokens" and not stage.first:
            return Fault(ErrorCode.WRONG_STAGE, f"this stage (layers {stage.layers}) takes hidden input")
        if req.input == "hidden" and stage.first:
            return Fault(ErrorCode.WRONG_STAGE, "this is a first stage: it takes token input")
        if self.forwarder is None and (req.out == "hidden") == stage.last:
            want = "'token' or 'logits'" if stage.last else "'hidden'"
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
        A fault decided here was counted here; the engine's and the next stage's, where decided."""
        local_out = _OUT[req.out] if self.forwarder is None else Output.HIDDEN
        request = StepRequest(peer, req.session, req.pos, local_out, tokens=req.tokens, hidden=req.hidden)
        done = await self.engine.request(request)
        if isinstance(done, Fault):
            return done
        assert isinstance(done, StepDone)
        if self.forwarder is None:
            return _local(done, req.out)
        assert done.hidden is not None
        reply = await self.forwarder.step(peer, req, done.hidden, done.max_tokens)
        if isinstance(reply, Fault):
            await self.engine.cleanup(Rollback(peer, req.session, req.pos))
            return reply
        return _relayed(done, req, reply)
