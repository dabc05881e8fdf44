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
from transport.requester import Reply

log = logging.getLogger("neuron_tai.node")

Key = tuple[bytes, str]


def forwarded_session(peer: bytes, session: str) -> str:
    """The id a session has on the next stage: distinct per upstream connection."""
    return hashlib.blake2b(peer + b"\0" + session.encode(), digest_size=12).hexdigest()


def _open_header(session: str, req: wire.Open) -> dict[str, Any]:
    s = req.sampling
    sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed}
    open_ = {"op": "open", "session": session, "max_tokens": req.max_tokens, "wait_ms": req.wait_ms}
    return {**open_, "sampling": sampling}


@dataclass(frozen=True, slots=True)
class BrokenRoute:
    """A step the stages below did not take (it was rolled back here, or is being): the chain's
    head recovers the session on another route; elsewhere it is answered `downstream`."""

    fault: Fault


_BROKEN = frozenset({ErrorCode.DOWNSTREAM, ErrorCode.INTERNAL})


def _their_fault(header: dict[str, Any]) -> Fault:
    """The next stage's own error, relayed as it came."""
    return Fault(ErrorCode.parse(header.get("code")), str(header.get("message", "")), header.get("retry_after_ms"))


class Forwarder:
    def __init__(self, replicas: Replicas, engine: Engine) -> None:
        self.replicas = replicas
        self.engine = engine  # counts the errors decided here
        self.opens: dict[Key, dict[str, Any]] = {}  # each forwarded session's open, to reopen it
        self.chain_max_step_tokens: int | None = None  # the fewest any stage below takes in one step

    def _downstream(self, message: str) -> Fault:
        self.engine.count_error(ErrorCode.DOWNSTREAM)
        return Fault(ErrorCode.DOWNSTREAM, message)

    async def open(self, peer: bytes, req: wire.Open, stage: Stage) -> Stage | Fault:
        """Open the session on the next stage: the chain's stage seen from here, or why not."""
        fwd = forwarded_session(peer, req.session)
        header = _open_header(fwd, req)
        reply = await self.replicas.open(fwd, header)
        if reply is None:
            return self._downstream("no replica of the next stage answered; nothing was opened")
        if reply[0].get("op") != "opened":
            return _their_fault(reply[0])
        self.opens[(peer, req.session)] = {**header, "wait_ms": 0}
        theirs = reply[0].get("stage", {})
        chained = replace(
            stage,
            last=theirs.get("last", False),
            layers=(stage.layers[0], theirs.get("layers", [0, 0])[1]),
            max_step_tokens=min(stage.max_step_tokens, theirs.get("max_step_tokens", 1 << 30)),
            eog_tokens=tuple(theirs.get("eog_tokens", stage.eog_tokens)),
        )
        self.chain_max_step_tokens = min(chained.max_step_tokens, self.chain_max_step_tokens or 1 << 30)
        return chained

    async def step(self, peer: bytes, req: wire.Step, hidden: npt.NDArray[np.float32]) -> Reply | Fault | BrokenRoute:
        """The next stage's `result` for this step, or why there is none (the caller rolls back).

        If the next stage lost the session (it restarted) and the step starts at 0, the
        session is opened there again and the step resent, once."""
        fwd = forwarded_session(peer, req.session)
        header = {
            "op": "step",
            "session": fwd,
            "pos": req.pos,
            "n": req.n,
            "input": "hidden",
            "dtype": "f32",
            "out": req.out,
            "out_dtype": req.out_dtype,
        }
        payload = [wire.hidden_frame(hidden, "f32")]
        if req.pos == 0 and fwd not in self.replicas.placed:  # given up below after a failure: open it again
            await self.reroute(peer, req.session)
        reply = await self.replicas.request(fwd, header, payload)
        lost = reply is not None and reply[0].get("code") == ErrorCode.UNKNOWN_SESSION
        if lost and req.pos == 0 and await self.reroute(peer, req.session):
            reply = await self.replicas.request(fwd, header, payload)
        if reply is None:
            return BrokenRoute(Fault(ErrorCode.DOWNSTREAM, "the next stage failed or did not answer"))
        if reply[0].get("op") == "result":
            return reply
        if reply[0].get("code") == ErrorCode.UNKNOWN_SESSION:
            lost = Fault(ErrorCode.DOWNSTREAM, "the next stage lost this session (restarted?); resend from pos 0")
            return BrokenRoute(lost)
        fault = _their_fault(reply[0])
        return BrokenRoute(fault) if fault.code in _BROKEN else fault

    async def reroute(self, peer: bytes, session: str) -> bool:
        """Close what is left of the session below (best effort) and open it again, with its own
        open (its sampling above all), on a replica that is up; False: none opened it."""
        fwd = forwarded_session(peer, session)
        self.replicas.release(fwd)
        reopen = self.opens.get((peer, session))
        if reopen is None:  # freed here meanwhile: nothing to reopen
            return False
        opened = await self.replicas.open(fwd, reopen)
        if opened is None or opened[0].get("op") != "opened":
            return False
        if (peer, session) not in self.opens:  # freed here while it was being opened there
            self.replicas.release(fwd)
            return False
        return True

    def session_freed(self, peer: bytes, session: str) -> None:
        """This stage freed a session: close it on the next stage too (queued, never waits)."""
        if self.opens.pop((peer, session), None) is not None:
            self.replicas.release(forwarded_session(peer, session))

    def stats(self, *, show_address: bool) -> dict[str, Any]:
        """The links together (counters summed, `connected` if any replica is up) and each replica."""
        links = self.replicas.links
        summed = ("failures_total", "disconnects_total", "sessions", "pings_total", "outbox_bytes")
        each = [link.stats() for link in links]
        stats: dict[str, Any] = {key: sum(s[key] for s in each) for key in summed}
        stats.update(
            connected=self.replicas.any_up(),
            max_outbox_bytes=each[0]["max_outbox_bytes"],
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
