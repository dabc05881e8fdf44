"""A node: one stage's engine behind a ZeroMQ ROUTER socket speaking PROTOCOL.md v1.

    async with open_node(config) as node:      # inside any Trio program
        print(node.address)
        await trio.sleep_forever()

The node is a dispatcher. One pump task owns the ROUTER socket: it decodes and validates
each message within the wire limits, and the node answers at once what needs no waiting
(ping, stats, errors) and hands everything else to the part that owns it:
- `HandlerPool` (neuron_tai.handler_pool): each request that waits is a task of its own,
  capped per connection and in total, in number and bytes (beyond a cap: `busy` at once);
- `SessionDesk` (neuron_tai.sessions): open and close, here and on the next stage;
- `StepRunner` (neuron_tai.steps): a step through this stage and the rest of the chain;
- `Generations` (neuron_tai.generate_run): server-side generation, its stream and cancel;
- `Forwarder` (neuron_tai.forwarding): the link to the next stage;
- `TextService` (neuron_tai.text_service): tokenize and detokenize on a worker thread;
- `Leases` (neuron_tai.leases): sessions of silent connections are freed;
- `Outbox` (neuron_tai.outbox): every reply, onto the pump.
Replies waiting for a connection that does not read are bounded in bytes by the pump,
which treats a connection past its bound as gone (its sessions are freed).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import trio
import zmq

from engine.engine import Engine, open_engine
from engine.gguf_facts import read_facts
from engine.messages import DropOwner, SessionEnded
from neuron_tai.config import CHAIN_MICRO_BATCHES, NodeConfig
from neuron_tai.downstream import NextStage
from neuron_tai.forwarding import Forwarder
from neuron_tai.generate_run import Generations
from neuron_tai.handler_pool import HandlerPool, Held, PoolLimits
from neuron_tai.leases import Leases
from neuron_tai.outbox import Outbox
from neuron_tai.replicas import Replicas
from neuron_tai.security import AllowList, ClientCurve, is_loopback, make_curve_server, open_zmq_context
from neuron_tai.sessions import SessionDesk
from neuron_tai.shard_fingerprint import shard_fingerprint
from neuron_tai.steps import RecoveryLimits, SessionGate, StepRunner
from neuron_tai.text_service import TextService
from protocol.errors import ErrorCode, Fault
from transport import wire
from transport.pump import SocketPump
from transport.trio_zmq import TrioSocket

log = logging.getLogger("neuron_tai.node")

# How long a stopping node's sockets may still deliver what it sent (its last replies, and
# the closes of the sessions it forwarded) before the process exits: a peer that is gone
# costs no more.
SHUTDOWN_LINGER_MS = 1000


def bind_router(ctx: zmq.Context[zmq.Socket[bytes]], config: NodeConfig) -> zmq.Socket[bytes]:
    """The node's ROUTER socket, bound; closed again if it cannot bind (a socket left open
    would hold the ZeroMQ context's shutdown forever)."""
    sock = ctx.socket(zmq.ROUTER)
    try:
        if config.curve is not None:
            make_curve_server(sock, config.curve.secret)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer reconnecting under its identity takes it over
        sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, config.send_hwm)
        sock.setsockopt(zmq.RCVHWM, config.hwm)
        sock.setsockopt(zmq.LINGER, 0)
        _bind(sock, config.bind)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _bind(sock: zmq.Socket[bytes], address: str) -> None:
    """Bind; an address ZeroMQ refuses for a reason other than one the caller maps (in use,
    denied, not this host's) is a ValueError naming it and the reason."""
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise
        raise ValueError(f"cannot listen on {address}: {zmq.strerror(exc.errno or 0)}") from None


def next_stages(ctx: zmq.Context[zmq.Socket[bytes]], config: NodeConfig, engine: Engine) -> Replicas | None:
    """A link to each replica of the next layer range (None: this stage has no next)."""
    addresses = config.next_addresses
    if not addresses:
        return None
    curve = config.curve
    auth = ClientCurve(curve.secret, curve.next_key) if curve and curve.next_key else None
    stage, links = engine.stage, []
    try:
        for address in addresses:
            links.append(
                NextStage(
                    ctx,
                    address,
                    config.downstream_timeout_s,
                    config.hwm,
                    stage.n_embd,
                    stage.n_vocab,
                    curve=auth,
                    send_hwm=config.send_hwm,
                    max_outbox_bytes=config.max_next_outbox_bytes,
                    max_rows=stage.max_step_tokens,
                )
            )
    except BaseException:
        for link in links:
            link.close()
        raise
    return Replicas(links)


class Node:
    def __init__(
        self,
        config: NodeConfig,
        engine: Engine,
        ctx: zmq.Context[zmq.Socket[bytes]],
        router: zmq.Socket[bytes],
        allow: AllowList | None = None,
    ) -> None:
        """`router` is bound already (`bind_router`); the caller closes it when the node is done."""
        self.config = config
        self.engine = engine
        self.fingerprint = shard_fingerprint(config.engine.model)
        self.stage = replace(engine.stage, fingerprint=self.fingerprint)
        self.allow = allow  # the keys the ZAP handler admits: set when the node requires CURVE
        self.address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = TrioSocket(router)
        self.next = next_stages(ctx, config, engine)
        self.pump = SocketPump(
            self.sock,
            self._on_message,
            routed=True,
            max_bytes=config.max_reply_bytes,
            max_peer_bytes=config.max_peer_reply_bytes,
            on_peer_gone=self._peer_gone,
        )
        self._build_parts(config, engine)
        self.peers_gone = 0
        self.started = time.monotonic()
        self.limits = wire.request_limits(config.max_text_bytes)

    def _build_parts(self, config: NodeConfig, engine: Engine) -> None:
        self.outbox = Outbox(self.pump, engine)
        limits = PoolLimits(
            config.max_handlers, config.max_handlers_per_peer, config.max_request_bytes, config.max_peer_request_bytes
        )
        self.pool = HandlerPool(limits, self.outbox.error)
        self.forwarder = Forwarder(self.next, engine) if self.next is not None else None
        self.gate = SessionGate(lambda key: engine.open_sessions.max_tokens_of(*key) is not None)
        engine.activity = self.gate  # its idle clock runs from a step's answer, not its end here
        recovery = RecoveryLimits(config.recovery_attempts, config.recovery_deadline_s)
        self.steps = StepRunner(engine, self.stage, self.forwarder, recovery, config.part_rows)
        self.generations = Generations(engine, self.steps, self.gate, self.pool, self.outbox, config.speculate)
        self.leases = Leases(
            config.lease_s,
            busy=self.pool.busy_with,
            holds_sessions=engine.open_sessions.count_of,
            expire=self._drop_peer,
            forget=self.pump.forget,
        )
        self.pool.on_ended = self.leases.renew  # the lease runs from the end of its requests' work
        self.sessions = SessionDesk(
            engine, self.outbox, self.generations, self.forwarder, stage=self.stage, lease_ms=self.leases.lease_ms
        )
        self.text = TextService(
            engine,
            self.pool,
            self.outbox,
            max_tokens=config.max_text_tokens,
            max_pending_bytes=config.max_text_pending_bytes,
        )
        self.session_ends = engine.session_ends  # taken now: the engine posts ends from then on

    def forwarder_links(self) -> list[NextStage]:
        """The links to the next stage's replicas (none on a last stage)."""
        return [] if self.next is None else list(self.next.links)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The socket tasks, the leases and every request's task live in this nursery."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.pool.run)
            await nursery.start(self.pump.run)
            if self.next is not None:
                await nursery.start(self.next.run)
            await nursery.start(self.leases.run)
            nursery.start_soon(self._follow_session_ends)
            task_status.started()

    async def _follow_session_ends(self) -> None:
        """The one reader of the engine's session ends: a freed session is freed below too (and
        forgotten here); a close the engine ran is answered. Never waits for the engine."""
        async for end in self.session_ends:
            peer = end.owner
            assert isinstance(peer, bytes)  # the node's sessions are owned by connections
            if isinstance(end, SessionEnded):
                self.gate.forget((peer, end.session))
                self.steps.session_freed(peer, end.session)
            else:
                self.sessions.answered((peer, end.session), end.existed)

    # -- requests ----------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        peer, body = frames[0], frames[1:]
        request: wire.Request | None = None
        self.leases.renew(peer)  # any message renews the lease, even a broken one
        try:
            request = wire.decode_request(body, self.stage.n_embd, self.limits, self.config.max_text_tokens)
            self._dispatch(peer, request)
        except wire.WireError as exc:
            self.outbox.error(peer, exc.rid, Fault(exc.code, exc.message), exc.session)
        except Exception as exc:  # a bug must cost one request, never the node
            log.exception("request %r failed", type(request).__name__)
            rid = None if request is None else request.rid
            message = f"{type(exc).__name__}: {wire.show(str(exc), 200)}"
            self.outbox.error(peer, rid, Fault(ErrorCode.INTERNAL, message))

    def _dispatch(self, peer: bytes, request: wire.Request) -> None:
        rid = request.rid
        if isinstance(request, wire.Ping):
            self.outbox.send(peer, wire.encode_reply(wire.Pong(rid)))
        elif isinstance(request, wire.Stats):
            self.outbox.send(peer, wire.encode_reply(wire.StatsReply(rid, self.stats())))
        elif isinstance(request, wire.Tokenize | wire.Detokenize):
            self.text.start(peer, request)
        elif isinstance(request, wire.Open):
            self.pool.spawn(peer, rid, lambda: self.sessions.open(peer, request))
        elif isinstance(request, wire.Step):
            self._start_step(peer, request)
        elif isinstance(request, wire.Generate):
            self.generations.start(peer, request)
        elif isinstance(request, wire.Cancel):
            self.generations.cancel(peer, request)
        else:
            self.sessions.close(peer, request)

    def _start_step(self, peer: bytes, req: wire.Step) -> None:
        """Refuse at once what needs no engine; otherwise the step is in flight until answered."""
        key = (peer, req.session)
        fault = self.steps.refusal(req)
        if fault is not None:
            self.outbox.error(peer, req.rid, fault)
            return
        if key in self.gate and self.engine.open_sessions.max_tokens_of(peer, req.session) is not None:
            self.outbox.busy(peer, req.rid, "the session already has a step in flight")
            return
        payload = req.tokens if req.tokens is not None else req.hidden
        held = Held(self.steps.held_bytes(req.n, 0 if payload is None else payload.nbytes))

        async def step() -> None:
            outcome = await self.steps.run(peer, req)
            if isinstance(outcome, Fault):
                self.outbox.relay(peer, req.rid, outcome)
            else:
                self.outbox.deliver(peer, req.session, outcome.frames(req.rid, req.session))

        if self.pool.spawn(peer, req.rid, step, held=held, on_exit=lambda: self.gate.leave(key)):
            self.gate.enter(key)

    # -- connections -------------------------------------------------------------------

    def _peer_gone(self, peer: bytes) -> None:
        self.peers_gone += 1
        log.info("peer %s is gone: freeing its sessions", peer.hex())
        self._drop_peer(peer)

    def _drop_peer(self, peer: bytes) -> None:
        self.generations.stop_all(peer)
        self.engine.cleanup_nowait(DropOwner(peer))

    # -- telemetry ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        cfg, pump = self.config, self.pump
        stats = self.engine.stats()
        stats.update(
            max_message_bytes=cfg.max_message_bytes,
            max_header_bytes=self.limits.max_header_bytes,
            max_text_bytes=cfg.max_text_bytes,
            max_text_tokens=cfg.max_text_tokens,
            messages_failed_total=pump.failed,
            text_pending_bytes=self.text.pending_bytes,
            peers_gone_total=self.peers_gone,
            send_hwm=cfg.send_hwm,
            reply_bytes=pump.queued_bytes,
            reply_bytes_peak=pump.peak_bytes,
            max_reply_bytes=cfg.max_reply_bytes,
            peer_reply_bytes=pump.most_peer_bytes,
            max_peer_reply_bytes=cfg.max_peer_reply_bytes,
            peers_cut_off_total=pump.cut_off,
            **self.pool.stats(),
            uptime_s=round(time.monotonic() - self.started, 1),
            generations_active=len(self.generations.runs),
            closes_pending=len(self.sessions.closing),
            generated_tokens_total=self.generations.tokens_total,
            lease_ms=self.leases.lease_ms,
            leases_expired_total=self.leases.expired,
        )
        stats.update(self._security_stats())
        stats["stage"] = wire.stage_map(self.stage)
        if self.steps.recovery is not None:
            stats.update(self.steps.recovery.stats.as_wire())
        if self.forwarder is not None:
            # Where the chain goes on is told only to authenticated peers.
            stats["downstream"] = self.forwarder.stats(show_address=self.allow is not None)
        return {**stats, **cfg.extra_stats}

    def _security_stats(self) -> dict[str, Any]:
        allow = self.allow
        stats: dict[str, Any] = {"curve": allow is not None, "auth_failures_total": allow.failures if allow else 0}
        if allow is not None:
            stats["curve_allowed_keys"] = len(allow)
        return stats


def _default_micro_batches(config: NodeConfig) -> int:
    """A chain's head overlaps its micro-batches with the next stage's compute. A stage fed by
    another runs each group as it comes from upstream (engine/bursts.py): groups of
    its own would only cut those in smaller calls."""
    head = config.next is not None and read_facts(config.engine.model).first
    return CHAIN_MICRO_BATCHES if head else 1


@asynccontextmanager
async def open_node(config: NodeConfig) -> AsyncIterator[Node]:
    """Run a node inside the caller's Trio program; drains and closes on exit.

    The socket is bound before the model loads, so a busy address fails at once with
    ZeroMQ's own error (EADDRINUSE), and nothing is left open behind it."""
    engine_config = config.engine
    if engine_config.micro_batches is None:
        engine_config = replace(engine_config, micro_batches=_default_micro_batches(config))
    with open_zmq_context(config.curve) as (ctx, allow):
        router = bind_router(ctx, config)
        node: Node | None = None
        try:
            async with open_engine(engine_config) as engine:
                node = Node(config, engine, ctx, router, allow)
                async with _serving(node):
                    yield node
        finally:  # the tasks that owned the sockets have ended
            router.close(linger=SHUTDOWN_LINGER_MS)  # the last replies still go out
            if node is not None:
                for link in node.forwarder_links():
                    link.close(linger_ms=SHUTDOWN_LINGER_MS)


@asynccontextmanager
async def _serving(node: Node) -> AsyncIterator[None]:
    """The node's tasks (and its metrics endpoint) until the caller is done; then drain."""
    config = node.config
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        if config.metrics_port is not None:
            from neuron_tai.metrics import serve_metrics  # noqa: PLC0415 - only when asked for

            await nursery.start(serve_metrics, node, config.metrics_port, config.metrics_bind)
        stage = node.stage
        role = ("first " if stage.first else "") + ("last" if stage.last else "stage")
        onward = f", next stage {config.next}" if config.next else ""
        log.info("serving %s layers %d-%d (%s) on %s%s", stage.model, *stage.layers, role, node.address, onward)
        _warn_if_unauthenticated(config, node.address)
        try:
            yield
        finally:
            await _drain(node)
            nursery.cancel_scope.cancel()


async def _drain(node: Node) -> None:
    """Stop taking work and finish what is in progress (up to the drain timeout); answer what is
    left `shutting_down`, close the sessions forwarded below, and let those replies go out."""
    engine = node.engine
    engine.begin_shutdown()
    with trio.move_on_after(node.config.drain_timeout_s):
        await engine.stopped.wait()
        await node.pool.idle.wait()  # the last replies, relayed from the next stage too
    node.pool.stop_all()
    with trio.move_on_after(1.0):
        await node.pool.idle.wait()
    if node.forwarder is not None:  # what the engine freed stopping, freed below at once
        node.forwarder.close_all()
    with trio.move_on_after(1.0):  # let the pumps deliver the last replies, and those closes
        while node.pump.queued or any(link.core.pump.queued for link in node.forwarder_links()):
            await trio.sleep(0.01)


def _warn_if_unauthenticated(config: NodeConfig, address: str) -> None:
    if config.curve is None and not is_loopback(address):
        log.warning(
            "%s is reachable beyond this host and its links are unauthenticated and in clear: "
            "anyone who reaches it can use it (see --curve-secret and --allow)",
            address,
        )
    for next_address in config.next_addresses:
        if not (config.curve and config.curve.next_key) and not is_loopback(next_address):
            log.warning("the link to the next stage %s is unauthenticated and in clear (see --next-key)", next_address)
