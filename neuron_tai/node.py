"""A node: one stage's engine behind a ZeroMQ ROUTER socket speaking PROTOCOL.md v1.

    async with open_node(config) as node:      # inside any Trio program
        print(node.address)
        await trio.sleep_forever()

One pump task owns the ROUTER socket: it decodes and validates each message and
either answers at once (ping, stats, tokenize, detokenize, errors) or submits the
work to the engine without blocking. Engine results come back as callbacks that
queue the reply on the pump. With `next` set, results are forwarded to the next
stage and its reply is relayed, so a chain looks like one node to a client.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio
import zmq

from engine.engine import Engine, EngineConfig, open_engine
from engine.messages import (
    Closed,
    CloseRequest,
    DropOwner,
    Failure,
    Opened,
    OpenRequest,
    Output,
    Refused,
    Result,
    Rollback,
    StepDone,
    StepRequest,
)
from engine.sampling import SamplingParams
from neuron_tai.downstream import Downstream
from protocol.errors import ErrorCode
from transport import wire
from transport.pump import SocketPump
from transport.trio_zmq import TrioSocket

log = logging.getLogger("neuron_tai.node")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    engine: EngineConfig
    bind: str = "tcp://127.0.0.1:5555"
    next: str | None = None
    max_message_bytes: int = 64 * 2**20
    hwm: int = 1000
    downstream_timeout_s: float = 30.0
    metrics_port: int | None = None
    drain_timeout_s: float = 10.0
    extra_stats: dict[str, Any] = field(default_factory=dict)


_OUT = {"hidden": Output.HIDDEN, "token": Output.TOKEN, "logits": Output.LOGITS}


def forwarded_session(peer: bytes, session: str) -> str:
    """The id a session has on the next stage: distinct per upstream connection."""
    return hashlib.blake2b(peer + b"\0" + session.encode(), digest_size=12).hexdigest()


class Node:
    def __init__(self, config: NodeConfig, engine: Engine, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.config = config
        self.engine = engine
        self.info = engine.info
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, config.hwm)
        sock.setsockopt(zmq.RCVHWM, config.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(config.bind)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = TrioSocket(sock)
        self.pump = SocketPump(self.sock, self._on_message, routed=True, on_peer_gone=self._peer_gone)
        self.downstream = Downstream(ctx, config.next, config.downstream_timeout_s, config.hwm) if config.next else None
        self.peers_gone = 0
        self.started = time.monotonic()
        # Sessions whose step finished here and is still on its way through the next stage:
        # the step is in flight until the chain answers, so another one is `busy`.
        self.forwarding: set[tuple[bytes, str]] = set()
        # Once: asking llama.cpp about every vocabulary entry takes a while on large vocabularies.
        self.eog_tokens = [t for t in range(self.info.n_vocab) if engine.backend.model.is_eog(t)][:16]

    # -- replies -----------------------------------------------------------------------

    def _send(self, peer: bytes, frames: list[bytes]) -> bool:
        return self.pump.send_nowait([peer, *frames])

    def _error(self, peer: bytes, rid: int | None, code: ErrorCode, message: str, retry: int | None = None) -> bool:
        if code not in ("busy",):
            log.debug("error %s to %s: %s", code, peer.hex(), message)
        return self._send(peer, wire.encode_error(rid, code, message, retry))

    def _failure(self, peer: bytes, rid: int, failure: Failure) -> bool:
        return self._error(peer, rid, failure.code, failure.message, failure.retry_after_ms)

    def stage_map(self) -> dict[str, Any]:
        info = self.info
        return {
            "first": info.first,
            "last": info.last,
            "layers": list(info.layers),
            "n_embd": info.n_embd,
            "n_vocab": info.n_vocab,
            "model": info.model,
            "max_step_tokens": self.engine.scheduler.config.max_step_tokens,
            "eog_tokens": self.eog_tokens,
        }

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        stats["max_message_bytes"] = self.config.max_message_bytes
        stats["peers_gone_total"] = self.peers_gone
        stats["uptime_s"] = round(time.monotonic() - self.started, 1)
        if self.downstream is not None:
            stats["downstream"] = {"address": self.downstream.address, "failures_total": self.downstream.failures}
        return {**stats, **self.config.extra_stats}

    # -- requests ----------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        peer, body = frames[0], frames[1:]
        try:
            request = wire.decode_request(body, self.info.n_embd)
        except wire.WireError as exc:
            self.engine.telemetry.errors[exc.code] += 1
            self._error(peer, exc.rid, exc.code, exc.message)
            return
        try:
            self._dispatch(peer, request)
        except Exception as exc:  # a bug must cost one request, never the node
            log.exception("request %r failed", type(request).__name__)
            self._error(peer, request.rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _dispatch(self, peer: bytes, request: wire.Request) -> None:
        rid = request.rid
        if isinstance(request, wire.Ping):
            self._send(peer, wire.encode({"op": "pong", "rid": rid}))
        elif isinstance(request, wire.Stats):
            self._send(peer, wire.encode({"op": "stats", "rid": rid, "stats": self.stats()}))
        elif isinstance(request, wire.Tokenize):
            ids = np.array(self.engine.tokenize(request.text, request.add_special), "<i4")
            self._send(peer, wire.encode({"op": "tokens", "rid": rid, "n": len(ids)}, ids.tobytes()))
        elif isinstance(request, wire.Detokenize):
            try:
                text = self.engine.detokenize(request.tokens.tolist())
            except Refused as exc:
                self._error(peer, rid, ErrorCode.BAD_REQUEST, str(exc))
                return
            self._send(peer, wire.encode({"op": "text", "rid": rid, "text": text}))
        elif isinstance(request, wire.Open):
            self._open(peer, request)
        elif isinstance(request, wire.Step):
            self._step(peer, request)
        else:
            self._close(peer, request)

    def _submit(self, peer: bytes, rid: int, request: Any, on_result: Any) -> None:
        refused = self.engine.submit(request, on_result)
        if refused is not None:
            self._failure(peer, rid, refused)

    def _open(self, peer: bytes, req: wire.Open) -> None:
        s = req.sampling
        sampling = SamplingParams(s.temperature, s.top_k, s.top_p, s.seed)
        request = OpenRequest(peer, req.session, req.max_tokens, sampling, req.wait_ms)

        def on_result(result: Result) -> bool:
            if isinstance(result, Failure):
                self._failure(peer, req.rid, result)
                return True  # nothing was created for this requester: nothing to free
            assert isinstance(result, Opened)
            if self.downstream is None:
                header = {"op": "opened", "rid": req.rid, "session": req.session,
                          "kv_reserved": result.kv_reserved, "stage": self.stage_map()}  # fmt: skip
                return self._send(peer, wire.encode(header))
            self._forward_open(peer, req, result)
            return True

        self._submit(peer, req.rid, request, on_result)

    def _forward_open(self, peer: bytes, req: wire.Open, local: Opened) -> None:
        assert self.downstream is not None
        header = {"op": "open", "session": forwarded_session(peer, req.session), "max_tokens": req.max_tokens,
                  "wait_ms": req.wait_ms, "sampling": {"temperature": req.sampling.temperature,
                  "top_k": req.sampling.top_k, "top_p": req.sampling.top_p, "seed": req.sampling.seed}}  # fmt: skip

        def on_reply(reply: dict[str, Any] | None, _payload: list[bytes]) -> None:
            if reply is None or reply.get("op") != "opened":
                self.engine.submit(CloseRequest(peer, req.session), lambda _r: True)
                if reply is None:
                    self._error(
                        peer, req.rid, ErrorCode.DOWNSTREAM, "the next stage did not answer; nothing was opened"
                    )
                else:
                    self._error(peer, req.rid, ErrorCode.parse(reply.get("code")), str(reply.get("message", "")),
                                reply.get("retry_after_ms"))  # fmt: skip
                return
            theirs = reply.get("stage", {})
            stage = self.stage_map()
            stage.update(last=theirs.get("last", False), layers=[stage["layers"][0], theirs.get("layers", [0, 0])[1]])
            stage["max_step_tokens"] = min(stage["max_step_tokens"], theirs.get("max_step_tokens", 1 << 30))
            stage["eog_tokens"] = theirs.get("eog_tokens", stage["eog_tokens"])
            self._send(peer, wire.encode({"op": "opened", "rid": req.rid, "session": req.session,
                                          "kv_reserved": local.kv_reserved, "stage": stage}))  # fmt: skip

        self.downstream.forward(header, [], on_reply)

    def _step(self, peer: bytes, req: wire.Step) -> None:
        info = self.info
        if req.input == "tokens" and not info.first:
            self._error(peer, req.rid, ErrorCode.WRONG_STAGE, f"this stage (layers {info.layers}) takes hidden input")
            return
        if req.input == "hidden" and info.first:
            self._error(peer, req.rid, ErrorCode.WRONG_STAGE, "this is a first stage: it takes token input")
            return
        chain_end_here = self.downstream is None
        if chain_end_here and (req.out == "hidden") == info.last:
            want = "'token' or 'logits'" if info.last else "'hidden'"
            self._error(peer, req.rid, ErrorCode.WRONG_STAGE, f"this stage (layers {info.layers}) gives out={want}")
            return
        if (peer, req.session) in self.forwarding:
            retry = self.engine.scheduler.busy_retry_ms()
            self._error(peer, req.rid, ErrorCode.BUSY, "the session's previous step is still in the next stage", retry)
            return
        local_out = _OUT[req.out] if chain_end_here else Output.HIDDEN
        request = StepRequest(peer, req.session, req.pos, local_out, tokens=req.tokens, hidden=req.hidden)

        def on_result(result: Result) -> bool:
            if isinstance(result, Failure):
                self._failure(peer, req.rid, result)
                return True  # nothing was created for this requester: nothing to free
            assert isinstance(result, StepDone)
            if self.downstream is not None:
                self.forwarding.add((peer, req.session))
                self._forward_step(peer, req, result)
                return True
            return self._send(peer, self._result_frames(req, result))

        self._submit(peer, req.rid, request, on_result)

    @staticmethod
    def _result_frames(req: wire.Step, result: StepDone) -> list[bytes]:
        header: dict[str, Any] = {"op": "result", "rid": req.rid, "session": req.session, "pos": req.pos,
                                  "n": req.n, "out": req.out}  # fmt: skip
        if result.hidden is not None:
            header["dtype"] = req.out_dtype
            return wire.encode(header, wire.hidden_frame(result.hidden, req.out_dtype))
        if result.logits is not None:
            return wire.encode(header, np.asarray(result.logits, "<f4").tobytes())
        return wire.encode(header, np.array([result.token], "<i4").tobytes())

    def _forward_step(self, peer: bytes, req: wire.Step, local: StepDone, reopened: bool = False) -> None:
        assert self.downstream is not None and local.hidden is not None
        fwd = forwarded_session(peer, req.session)
        header = {"op": "step", "session": fwd, "pos": req.pos, "n": req.n, "input": "hidden", "dtype": "f32",
                  "out": req.out, "out_dtype": req.out_dtype}  # fmt: skip
        payload = [wire.hidden_frame(local.hidden, "f32")]

        def on_reply(reply: dict[str, Any] | None, frames: list[bytes]) -> None:
            if reply is not None and reply.get("code") == "unknown_session" and req.pos == 0 and not reopened:
                self._reopen_and_retry(peer, req, local)
                return
            self.forwarding.discard((peer, req.session))
            if reply is not None and reply.get("op") == "result":
                self._send(peer, wire.encode({**reply, "rid": req.rid, "session": req.session}, *frames))
                return
            # The next stage did not take the step: undo it here so the session is as before.
            self.engine.submit(Rollback(peer, req.session, req.pos), lambda _r: True)
            if reply is None:
                self._error(peer, req.rid, ErrorCode.DOWNSTREAM, "the next stage failed or did not answer; rolled back")
            elif reply.get("code") == "unknown_session":
                self._error(peer, req.rid, ErrorCode.DOWNSTREAM,
                            "the next stage lost this session (restarted?); resend from pos 0")  # fmt: skip
            else:
                self._error(peer, req.rid, ErrorCode.parse(reply.get("code")), str(reply.get("message", "")),
                            reply.get("retry_after_ms"))  # fmt: skip

        self.downstream.forward(header, payload, on_reply)

    def _reopen_and_retry(self, peer: bytes, req: wire.Step, local: StepDone) -> None:
        """The next stage lost the session (it restarted): open it there again and resend."""
        assert self.downstream is not None
        session = self.engine.scheduler.sessions.get((peer, req.session))
        max_tokens = session.max_tokens if session is not None else req.pos + req.n
        header = {"op": "open", "session": forwarded_session(peer, req.session), "max_tokens": max_tokens}

        def on_open(reply: dict[str, Any] | None, _frames: list[bytes]) -> None:
            ok = reply is not None and (reply.get("op") == "opened" or reply.get("code") == "session_exists")
            if ok:
                self._forward_step(peer, req, local, reopened=True)
                return
            self.forwarding.discard((peer, req.session))
            self.engine.submit(Rollback(peer, req.session, req.pos), lambda _r: True)
            self._error(peer, req.rid, ErrorCode.DOWNSTREAM, "the next stage could not reopen the session; rolled back")

        self.downstream.forward(header, [], on_open)

    def _close(self, peer: bytes, req: wire.Close) -> None:
        def on_result(result: Result) -> bool:
            if isinstance(result, Failure):
                self._failure(peer, req.rid, result)
                return True  # nothing was created for this requester: nothing to free
            assert isinstance(result, Closed)
            if self.downstream is not None and result.existed:
                close = {"op": "close", "session": forwarded_session(peer, req.session)}
                self.downstream.forward(close, [], lambda _h, _p: None)
            header = {"op": "closed", "rid": req.rid, "session": req.session, "existed": result.existed}
            return self._send(peer, wire.encode(header))

        self._submit(peer, req.rid, CloseRequest(peer, req.session), on_result)

    def _peer_gone(self, peer: bytes) -> None:
        self.peers_gone += 1
        self.forwarding = {key for key in self.forwarding if key[0] != peer}
        log.info("peer %s is gone: freeing its sessions", peer.hex())
        self.engine.submit(DropOwner(peer), lambda _r: True)


@asynccontextmanager
async def open_node(config: NodeConfig) -> AsyncIterator[Node]:
    """Run a node inside the caller's Trio program; drains and closes on exit."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        async with open_engine(config.engine) as engine:
            node = Node(config, engine, ctx)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(node.pump.run)
                    if node.downstream is not None:
                        await nursery.start(node.downstream.run)
                    if config.metrics_port is not None:
                        from neuron_tai.metrics import serve_metrics  # noqa: PLC0415 - only when asked for

                        await nursery.start(serve_metrics, node, config.metrics_port)
                    log.info(
                        "serving %s layers %d-%d (%s%s) on %s%s", engine.info.model, *engine.info.layers,
                        "first " if engine.info.first else "", "last" if engine.info.last else "stage",
                        node.address, f", next stage {config.next}" if config.next else "",
                    )  # fmt: skip
                    try:
                        yield node
                    finally:
                        engine.begin_shutdown()
                        with trio.move_on_after(config.drain_timeout_s):
                            await engine.stopped.wait()
                        with trio.move_on_after(1.0):  # let the pump deliver the last replies
                            while node.pump.queued:
                                await trio.sleep(0.01)
                        nursery.cancel_scope.cancel()
            finally:  # the tasks that owned the sockets have ended
                node.sock.close()
                if node.downstream is not None:
                    node.downstream.close()
    finally:
        ctx.term()
