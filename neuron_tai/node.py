"""A node: one stage's engine behind a ZeroMQ ROUTER socket speaking PROTOCOL.md v1.

    async with open_node(config) as node:      # inside any Trio program
        print(node.address)
        await trio.sleep_forever()

One pump task owns the ROUTER socket: it decodes and validates each message within
the wire limits and answers at once what needs no waiting (ping, stats, errors).
Each open, step and generate becomes one handler task in the node's nursery that
awaits the engine, then (with `next` set) the next stage, then replies: a chain looks
like one node to a client. A close is never a task and never refused: it is answered
at once when there is nothing to close, else once the engine's cleanup path has freed
the session. A generate's task runs the token loop itself: every token
is one ordinary engine step (so it batches with every other session's), fed the token
the step before it sampled. Tokenize and detokenize, whose work grows with their input,
are handler tasks too and run on a worker thread, never on the event loop. Handler
tasks are capped per connection and in total, in number and in the bytes they hold;
beyond a cap a request is answered `busy` at once, so ping and stats are never held up.
Replies waiting for a connection that does not read are bounded in bytes by the pump,
which treats a connection past its bound as gone (its sessions are freed).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import trio
import zmq

from engine.engine import Engine, open_engine
from engine.messages import (
    CloseRequest,
    DropOwner,
    Failure,
    Opened,
    OpenRequest,
    Output,
    Refused,
    Rollback,
    StepDone,
    StepRequest,
)
from neuron_tai.config import NodeConfig
from neuron_tai.downstream import NextStage
from neuron_tai.generation import MAX_PENDING_CANCELS, EndReason, EndRule, Generation
from neuron_tai.security import AllowList, ClientCurve, is_loopback, make_curve_server, open_zmq_context
from protocol.errors import ErrorCode
from transport import wire
from transport.pump import SocketPump
from transport.requester import Reply
from transport.trio_zmq import TrioSocket

log = logging.getLogger("neuron_tai.node")


R = TypeVar("R", wire.Open, wire.Step, wire.Generate, wire.Cancel, wire.Close, wire.Tokenize, wire.Detokenize)
Handler = Callable[[bytes, R], Awaitable[None]]

_OUT = {"hidden": Output.HIDDEN, "token": Output.TOKEN, "logits": Output.LOGITS}


@dataclass(frozen=True, slots=True)
class StepError:
    """What a step is answered with instead of a result (already counted where it was decided)."""

    code: ErrorCode
    message: str
    retry_after_ms: int | None = None


@dataclass(slots=True)
class Held:
    """The bytes one request in progress holds: counted in the node's totals until it ends."""

    size: int = 0


def forwarded_session(peer: bytes, session: str) -> str:
    """The id a session has on the next stage: distinct per upstream connection."""
    return hashlib.blake2b(peer + b"\0" + session.encode(), digest_size=12).hexdigest()


class Node:
    def __init__(
        self, config: NodeConfig, engine: Engine, ctx: zmq.Context[zmq.Socket[bytes]], allow: AllowList | None = None
    ) -> None:
        self.config = config
        self.engine = engine
        self.stage = engine.stage
        self.allow = allow  # the keys the ZAP handler admits: set when the node requires CURVE
        sock = ctx.socket(zmq.ROUTER)
        if config.curve is not None:
            make_curve_server(sock, config.curve.secret)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer reconnecting under its identity takes it over
        sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, config.send_hwm)
        sock.setsockopt(zmq.RCVHWM, config.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(config.bind)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = TrioSocket(sock)
        self.pump = SocketPump(self.sock, self._on_message, routed=True, max_bytes=config.max_reply_bytes,
                               max_peer_bytes=config.max_peer_reply_bytes, on_peer_gone=self._peer_gone)  # fmt: skip
        self.next = None
        if config.next:
            curve = config.curve
            link = ClientCurve(curve.secret, curve.next_key) if curve and curve.next_key else None
            self.next = NextStage(ctx, config.next, config.downstream_timeout_s, config.hwm, self.stage.n_embd,
                                  self.stage.n_vocab, curve=link, send_hwm=config.send_hwm,
                                  max_outbox_bytes=config.max_next_outbox_bytes)  # fmt: skip
        self.peers_gone = 0
        self.started = time.monotonic()
        # Steps of a session from arrival until reply (through the next stage too): while the
        # session is open and one is in flight, another is `busy`. A count, not a flag: steps
        # for a session that does not exist all go on to be answered `unknown_session`.
        self.in_flight: Counter[tuple[bytes, str]] = Counter()
        self.handlers = 0
        self.handlers_by_peer: Counter[bytes] = Counter()
        self.handlers_refused = 0
        # What requests in progress hold, in bytes (see `_held_bytes`): in total and per connection.
        self.request_bytes = 0
        self.request_bytes_peak = 0
        self.request_bytes_by_peer: Counter[bytes] = Counter()
        self.request_bytes_refused = 0
        self.handlers_idle = trio.Event()
        self.handlers_idle.set()
        self.generations: dict[tuple[bytes, str], Generation] = {}  # running generates, by session
        # Sessions whose close is under way (waiting for its run to end, or for the engine): the
        # close's rid. One per session: a second close of it is answered at once.
        self.closing: dict[tuple[bytes, str], int] = {}
        self.generated_tokens = 0
        self.limits = wire.request_limits(config.max_text_bytes)
        # One tokenizer call at a time on a worker thread: the vocabulary is read-only in
        # llama.cpp (tokenize and detokenize are const), so they may overlap a decode.
        self.text_limiter = trio.CapacityLimiter(1)
        self.text_pending_bytes = 0
        # Leases: when each connection was last heard from (trio time); the open request of
        # each session forwarded to the next stage (to reopen it there, and to close it there).
        self.last_heard: dict[bytes, float] = {}
        self.leases_expired = 0
        self.forwarded: dict[tuple[bytes, str], dict[str, Any]] = {}
        engine.on_close = self._session_freed
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The socket tasks and every request's handler task live in this nursery."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.pump.run)
            if self.next is not None:
                await nursery.start(self.next.run)
            nursery.start_soon(self._expire_leases)
            task_status.started()

    # -- replies -----------------------------------------------------------------------

    def _send(self, peer: bytes, frames: list[bytes]) -> bool:
        """Queue a reply; False when it cannot go out (the peer is gone or hopelessly behind)."""
        return self.pump.send_nowait([peer, *frames])

    def _deliver(self, peer: bytes, session: str, frames: list[bytes]) -> bool:
        """A reply that hands the peer a session or its state: if it cannot go out, nobody owns them."""
        if self._send(peer, frames):
            return True
        self.engine.cleanup_nowait(CloseRequest(peer, session))
        return False

    def _error(self, peer: bytes, rid: int | None, code: ErrorCode, message: str, retry: int | None = None) -> None:
        """An error this node decided (the engine counts its own): counted in `errors_total`."""
        self.engine.count_error(code)
        self._relay_error(peer, rid, code, message, retry)

    def _relay_error(
        self, peer: bytes, rid: int | None, code: ErrorCode, message: str, retry: int | None = None
    ) -> None:
        if code is not ErrorCode.BUSY:
            log.debug("error %s to %s: %s", code, peer.hex(), message)
        self._send(peer, wire.encode_error(rid, code, message, retry))

    def _failure(self, peer: bytes, rid: int, failure: Failure) -> None:
        self._relay_error(peer, rid, failure.code, failure.message, failure.retry_after_ms)

    def _next_stage_error(self, peer: bytes, rid: int, reply: dict[str, Any]) -> None:
        code = ErrorCode.parse(reply.get("code"))
        self._relay_error(peer, rid, code, str(reply.get("message", "")), reply.get("retry_after_ms"))

    def stage_map(self) -> dict[str, Any]:
        stage = self.stage
        return {
            "first": stage.first,
            "last": stage.last,
            "layers": list(stage.layers),
            "n_embd": stage.n_embd,
            "n_vocab": stage.n_vocab,
            "model": stage.model,
            "max_step_tokens": stage.max_step_tokens,
            "eog_tokens": list(stage.eog_tokens),
        }

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        stats["max_message_bytes"] = self.config.max_message_bytes
        stats["max_header_bytes"] = self.limits.max_header_bytes
        stats["max_text_bytes"] = self.config.max_text_bytes
        stats["max_text_tokens"] = self.config.max_text_tokens
        stats["messages_failed_total"] = self.pump.failed
        stats["text_pending_bytes"] = self.text_pending_bytes
        stats["peers_gone_total"] = self.peers_gone
        stats.update(self._memory_stats())
        stats["uptime_s"] = round(time.monotonic() - self.started, 1)
        stats["handlers_active"] = self.handlers
        stats["handlers_refused_total"] = self.handlers_refused
        stats["generations_active"] = len(self.generations)
        stats["closes_pending"] = len(self.closing)
        stats["generated_tokens_total"] = self.generated_tokens
        stats["lease_ms"] = round(self.config.lease_s * 1000)
        stats["leases_expired_total"] = self.leases_expired
        stats["curve"] = self.allow is not None
        stats["auth_failures_total"] = self.allow.failures if self.allow is not None else 0
        if self.allow is not None:
            stats["curve_allowed_keys"] = len(self.allow)
        if self.next is not None:
            stats["downstream"] = {**self.next.stats(), "malformed_total": self.next.malformed,
                                   "replies_dropped_total": self.next.core.dropped}  # fmt: skip
            if self.allow is not None:  # only authenticated peers learn where the chain goes on
                stats["downstream"]["address"] = self.next.address
        return {**stats, **self.config.extra_stats}

    def _memory_stats(self) -> dict[str, int]:
        """Each byte bound with what it bounds now (for a connection: the one with the most)."""
        cfg, pump = self.config, self.pump
        return {
            "send_hwm": cfg.send_hwm,
            "reply_bytes": pump.queued_bytes,
            "reply_bytes_peak": pump.peak_bytes,
            "max_reply_bytes": cfg.max_reply_bytes,
            "peer_reply_bytes": pump.most_peer_bytes,
            "max_peer_reply_bytes": cfg.max_peer_reply_bytes,
            "peers_cut_off_total": pump.cut_off,
            "request_bytes": self.request_bytes,
            "request_bytes_peak": self.request_bytes_peak,
            "max_request_bytes": cfg.max_request_bytes,
            "peer_request_bytes": max(self.request_bytes_by_peer.values(), default=0),
            "max_peer_request_bytes": cfg.max_peer_request_bytes,
            "request_bytes_refused_total": self.request_bytes_refused,
        }

    # -- requests ----------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        peer, body = frames[0], frames[1:]
        request: wire.Request | None = None
        self.last_heard[peer] = trio.current_time()  # any message renews the lease, even a broken one
        try:
            request = wire.decode_request(body, self.stage.n_embd, self.limits, self.config.max_text_tokens)
            self._dispatch(peer, request)
        except wire.WireError as exc:
            self._error(peer, exc.rid, exc.code, exc.message)
        except Exception as exc:  # a bug must cost one request, never the node
            log.exception("request %r failed", type(request).__name__)
            rid = None if request is None else request.rid
            self._error(peer, rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {wire.show(str(exc), 200)}")

    def _dispatch(self, peer: bytes, request: wire.Request) -> None:
        rid = request.rid
        if isinstance(request, wire.Ping):
            self._send(peer, wire.encode({"op": "pong", "rid": rid}))
        elif isinstance(request, wire.Stats):
            self._send(peer, wire.encode({"op": "stats", "rid": rid, "stats": self.stats()}))
        elif isinstance(request, wire.Tokenize):
            self._start_text(peer, request, len(request.text))
        elif isinstance(request, wire.Detokenize):
            self._start_text(peer, request, request.tokens.nbytes)
        elif isinstance(request, wire.Open):
            self._spawn(peer, rid, self._open, request)
        elif isinstance(request, wire.Step):
            self._start_step(peer, request)
        elif isinstance(request, wire.Generate):
            self._start_generate(peer, request)
        elif isinstance(request, wire.Cancel):
            self._start_cancel(peer, request)
        else:
            self._start_close(peer, request)

    def _spawn(
        self,
        peer: bytes,
        rid: int,
        handler: Handler[R],
        request: R,
        *,
        held: Held | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> bool:
        """Run `handler(peer, request)` as a task of its own that holds `held` bytes, or answer
        `busy` at once when too many run or they hold too many bytes."""
        cfg = self.config
        if self.handlers >= cfg.max_handlers or self.handlers_by_peer[peer] >= cfg.max_handlers_per_peer:
            self.handlers_refused += 1
            self._error(peer, rid, ErrorCode.BUSY, "the node has too many requests in progress", self._retry_ms())
            return False
        held = held or Held()
        if held.size and (why := self._no_room_for(peer, held.size)):
            self.request_bytes_refused += 1
            self._error(peer, rid, ErrorCode.BUSY, why, self._retry_ms())
            return False
        assert self._nursery is not None
        self.handlers += 1
        self.handlers_by_peer[peer] += 1
        if held.size:
            self.request_bytes += held.size
            self.request_bytes_peak = max(self.request_bytes_peak, self.request_bytes)
            self.request_bytes_by_peer[peer] += held.size
        self.handlers_idle = trio.Event() if self.handlers == 1 else self.handlers_idle
        self._nursery.start_soon(self._run_handler, peer, rid, handler, request, held, on_exit)
        return True

    def _release(self, peer: bytes, held: Held, size: int) -> None:
        """`held` now holds `size` bytes (fewer than before): let the rest go."""
        freed, held.size = held.size - size, size
        if freed:
            self.request_bytes -= freed
            self.request_bytes_by_peer[peer] -= freed
            if not self.request_bytes_by_peer[peer]:
                del self.request_bytes_by_peer[peer]

    def _no_room_for(self, peer: bytes, size: int) -> str | None:
        """Why a request holding `size` bytes cannot be taken now (None: it can). One is always
        taken when nothing is held, so no single request is refused for its size alone."""
        held = self.request_bytes_by_peer[peer]
        if held and held + size > self.config.max_peer_request_bytes:
            return "this connection's requests in progress hold too many bytes"
        if self.request_bytes and self.request_bytes + size > self.config.max_request_bytes:
            return "the node's requests in progress hold too many bytes"
        return None

    async def _run_handler(
        self, peer: bytes, rid: int, handler: Handler[R], request: R, held: Held, on_exit: Callable[[], None] | None
    ) -> None:
        try:
            await handler(peer, request)
        except Exception as exc:  # a bug must cost one request, never the node
            log.exception("request %d failed", rid)
            self._error(peer, rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            if on_exit is not None:
                on_exit()
            self.last_heard[peer] = trio.current_time()  # the lease runs from the end of its requests' work
            self.handlers -= 1
            self.handlers_by_peer[peer] -= 1
            if not self.handlers_by_peer[peer]:
                del self.handlers_by_peer[peer]
            self._release(peer, held, 0)
            if not self.handlers:
                self.handlers_idle.set()

    def _start_text(self, peer: bytes, req: wire.Tokenize | wire.Detokenize, size: int) -> None:
        """A tokenizer request becomes a handler task unless too much text already waits."""
        if self.text_pending_bytes and self.text_pending_bytes + size > self.config.max_text_pending_bytes:
            self._error(peer, req.rid, ErrorCode.BUSY, "too much text is waiting for the tokenizer", self._retry_ms())
            return

        def done() -> None:
            self.text_pending_bytes -= size

        if isinstance(req, wire.Tokenize):
            spawned = self._spawn(peer, req.rid, self._tokenize, req, held=Held(size), on_exit=done)
        else:
            spawned = self._spawn(peer, req.rid, self._detokenize, req, held=Held(size), on_exit=done)
        if spawned:
            self.text_pending_bytes += size

    async def _tokenize(self, peer: bytes, req: wire.Tokenize) -> None:
        def work() -> npt.NDArray[np.int32]:
            return np.array(self.engine.tokenize(req.text, req.add_special), "<i4")

        ids = await trio.to_thread.run_sync(work, limiter=self.text_limiter)
        if len(ids) > self.config.max_text_tokens:
            limit = self.config.max_text_tokens
            self._error(peer, req.rid, ErrorCode.TOO_LARGE, f"the text is {len(ids)} tokens, the limit is {limit}")
            return
        self._send(peer, wire.encode({"op": "tokens", "rid": req.rid, "n": len(ids)}, ids.tobytes()))

    async def _detokenize(self, peer: bytes, req: wire.Detokenize) -> None:
        def work() -> str:
            return self.engine.detokenize(req.tokens.tolist())

        try:
            text = await trio.to_thread.run_sync(work, limiter=self.text_limiter)
        except Refused as exc:
            self._error(peer, req.rid, exc.code, str(exc))
            return
        self._send(peer, wire.encode({"op": "text", "rid": req.rid, "text": text}))

    def _retry_ms(self) -> int:
        return self.engine.busy_retry_ms()

    async def _open(self, peer: bytes, req: wire.Open) -> None:
        s = req.sampling
        result = await self.engine.request(OpenRequest(peer, req.session, req.max_tokens, s, req.wait_ms))
        if isinstance(result, Failure):
            self._failure(peer, req.rid, result)
            return
        assert isinstance(result, Opened)
        stage = self.stage_map()
        if self.next is not None:
            fwd = forwarded_session(peer, req.session)
            header = {"op": "open", "session": fwd, "max_tokens": req.max_tokens,
                      "wait_ms": req.wait_ms, "sampling": {"temperature": s.temperature, "top_k": s.top_k,
                      "top_p": s.top_p, "seed": s.seed}}  # fmt: skip
            reply = await self.next.request(header)
            if reply is None or reply[0].get("op") != "opened":
                await self.engine.cleanup(CloseRequest(peer, req.session))  # nothing is opened anywhere
                if reply is None:
                    self._error(
                        peer, req.rid, ErrorCode.DOWNSTREAM, "the next stage did not answer; nothing was opened"
                    )
                else:
                    self._next_stage_error(peer, req.rid, reply[0])
                return
            if self.engine.max_tokens_of(peer, req.session) is None:  # freed meanwhile: free it there too
                self.next.close_soon(fwd)
            else:
                self.forwarded[(peer, req.session)] = {**header, "wait_ms": 0}
            theirs = reply[0].get("stage", {})
            stage.update(last=theirs.get("last", False), layers=[stage["layers"][0], theirs.get("layers", [0, 0])[1]])
            stage["max_step_tokens"] = min(stage["max_step_tokens"], theirs.get("max_step_tokens", 1 << 30))
            stage["eog_tokens"] = theirs.get("eog_tokens", stage["eog_tokens"])
        header = {"op": "opened", "rid": req.rid, "session": req.session, "kv_reserved": result.kv_reserved,
                  "stage": stage, "lease_ms": round(self.config.lease_s * 1000)}  # fmt: skip
        self._deliver(peer, req.session, wire.encode(header))

    def _start_step(self, peer: bytes, req: wire.Step) -> None:
        """Refuse at once what needs no engine; otherwise the step is in flight until answered."""
        stage, key = self.stage, (peer, req.session)
        if req.input == "tokens" and not stage.first:
            self._error(peer, req.rid, ErrorCode.WRONG_STAGE, f"this stage (layers {stage.layers}) takes hidden input")
            return
        if req.input == "hidden" and stage.first:
            self._error(peer, req.rid, ErrorCode.WRONG_STAGE, "this is a first stage: it takes token input")
            return
        if self.next is None and (req.out == "hidden") == stage.last:
            want = "'token' or 'logits'" if stage.last else "'hidden'"
            self._error(peer, req.rid, ErrorCode.WRONG_STAGE, f"this stage (layers {stage.layers}) gives out={want}")
            return
        if self._too_large(peer, req.rid, req.n):
            return
        if self.in_flight[key] and self.engine.max_tokens_of(peer, req.session) is not None:
            self._error(peer, req.rid, ErrorCode.BUSY, "the session already has a step in flight", self._retry_ms())
            return
        payload = req.tokens if req.tokens is not None else req.hidden
        held = Held(self._held_bytes(req.n, 0 if payload is None else payload.nbytes))
        if self._spawn(peer, req.rid, self._step, req, held=held, on_exit=lambda: self._step_done(key)):
            self.in_flight[key] += 1

    def _too_large(self, peer: bytes, rid: int, n: int) -> bool:
        """A step (or a generate's first) longer than this stage takes is refused before it holds anything."""
        limit = self.stage.max_step_tokens
        if n > limit:
            self._error(peer, rid, ErrorCode.TOO_LARGE, f"n={n} exceeds max_step_tokens {limit}")
        return n > limit

    def _held_bytes(self, n: int, payload: int) -> int:
        """What a step of `n` positions holds while in progress: its payload, and with a next
        stage the hidden states (f32) it sends there and keeps until that stage answers."""
        return payload + (n * self.stage.n_embd * 4 if self.next is not None else 0)

    def _step_done(self, key: tuple[bytes, str]) -> None:
        self.in_flight[key] -= 1
        if not self.in_flight[key]:
            del self.in_flight[key]

    async def _step(self, peer: bytes, req: wire.Step) -> None:
        outcome = await self._run_step(peer, req)
        if isinstance(outcome, StepError):
            self._relay_error(peer, req.rid, outcome.code, outcome.message, outcome.retry_after_ms)
            return
        header, frames = outcome
        self._deliver(peer, req.session, wire.encode(header, *frames))

    async def _run_step(self, peer: bytes, req: wire.Step) -> Reply | StepError:
        """One step through this stage and (with `next`) the rest of the chain: the `result` reply,
        or the error to answer instead, the session left as it was before the step."""
        local_out = _OUT[req.out] if self.next is None else Output.HIDDEN
        request = StepRequest(peer, req.session, req.pos, local_out, tokens=req.tokens, hidden=req.hidden)
        result = await self.engine.request(request)
        if isinstance(result, Failure):
            return StepError(result.code, result.message, result.retry_after_ms)
        assert isinstance(result, StepDone)
        if self.next is None:
            return self._result_reply(req, result)
        reply = await self._forward_step(peer, req, result)
        if reply is not None and reply[0].get("op") == "result":
            header, frames = reply
            return {**header, "rid": req.rid, "session": req.session}, frames
        # The next stage did not take the step: undo it here, then tell the requester.
        await self.engine.cleanup(Rollback(peer, req.session, req.pos))
        if reply is None:
            return self._node_error(ErrorCode.DOWNSTREAM, "the next stage failed or did not answer; rolled back")
        if reply[0].get("code") == ErrorCode.UNKNOWN_SESSION:
            return self._node_error(ErrorCode.DOWNSTREAM,
                                    "the next stage lost this session (restarted?); resend from pos 0")  # fmt: skip
        theirs = reply[0]
        return StepError(ErrorCode.parse(theirs.get("code")), str(theirs.get("message", "")),
                         theirs.get("retry_after_ms"))  # fmt: skip

    def _node_error(self, code: ErrorCode, message: str) -> StepError:
        self.engine.count_error(code)
        return StepError(code, message)

    @staticmethod
    def _result_reply(req: wire.Step, result: StepDone) -> Reply:
        header: dict[str, Any] = {"op": "result", "rid": req.rid, "session": req.session, "pos": req.pos,
                                  "n": req.n, "out": req.out}  # fmt: skip
        if result.hidden is not None:
            header["dtype"] = req.out_dtype
            return header, [wire.hidden_frame(result.hidden, req.out_dtype)]
        if result.logits is not None:
            return header, [np.asarray(result.logits, "<f4").tobytes()]
        return header, [np.array([result.token], "<i4").tobytes()]

    # -- server-side generation -----------------------------------------------------------

    def _start_generate(self, peer: bytes, req: wire.Generate) -> None:
        """Refuse at once what needs no engine; otherwise the run holds the session until `done`."""
        stage, key = self.stage, (peer, req.session)
        if not stage.first:
            where = f"this stage (layers {stage.layers}) takes hidden input: generate at the chain's head"
            self._error(peer, req.rid, ErrorCode.WRONG_STAGE, where)
            return
        if self.next is None and not stage.last:
            self._error(peer, req.rid, ErrorCode.WRONG_STAGE,
                        f"this stage (layers {stage.layers}) cannot sample tokens and has no next stage")  # fmt: skip
            return
        if self._too_large(peer, req.rid, req.n):
            return
        if self.in_flight[key] and self.engine.max_tokens_of(peer, req.session) is not None:
            self._error(peer, req.rid, ErrorCode.BUSY, "the session already has a step in flight", self._retry_ms())
            return
        run, hold = Generation(), Held(self._held_bytes(req.n, req.tokens.nbytes))
        handler = functools.partial(self._generate, run=run, hold=hold)
        if self._spawn(peer, req.rid, handler, req, held=hold, on_exit=lambda: self._generation_done(key, run)):
            self.in_flight[key] += 1
            self.generations[key] = run

    def _generation_done(self, key: tuple[bytes, str], run: Generation) -> None:
        for rid in run.cancels:  # after the run's `done`
            self._send(key[0], self._cancelled(rid, key[1], run.length))
        if self.generations.get(key) is run:
            del self.generations[key]
        self._step_done(key)
        if run.close_after:  # its `done` is out: now the close it was stopped for
            self._close_in_engine(key)

    async def _generate(self, peer: bytes, req: wire.Generate, *, run: Generation, hold: Held) -> None:
        """Step, sample, feed the token back, until a token or `cancel` ends the run; stream as it goes.

        Tokens are held back (and later sent several to a message) while the peer's pipe is
        full, so a slow reader costs one growing list bounded by `max_new`, not a message queue.
        """
        rule = EndRule(req.max_new, req.stop, frozenset() if req.ignore_eog else self.engine.eog_tokens)
        pos, feed = req.pos, req.tokens
        produced: list[int] = []
        held = 0  # the last `held` tokens of `produced` are not streamed yet
        reason: EndReason | None = None
        while reason is None:
            if run.cancel.is_set():
                reason = EndReason.CANCELLED
                break
            step = wire.Step(req.rid, req.session, pos, len(feed), "tokens", "token", "f32", tokens=feed)
            outcome = await self._run_step(peer, step)
            if isinstance(outcome, StepError) and outcome.code is ErrorCode.BUSY and produced:
                # A full queue mid-run is this node's own congestion: the run waits its turn
                # (a one-token step always fits again) instead of failing the client's generation.
                await trio.sleep(max(outcome.retry_after_ms or 0, 1) / 1000)
                continue
            if isinstance(outcome, StepError):
                if held and not self._stream(peer, req, produced, held):
                    return
                run.length = self.engine.length_of(peer, req.session) or 0
                frames = wire.encode_error(req.rid, outcome.code, outcome.message, outcome.retry_after_ms,
                                           session=req.session, length=run.length)  # fmt: skip
                self._send(peer, frames)
                return
            token = int(np.frombuffer(outcome[1][0], "<i4")[0])
            if not produced:  # from now on each step is one token: it holds that much
                self._release(peer, hold, self._held_bytes(1, req.tokens.nbytes))
            produced.append(token)
            self.generated_tokens += 1
            pos, feed = pos + len(feed), np.array([token], np.int32)
            max_tokens = self.engine.max_tokens_of(peer, req.session)
            reason = rule.reason(token, len(produced), pos, pos + 1 if max_tokens is None else max_tokens)
            if req.stream:
                held += 1
                if reason is not None or not self.pump.backlog(peer):
                    if not self._stream(peer, req, produced, held):
                        return  # the peer is gone: its session is being freed
                    held = 0
        run.length = pos if produced else (self.engine.length_of(peer, req.session) or 0)
        header = {"op": "done", "rid": req.rid, "session": req.session, "reason": str(reason),
                  "generated": len(produced), "length": run.length}  # fmt: skip
        payload = [] if req.stream else [np.array(produced, "<i4").tobytes()]
        self._deliver(peer, req.session, wire.encode(header, *payload))

    def _stream(self, peer: bytes, req: wire.Generate, produced: list[int], held: int) -> bool:
        """Send the last `held` tokens of `produced` as one `generated` message."""
        first = len(produced) - held
        header = {"op": "generated", "rid": req.rid, "session": req.session, "pos": req.pos + req.n + first,
                  "n": held}  # fmt: skip
        return self._deliver(peer, req.session, wire.encode(header, np.array(produced[first:], "<i4").tobytes()))

    def _start_cancel(self, peer: bytes, req: wire.Cancel) -> None:
        """A session that is not generating is answered at once; otherwise once its `done` is out
        (the run answers its cancels as it ends: no task, so a cancel is never refused for room)."""
        run = self.generations.get((peer, req.session))
        if run is None:
            self._send(peer, self._cancelled(req.rid, req.session, self.engine.length_of(peer, req.session) or 0))
        elif len(run.cancels) >= MAX_PENDING_CANCELS:
            self._error(peer, req.rid, ErrorCode.BUSY,
                        f"this session's generation already has {MAX_PENDING_CANCELS} cancels waiting for its end",
                        self._retry_ms())  # fmt: skip
        else:
            run.cancels.append(req.rid)
            run.cancel.set()

    @staticmethod
    def _cancelled(rid: int, session: str, length: int) -> list[bytes]:
        return wire.encode({"op": "cancelled", "rid": rid, "session": session, "length": length})

    async def _forward_step(self, peer: bytes, req: wire.Step, local: StepDone) -> Reply | None:
        """The next stage's reply to this step. If it lost the session (it restarted) and the
        step starts at 0, the session is opened there again and the step resent, once."""
        assert self.next is not None and local.hidden is not None
        fwd = forwarded_session(peer, req.session)
        header = {"op": "step", "session": fwd, "pos": req.pos, "n": req.n, "input": "hidden", "dtype": "f32",
                  "out": req.out, "out_dtype": req.out_dtype}  # fmt: skip
        payload = [wire.hidden_frame(local.hidden, "f32")]
        reply = await self.next.request(header, payload)
        if reply is None or reply[0].get("code") != ErrorCode.UNKNOWN_SESSION or req.pos != 0:
            return reply
        max_tokens = self.engine.max_tokens_of(peer, req.session) or req.pos + req.n
        # The session's own open (its sampling above all), as first forwarded.
        reopen = self.forwarded.get((peer, req.session), {"op": "open", "session": fwd, "max_tokens": max_tokens})
        opened = await self.next.request(reopen)
        if opened is None or not (opened[0].get("op") == "opened" or opened[0].get("code") == ErrorCode.SESSION_EXISTS):
            return None
        return await self.next.request(header, payload)

    def _start_close(self, peer: bytes, req: wire.Close) -> None:
        """Never refused, never a task. Nothing to close (or its close already under way):
        `existed: false` at once. Otherwise the engine's cleanup path closes it (after its
        run, if it is generating, has answered `done`) and then it is answered. At most one
        close per session waits, so a flood of closes holds no more than the sessions do."""
        key = (peer, req.session)
        run = self.generations.get(key)
        if key in self.closing or (run is None and self.engine.max_tokens_of(peer, req.session) is None):
            self._closed(peer, req.rid, req.session, existed=False)
            return
        self.closing[key] = req.rid
        if run is None:
            self._close_in_engine(key)
        else:
            run.close_after = True
            run.cancel.set()

    def _close_in_engine(self, key: tuple[bytes, str]) -> None:
        peer, session = key

        def answer(existed: bool) -> None:  # in the engine task, once it has closed the session
            rid = self.closing.pop(key, None)
            if rid is not None:
                self._closed(peer, rid, session, existed)  # its close on the next stage is queued by then

        self.engine.cleanup_nowait(CloseRequest(peer, session), answer)

    def _closed(self, peer: bytes, rid: int, session: str, existed: bool) -> None:
        self._send(peer, wire.encode({"op": "closed", "rid": rid, "session": session, "existed": existed}))

    def _session_freed(self, peer: bytes, session: str) -> None:
        """The engine freed a session (closed, lease run out, peer gone, rollback failed, ...):
        free it on the next stage too. Runs in the engine task: queues the close, never waits."""
        forwarded = self.forwarded.pop((peer, session), None)
        if forwarded is not None and self.next is not None:
            self.next.close_soon(forwarded["session"])

    async def _expire_leases(self) -> None:
        """Free the sessions of every connection silent for longer than the lease."""
        lease = self.config.lease_s
        while True:
            now = trio.current_time()
            for peer, heard in list(self.last_heard.items()):
                if now - heard <= lease or self.handlers_by_peer[peer]:
                    continue
                del self.last_heard[peer]
                self.pump.forget(peer)
                if self.engine.sessions_of(peer):
                    self.leases_expired += 1
                    log.info("peer %s was silent for over %.1fs: freeing its sessions", peer.hex(), lease)
                    self._drop_peer(peer)
            idle = [heard for peer, heard in self.last_heard.items() if not self.handlers_by_peer[peer]]
            oldest = min(idle, default=now)  # a peer with work in progress is renewed when it ends
            await trio.sleep_until(max(oldest + lease, now) + 0.01)

    def _peer_gone(self, peer: bytes) -> None:
        self.peers_gone += 1
        log.info("peer %s is gone: freeing its sessions", peer.hex())
        self._drop_peer(peer)

    def _drop_peer(self, peer: bytes) -> None:
        for key, run in self.generations.items():
            if key[0] == peer:
                run.cancel.set()
        self.engine.cleanup_nowait(DropOwner(peer))


@asynccontextmanager
async def open_node(config: NodeConfig) -> AsyncIterator[Node]:
    """Run a node inside the caller's Trio program; drains and closes on exit."""
    engine_config = config.engine
    if engine_config.micro_batches is None:  # a head overlaps its micro-batches with the next stage's
        engine_config = replace(engine_config, micro_batches=2 if config.next else 1)
    with open_zmq_context(config.curve) as (ctx, allow):
        async with open_engine(engine_config) as engine:
            node = Node(config, engine, ctx, allow)
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(node.run)
                    if config.metrics_port is not None:
                        from neuron_tai.metrics import serve_metrics  # noqa: PLC0415 - only when asked for

                        await nursery.start(serve_metrics, node, config.metrics_port, config.metrics_bind)
                    log.info(
                        "serving %s layers %d-%d (%s%s) on %s%s", node.stage.model, *node.stage.layers,
                        "first " if node.stage.first else "", "last" if node.stage.last else "stage",
                        node.address, f", next stage {config.next}" if config.next else "",
                    )  # fmt: skip
                    _warn_if_unauthenticated(config, node.address)
                    try:
                        yield node
                    finally:
                        engine.begin_shutdown()
                        with trio.move_on_after(config.drain_timeout_s):
                            await engine.stopped.wait()
                            await node.handlers_idle.wait()  # the last replies, relayed from the next stage too
                        with trio.move_on_after(1.0):  # let the pump deliver the last replies
                            while node.pump.queued:
                                await trio.sleep(0.01)
                        nursery.cancel_scope.cancel()
            finally:  # the tasks that owned the sockets have ended
                node.sock.close()
                if node.next is not None:
                    node.next.close()


def _warn_if_unauthenticated(config: NodeConfig, address: str) -> None:
    if config.curve is None and not is_loopback(address):
        log.warning("%s is reachable beyond this host and its links are unauthenticated and in clear: "
                    "anyone who reaches it can use it (see --curve-secret and --allow)", address)  # fmt: skip
    if config.next and not (config.curve and config.curve.next_key) and not is_loopback(config.next):
        log.warning("the link to the next stage %s is unauthenticated and in clear (see --next-key)", config.next)
