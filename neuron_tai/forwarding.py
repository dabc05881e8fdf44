"""A chain's link onward: open, step, reopen and close sessions on the next stage.

A session has its own id on the next stage (`forwarded_session`: distinct per upstream
connection), opened there with the same `max_tokens` and sampling, on one of the next
layer range's replicas (neuron_tai.replicas). The forwarder alone knows which sessions
were forwarded and how they were opened, so that a session can be opened again: on a
restarted next stage (a step from position 0 reopens it once), or on another replica
when the chain's head recovers it (`reroute`). Every session this stage frees is closed
there as well: abandoned sessions never hold KV anywhere in a chain past one lease.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.engine import Engine
from neuron_tai.replicas import Replicas
from protocol.errors import ErrorCode, Fault
from protocol.stage import Stage
from transport import wire

log = logging.getLogger("neuron_tai.node")

Key = tuple[bytes, str]


def forwarded_session(peer: bytes, session: str) -> str:
    """The id a session has on the next stage: distinct per upstream connection. The peer's
    length goes first: a session id may hold any character, NUL too, so a separator alone
    would let two (connection, session) pairs name the same bytes."""
    key = len(peer).to_bytes(2, "big") + peer + session.encode()
    return hashlib.blake2b(key, digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class BrokenRoute:
    """A step the stages below did not take (it was rolled back here, or is being): the chain's
    head recovers the session on another route; elsewhere it is answered `downstream`."""

    fault: Fault


_BROKEN = frozenset({ErrorCode.DOWNSTREAM, ErrorCode.INTERNAL})


def _their_fault(reply: wire.Reply) -> Fault:
    """The next stage's own error, relayed as it came."""
    if isinstance(reply, wire.ErrorReply):
        return reply.fault()
    return Fault(ErrorCode.DOWNSTREAM, f"the next stage answered an open with {type(reply).__name__}")


class Forwarder:
    def __init__(self, replicas: Replicas, engine: Engine) -> None:
        self.replicas = replicas
        self.engine = engine  # counts the errors decided here
        self.opens: dict[Key, wire.Open] = {}  # each forwarded session's open, to reopen it
        self.chain_max_step_tokens: int | None = None  # the fewest any stage below takes in one step

    def _downstream(self, message: str) -> Fault:
        self.engine.count_error(ErrorCode.DOWNSTREAM)
        return Fault(ErrorCode.DOWNSTREAM, message)

    async def open(self, peer: bytes, req: wire.Open, stage: Stage) -> Stage | Fault:
        """Open the session on the next stage: the chain's stage seen from here, or why not."""
        fwd = forwarded_session(peer, req.session)
        if self.opens.pop((peer, req.session), None) is not None:
            # The same session closed and opened again before its end was read from the engine:
            # what is left of the old one below is closed first (queued ahead of this open).
            self.replicas.release(fwd)
        request = replace(req, rid=0, session=fwd)
        reply = await self.replicas.open(fwd, request)
        if reply is None:
            return self._downstream("no replica of the next stage answered; nothing was opened")
        if not isinstance(reply, wire.Opened):
            return _their_fault(reply)
        self.opens[(peer, req.session)] = replace(request, wait_ms=0)
        theirs = reply.stage
        chained = replace(
            stage,
            last=theirs.last,
            layers=(stage.layers[0], theirs.layers[1]),
            max_step_tokens=min(stage.max_step_tokens, theirs.max_step_tokens),
            eog_tokens=theirs.eog_tokens or stage.eog_tokens,  # a minimal stage may name none
        )
        self.chain_max_step_tokens = min(chained.max_step_tokens, self.chain_max_step_tokens or 1 << 30)
        return chained

    async def step(
        self, peer: bytes, req: wire.Step, hidden: npt.NDArray[np.float32]
    ) -> wire.Result | Fault | BrokenRoute:
        """The next stage's `result` for this step, or why there is none (the caller rolls back).

        If the next stage lost the session (it restarted) and the step starts at 0, the
        session is opened there again and the step resent, once."""
        fwd = forwarded_session(peer, req.session)
        step = wire.Step(0, fwd, req.pos, req.n, "hidden", req.out, req.out_dtype, hidden=hidden)
        if req.pos == 0 and fwd not in self.replicas.placed:  # given up below after a failure: open it again
            await self.reroute(peer, req.session)
        reply = await self.replicas.request(fwd, step)
        lost = isinstance(reply, wire.ErrorReply) and reply.code is ErrorCode.UNKNOWN_SESSION
        if lost and req.pos == 0 and await self.reroute(peer, req.session):
            reply = await self.replicas.request(fwd, step)
        if reply is None:
            return BrokenRoute(Fault(ErrorCode.DOWNSTREAM, "the next stage failed or did not answer"))
        if isinstance(reply, wire.Result):
            return reply
        if not isinstance(reply, wire.ErrorReply):  # `answer_to` lets nothing else through
            return BrokenRoute(Fault(ErrorCode.DOWNSTREAM, f"the next stage answered a step with {reply!r}"))
        if reply.code is ErrorCode.UNKNOWN_SESSION:
            lost_fault = Fault(ErrorCode.DOWNSTREAM, "the next stage lost this session (restarted?); resend from pos 0")
            return BrokenRoute(lost_fault)
        fault = _their_fault(reply)
        return BrokenRoute(fault) if fault.code in _BROKEN else fault

    async def reroute(self, peer: bytes, session: str) -> bool:
        """Close what is left of the session below (best effort) and open it again, with its own
        open (its sampling above all), on a replica that is up; False: none opened it."""
        fwd = forwarded_session(peer, session)
        self.replicas.release(fwd)
        reopen = self.opens.get((peer, session))
        if reopen is None:  # freed here meanwhile: nothing to reopen
            return False
        if not isinstance(await self.replicas.open(fwd, reopen), wire.Opened):
            return False
        if (peer, session) not in self.opens:  # freed here while it was being opened there
            self.replicas.release(fwd)
            return False
        return True

    def session_freed(self, peer: bytes, session: str) -> None:
        """This stage freed a session: close it on the next stage too (queued, never waits)."""
        if self.opens.pop((peer, session), None) is not None:
            self.replicas.release(forwarded_session(peer, session))

    def close_all(self) -> None:
        """This stage stops: every session it forwarded is closed below (queued, never waits)."""
        for peer, session in list(self.opens):
            self.session_freed(peer, session)

    def stats(self, *, show_address: bool) -> dict[str, Any]:
        """The links together (counters summed, `connected` if any replica is up) and each replica."""
        links = self.replicas.links
        summed = ("failures_total", "disconnects_total", "redials_total", "sessions", "pings_total", "outbox_bytes")
        each = [link.stats() for link in links]
        stats: dict[str, Any] = {key: sum(s[key] for s in each) for key in summed}
        stats.update(
            connected=self.replicas.any_up(),
            max_outbox_bytes=each[0]["max_outbox_bytes"],
            max_reply_frame_bytes=each[0]["max_reply_frame_bytes"],
            malformed_total=sum(link.malformed for link in links),
            replies_dropped_total=sum(link.core.dropped for link in links),
            replicas=self.replicas.stats(),
        )
        if show_address:  # only authenticated peers learn where the chain goes on
            stats["address"] = ",".join(link.address for link in links)
        else:
            for replica in stats["replicas"]:
                del replica["address"]
        return stats
