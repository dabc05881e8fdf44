"""The wire layer: every message of PROTOCOL.md, and fuzzed bytes never escape as exceptions."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ErrorCode
from transport.wire import (
    Close,
    Detokenize,
    Open,
    Ping,
    Stats,
    Step,
    Tokenize,
    WireError,
    decode_reply,
    decode_request,
    encode,
    encode_error,
    hidden_frame,
)

N_EMBD = 8


def frames(header: dict[str, Any], *payload: bytes) -> list[bytes]:
    return [msgpack.packb(header), *payload]


def base(op: str, **kw: Any) -> dict[str, Any]:
    return {"v": 1, "op": op, "rid": 7, **kw}


def test_every_request_decodes() -> None:
    assert decode_request(frames(base("ping")), N_EMBD) == Ping(7)
    assert decode_request(frames(base("stats")), N_EMBD) == Stats(7)
    o = decode_request(frames(base("open", session="s", max_tokens=10, sampling={"temperature": 1, "top_k": 5,
                                                                                  "top_p": 0.5, "seed": 3},
                                    wait_ms=20, extra="ignored")), N_EMBD)  # fmt: skip
    assert isinstance(o, Open) and o.sampling.top_k == 5 and o.sampling.temperature == 1.0 and o.wait_ms == 20
    assert decode_request(frames(base("close", session="s")), N_EMBD) == Close(7, "s")
    t = decode_request(frames(base("tokenize", text="hi", add_special=False)), N_EMBD)
    assert t == Tokenize(7, "hi", False)
    d = decode_request(frames(base("detokenize"), np.array([1, 2], "<i4").tobytes()), N_EMBD)
    assert isinstance(d, Detokenize) and d.tokens.tolist() == [1, 2]
    s = decode_request(
        frames(base("step", session="s", pos=0, n=2, input="tokens", out="token"), np.array([3, 4], "<i4").tobytes()),
        N_EMBD,
    )
    assert isinstance(s, Step) and s.tokens is not None and s.tokens.tolist() == [3, 4] and s.out_dtype == "f32"
    h16 = np.arange(2 * N_EMBD, dtype="<f2").reshape(2, N_EMBD)
    s = decode_request(
        frames(base("step", session="s", pos=1, n=2, input="hidden", dtype="f16", out="hidden", out_dtype="f16"),
               h16.tobytes()),
        N_EMBD,
    )  # fmt: skip
    assert isinstance(s, Step) and s.hidden is not None and s.hidden.dtype == np.float32
    assert np.array_equal(s.hidden, h16.astype(np.float32))


@pytest.mark.parametrize(
    ("msg", "code", "rid"),
    [
        ([b"\xc1"], "bad_request", None),
        (frames([1, 2]), "bad_request", None),  # type: ignore[arg-type]
        (frames({"v": 2, "op": "ping", "rid": 1}), "unsupported_version", 1),
        (frames({"v": 1, "op": "ping"}), "bad_request", None),
        (frames({"v": 1, "op": "ping", "rid": -1}), "bad_request", None),
        (frames({"v": 1, "op": "ping", "rid": True}), "bad_request", None),
        (frames({"v": 1, "op": "ping", "rid": 2**63}), "bad_request", None),
        (frames(base("fly")), "bad_request", 7),
        (frames(base("open", session="", max_tokens=1)), "bad_request", 7),
        (frames(base("open", session="x" * 129, max_tokens=1)), "bad_request", 7),
        (frames(base("open", session="s", max_tokens=0)), "bad_request", 7),
        (frames(base("open", session="s", max_tokens="9")), "bad_request", 7),
        (frames(base("open", session="s", max_tokens=9, sampling={"top_p": 0})), "bad_request", 7),
        (frames(base("open", session="s", max_tokens=9, sampling={"temperature": -1})), "bad_request", 7),
        (frames(base("step", session="s", pos=0, n=2, input="tokens", out="token"), b"\0" * 4), "bad_request", 7),
        (frames(base("step", session="s", pos=0, n=1, input="tokens", out="token")), "bad_request", 7),
        (frames(base("step", session="s", pos=0, n=1, input="tokens", out="x"), b"\0" * 4), "bad_request", 7),
        (frames(base("step", session="s", pos=0, n=1, input="hidden", out="hidden"), b"\0" * 32), "bad_request", 7),
        (frames(base("step", session="s", pos=0, n=1, input="hidden", dtype="f32", out="hidden"), b"\0" * 31),
         "bad_request", 7),
        (frames(base("ping"), b"extra"), "bad_request", 7),
        (frames(base("detokenize"), b"\0\0\0"), "bad_request", 7),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_with_code_and_rid(msg: list[bytes], code: str, rid: int | None) -> None:
    with pytest.raises(WireError) as info:
        decode_request(msg, N_EMBD)
    assert info.value.code == code and info.value.rid == rid and info.value.message


def test_replies_encode() -> None:
    header, payload = decode_reply(encode_error(3, ErrorCode.BUSY, "full"))
    assert header == {"v": 1, "op": "error", "rid": 3, "code": "busy", "message": "full", "retry_after_ms": 100}
    header, _ = decode_reply(encode_error(None, ErrorCode.BAD_REQUEST, "x"))
    assert header["rid"] is None and "retry_after_ms" not in header
    h = np.ones((2, 3), np.float32)
    header, payload = decode_reply(encode({"op": "result", "rid": 1}, hidden_frame(h, "f16")))
    assert np.frombuffer(payload[0], "<f2").tolist() == [1.0] * 6


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes_never_escape(raw: list[bytes]) -> None:
    try:
        decode_request(raw, N_EMBD)
    except WireError as exc:
        assert exc.code in ("bad_request", "unsupported_version")


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_keys = st.sampled_from(["v", "op", "rid", "session", "pos", "n", "input", "out", "dtype", "out_dtype", "max_tokens",
                         "sampling", "wait_ms", "text", "add_special"])  # fmt: skip
_ops = st.sampled_from(["open", "step", "close", "tokenize", "detokenize", "stats", "ping", "x"])


@settings(max_examples=600, deadline=None)
@given(
    st.dictionaries(_keys, _values, max_size=10),
    _ops,
    st.sampled_from([1, 1, 1, 2]),
    st.lists(st.binary(max_size=80), max_size=2),
)
def test_structured_garbage_decodes_or_is_bad_request(
    header: dict[str, Any], op: str, version: int, payload: list[bytes]
) -> None:
    header = {**header, "op": op, "v": version, "rid": header.get("rid", 5)}
    try:
        packed = msgpack.packb(header)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        decode_request([packed, *payload], N_EMBD)
    except WireError as exc:
        assert exc.code in ("bad_request", "unsupported_version") and exc.message
