"""The dict-based helpers the node used before the typed codec; they go once the node is
switched to `encode_reply` and `NextStage.call` (each is a thin layer over the codec)."""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.errors import ErrorCode
from transport.reply_check import answer_to
from transport.wire_header import HeaderLimits, pack_header
from transport.wire_replies import Opened, Reply, encode_reply
from transport.wire_requests import OUTS, Close, Open, Ping, Request, Stats, Step, decode_request, hidden_bytes

hidden_frame = hidden_bytes
# A header this side built is not bounded here: the peer that receives it bounds it.
_UNBOUNDED = HeaderLimits(2**31, 2**31, 2**16, 2**16, 16, max_bin_bytes=2**31, max_text_bytes=2**31)


def encode(header: dict[str, Any], *payload: bytes) -> list[bytes]:
    return [pack_header(header), *payload]


def encode_error(
    rid: int | None, code: ErrorCode, message: str, retry_after_ms: int | None = None, **extra: Any
) -> list[bytes]:
    header: dict[str, Any] = {**extra, "op": "error", "rid": rid, "code": str(code), "message": message}
    if code.retryable:
        header["retry_after_ms"] = int(retry_after_ms if retry_after_ms is not None else 100)
    return encode(header)


def request_from_header(header: dict[str, Any], payload: list[bytes], n_embd: int) -> Request:
    """The typed request a hand-built header describes (checked as the node checks requests)."""
    return decode_request(encode({**header, "rid": 0}, *payload), n_embd, _UNBOUNDED, 2**31, outs=OUTS)


def reply_header(reply: Reply) -> tuple[dict[str, Any], list[bytes]]:
    """A typed reply as the header map and payload frames a dict-based caller reads."""
    frames = encode_reply(reply)
    header: dict[str, Any] = msgpack.unpackb(frames[0])
    if isinstance(reply, Opened) and not reply.stage.eog_tokens:
        del header["stage"]["eog_tokens"]  # as before: a stage that names none leaves the node's own
    return header, frames[1:]


def _sent(sent: dict[str, Any]) -> Request:
    """The typed request a forwarded header map stands for (only what `answer_to` reads)."""
    op, session = sent.get("op"), str(sent.get("session", ""))
    if op == "open":
        return Open(0, session, int(sent.get("max_tokens", 1)))
    if op == "step":
        out_dtype = str(sent.get("out_dtype", "f32"))
        return Step(0, session, sent["pos"], sent["n"], sent["input"], sent["out"], out_dtype)
    others: dict[str, Request] = {"close": Close(0, session), "ping": Ping(0)}
    return others.get(str(op), Stats(0))


def check_reply(
    sent: dict[str, Any], header: dict[str, Any], payload: list[bytes], n_embd: int, n_vocab: int
) -> tuple[dict[str, Any], list[bytes]]:
    """`answer_to` for a request sent as a header map; the reply as a header map and payload."""
    return reply_header(answer_to(_sent(sent), header, payload, n_embd, n_vocab))
