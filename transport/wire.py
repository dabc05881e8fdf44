"""Protocol v1 (PROTOCOL.md): the one codec of every request and reply, and its import point.

Requests and replies are frozen dataclasses; `encode_request`/`decode_request` and
`encode_reply`/`decode_reply` turn them into frames and back, validating shape within
`HeaderLimits` (a decode raises `Fault` and nothing else, whatever the bytes). A header
refused unread is still answered with its `rid` when a bounded scan finds one
(`header_scan`). A next stage's reply is checked against what was forwarded
(`reply_check.answer_to`). No header map is built outside these modules.
"""

from __future__ import annotations

from protocol.errors import Fault
from transport.header_scan import scan_rid
from transport.reply_check import MAX_MESSAGE_CHARS, answer_to
from transport.wire_header import (
    DTYPES,
    MAX_RID,
    MAX_TEXT_BYTES,
    MAX_TEXT_TOKENS,
    NEXT_STAGE_REPLY_LIMITS,
    REPLY_LIMITS,
    REQUEST_HEADER_EXTRA,
    VERSION,
    HeaderLimits,
    parse_header,
    request_limits,
    show,
)
from transport.wire_legacy import check_reply, encode, encode_error, hidden_frame, reply_header, request_from_header
from transport.wire_replies import (
    REPLY_OPS,
    Cancelled,
    Closed,
    Done,
    ErrorReply,
    Generated,
    Opened,
    Pong,
    Reply,
    Result,
    StatsReply,
    Text,
    Tokens,
    decode_reply,
    encode_reply,
    parse_reply,
    reply_from,
)
from transport.wire_requests import (
    MAX_SESSION_BYTES,
    OUTS,
    SERVED_OUTS,
    Cancel,
    Close,
    Detokenize,
    Generate,
    Open,
    Ping,
    Request,
    Stats,
    Step,
    Tokenize,
    decode_request,
    encode_request,
    hidden_bytes,
    op_of,
)

WireError = Fault  # the wire's refusals are Faults; this name goes once the node is switched

__all__ = [
    "DTYPES",
    "MAX_MESSAGE_CHARS",
    "MAX_RID",
    "MAX_SESSION_BYTES",
    "MAX_TEXT_BYTES",
    "MAX_TEXT_TOKENS",
    "NEXT_STAGE_REPLY_LIMITS",
    "OUTS",
    "REPLY_LIMITS",
    "REPLY_OPS",
    "REQUEST_HEADER_EXTRA",
    "SERVED_OUTS",
    "VERSION",
    "Cancel",
    "Cancelled",
    "Close",
    "Closed",
    "Detokenize",
    "Done",
    "ErrorReply",
    "Fault",
    "Generate",
    "Generated",
    "HeaderLimits",
    "Open",
    "Opened",
    "Ping",
    "Pong",
    "Reply",
    "Request",
    "Result",
    "Stats",
    "StatsReply",
    "Step",
    "Text",
    "Tokenize",
    "Tokens",
    "WireError",
    "answer_to",
    "check_reply",
    "decode_reply",
    "decode_request",
    "encode",
    "encode_error",
    "encode_reply",
    "encode_request",
    "hidden_bytes",
    "hidden_frame",
    "op_of",
    "parse_header",
    "parse_reply",
    "reply_from",
    "reply_header",
    "request_from_header",
    "request_limits",
    "scan_rid",
    "show",
]
