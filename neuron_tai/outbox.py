"""Every reply a node sends leaves through here, onto the socket pump.

The pump's task owns the ROUTER socket; this is the only way the node's other parts
reach it. A reply that hands a peer a session (or its state) and cannot go out
leaves the session with no owner: it is freed at once. An error the node decided
itself is counted in `errors_total`; one relayed from the engine or the next stage
was counted where it was decided.
"""

from __future__ import annotations

import logging

from engine.engine import Engine
from engine.messages import CloseRequest
from protocol.errors import ErrorCode, Fault
from transport import wire
from transport.pump import SocketPump

log = logging.getLogger("neuron_tai.node")


class Outbox:
    def __init__(self, pump: SocketPump, engine: Engine) -> None:
        self.pump = pump
        self.engine = engine

    def send(self, peer: bytes, frames: list[bytes]) -> bool:
        """Queue a reply; False when it cannot go out (the peer is gone or hopelessly behind)."""
        return self.pump.send_nowait([peer, *frames])

    def deliver(self, peer: bytes, session: str, frames: list[bytes]) -> bool:
        """A reply that hands the peer a session or its state: if it cannot go out, nobody owns them."""
        if self.send(peer, frames):
            return True
        self.engine.cleanup_nowait(CloseRequest(peer, session))
        return False

    def error(self, peer: bytes, rid: int | None, fault: Fault, session: str | None = None) -> None:
        """An error this node decided: counted, then answered (`busy` with the engine's estimate
        of when to try again). `session` for the replies of a `generate`, which all carry it."""
        self.engine.count_error(fault.code)
        if fault.code is ErrorCode.BUSY and fault.retry_after_ms is None:
            fault = Fault(fault.code, fault.message, self.engine.busy_retry_ms())
        self.relay(peer, rid, fault, session)

    def relay(self, peer: bytes, rid: int | None, fault: Fault, session: str | None = None) -> None:
        """An error decided (and counted) elsewhere: the engine's, or the next stage's."""
        if fault.code is not ErrorCode.BUSY:
            log.debug("error %s to %s: %s", fault.code, peer.hex(), fault.message)
        self.send(peer, wire.encode_reply(wire.ErrorReply.of(fault, rid, session)))

    def busy(self, peer: bytes, rid: int, message: str, session: str | None = None) -> None:
        self.error(peer, rid, Fault(ErrorCode.BUSY, message), session)
