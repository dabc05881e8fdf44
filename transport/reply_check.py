"""Whether a next stage's reply answers the request a node forwarded to it (PROTOCOL.md, Chaining).

A node relays what its next stage answers, so that reply is checked like a request: the
answer the request expects or an `error`, with the keys and payload shape the request
implies (the model's `n_embd` and `n_vocab` are the same on every stage). A minimal next
stage may leave out of `opened` what the node does not use (`session`, `kv_reserved` and
most of `stage`). An error's message is shortened before it is relayed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from protocol.errors import ErrorCode, Fault
from transport.wire_header import show
from transport.wire_replies import REPLY_OPS, Closed, ErrorReply, Opened, Pong, Reply, Result, reply_from
from transport.wire_requests import Close, Open, Ping, Request, Step, op_of

MAX_MESSAGE_CHARS = 512  # of an error message relayed from a next stage

# What a next stage answers to each request a node forwards to it.
ANSWERS: dict[type[Request], type[Reply]] = {Open: Opened, Step: Result, Close: Closed, Ping: Pong}


def _malformed(what: str) -> Fault:
    return Fault(ErrorCode.DOWNSTREAM, f"the next stage sent a malformed reply: {what}")


def _defaults(sent: Request) -> dict[str, Any]:
    """What a minimal next stage may leave out of its answer to `sent` (its `rid` was matched)."""
    if isinstance(sent, Open):
        return {"rid": sent.rid, "session": sent.session, "kv_reserved": sent.max_tokens}
    return {"rid": sent.rid, "session": sent.session} if isinstance(sent, Step | Close) else {"rid": sent.rid}


def answer_to(sent: Request, header: dict[str, Any], payload: list[bytes], n_embd: int, n_vocab: int) -> Reply:
    """The next stage's reply to `sent`, typed and checked; Fault (`downstream`) otherwise."""
    want = ANSWERS.get(type(sent))
    if want is None:
        raise _malformed(f"no reply check for a forwarded {op_of(sent)!r}")
    try:
        reply = reply_from(header if header.get("op") == "error" else {**_defaults(sent), **header}, payload)
    except Fault as exc:
        raise _malformed(exc.message) from None
    if isinstance(reply, ErrorReply):
        return dataclasses.replace(reply, message=reply.message[:MAX_MESSAGE_CHARS])
    if not isinstance(reply, want):
        raise _malformed(f"expected {REPLY_OPS[want]!r} or 'error', got op {show(header.get('op'))}")
    if isinstance(reply, Opened) and not all(t < n_vocab for t in reply.stage.eog_tokens):
        raise _malformed(f"'stage.eog_tokens' must be token ids in [0, {n_vocab})")
    if isinstance(reply, Result):
        assert isinstance(sent, Step)
        _check_result(sent, reply, n_embd, n_vocab)
    return reply


def _check_result(sent: Step, reply: Result, n_embd: int, n_vocab: int) -> None:
    for key in ("pos", "n", "out"):
        if getattr(reply, key) != getattr(sent, key):
            raise _malformed(f"{key!r} is {show(getattr(reply, key))}, the step had {getattr(sent, key)!r}")
    if reply.out == "hidden" and reply.dtype != sent.out_dtype:
        raise _malformed(f"'dtype' is {show(reply.dtype)}, the step asked for {sent.out_dtype!r}")
    if reply.out == "hidden" and reply.data.shape[1] != n_embd:
        raise _malformed(f"hidden rows are {reply.data.shape[1]} wide, the model's are {n_embd}")
    if reply.out == "logits" and len(reply.data) != n_vocab:
        raise _malformed(f"{len(reply.data)} logits, the model has {n_vocab} tokens")
    if reply.out in ("token", "tokens") and not bool(np.all((reply.data >= 0) & (reply.data < n_vocab))):
        raise _malformed(f"a token is not in [0, {n_vocab})")
