"""Protocol v1 replies (PROTOCOL.md, Operations and Errors): typed, encoded, decoded.

A decoded reply has the keys and payload shape its `op` implies, within `REPLY_LIMITS`;
anything else is a `Fault` with code `downstream` (the peer failed). Whether it answers
the request that was sent is `reply_check`'s business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import ErrorCode, Fault
from protocol.stage import Stage
from transport.wire_header import DTYPES, MAX_RID, REPLY_LIMITS, HeaderLimits, is_int, pack_header, parse_header, show
from transport.wire_requests import OUTS, hidden_bytes
from transport.wire_values import int32_bytes, int32_frame, one_frame, read_bool, read_int, read_str

MAX_RETRY_MS = 2**31 - 1
MAX_EOG_TOKENS = 16
MAX_STEP = 2**31 - 1  # a stage that does not say how many tokens a step may carry: no limit of its own
REASONS = ("eog", "stop", "length", "cancelled")  # why a `generate` ended
DEFAULT_RETRY_MS = 100  # a retryable error's hint when the refusal gave none
_DOWN = ErrorCode.DOWNSTREAM


@dataclass(frozen=True, slots=True)
class Opened:
    rid: int
    session: str
    kv_reserved: int
    stage: Stage
    lease_ms: int | None = None  # None: the node does not expire sessions


@dataclass(frozen=True, slots=True)
class Result:
    """A step's output. `data` is float32[n, n_embd] for `hidden` (sent as `dtype`), int32[1]
    for `token`, float32[n_vocab] for `logits`, int32[n] for `tokens`."""

    rid: int
    session: str
    pos: int
    n: int
    out: str
    data: npt.NDArray[Any]
    dtype: str = "f32"

    @property
    def token(self) -> int:
        return int(self.data[-1])


@dataclass(frozen=True, slots=True)
class Generated:
    rid: int
    session: str
    pos: int  # of the first token
    tokens: npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class Done:
    rid: int
    session: str
    reason: str
    generated: int
    length: int
    tokens: npt.NDArray[np.int32] | None = None  # only when not streamed
    passes: int | None = None  # passes through the chain this generate made (speculative generate)


@dataclass(frozen=True, slots=True)
class Cancelled:
    rid: int
    session: str
    length: int


@dataclass(frozen=True, slots=True)
class Closed:
    rid: int
    session: str
    existed: bool


@dataclass(frozen=True, slots=True)
class Tokens:
    rid: int
    tokens: npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class Text:
    rid: int
    text: str


@dataclass(frozen=True, slots=True)
class StatsReply:
    rid: int
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Pong:
    rid: int


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An `error`: `rid` is None when the request's could not be read."""

    rid: int | None
    code: ErrorCode
    message: str
    retry_after_ms: int | None = None
    session: str | None = None  # for the replies of a `generate`, which all carry it
    length: int | None = None  # a `generate` that failed: where the session stands

    @classmethod
    def of(
        cls, fault: Fault, rid: int | None = None, session: str | None = None, length: int | None = None
    ) -> ErrorReply:
        """The reply to a refusal; `rid` defaults to the one the wire read."""
        retry = fault.retry_after_ms if fault.retry_after_ms is not None else DEFAULT_RETRY_MS
        return cls(
            fault.rid if rid is None else rid,
            fault.code,
            fault.message,
            retry if fault.code.retryable else None,
            session,
            length,
        )

    def fault(self) -> Fault:
        return Fault(self.code, self.message, self.retry_after_ms, rid=self.rid)


Reply = Opened | Result | Generated | Done | Cancelled | Closed | Tokens | Text | StatsReply | Pong | ErrorReply

REPLY_OPS: dict[type[Reply], str] = {
    Opened: "opened",
    Result: "result",
    Generated: "generated",
    Done: "done",
    Cancelled: "cancelled",
    Closed: "closed",
    Tokens: "tokens",
    Text: "text",
    StatsReply: "stats",
    Pong: "pong",
    ErrorReply: "error",
}


# -- encoding ------------------------------------------------------------------------------


def stage_map(s: Stage) -> dict[str, Any]:
    return {
        "first": s.first,
        "last": s.last,
        "layers": list(s.layers),
        "n_embd": s.n_embd,
        "n_vocab": s.n_vocab,
        "model": s.model,
        "max_step_tokens": s.max_step_tokens,
        "eog_tokens": list(s.eog_tokens),
    } | ({"fingerprint": s.fingerprint} if s.fingerprint else {})


def _result_message(r: Result) -> tuple[dict[str, Any], list[bytes]]:
    keys: dict[str, Any] = {"session": r.session, "pos": r.pos, "n": r.n, "out": r.out}
    if r.out == "hidden":
        return {**keys, "dtype": r.dtype}, [hidden_bytes(r.data, r.dtype)]
    if r.out == "logits":
        return keys, [np.asarray(r.data, "<f4").tobytes()]
    return keys, [int32_bytes(r.data)]


def _error_message(r: ErrorReply) -> tuple[dict[str, Any], list[bytes]]:
    keys: dict[str, Any] = {"code": str(r.code), "message": r.message}
    if r.retry_after_ms is not None:
        keys["retry_after_ms"] = r.retry_after_ms
    if r.session is not None:
        keys["session"] = r.session
    if r.length is not None:
        keys["length"] = r.length
    return keys, []


def _message(r: Reply) -> tuple[dict[str, Any], list[bytes]]:
    """The header keys (after `v`, `op`, `rid`) and payload frames of a reply."""
    if isinstance(r, Opened):
        keys = {"session": r.session, "kv_reserved": r.kv_reserved, "stage": stage_map(r.stage)}
        return keys if r.lease_ms is None else {**keys, "lease_ms": r.lease_ms}, []
    if isinstance(r, Result):
        return _result_message(r)
    if isinstance(r, Generated):
        return {"session": r.session, "pos": r.pos, "n": len(r.tokens)}, [int32_bytes(r.tokens)]
    if isinstance(r, Done):
        keys = {"session": r.session, "reason": r.reason, "generated": r.generated, "length": r.length}
        if r.passes is not None:
            keys["passes"] = r.passes
        return keys, [] if r.tokens is None else [int32_bytes(r.tokens)]
    if isinstance(r, Cancelled):
        return {"session": r.session, "length": r.length}, []
    if isinstance(r, Closed):
        return {"session": r.session, "existed": r.existed}, []
    if isinstance(r, Tokens):
        return {"n": len(r.tokens)}, [int32_bytes(r.tokens)]
    if isinstance(r, Text):
        return {"text": r.text}, []
    if isinstance(r, StatsReply):
        return {"stats": r.stats}, []
    if isinstance(r, ErrorReply):
        return _error_message(r)
    return {}, []  # Pong


def encode_reply(reply: Reply) -> list[bytes]:
    """The frames of `reply` as PROTOCOL.md describes them (header, then payload)."""
    keys, payload = _message(reply)
    return [pack_header({"op": REPLY_OPS[type(reply)], "rid": reply.rid, **keys}), *payload]


# -- decoding ------------------------------------------------------------------------------


def _stage(h: dict[str, Any]) -> Stage:
    s = h.get("stage")
    if not isinstance(s, dict) or not isinstance(s.get("last"), bool):
        raise Fault(_DOWN, "'stage' must be a map with a boolean 'last'")
    layers = s.get("layers")
    if not (
        isinstance(layers, list)
        and len(layers) == 2
        and all(is_int(x) for x in layers)
        and 0 <= layers[0] < layers[1] < 2**31
    ):
        raise Fault(_DOWN, "'stage.layers' must be [a, b] with 0 <= a < b")
    max_step = read_int(s, "max_step_tokens", None, lo=1, default=MAX_STEP, code=_DOWN)
    eog = s.get("eog_tokens", [])  # a minimal stage may leave out what it does not use
    if not isinstance(eog, list) or len(eog) > MAX_EOG_TOKENS or not all(is_int(t) and t >= 0 for t in eog):
        raise Fault(_DOWN, f"'stage.eog_tokens' must be at most {MAX_EOG_TOKENS} token ids")
    first = read_bool(s, "first", None, False, _DOWN)
    n_embd = read_int(s, "n_embd", None, lo=0, default=0, code=_DOWN)
    n_vocab = read_int(s, "n_vocab", None, lo=0, default=0, code=_DOWN)
    model = read_str(s, "model", None, default="", code=_DOWN)
    fingerprint = read_str(s, "fingerprint", None, default="", code=_DOWN)
    layers_ = (layers[0], layers[1])
    return Stage(first, s["last"], layers_, n_embd, n_vocab, model, min(max_step, MAX_STEP), tuple(eog), fingerprint)


def _opened(h: dict[str, Any], rid: int) -> Opened:
    lease = h.get("lease_ms")
    if lease is not None and not (is_int(lease) and lease >= 0):
        raise Fault(_DOWN, "'lease_ms' must be an integer >= 0")
    kv = read_int(h, "kv_reserved", rid, lo=0, code=_DOWN)
    return Opened(rid, read_str(h, "session", rid, code=_DOWN), kv, _stage(h), lease)


def _result(h: dict[str, Any], payload: list[bytes], rid: int) -> Result:
    session = read_str(h, "session", rid, code=_DOWN)
    pos, n = read_int(h, "pos", rid, lo=0, code=_DOWN), read_int(h, "n", rid, lo=1, code=_DOWN)
    out = read_str(h, "out", rid, OUTS, code=_DOWN)
    frame = one_frame(payload, rid, _DOWN)
    if out in ("token", "tokens"):
        return Result(rid, session, pos, n, out, int32_frame(frame, 1 if out == "token" else n, rid, _DOWN))
    dtype = read_str(h, "dtype", rid, tuple(DTYPES), default="f32", code=_DOWN) if out == "hidden" else "f32"
    width = np.dtype(DTYPES[dtype]).itemsize * (n if out == "hidden" else 1)
    if not frame or len(frame) % width:
        raise Fault(_DOWN, f"a {out} payload of {len(frame)} bytes is not whole rows of {width} bytes")
    data = np.frombuffer(frame, np.dtype(DTYPES[dtype]).newbyteorder("<")).astype(np.float32)
    return Result(rid, session, pos, n, out, data.reshape(n, -1) if out == "hidden" else data, dtype)


def _generated(h: dict[str, Any], payload: list[bytes], rid: int) -> Generated:
    session = read_str(h, "session", rid, code=_DOWN)
    pos, n = read_int(h, "pos", rid, lo=0, code=_DOWN), read_int(h, "n", rid, lo=1, code=_DOWN)
    return Generated(rid, session, pos, int32_frame(one_frame(payload, rid, _DOWN), n, rid, _DOWN))


def _done(h: dict[str, Any], payload: list[bytes], rid: int) -> Done:
    session = read_str(h, "session", rid, code=_DOWN)
    reason = read_str(h, "reason", rid, REASONS, code=_DOWN)
    generated = read_int(h, "generated", rid, lo=0, code=_DOWN)
    length = read_int(h, "length", rid, lo=0, code=_DOWN)
    tokens = int32_frame(one_frame(payload, rid, _DOWN), generated, rid, _DOWN) if payload else None
    passes = read_int(h, "passes", rid, lo=0, code=_DOWN) if "passes" in h else None
    return Done(rid, session, reason, generated, length, tokens, passes)


def _error(h: dict[str, Any], payload: list[bytes]) -> ErrorReply:
    rid, code, message = h.get("rid"), h.get("code"), h.get("message", "")
    if not isinstance(code, str) or not isinstance(message, str) or payload:
        raise Fault(_DOWN, "an error needs a string 'code' and 'message' and no payload")
    if rid is not None and not (is_int(rid) and 0 <= rid < MAX_RID):
        raise Fault(_DOWN, "an error's 'rid' must be nil or a request id")
    retry = h.get("retry_after_ms")
    if retry is not None and not (is_int(retry) and 0 <= retry <= MAX_RETRY_MS):
        raise Fault(_DOWN, f"'retry_after_ms' must be an integer in [0, {MAX_RETRY_MS}], got {show(retry)}")
    session, length = h.get("session"), h.get("length")
    length = length if is_int(length) and 0 <= length < MAX_RID else None
    return ErrorReply(rid, ErrorCode.parse(code), message, retry, session if isinstance(session, str) else None, length)


def _keyed(h: dict[str, Any], payload: list[bytes], rid: int, op: str) -> Reply:
    """The replies without a payload frame but `tokens`'."""
    if op == "tokens":
        return Tokens(rid, int32_frame(one_frame(payload, rid, _DOWN), None, rid, _DOWN))
    if payload:
        raise Fault(_DOWN, f"{op!r} takes no payload")
    if op == "opened":
        return _opened(h, rid)
    session = read_str(h, "session", rid, code=_DOWN) if op in ("cancelled", "closed") else ""
    if op == "cancelled":
        return Cancelled(rid, session, read_int(h, "length", rid, lo=0, code=_DOWN))
    if op == "closed":
        existed = h.get("existed")
        if not isinstance(existed, bool):
            raise Fault(_DOWN, "'existed' must be a boolean")
        return Closed(rid, session, existed)
    if op == "text":
        return Text(rid, read_str(h, "text", rid, code=_DOWN))
    if op == "stats":
        stats = h.get("stats")
        if not isinstance(stats, dict):
            raise Fault(_DOWN, "'stats' must be a map")
        return StatsReply(rid, stats)
    return Pong(rid)


_PAYLOAD_OPS: dict[str, Callable[[dict[str, Any], list[bytes], int], Reply]] = {
    "result": _result,
    "generated": _generated,
    "done": _done,
}
_KEYED_OPS = ("opened", "cancelled", "closed", "tokens", "text", "stats", "pong")


def reply_from(header: dict[str, Any], payload: list[bytes]) -> Reply:
    """The typed reply of a parsed header and its payload; Fault (`downstream`) when its keys or
    payload are not what its `op` implies."""
    op = header.get("op")
    try:
        if op == "error":
            return _error(header, payload)
        rid = header.get("rid")
        if not is_int(rid) or not 0 <= rid < MAX_RID:
            raise Fault(_DOWN, f"'rid' must be a request id, got {show(rid)}")
        if op in _PAYLOAD_OPS:
            return _PAYLOAD_OPS[op](header, payload, rid)
        if op in _KEYED_OPS:
            return _keyed(header, payload, rid, op)
        raise Fault(_DOWN, f"unknown reply op {show(op)}")
    except Fault as exc:
        raise Fault(_DOWN, f"malformed {show(op)} reply: {exc.message}") from None


def parse_reply(frames: list[bytes], limits: HeaderLimits = REPLY_LIMITS) -> tuple[dict[str, Any], list[bytes]]:
    """A reply's parsed header and payload frames, before its keys are read (to match it by `rid`).
    Fault (`downstream`) when the header is not a map within `limits`."""
    if not frames:
        raise Fault(_DOWN, "empty reply")
    try:
        header = parse_header(frames[0], limits)
    except Fault as exc:
        raise Fault(_DOWN, f"malformed reply: {exc.message}") from None
    return header, frames[1:]


def decode_reply(frames: list[bytes], limits: HeaderLimits = REPLY_LIMITS) -> Reply:
    """A typed reply within `limits`; Fault (`downstream`) otherwise."""
    return reply_from(*parse_reply(frames, limits))
