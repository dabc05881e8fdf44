"""Protocol v1 requests (PROTOCOL.md, Operations): typed, decoded with validation, encoded.

Every decode either returns a request or raises `Fault` with the code and the request id
when it could be read (from the parsed header, or else from a bounded scan of a header
refused unread: `header_scan`): no other exception escapes, whatever the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import ErrorCode, Fault
from protocol.sampling import Sampling
from transport.header_scan import scan_rid
from transport.wire_header import (
    DTYPES,
    MAX_RID,
    VERSION,
    HeaderLimits,
    is_int,
    pack_header,
    parse_header,
    request_limits,
    show,
)
from transport.wire_values import int32_bytes, int32_frame, one_frame, read_bool, read_int, read_str

MAX_SESSION_BYTES = 128
MAX_TOP_K = 2**31 - 1  # llama.cpp takes top_k as int32; more keeps every token, as 0 does
# Sampling runs in float32. A positive value below its smallest normal number would be
# subnormal there (or round to 0), and one above its largest would be infinite: the node
# takes what such values tend to (only the likeliest token for a vanishing top_p, uniform
# for a huge temperature) at float32's own limits.
F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)
F32_MAX = float(np.finfo(np.float32).max)
# llama.cpp divides the logits by the temperature in float32: below this it would overflow
# (a real model's logits stay far under 1e4, and 1e4 / 1e-30 = 1e34), so such a temperature
# is greedy, what sampling tends to as the temperature vanishes.
GREEDY_TEMPERATURE = 1e-30
SEED_RANGE = (-(2**63), 2**64)  # what a msgpack integer can hold; the sampler hashes it to 32 bits
MAX_TEXT_TOKENS = 2**18
OUTS = ("hidden", "token", "logits", "tokens")  # what a step may ask for (`tokens`: a v1 extension)
SERVED_OUTS = OUTS  # what a node serves


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
    out: str  # "hidden" | "token" | "logits" | "tokens"
    out_dtype: str
    tokens: npt.NDArray[np.int32] | None = None
    hidden: npt.NDArray[np.float32] | None = None  # always f32 here, whatever came on the wire
    dtype: str = "f32"  # the wire's dtype of `hidden`


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
    speculate: int | None = None  # most draft tokens per pass; None: the node's own setting


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

OPS: dict[type[Request], str] = {
    Open: "open",
    Step: "step",
    Generate: "generate",
    Cancel: "cancel",
    Close: "close",
    Tokenize: "tokenize",
    Detokenize: "detokenize",
    Stats: "stats",
    Ping: "ping",
}


def op_of(request: Request) -> str:
    return OPS[type(request)]


# -- decoding ------------------------------------------------------------------------------


def _session(h: dict[str, Any], rid: int) -> str:
    s = read_str(h, "session", rid)
    if not 1 <= len(s.encode("utf-8", "surrogatepass")) <= MAX_SESSION_BYTES:
        raise Fault(ErrorCode.BAD_REQUEST, "'session' must be 1-128 UTF-8 bytes", rid=rid)
    return s


def _real(raw: dict[str, Any], key: str, default: float, hi: float, zero_ok: bool, rid: int) -> float:
    """A finite number in [0, hi] (or (0, hi] unless `zero_ok`)."""
    v = raw.get(key, default)
    allowed = f"'sampling.{key}' must be a finite number in {'[' if zero_ok else '('}0, {hi:g}]"
    if not (isinstance(v, int | float) and not isinstance(v, bool)):
        raise Fault(ErrorCode.BAD_REQUEST, allowed, rid=rid)
    f = float(v)  # msgpack integers are at most 2**64: finite as floats
    if not (math.isfinite(f) and 0 <= f <= hi and (zero_ok or f > 0)):
        raise Fault(ErrorCode.BAD_REQUEST, f"{allowed}; got {show(v)}", rid=rid)
    return f


def _sampling(h: dict[str, Any], rid: int) -> Sampling:
    raw = h.get("sampling")
    if raw is None:
        return Sampling()
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise Fault(ErrorCode.BAD_REQUEST, "'sampling' must be a map", rid=rid)
    temperature = _real(raw, "temperature", 0.0, math.inf, True, rid)
    temperature = 0.0 if temperature < GREEDY_TEMPERATURE else min(temperature, F32_MAX)
    top_p = max(_real(raw, "top_p", 1.0, 1.0, False, rid), F32_MIN_NORMAL)
    top_k = read_int(raw, "top_k", rid, lo=0, default=0)
    top_k = 0 if top_k > MAX_TOP_K else top_k
    seed = read_int(raw, "seed", rid, default=0)
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise Fault(ErrorCode.BAD_REQUEST, "'sampling.seed' must be in [-2**63, 2**64)", rid=rid)
    return Sampling(temperature, top_k, top_p, seed)


def _header(frames: list[bytes], limits: HeaderLimits) -> tuple[dict[str, Any], int]:
    """The parsed header and its rid. A header refused unread is answered with the rid a
    bounded scan finds in it (PROTOCOL.md, Framing)."""
    if not frames:
        raise Fault(ErrorCode.BAD_REQUEST, "empty message")
    try:
        header = parse_header(frames[0], limits)
    except Fault as exc:
        raise Fault(exc.code, exc.message, rid=scan_rid(frames[0])) from None
    raw_rid = header.get("rid")
    rid = raw_rid if is_int(raw_rid) and 0 <= raw_rid < MAX_RID else None
    version = header.get("v")
    if not is_int(version):
        raise Fault(ErrorCode.BAD_REQUEST, "missing or mistyped 'v'", rid=rid)
    if version != VERSION:
        raise Fault(
            ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version} is not supported (this node speaks 1)", rid=rid
        )
    if rid is None:
        raise Fault(ErrorCode.BAD_REQUEST, "'rid' must be an integer in [0, 2**63)")
    return header, rid


def decode_request(
    frames: list[bytes],
    n_embd: int,
    limits: HeaderLimits | None = None,
    max_text_tokens: int = MAX_TEXT_TOKENS,
    *,
    outs: Collection[str] = SERVED_OUTS,
) -> Request:
    """A validated request, or Fault. `n_embd` is the stage's hidden width; `limits` bound the
    header (and a tokenize's text), `max_text_tokens` a detokenize's ids; `outs` are the step
    outputs served."""
    limits = limits or request_limits()
    header, rid = _header(frames, limits)
    op, payload = header.get("op"), frames[1:]
    if op in ("open", "close", "cancel", "tokenize", "stats", "ping") and payload:
        raise Fault(ErrorCode.BAD_REQUEST, f"{show(op)} takes no payload frames", rid=rid)
    if op == "ping":
        return Ping(rid)
    if op == "stats":
        return Stats(rid)
    if op == "open":
        max_tokens = read_int(header, "max_tokens", rid, lo=1)
        wait_ms = read_int(header, "wait_ms", rid, lo=0, default=0)
        return Open(rid, _session(header, rid), max_tokens, _sampling(header, rid), wait_ms)
    if op in ("close", "cancel"):
        return (Close if op == "close" else Cancel)(rid, _session(header, rid))
    if op == "tokenize":
        return _tokenize(header, rid, limits)
    if op == "detokenize":
        frame = one_frame(payload, rid)
        if len(frame) > 4 * max_text_tokens:
            raise Fault(ErrorCode.TOO_LARGE, f"{len(frame) // 4} token ids, the limit is {max_text_tokens}", rid=rid)
        return Detokenize(rid, int32_frame(frame, None, rid))
    if op == "step":
        return _step(header, payload, rid, n_embd, outs)
    if op == "generate":
        try:
            return _generate(header, payload, rid)
        except Fault as fault:  # every reply of a generate carries its session, a refusal's too
            with suppress(Fault):
                fault.session = _session(header, rid)
            raise
    raise Fault(ErrorCode.BAD_REQUEST, f"unknown op {show(op)}", rid=rid)


def _tokenize(h: dict[str, Any], rid: int, limits: HeaderLimits) -> Tokenize:
    add = read_bool(h, "add_special", rid, True)
    text = read_str(h, "text", rid)
    if (size := len(text.encode("utf-8", "surrogatepass"))) > limits.max_text_bytes:
        raise Fault(ErrorCode.TOO_LARGE, f"text is {size} bytes, the limit is {limits.max_text_bytes}", rid=rid)
    return Tokenize(rid, text, add)


def _step(h: dict[str, Any], payload: list[bytes], rid: int, n_embd: int, outs: Collection[str]) -> Step:
    session = _session(h, rid)
    pos = read_int(h, "pos", rid, lo=0)
    n = read_int(h, "n", rid, lo=1)
    kind = read_str(h, "input", rid, ("tokens", "hidden"))
    out = read_str(h, "out", rid, tuple(o for o in OUTS if o in outs))
    out_dtype = read_str(h, "out_dtype", rid, tuple(DTYPES), default="f32")
    frame = one_frame(payload, rid)
    if kind == "tokens":
        return Step(rid, session, pos, n, kind, out, out_dtype, tokens=int32_frame(frame, n, rid))
    dtype = read_str(h, "dtype", rid, tuple(DTYPES))
    width = np.dtype(DTYPES[dtype]).itemsize
    if len(frame) != n * n_embd * width:
        raise Fault(
            ErrorCode.BAD_REQUEST,
            f"payload is {len(frame)} bytes, expected {dtype}[{n}, {n_embd}] = {n * n_embd * width}",
            rid=rid,
        )
    hidden = np.frombuffer(frame, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).reshape(n, n_embd)
    return Step(rid, session, pos, n, kind, out, out_dtype, hidden=hidden.astype(np.float32), dtype=dtype)


def _generate(h: dict[str, Any], payload: list[bytes], rid: int) -> Generate:
    session = _session(h, rid)
    pos = read_int(h, "pos", rid, lo=0)
    n = read_int(h, "n", rid, lo=1)
    max_new = read_int(h, "max_new", rid, lo=1)
    stop = h.get("stop", [])
    if not isinstance(stop, list) or not all(is_int(t) for t in stop):
        raise Fault(ErrorCode.BAD_REQUEST, "'stop' must be a list of token ids", rid=rid)
    tokens = int32_frame(one_frame(payload, rid), n, rid)
    ignore_eog, stream = read_bool(h, "ignore_eog", rid, False), read_bool(h, "stream", rid, True)
    speculate = read_int(h, "speculate", rid, lo=0) if "speculate" in h else None
    return Generate(rid, session, pos, n, tokens, max_new, frozenset(stop), ignore_eog, stream, speculate)


# -- encoding ------------------------------------------------------------------------------


def _sampling_map(s: Sampling) -> dict[str, Any]:
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed}


def hidden_bytes(hidden: npt.NDArray[np.floating[Any]], dtype: str) -> bytes:
    """Hidden states as a little-endian `dtype` payload frame."""
    return np.ascontiguousarray(hidden, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).tobytes()


def _step_message(r: Step) -> tuple[dict[str, Any], list[bytes]]:
    header: dict[str, Any] = {
        "session": r.session,
        "pos": r.pos,
        "n": r.n,
        "input": r.input,
        "out": r.out,
        "out_dtype": r.out_dtype,
    }
    if r.input == "hidden":
        if r.hidden is None:
            raise ValueError("a step with input 'hidden' needs its hidden states")
        header["dtype"] = r.dtype
        return header, [hidden_bytes(r.hidden, r.dtype)]
    if r.tokens is None:
        raise ValueError("a step with input 'tokens' needs its tokens")
    return header, [int32_bytes(r.tokens)]


def _message(r: Request) -> tuple[dict[str, Any], list[bytes]]:
    """The header keys (after `v`, `op`, `rid`) and payload frames of a request."""
    if isinstance(r, Open):
        keys = {"session": r.session, "max_tokens": r.max_tokens, "wait_ms": r.wait_ms}
        return {**keys, "sampling": _sampling_map(r.sampling)}, []
    if isinstance(r, Step):
        return _step_message(r)
    if isinstance(r, Generate):
        keys = {"session": r.session, "pos": r.pos, "n": r.n, "max_new": r.max_new, "stop": sorted(r.stop)}
        keys |= {"ignore_eog": r.ignore_eog, "stream": r.stream}
        if r.speculate is not None:
            keys["speculate"] = r.speculate
        return keys, [int32_bytes(r.tokens)]
    if isinstance(r, Cancel | Close):
        return {"session": r.session}, []
    if isinstance(r, Tokenize):
        return {"text": r.text, "add_special": r.add_special}, []
    if isinstance(r, Detokenize):
        return {}, [int32_bytes(r.tokens)]
    return {}, []  # Stats, Ping


def encode_request(request: Request) -> list[bytes]:
    """The frames of `request` as PROTOCOL.md describes them (header, then payload)."""
    keys, payload = _message(request)
    return [pack_header({"op": op_of(request), "rid": request.rid, **keys}), *payload]
