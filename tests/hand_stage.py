"""A next stage the test answers by hand: a ROUTER socket in the test's own event loop.

It lets a test hold a forwarded request, answer it late, refuse it, or never answer it, and
see everything a chain's head sends below (pings are answered and skipped).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import trio
import zmq

Request = tuple[bytes, dict[str, Any]]  # the head's routing id, and the request's header

STAGE = {"first": False, "last": True, "layers": [2, 4], "n_embd": 64, "n_vocab": 268, "model": "tiny"}


class HandStage:
    def __init__(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    async def recv(self, polls: int = 1000, *, pings: bool = False) -> Request | None:
        """The next request, polled every 10 ms (None after `polls` polls with none); pings are
        answered, and returned only with `pings`."""
        for _ in range(polls):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await trio.sleep(0.01)
                continue
            header = msgpack.unpackb(frames[1])
            if header["op"] == "ping":
                self.send(frames[0], {"op": "pong", "rid": header["rid"]})
                if not pings:
                    continue
            return frames[0], header
        return None

    async def expect(self, op: str) -> Request:
        got = await self.recv(pings=op == "ping")
        assert got is not None and got[1]["op"] == op, got
        return got

    def send(self, peer: bytes, header: dict[str, Any], *payload: bytes) -> None:
        self.sock.send_multipart([peer, msgpack.packb({"v": 1, **header}), *payload])

    def opened(self, got: Request, *, lease_ms: int | None = 60_000) -> None:
        peer, req = got
        reply = {"op": "opened", "rid": req["rid"], "session": req["session"], "kv_reserved": req["max_tokens"]}
        reply["stage"] = {**STAGE, "max_step_tokens": 128}
        self.send(peer, reply if lease_ms is None else {**reply, "lease_ms": lease_ms})

    def token(self, got: Request, token: int = 7) -> None:
        peer, req = got
        header = {k: req[k] for k in ("rid", "session", "pos", "n", "out")}
        self.send(peer, {"op": "result", **header}, np.array([token], "<i4").tobytes())

    def error(self, got: Request, code: str) -> None:
        peer, req = got
        self.send(peer, {"op": "error", "rid": req["rid"], "code": code, "message": "refused by hand"})

    def closed(self, got: Request) -> None:
        peer, req = got
        self.send(peer, {"op": "closed", "rid": req["rid"], "session": req["session"], "existed": True})

    def close(self) -> None:
        self.sock.close()
