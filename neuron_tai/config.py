"""What a node is built from: its engine, its sockets, its links and its byte bounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from neuron_tai.security import ServerCurve
from transport import memory_bounds as bounds
from transport import wire


@dataclass(frozen=True, slots=True)
class NodeConfig:
    engine: EngineConfig
    bind: str = "tcp://127.0.0.1:5555"
    # The next stage's address; several (comma-separated) are replicas of the next layer range.
    next: str | None = None
    max_message_bytes: int = bounds.MAX_MESSAGE_BYTES
    hwm: int = 1000  # ZeroMQ's queue of arriving messages per connection (RCVHWM)
    # ZeroMQ's queue of messages on their way out, per connection (the ROUTER's SNDHWM) and to
    # the next stage. It counts messages: its bytes are at most this many of the largest reply.
    send_hwm: int = bounds.SEND_HWM
    # Replies waiting in the node for one connection whose pipe is full, and for all of them
    # together; a connection past either is treated as gone (its sessions are freed).
    max_peer_reply_bytes: int = bounds.MAX_PEER_REPLY_BYTES
    max_reply_bytes: int = bounds.MAX_REPLY_BYTES
    # Bytes that requests in progress hold (their payloads and, on a chain head, the hidden
    # states sent on), per connection and in total; beyond either a request is `busy` at once.
    max_peer_request_bytes: int = bounds.MAX_PEER_REQUEST_BYTES
    max_request_bytes: int = bounds.MAX_REQUEST_BYTES
    # Requests waiting to go out to the next stage (behind ZeroMQ's `send_hwm`).
    max_next_outbox_bytes: int = bounds.MAX_OUTBOX_BYTES
    downstream_timeout_s: float = 30.0
    metrics_port: int | None = None
    metrics_bind: str = "127.0.0.1"
    # Require CURVE from every peer (and use it to the next stage with `next_key`); None: plain links.
    curve: ServerCurve | None = None
    drain_timeout_s: float = 10.0
    # Requests waiting on the engine or the next stage at once (each is one task): in total
    # and per connection. Beyond either, a request is answered `busy` at once.
    max_handlers: int = 1024
    max_handlers_per_peer: int = 256
    # A tokenize's text (UTF-8 bytes) and a detokenize's ids (or a tokenize's result) at most;
    # beyond either the request is `too_large`. The text bounds the header frame size too.
    max_text_bytes: int = wire.MAX_TEXT_BYTES
    max_text_tokens: int = wire.MAX_TEXT_TOKENS
    # Text and token ids of tokenize/detokenize requests waiting for the tokenizer, at most
    # (one request is always taken); beyond it a request is answered `busy` at once.
    max_text_pending_bytes: int = 8 * 2**20
    # A connection heard from (any request) less recently than this, with no request of its
    # in progress, has its sessions freed (PROTOCOL.md, "Leases"); `lease_ms` in stats.
    lease_s: float = 15.0
    # A chain's head recovers a session whose route broke (neuron_tai.recovery): this many
    # attempts within this long, then `downstream`. 0 attempts: never.
    recovery_attempts: int = 3
    recovery_deadline_s: float = 30.0
    extra_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def next_addresses(self) -> list[str]:
        return [a.strip() for a in (self.next or "").split(",") if a.strip()]
