"""Recovery at a chain's head: a session whose route breaks is replayed onto one that is up.

Only the head sees a session's tokens (what its client sent and what the chain generated),
and tokens are 4 bytes each, so the head keeps every session's history. When the stages
below lose a session mid-step (a replica dies, hangs or answers `downstream`/`internal`),
the head closes what is left of it below, opens it again on a route that is up, replays
the history there as a prefill from position 0 (its own KV is recomputed on the way, by
the same steps), and then runs the step that broke. The requester sees a slower reply,
never an error, while some route is up. Recovery is bounded: `attempts` tries within
`deadline_s`; after that the step fails with `downstream`, rolled back as before.

In batch-invariant mode a replayed prefill rebuilds bit for bit the KV that padded decode
steps built (DESIGN.md), so a recovered session goes on with exactly the tokens an
undisturbed one would have produced.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt
import trio

from neuron_tai.forwarding import BrokenRoute, Forwarder
from protocol.errors import ErrorCode, Fault
from transport import wire

log = logging.getLogger("neuron_tai.recovery")

Key = tuple[bytes, str]


class Histories:
    """Every open session's tokens by position: bounded by its `max_tokens`, freed with it.

    Kept as lists that a step extends in place (it runs on the head's token path once per
    step): a rewind cuts the tail, an append costs the step's own tokens, never the history."""

    def __init__(self) -> None:
        self.tokens: dict[Key, list[int]] = {}

    def record(self, key: Key, pos: int, tokens: npt.NDArray[np.int32]) -> None:
        """A step at `pos` went through: the history is what came before it, then its tokens."""
        history = self.tokens.setdefault(key, [])
        del history[pos:]
        history.extend(int(t) for t in tokens)

    def before(self, key: Key, pos: int) -> npt.NDArray[np.int32]:
        return np.array(self.tokens.get(key, [])[:pos], np.int32)

    def forget(self, key: Key) -> None:
        self.tokens.pop(key, None)


@dataclass(slots=True)
class RecoveryStats:
    recoveries: int = 0
    failed: int = 0
    replayed_tokens: int = 0
    seconds_total: float = 0.0
    seconds_max: float = 0.0

    def as_wire(self) -> dict[str, float | int]:
        return {
            "recoveries_total": self.recoveries,
            "recoveries_failed_total": self.failed,
            "replayed_tokens_total": self.replayed_tokens,
            "recovery_seconds_total": round(self.seconds_total, 6),
            "recovery_seconds_max": round(self.seconds_max, 6),
        }


T = TypeVar("T")


class Recovery(Generic[T]):
    """Recovers the sessions of a chain's head; `T` is what a step that went through gives."""

    def __init__(
        self,
        forwarder: Forwarder,
        step_once: Callable[[bytes, wire.Step], Awaitable[T | Fault | BrokenRoute]],
        step_here: Callable[[bytes, wire.Step], Awaitable[object]],
        *,
        max_step_tokens: int,
        attempts: int,
        deadline_s: float,
    ) -> None:
        self.forwarder = forwarder
        self.step_once = step_once  # one step through this stage and the chain, no recovery
        self.step_here = step_here  # one step through this stage's layers alone (a Fault if not)
        self.max_step_tokens = max_step_tokens
        self.attempts = attempts
        self.deadline_s = deadline_s
        self.histories = Histories()
        self.stats = RecoveryStats()

    async def recover(self, peer: bytes, req: wire.Step, broken: BrokenRoute) -> T | Fault:
        """The outcome of `req` after its route was rebuilt (a StepOutcome), or why not (a Fault)."""
        started = trio.current_time()
        log.warning("session %r lost its route (%s): recovering", req.session, broken.fault.message)
        outcome: T | Fault | BrokenRoute = broken
        opening = self.forwarder.engine.open_sessions.opening_of(peer, req.session)
        deadline = started + self.deadline_s
        # The deadline is checked between attempts, never inside one: an attempt cancelled
        # midway would leave an open in flight below, or its replay step in the head's engine
        # (which frees a session whose requester stops waiting). Each call below is bounded
        # by the link's own timeout.
        for attempt in range(self.attempts):
            if attempt:
                await trio.sleep(min(0.25 * 2**attempt, 2.0, max(0.0, deadline - trio.current_time())))
            if trio.current_time() >= deadline:
                break
            outcome = await self._attempt(peer, req, deadline, opening)
            if not isinstance(outcome, BrokenRoute):
                break
        elapsed = trio.current_time() - started
        if isinstance(outcome, Fault):
            self.stats.failed += 1
            await self._restore(peer, req, opening)
            return outcome
        if isinstance(outcome, BrokenRoute):
            self.stats.failed += 1
            log.warning("session %r: no route recovered it within %d attempts", req.session, self.attempts)
            whole = await self._restore(peer, req, opening)
            self.forwarder.engine.count_error(ErrorCode.DOWNSTREAM)
            stands = "it stands as before the step" if whole else "resend it from position 0"
            return Fault(ErrorCode.DOWNSTREAM, f"{broken.fault.message}; no route recovered the session ({stands})")
        self.stats.recoveries += 1
        self.stats.seconds_total += elapsed
        self.stats.seconds_max = max(self.stats.seconds_max, elapsed)
        return outcome

    async def _attempt(
        self, peer: bytes, req: wire.Step, deadline: float, opening: int | None
    ) -> T | Fault | BrokenRoute:
        """Reopen below, replay the history before `req.pos`, then run `req` itself."""
        if self._gone(peer, req.session, opening):
            return _gone_fault()
        if not await self.forwarder.reroute(peer, req.session):
            unopened = Fault(ErrorCode.DOWNSTREAM, "no replica of the next stage opened the session")
            return BrokenRoute(unopened)
        history = self.histories.before((peer, req.session), req.pos)
        chunk = min(self.max_step_tokens, self.forwarder.chain_max_step_tokens or self.max_step_tokens)
        out = "hidden" if req.out == "hidden" else "logits"  # no sampling: the sampler's state stays
        for replay in _chunks(req, history, 0, chunk, out):
            done = await self._step(peer, replay, deadline)
            if self._gone(peer, req.session, opening):
                return _gone_fault()
            if isinstance(done, Fault) and not self.forwarder.engine.draining:
                return BrokenRoute(done)  # refused below: that route is no good either
            if isinstance(done, BrokenRoute | Fault):
                return done
            self.stats.replayed_tokens += replay.n
        return await self._step(peer, req, deadline)

    def _gone(self, peer: bytes, session: str, opening: int | None) -> bool:
        """Whether the session was closed (and maybe opened again) since the recovery began:
        what is recovered is no longer there to recover."""
        return self.forwarder.engine.open_sessions.opening_of(peer, session) != opening

    async def _restore(self, peer: bytes, req: wire.Step, opening: int | None) -> bool:
        """After a recovery that failed: this stage's KV of the session rebuilt up to `req.pos`,
        as before the step (a replay recomputes it from position 0, and a failed one stops short).
        Through this stage's layers alone: nothing below holds the session any more. Whether the
        session now stands at `req.pos`."""
        length = self.forwarder.engine.open_sessions.length_of(peer, req.session)
        history = self.histories.before((peer, req.session), req.pos)
        if length is None or self._gone(peer, req.session, opening) or len(history) < req.pos:
            return False
        for part in _chunks(req, history, length, self.max_step_tokens, "hidden"):
            if isinstance(await self.step_here(peer, part), Fault):
                log.warning("session %r: its KV could not be rebuilt here past %d", req.session, part.pos)
                return False
        return True

    async def _step(self, peer: bytes, req: wire.Step, deadline: float) -> T | Fault | BrokenRoute:
        """One step, waiting out `busy` (congestion, not a broken route) until the deadline."""
        while True:
            done = await self.step_once(peer, req)
            if not (isinstance(done, Fault) and done.code is ErrorCode.BUSY) or trio.current_time() >= deadline:
                return done
            await trio.sleep(max(done.retry_after_ms or 0, 1) / 1000)


def _gone_fault() -> Fault:
    return Fault(ErrorCode.UNKNOWN_SESSION, "the session was closed while its route was being recovered")


def _chunks(req: wire.Step, history: npt.NDArray[np.int32], start: int, size: int, out: str) -> list[wire.Step]:
    """`history[start:]` as steps of `req`'s session of at most `size` tokens each, asking `out`."""
    return [
        wire.Step(req.rid, req.session, pos, len(tokens), "tokens", out, "f32", tokens=tokens)
        for pos in range(start, len(history), size)
        if len(tokens := history[pos : pos + size])
    ]
