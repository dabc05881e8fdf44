"""A chain's link onward: open, step, reopen and close sessions on the next stage.

A session has its own id on the next stage (`forwarded_session`: distinct per upstream
connection), opened there with the same `max_tokens` and sampling. The forwarder alone
knows which sessions were forwarded and how they were opened, so that a restarted next
stage can be given a session again (a step from position 0 reopens it once), and so
that every session this stage frees is closed there as well: abandoned sessions never
hold KV anywhere in a chain past one lease.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.engine import Engine
from neuron_tai.downstream import NextStage
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


def _their_fault(header: dict[str, Any]) -> Fault:
    """The next stage's own error, relayed as it came."""
    return Fault(ErrorCode.parse(header.get("code")), str(header.get("message", "")), header.get("retry_after_ms"))


class Forwarder:
    def __init__(self, link: NextStage, engine: Engine) -> None:
        self.link = link
        self.engine = engine  # counts the errors decided here
        self.opens: dict[Key, dict[str, Any]] = {}  # each forwarded session's open, to reopen it

    def _downstream(self, message: str) -> Fault:
        self.engine.count_error(ErrorCode.DOWNSTREAM)
        return Fault(ErrorCode.DOWNSTREAM, message)

    async def open(self, peer: bytes, req: wire.Open, stage: Stage) -> Stage | Fault:
        """Open the session on the next stage: the chain's stage seen from here, or why not."""
        header = _open_header(forwarded_session(peer, req.session), req)
        reply = await self.link.request(header)
        if reply is None:
            return self._downstream("the next stage did not answer; nothing was opened")
        if reply[0].get("op") != "opened":
            return _their_fault(reply[0])
        self.opens[(peer, req.session)] = {**header, "wait_ms": 0}
        theirs = reply[0].get("stage", {})
        return replace(
            stage,
            last=theirs.get("last", False),
            layers=(stage.layers[0], theirs.get("layers", [0, 0])[1]),
            max_step_tokens=min(stage.max_step_tokens, theirs.get("max_step_tokens", 1 << 30)),
            eog_tokens=tuple(theirs.get("eog_tokens", stage.eog_tokens)),
        )

    async def step(
        self, peer: bytes, req: wire.Step, hidden: npt.NDArray[np.float32], max_tokens: int
    ) -> Reply | Fault:
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
        reply = await self.link.request(header, payload)
        lost = reply is not None and reply[0].get("code") == ErrorCode.UNKNOWN_SESSION
        if lost and req.pos == 0 and await self._reopen(peer, req.session, fwd, max_tokens):
            reply = await self.link.request(header, payload)
        if reply is None:
            return self._downstream("the next stage failed or did not answer; rolled back")
        if reply[0].get("op") == "result":
            return reply
        if reply[0].get("code") == ErrorCode.UNKNOWN_SESSION:
            return self._downstream("the next stage lost this session (restarted?); resend from pos 0")
        return _their_fault(reply[0])

    async def _reopen(self, peer: bytes, session: str, fwd: str, max_tokens: int) -> bool:
        """The session's own open (its sampling above all), as first forwarded."""
        reopen = self.opens.get((peer, session), {"op": "open", "session": fwd, "max_tokens": max_tokens})
        opened = await self.link.request(reopen)
        return opened is not None and (
            opened[0].get("op") == "opened" or opened[0].get("code") == ErrorCode.SESSION_EXISTS
        )

    def session_freed(self, peer: bytes, session: str) -> None:
        """This stage freed a session: close it on the next stage too (queued, never waits)."""
        if self.opens.pop((peer, session), None) is not None:
            self.link.close_soon(forwarded_session(peer, session))

    def stats(self, *, show_address: bool) -> dict[str, Any]:
        link = self.link
        stats = {**link.stats(), "malformed_total": link.malformed, "replies_dropped_total": link.core.dropped}
        if show_address:  # only authenticated peers learn where the chain goes on
            stats["address"] = link.address
        return stats
