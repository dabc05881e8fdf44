"""The link from a node to the next stage of its chain: a client of that stage.

Built on the same request/reply core as `neuron_tai.client` (transport.requester):
one DEALER socket owned by its pump task, rids of our own matched to replies, a
timeout per request. With CURVE it authenticates with the node's own key pair,
like any client. A request the next stage does not answer within `timeout_s`,
or that cannot be sent, comes back as None and counts as a failure; so does a reply
that is not what the request expects (wire.check_reply: an `error`, or the answer to
that op with its keys and payload shape), which also counts in `malformed`.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
import zmq

from neuron_tai.security import ClientCurve
from transport.requester import ClientClosed, OutboxFull, Reply, Requester
from transport.trio_zmq import TrioSocket
from transport.wire import NEXT_STAGE_REPLY_LIMITS, WireError, check_reply

log = logging.getLogger("neuron_tai.downstream")


class NextStage:
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        timeout_s: float,
        hwm: int,
        n_embd: int,
        n_vocab: int,
        *,
        curve: ClientCurve | None = None,
    ) -> None:
        sock = ctx.socket(zmq.DEALER)
        if curve is not None:  # the node's own key pair, and the next stage's public key
            curve.apply(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.connect(address)
        self.address = address
        self.timeout_s = timeout_s
        self.sock = TrioSocket(sock)
        self.core = Requester(self.sock, max_outbox=hwm, limits=NEXT_STAGE_REPLY_LIMITS)
        self.failures = 0
        self.malformed = 0
        self.n_embd = n_embd  # the model's, the same on every stage: the shape replies must have
        self.n_vocab = n_vocab

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.core.run(task_status=task_status)

    async def request(self, header: dict[str, Any], payload: list[bytes] | None = None) -> Reply | None:
        """The next stage's reply (`error` replies included); None when it failed or did not answer."""
        try:
            reply = await self.core.request(header, payload or [], self.timeout_s)
            return check_reply(header, *reply, self.n_embd, self.n_vocab)
        except WireError as exc:
            self.malformed += 1
            log.warning("next stage %s: %s", self.address, exc.message)
        except TimeoutError:
            log.warning("next stage %s did not answer %r within %.1fs", self.address, header.get("op"), self.timeout_s)
        except (OutboxFull, ClientClosed) as exc:
            log.warning("next stage %s: %s", self.address, exc)
        self.failures += 1
        return None

    def close(self) -> None:
        self.sock.close()
