"""Protocol v1 messages (PROTOCOL.md): decode and validate requests, encode replies. Pure.

Every decode either returns a request or raises `WireError` with the code and the
request id when it could be read: no other exception escapes, whatever the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from protocol.errors import ErrorCode

VERSION = 1
MAX_RID = 2**63
MAX_SESSION_BYTES = 128
DTYPES: dict[str, type[np.floating[Any]]] = {"f32": np.float32, "f16": np.float16}


class WireError(Exception):
    """A request that cannot be served as sent; becomes an `error` reply."""

    def __init__(self, code: ErrorCode, message: str, rid: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.rid = rid


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Open:
    rid: int
    session: str
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    wait_ms: int = 0


@dataclass(frozen=True, slots=True)
class Step:
    rid: int
    session: str
    pos: int
    n: int
    input: str  # "tokens" | "hidden"
    out: str  # "hidden" | "token" | "logits"
    out_dtype: str
    tokens: npt.NDArray[np.int32] | None = None
    hidden: npt.NDArray[np.float32] | None = None  # always f32 here, whatever came on the wire


@dataclass(frozen=True, slots=True)
class Generate:
    """Server-side generation: a token step, then the node feeds back each token it samples."""

    rid: int
    session: str
    pos: int
    n: int
    tokens: npt.NDArray[np.int32]
    max_new: int
    stop: frozenset[int] = frozenset()
    ignore_eog: bool = False
    stream: bool = True


@dataclass(frozen=True, slots=True)
class Cancel:
    rid: int
    session: str


@dataclass(frozen=True, slots=True)
class Close:
    rid: int
    session: str


@dataclass(frozen=True, slots=True)
class Tokenize:
    rid: int
    text: str
    add_special: bool = True


@dataclass(frozen=True, slots=True)
class Detokenize:
    rid: int
    tokens: npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class Stats:
    rid: int


@dataclass(frozen=True, slots=True)
class Ping:
    rid: int


Request = Open | Step | Generate | Cancel | Close | Tokenize | Detokenize | Stats | Ping


# -- decoding ------------------------------------------------------------------------------


def _int(h: dict[str, Any], key: str, rid: int | None, *, lo: int | None = None, default: Any = ...) -> int:
    if key not in h:
        if default is ...:
            raise WireError(ErrorCode.BAD_REQUEST, f"missing key {key!r}", rid)
        return int(default)
    v = h[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise WireError(ErrorCode.BAD_REQUEST, f"{key!r} must be an integer", rid)
    if lo is not None and v < lo:
        raise WireError(ErrorCode.BAD_REQUEST, f"{key!r} must be >= {lo}", rid)
    return v


def _str(h: dict[str, Any], key: str, rid: int | None, choices: tuple[str, ...] = (), default: Any = ...) -> str:
    if key not in h:
        if default is ...:
            raise WireError(ErrorCode.BAD_REQUEST, f"missing key {key!r}", rid)
        return str(default)
    v = h[key]
    if not isinstance(v, str):
        raise WireError(ErrorCode.BAD_REQUEST, f"{key!r} must be a string", rid)
    if choices and v not in choices:
        raise WireError(ErrorCode.BAD_REQUEST, f"{key!r} must be one of {', '.join(choices)}", rid)
    return v


def _bool(h: dict[str, Any], key: str, rid: int, default: bool) -> bool:
    v = h.get(key, default)
    if not isinstance(v, bool):
        raise WireError(ErrorCode.BAD_REQUEST, f"{key!r} must be a boolean", rid)
    return v


def _session(h: dict[str, Any], rid: int) -> str:
    s = _str(h, "session", rid)
    if not 1 <= len(s.encode("utf-8", "surrogatepass")) <= MAX_SESSION_BYTES:
        raise WireError(ErrorCode.BAD_REQUEST, "'session' must be 1-128 UTF-8 bytes", rid)
    return s


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _sampling(h: dict[str, Any], rid: int) -> Sampling:
    raw = h.get("sampling")
    if raw is None:
        return Sampling()
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise WireError(ErrorCode.BAD_REQUEST, "'sampling' must be a map", rid)
    temperature = raw.get("temperature", 0.0)
    if not _number(temperature) or not temperature >= 0:
        raise WireError(ErrorCode.BAD_REQUEST, "'sampling.temperature' must be a number >= 0", rid)
    top_p = raw.get("top_p", 1.0)
    if not _number(top_p) or not 0 < top_p <= 1:
        raise WireError(ErrorCode.BAD_REQUEST, "'sampling.top_p' must be in (0, 1]", rid)
    top_k = _int(raw, "top_k", rid, lo=0, default=0)
    seed = _int(raw, "seed", rid, default=0)
    return Sampling(float(temperature), top_k, float(top_p), seed)


def _one_frame(payload: list[bytes], rid: int) -> bytes:
    if len(payload) != 1:
        raise WireError(ErrorCode.BAD_REQUEST, f"expected exactly one payload frame, got {len(payload)}", rid)
    return payload[0]


def _int32_frame(frame: bytes, n: int | None, rid: int) -> npt.NDArray[np.int32]:
    if len(frame) % 4 or (n is not None and len(frame) != 4 * n):
        want = "a multiple of 4" if n is None else f"{4 * n} (int32[{n}])"
        raise WireError(ErrorCode.BAD_REQUEST, f"payload is {len(frame)} bytes, expected {want}", rid)
    return np.frombuffer(frame, dtype="<i4").astype(np.int32)


def decode_request(frames: list[bytes], n_embd: int) -> Request:
    """A validated request, or WireError. `n_embd` is the stage's hidden width."""
    if not frames:
        raise WireError(ErrorCode.BAD_REQUEST, "empty message")
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types for bad bytes
        raise WireError(ErrorCode.BAD_REQUEST, f"header is not msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not all(isinstance(k, str) for k in header):
        raise WireError(ErrorCode.BAD_REQUEST, "header must be a msgpack map with string keys")
    raw_rid = header.get("rid")
    rid = raw_rid if isinstance(raw_rid, int) and not isinstance(raw_rid, bool) and 0 <= raw_rid < MAX_RID else None
    version = header.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise WireError(ErrorCode.BAD_REQUEST, "missing or mistyped 'v'", rid)
    if version != VERSION:
        raise WireError(
            ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version} is not supported (this node speaks 1)", rid
        )
    if rid is None:
        raise WireError(ErrorCode.BAD_REQUEST, "'rid' must be an integer in [0, 2**63)")
    op = header.get("op")
    payload = frames[1:]
    if op in ("open", "close", "cancel", "tokenize", "stats", "ping") and payload:
        raise WireError(ErrorCode.BAD_REQUEST, f"{op!r} takes no payload frames", rid)
    if op == "ping":
        return Ping(rid)
    if op == "stats":
        return Stats(rid)
    if op == "open":
        return Open(
            rid, _session(header, rid), _int(header, "max_tokens", rid, lo=1), _sampling(header, rid),
            _int(header, "wait_ms", rid, lo=0, default=0),
        )  # fmt: skip
    if op == "close":
        return Close(rid, _session(header, rid))
    if op == "cancel":
        return Cancel(rid, _session(header, rid))
    if op == "tokenize":
        return Tokenize(rid, _str(header, "text", rid), _bool(header, "add_special", rid, True))
    if op == "detokenize":
        return Detokenize(rid, _int32_frame(_one_frame(payload, rid), None, rid))
    if op == "step":
        return _step(header, payload, rid, n_embd)
    if op == "generate":
        return _generate(header, payload, rid)
    raise WireError(ErrorCode.BAD_REQUEST, f"unknown op {op!r}", rid)


def _step(h: dict[str, Any], payload: list[bytes], rid: int, n_embd: int) -> Step:
    session = _session(h, rid)
    pos = _int(h, "pos", rid, lo=0)
    n = _int(h, "n", rid, lo=1)
    kind = _str(h, "input", rid, ("tokens", "hidden"))
    out = _str(h, "out", rid, ("hidden", "token", "logits"))
    out_dtype = _str(h, "out_dtype", rid, tuple(DTYPES), default="f32")
    frame = _one_frame(payload, rid)
    if kind == "tokens":
        return Step(rid, session, pos, n, kind, out, out_dtype, tokens=_int32_frame(frame, n, rid))
    dtype = _str(h, "dtype", rid, tuple(DTYPES))
    width = np.dtype(DTYPES[dtype]).itemsize
    if len(frame) != n * n_embd * width:
        raise WireError(
            ErrorCode.BAD_REQUEST,
            f"payload is {len(frame)} bytes, expected {dtype}[{n}, {n_embd}] = {n * n_embd * width}",
            rid,
        )
    hidden = np.frombuffer(frame, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).reshape(n, n_embd)
    return Step(rid, session, pos, n, kind, out, out_dtype, hidden=hidden.astype(np.float32))


def _generate(h: dict[str, Any], payload: list[bytes], rid: int) -> Generate:
    session = _session(h, rid)
    pos = _int(h, "pos", rid, lo=0)
    n = _int(h, "n", rid, lo=1)
    max_new = _int(h, "max_new", rid, lo=1)
    stop = h.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        raise WireError(ErrorCode.BAD_REQUEST, "'stop' must be a list of token ids", rid)
    tokens = _int32_frame(_one_frame(payload, rid), n, rid)
    return Generate(
        rid, session, pos, n, tokens, max_new, frozenset(stop),
        _bool(h, "ignore_eog", rid, False), _bool(h, "stream", rid, True),
    )  # fmt: skip


# -- encoding ------------------------------------------------------------------------------


def encode(header: dict[str, Any], *payload: bytes) -> list[bytes]:
    return [msgpack.packb({"v": VERSION, **header}, use_bin_type=True), *payload]


def encode_error(
    rid: int | None, code: ErrorCode, message: str, retry_after_ms: int | None = None, **extra: Any
) -> list[bytes]:
    header: dict[str, Any] = {**extra, "op": "error", "rid": rid, "code": str(code), "message": message}
    if code.retryable:
        header["retry_after_ms"] = int(retry_after_ms if retry_after_ms is not None else 100)
    return encode(header)


def hidden_frame(hidden: npt.NDArray[np.float32], out_dtype: str) -> bytes:
    return np.ascontiguousarray(hidden, dtype=np.dtype(DTYPES[out_dtype]).newbyteorder("<")).tobytes()


def decode_reply(frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    """A reply's header and payload frames (for clients and the chaining forwarder)."""
    header = msgpack.unpackb(frames[0], raw=False)
    if not isinstance(header, dict):
        raise ValueError("reply header is not a map")
    return header, frames[1:]
