"""What a node is built from: its engine, its sockets, its links and its byte bounds.

Each field a node's operator may set carries its command-line help in `metadata`
(neuron_tai/cli_options.py reads it): the default and type here are the only copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from neuron_tai.drafting import MAX_SPECULATE
from neuron_tai.security import ServerCurve
from transport import memory_bounds as bounds
from transport import wire

# Micro-batches of a node with --next unless told (--micro-batches): a 2-stage chain's head
# keeps both stages busy with 2; longer chains are given one per stage (`neuron-tai plan`).
CHAIN_MICRO_BATCHES = 2


def _bytes(help_text: str, group: str = "memory") -> dict[str, Any]:
    return {"help": help_text, "group": group, "kind": "bytes", "min": 0}


@dataclass(frozen=True, slots=True)
class NodeConfig:
    engine: EngineConfig
    bind: str = field(
        default="tcp://127.0.0.1:5555",
        metadata={
            "help": "the address to serve on (tcp://HOST:PORT, port * for any; or ipc://PATH)",
            "group": "start",
            "kind": "bind",
            "metavar": "ADDR",
        },
    )
    next: str | None = field(
        default=None,
        metadata={
            "help": "the address of the next stage: forward results there; repeat it (or separate addresses "
            "with commas) for replicas of the next layer range",
            "group": "start",
            "kind": "addresses",
            "metavar": "ADDR",
            "shown": "none, this stage ends the chain",
        },
    )
    max_message_bytes: int = field(
        default=bounds.MAX_MESSAGE_BYTES,
        metadata=_bytes("largest frame ZeroMQ accepts (ZMQ_MAXMSGSIZE); a larger one drops its connection"),
    )
    hwm: int = 1000  # ZeroMQ's queue of arriving messages per connection (RCVHWM)
    # ZeroMQ's queue of messages on their way out, per connection (the ROUTER's SNDHWM) and to
    # the next stage. It counts messages: its bytes are at most this many of the largest reply.
    send_hwm: int = field(
        default=bounds.SEND_HWM,
        metadata={
            "help": "messages ZeroMQ queues for one connection, and for the next stage",
            "group": "memory",
            "min": 1,
        },
    )
    # Replies waiting in the node for one connection whose pipe is full, and for all of them
    # together; a connection past either is treated as gone (its sessions are freed).
    max_peer_reply_bytes: int = field(
        default=bounds.MAX_PEER_REPLY_BYTES,
        metadata=_bytes("replies waiting for one connection that does not read: past this it is treated as gone"),
    )
    max_reply_bytes: int = field(
        default=bounds.MAX_REPLY_BYTES,
        metadata=_bytes("replies waiting for all connections (the ones furthest behind are cut off first)"),
    )
    # Bytes that requests in progress hold (their payloads and, on a chain head, the hidden
    # states sent on), per connection and in total; beyond either a request is `busy` at once.
    max_peer_request_bytes: int = field(
        default=bounds.MAX_PEER_REQUEST_BYTES,
        metadata=_bytes("bytes one connection's requests in progress hold; more: busy"),
    )
    max_request_bytes: int = field(
        default=bounds.MAX_REQUEST_BYTES, metadata=_bytes("bytes all requests in progress hold; more: busy")
    )
    # Requests waiting to go out to the next stage (behind ZeroMQ's `send_hwm`).
    max_next_outbox_bytes: int = field(
        default=bounds.MAX_OUTBOX_BYTES,
        metadata=_bytes("requests waiting to go out to the next stage; more fail with downstream"),
    )
    downstream_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds to wait for the next stage's reply",
            "flag": "downstream-timeout",
            "group": "limits",
            "min": 0,
        },
    )
    metrics_port: int | None = field(
        default=None,
        metadata={
            "help": "serve Prometheus metrics on this port (plain, unauthenticated HTTP)",
            "group": "options",
            "min": 1,
            "max": 65535,
            "shown": "off",
        },
    )
    metrics_bind: str = field(
        default="127.0.0.1", metadata={"help": "the address the metrics endpoint listens on", "group": "options"}
    )
    # Require CURVE from every peer (and use it to the next stage with `next_key`); None: plain links.
    curve: ServerCurve | None = None
    drain_timeout_s: float = 10.0
    # Requests waiting on the engine or the next stage at once (each is one task): in total
    # and per connection. Beyond either, a request is answered `busy` at once.
    max_handlers: int = 1024
    max_handlers_per_peer: int = 256
    # A tokenize's text (UTF-8 bytes) and a detokenize's ids (or a tokenize's result) at most;
    # beyond either the request is `too_large`. The text bounds the header frame size too.
    max_text_bytes: int = field(
        default=wire.MAX_TEXT_BYTES,
        metadata={
            "help": "largest tokenize text (UTF-8 bytes); bounds headers too",
            "group": "limits",
            "kind": "bytes",
            "min": 1,
        },
    )
    max_text_tokens: int = field(
        default=wire.MAX_TEXT_TOKENS,
        metadata={"help": "most token ids a (de)tokenize may carry", "group": "limits", "min": 1},
    )
    # Text and token ids of tokenize/detokenize requests waiting for the tokenizer, at most
    # (one request is always taken); beyond it a request is answered `busy` at once.
    max_text_pending_bytes: int = 8 * 2**20
    # A connection heard from (any request) less recently than this, with no request of its
    # in progress, has its sessions freed (PROTOCOL.md, "Leases"); `lease_ms` in stats.
    lease_s: float = field(
        default=15.0,
        metadata={
            "help": "free the sessions of a connection silent this long (s; clients ping every quarter of it)",
            "flag": "lease",
            "group": "limits",
            "min": 0,
        },
    )
    # Merged into `stats` (the CLI adds the model's name and the layers this stage serves).
    # A chain's head recovers a session whose route broke (neuron_tai.recovery): this many
    # attempts within this long, then `downstream`. 0 attempts: never.
    recovery_attempts: int = field(
        default=3,
        metadata={
            "help": "a chain's head replays a session whose route broke onto a route that is up, at most this "
            "many times (0: never)",
            "group": "limits",
            "min": 0,
        },
    )
    recovery_deadline_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds a recovery may take before the step fails with `downstream`",
            "flag": "recovery-deadline",
            "group": "limits",
            "min": 0,
        },
    )
    # A chain stage pipelines a long step (a prompt) across the chain (neuron_tai/step_parts.py).
    part_rows: int = field(
        default=64,
        metadata={
            "help": "with --next: a step longer than this (a prompt) goes on in parts of this many rows, each "
            "as soon as it is computed, so the next stage computes one while this one computes the next "
            "(0: whole steps)",
            "group": "tuning",
            "min": 0,
        },
    )
    # Speculative `generate` (PROTOCOL.md): draft tokens verified per pass through the chain,
    # unless a request's `speculate` says otherwise. Only a node that runs generate uses it.
    speculate: int = field(
        default=0,
        metadata={
            "help": "draft tokens a generate verifies per pass through the chain (prompt lookup; 0: off); "
            "a request's `speculate` overrides it",
            "group": "options",
            "min": 0,
            "max": MAX_SPECULATE,
        },
    )
    extra_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def next_addresses(self) -> list[str]:
        return [a.strip() for a in (self.next or "").split(",") if a.strip()]
