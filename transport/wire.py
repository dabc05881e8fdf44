"""Protocol v1 messages (PROTOCOL.md): decode and validate requests, encode replies. Pure.

Every decode either returns a request or raises `WireError` with the code and the
request id when it could be read: no other exception escapes, whatever the bytes.
What a header may cost is bounded before and while it is parsed (`HeaderLimits`): its size,
the length of every string, array and map, how many arrays and maps it holds and how
deeply they nest. Error messages show at most a short prefix of any value a peer sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from protocol.errors import ErrorCode
from protocol.sampling import Sampling

VERSION = 1
MAX_RID = 2**63
MAX_SESSION_BYTES = 128
DTYPES: dict[str, type[np.floating[Any]]] = {"f32": np.float32, "f16": np.float16}
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1  # llama.cpp takes top_k as int32
# Sampling runs in float32: a positive value below its smallest normal number would be
# subnormal there (or round to 0), so such temperatures and top_p are refused.
F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)
SEED_RANGE = (-(2**63), 2**64)  # what a msgpack integer can hold; the sampler hashes it to 32 bits


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    """What one header may cost to parse; beyond any limit it is refused unparsed or mid-parse."""

    max_header_bytes: int
    max_str_bytes: int
    max_container_len: int  # entries of one array or map
    max_containers: int  # arrays and maps in one header
    max_depth: int  # nesting of arrays and maps (the header map itself is depth 1)
    max_bin_bytes: int = 2**10
    max_text_bytes: int = 0  # UTF-8 bytes of a tokenize's text


# A tokenize's text is the only large value a request header carries: the header may
# hold that much text plus 64 KiB of everything else.
MAX_TEXT_BYTES = 2**20
MAX_TEXT_TOKENS = 2**18
REQUEST_HEADER_EXTRA = 2**16


def request_limits(max_text_bytes: int = MAX_TEXT_BYTES) -> HeaderLimits:
    size = max_text_bytes + REQUEST_HEADER_EXTRA
    return HeaderLimits(size, size, 64, 64, 4, max_text_bytes=max_text_bytes)


# Replies: `stats` maps and a detokenized text are larger, but they too are bounded.
REPLY_LIMITS = HeaderLimits(64 * 2**20, 64 * 2**20, 4096, 4096, 8)
# What a next stage answers a node (opened, result, closed, error) is small: request-sized.
NEXT_STAGE_REPLY_LIMITS = HeaderLimits(REQUEST_HEADER_EXTRA, REQUEST_HEADER_EXTRA, 64, 64, 4)


class WireError(Exception):
    """A request that cannot be served as sent; becomes an `error` reply."""

    def __init__(self, code: ErrorCode, message: str, rid: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.rid = rid


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


def show(value: Any, width: int = 40) -> str:
    """A value a peer sent, for an error message: a short prefix of scalars, only the type of the rest."""
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
    elif isinstance(value, str | bytes):
        text = repr(value[:width])
    else:
        return type(value).__name__
    return text if len(text) <= width else text[:width] + "..."


class _TooComplex(Exception):
    pass


def _depth_within(value: Any, max_depth: int) -> bool:
    """Whether arrays and maps nest at most `max_depth` deep (iterative: any depth is safe)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > max_depth:
            return False
        stack.extend((c, depth + 1) for c in children)
    return True


def parse_header(frame: bytes, limits: HeaderLimits, rid: int | None = None) -> dict[str, Any]:
    """The header map, parsed within `limits`; WireError (`too_large`, `bad_request`) otherwise."""
    if len(frame) > limits.max_header_bytes:
        raise WireError(
            ErrorCode.TOO_LARGE, f"header is {len(frame)} bytes, the limit is {limits.max_header_bytes}", rid
        )
    containers = 0

    def count(container: Any) -> Any:  # called by msgpack once per array and map it builds
        nonlocal containers
        containers += 1
        if containers > limits.max_containers:
            raise _TooComplex
        return container

    try:
        header = msgpack.unpackb(
            frame, raw=False, strict_map_key=True, list_hook=count, object_hook=count,
            max_str_len=limits.max_str_bytes, max_bin_len=limits.max_bin_bytes, max_ext_len=0,
            max_array_len=limits.max_container_len, max_map_len=limits.max_container_len,
        )  # fmt: skip
    except _TooComplex:
        raise WireError(
            ErrorCode.BAD_REQUEST, f"header holds more than {limits.max_containers} arrays and maps", rid
        ) from None
    except Exception as exc:  # msgpack raises many types for bad or over-limit bytes
        raise WireError(
            ErrorCode.BAD_REQUEST, f"header is not msgpack within limits: {type(exc).__name__}", rid
        ) from None
    if not isinstance(header, dict):
        raise WireError(ErrorCode.BAD_REQUEST, "header must be a msgpack map with string keys", rid)
    if not _depth_within(header, limits.max_depth):
        raise WireError(ErrorCode.BAD_REQUEST, f"header nests deeper than {limits.max_depth} levels", rid)
    return header


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


def _real(raw: dict[str, Any], key: str, default: float, hi: float, zero_ok: bool, rid: int) -> float:
    """A finite number in [0, hi] (or (0, hi]) that is not subnormal in float32: 0 itself only if `zero_ok`."""
    v = raw.get(key, default)
    allowed = (
        f"'sampling.{key}' must be a finite number in {'[' if zero_ok else '('}0, {hi:g}], "
        f"{'either 0 or ' if zero_ok else ''}at least {F32_MIN_NORMAL:.7g} (the smallest normal float32)"
    )
    if not _number(v):
        raise WireError(ErrorCode.BAD_REQUEST, allowed, rid)
    f = float(v)  # msgpack integers are at most 2**64: finite as floats
    if not (math.isfinite(f) and f <= hi and (f >= F32_MIN_NORMAL or (zero_ok and f == 0))):
        raise WireError(ErrorCode.BAD_REQUEST, f"{allowed}; got {show(v)}", rid)
    return f


def _sampling(h: dict[str, Any], rid: int) -> Sampling:
    raw = h.get("sampling")
    if raw is None:
        return Sampling()
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise WireError(ErrorCode.BAD_REQUEST, "'sampling' must be a map", rid)
    temperature = _real(raw, "temperature", 0.0, MAX_TEMPERATURE, True, rid)
    top_p = _real(raw, "top_p", 1.0, 1.0, False, rid)
    top_k = _int(raw, "top_k", rid, lo=0, default=0)
    if top_k > MAX_TOP_K:
        raise WireError(ErrorCode.BAD_REQUEST, f"'sampling.top_k' must be in [0, {MAX_TOP_K}]", rid)
    seed = _int(raw, "seed", rid, default=0)
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise WireError(ErrorCode.BAD_REQUEST, "'sampling.seed' must be in [-2**63, 2**64)", rid)
    return Sampling(temperature, top_k, top_p, seed)


def _one_frame(payload: list[bytes], rid: int) -> bytes:
    if len(payload) != 1:
        raise WireError(ErrorCode.BAD_REQUEST, f"expected exactly one payload frame, got {len(payload)}", rid)
    return payload[0]


def _int32_frame(frame: bytes, n: int | None, rid: int) -> npt.NDArray[np.int32]:
    if len(frame) % 4 or (n is not None and len(frame) != 4 * n):
        want = "a multiple of 4" if n is None else f"{4 * n} (int32[{n}])"
        raise WireError(ErrorCode.BAD_REQUEST, f"payload is {len(frame)} bytes, expected {want}", rid)
    return np.frombuffer(frame, dtype="<i4").astype(np.int32)


def decode_request(
    frames: list[bytes], n_embd: int, limits: HeaderLimits | None = None, max_text_tokens: int = MAX_TEXT_TOKENS
) -> Request:
    """A validated request, or WireError. `n_embd` is the stage's hidden width; `limits`
    bound the header (and a tokenize's text), `max_text_tokens` a detokenize's ids."""
    limits = limits or request_limits()
    if not frames:
        raise WireError(ErrorCode.BAD_REQUEST, "empty message")
    header = parse_header(frames[0], limits)
    if not all(isinstance(k, str) for k in header):
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
        raise WireError(ErrorCode.BAD_REQUEST, f"{show(op)} takes no payload frames", rid)
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
        add = _bool(header, "add_special", rid, True)
        text = _str(header, "text", rid)
        if (size := len(text.encode("utf-8", "surrogatepass"))) > limits.max_text_bytes:
            raise WireError(ErrorCode.TOO_LARGE, f"text is {size} bytes, the limit is {limits.max_text_bytes}", rid)
        return Tokenize(rid, text, add)
    if op == "detokenize":
        frame = _one_frame(payload, rid)
        if len(frame) > 4 * max_text_tokens:
            raise WireError(ErrorCode.TOO_LARGE, f"{len(frame) // 4} token ids, the limit is {max_text_tokens}", rid)
        return Detokenize(rid, _int32_frame(frame, None, rid))
    if op == "step":
        return _step(header, payload, rid, n_embd)
    if op == "generate":
        return _generate(header, payload, rid)
    raise WireError(ErrorCode.BAD_REQUEST, f"unknown op {show(op)}", rid)


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


def decode_reply(frames: list[bytes], limits: HeaderLimits = REPLY_LIMITS) -> tuple[dict[str, Any], list[bytes]]:
    """A reply's header and payload frames (for clients and the chaining forwarder).
    WireError (`downstream`: the peer failed) when the header is not a map within `limits`."""
    if not frames:
        raise WireError(ErrorCode.DOWNSTREAM, "empty reply")
    try:
        header = parse_header(frames[0], limits)
    except WireError as exc:
        raise WireError(ErrorCode.DOWNSTREAM, f"malformed reply: {exc.message}") from None
    return header, frames[1:]


MAX_MESSAGE_CHARS = 512  # of an error message relayed from a next stage


def _reply_error(what: str) -> WireError:
    return WireError(ErrorCode.DOWNSTREAM, f"the next stage sent a malformed reply: {what}")


def _reply_int(h: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _reply_error(f"{key!r} must be an integer in [{lo}, {hi}], got {show(v)}")
    return v


# What a next stage answers to each request a node forwards to it.
_ANSWERS = {"open": "opened", "step": "result", "close": "closed", "ping": "pong"}


def check_reply(
    sent: dict[str, Any], header: dict[str, Any], payload: list[bytes], n_embd: int, n_vocab: int
) -> tuple[dict[str, Any], list[bytes]]:
    """A next stage's reply to the request `sent`, checked like a request: the answer that
    request expects or an `error`, with the keys and payload shape it implies. Returns
    the reply (an error's message shortened); WireError (`downstream`) otherwise."""
    op = header.get("op")
    if op == "error":
        message = header.get("message", "")
        if not isinstance(header.get("code"), str) or not isinstance(message, str) or payload:
            raise _reply_error("an error needs a string 'code' and 'message' and no payload")
        checked = {**header, "message": message[:MAX_MESSAGE_CHARS]}
        if header.get("retry_after_ms") is not None:
            checked["retry_after_ms"] = _reply_int(header, "retry_after_ms", 0, 2**31 - 1)
        return checked, payload
    want = _ANSWERS.get(str(sent["op"]))
    if want is None:
        raise _reply_error(f"no reply check for a forwarded {show(sent['op'])}")
    if op != want:
        raise _reply_error(f"expected {want!r} or 'error', got op {show(op)}")
    if want == "opened":
        stage = header.get("stage")
        if not isinstance(stage, dict) or not isinstance(stage.get("last"), bool) or payload:
            raise _reply_error("'opened' needs a 'stage' map with a boolean 'last' and no payload")
        layers = stage.get("layers")
        if not (isinstance(layers, list) and len(layers) == 2 and all(type(x) is int for x in layers)
                and 0 <= layers[0] < layers[1] < 2**31):  # fmt: skip
            raise _reply_error("'stage.layers' must be [a, b] with 0 <= a < b")
        if "max_step_tokens" in stage:  # as `eog_tokens`: a minimal next stage may leave it out
            _reply_int(stage, "max_step_tokens", 1, 2**31 - 1)
        eog = stage.get("eog_tokens", [])
        if not isinstance(eog, list) or len(eog) > 16 or not all(type(t) is int and 0 <= t < n_vocab for t in eog):
            raise _reply_error(f"'stage.eog_tokens' must be at most 16 token ids in [0, {n_vocab})")
    elif want == "result":
        for key in ("pos", "n"):
            if header.get(key) != sent[key] or type(header.get(key)) is not int:
                raise _reply_error(f"{key!r} is {show(header.get(key))}, the step had {sent[key]}")
        out = header.get("out")
        if out != sent["out"]:
            raise _reply_error(f"'out' is {show(out)}, the step asked for {sent['out']!r}")
        if len(payload) != 1:
            raise _reply_error(f"expected one payload frame, got {len(payload)}")
        size = len(payload[0])
        if out == "hidden":
            if header.get("dtype") != sent["out_dtype"]:
                raise _reply_error(f"'dtype' is {show(header.get('dtype'))}, the step asked for {sent['out_dtype']!r}")
            expected = sent["n"] * n_embd * np.dtype(DTYPES[sent["out_dtype"]]).itemsize
        else:
            expected = 4 * (n_vocab if out == "logits" else 1)
        if size != expected:
            raise _reply_error(f"payload is {size} bytes, expected {expected}")
        if out == "token" and not 0 <= int(np.frombuffer(payload[0], "<i4")[0]) < n_vocab:
            raise _reply_error(f"the token is not in [0, {n_vocab})")
    elif payload:
        raise _reply_error("'closed' takes no payload")
    return header, payload
