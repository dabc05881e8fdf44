"""The wire layer: every message of PROTOCOL.md, and fuzzed bytes never escape as exceptions."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ErrorCode, Fault
from protocol.sampling import Sampling
from transport.wire import (
    Close,
    Detokenize,
    ErrorReply,
    Open,
    Ping,
    Request,
    Result,
    Stats,
    Step,
    Tokenize,
    WireError,
    answer_to,
    decode_request,
    encode_reply,
    parse_reply,
    request_limits,
    show,
)

N_EMBD = 8


def frames(header: dict[str, Any], *payload: bytes) -> list[bytes]:
    return [msgpack.packb(header), *payload]


def base(op: str, **kw: Any) -> dict[str, Any]:
    return {"v": 1, "op": op, "rid": 7, **kw}


def test_every_request_decodes() -> None:
    assert decode_request(frames(base("ping")), N_EMBD) == Ping(7)
    assert decode_request(frames(base("stats")), N_EMBD) == Stats(7)
    o = decode_request(
        frames(
            base(
                "open",
                session="s",
                max_tokens=10,
                sampling={"temperature": 1, "top_k": 5, "top_p": 0.5, "seed": 3},
                wait_ms=20,
                extra="ignored",
            )
        ),
        N_EMBD,
    )
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
    header, payload = parse_reply(encode_reply(ErrorReply.of(Fault(ErrorCode.BUSY, "full", 100), rid=3)))
    assert header == {"v": 1, "op": "error", "rid": 3, "code": "busy", "message": "full", "retry_after_ms": 100}
    header, _ = parse_reply(encode_reply(ErrorReply.of(Fault(ErrorCode.BAD_REQUEST, "x"))))
    assert header["rid"] is None and "retry_after_ms" not in header
    failed = ErrorReply.of(Fault(ErrorCode.DOWNSTREAM, "gone"), rid=4, session="s", length=9)
    header, _ = parse_reply(encode_reply(failed))
    assert header["session"] == "s" and header["length"] == 9  # a failed generate says where it stands
    h = np.ones((2, 3), np.float32)
    header, payload = parse_reply(encode_reply(Result(1, "s", 0, 2, "hidden", h, "f16")))
    assert header["dtype"] == "f16" and np.frombuffer(payload[0], "<f2").tolist() == [1.0] * 6


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_bytes_never_escape(raw: list[bytes]) -> None:
    try:
        decode_request(raw, N_EMBD)
    except WireError as exc:
        assert exc.code in ("bad_request", "unsupported_version", "too_large")


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
_keys = st.sampled_from(
    [
        "v",
        "op",
        "rid",
        "session",
        "pos",
        "n",
        "input",
        "out",
        "dtype",
        "out_dtype",
        "max_tokens",
        "sampling",
        "wait_ms",
        "text",
        "add_special",
    ]
)
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


# -- hostile headers: whatever their nesting, size or types ------------------------------------

ANSWERS = ("bad_request", "unsupported_version", "too_large")


def _decoded_or_refused(raw: list[bytes]) -> None:
    """The property every byte sequence has: a request, or a WireError with a short message."""
    try:
        decode_request(raw, N_EMBD)
    except WireError as exc:
        assert exc.code in ANSWERS and 0 < len(exc.message) <= 300, exc.message


def _header_with(key: str, value_bytes: bytes) -> bytes:
    """A header {v: 1, rid: 3, key: value} whose value is the raw msgpack `value_bytes`."""
    return b"\x83" + b"".join(bytes(msgpack.packb(x)) for x in ("v", 1, "rid", 3, key)) + value_bytes


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(1, 5000),
    opener=st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\xde\x00\x01\xa1k"]),
    key=st.sampled_from(["op", "sampling", "session", "text", "extra"]),
)
def test_any_nesting_is_refused_cheaply(depth: int, opener: bytes, key: str) -> None:
    frame = _header_with(key, opener * depth + b"\xc0")
    _decoded_or_refused([frame])
    if depth > 3:  # the header map, then the value: deeper than the limit of 4 levels
        with pytest.raises(WireError) as info:
            decode_request([frame], N_EMBD)
        assert info.value.code == "bad_request"


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(0, 200_000),
    item=st.sampled_from([b"\x90", b"\x80", b"\xc0", b"\x01", b"\xa0"]),
    key=st.sampled_from(["op", "extra"]),
)
def test_wide_headers_are_refused_or_decoded(count: int, item: bytes, key: str) -> None:
    _decoded_or_refused([_header_with(key, b"\xdd" + count.to_bytes(4, "big") + item * count)])


@settings(max_examples=30, deadline=None)
@given(size=st.integers(0, 3 * 2**20), key=st.sampled_from(["op", "text", "session", "extra"]))
def test_huge_strings_are_refused_or_decoded(size: int, key: str) -> None:
    frame = msgpack.packb({"v": 1, "rid": 3, "op": "tokenize", "text": "t", key: "x" * size})
    _decoded_or_refused([frame])


def test_limits_and_their_answers() -> None:
    eight_mib = b"\xdd" + (8 * 2**20).to_bytes(4, "big") + b"\x90" * (8 * 2**20)
    with pytest.raises(WireError) as info:
        decode_request([eight_mib], N_EMBD)
    assert info.value.code == "too_large" and info.value.rid is None
    with pytest.raises(WireError) as info:
        decode_request([_header_with("op", b"\x91" * 1000 + b"\xc0")], N_EMBD)
    assert info.value.code == "bad_request" and len(info.value.message) < 100
    with pytest.raises(WireError) as info:  # an op of 60000 characters is shown by a short prefix
        decode_request(frames(base("x" * 60_000)), N_EMBD)
    assert info.value.code == "bad_request" and info.value.rid == 7 and len(info.value.message) < 100
    small = request_limits(max_text_bytes=100)
    assert isinstance(decode_request(frames(base("tokenize", text="é" * 50)), N_EMBD, small), Tokenize)
    with pytest.raises(WireError) as info:  # 101 bytes of UTF-8
        decode_request(frames(base("tokenize", text="é" * 50 + "x")), N_EMBD, small)
    assert info.value.code == "too_large" and info.value.rid == 7 and "100" in info.value.message
    assert isinstance(decode_request(frames(base("detokenize"), b"\0" * 40), N_EMBD, small, 10), Detokenize)
    with pytest.raises(WireError) as info:
        decode_request(frames(base("detokenize"), b"\0" * 44), N_EMBD, small, 10)
    assert info.value.code == "too_large"
    with pytest.raises(WireError) as info:  # timestamps and other extension types are not protocol values
        decode_request([msgpack.packb({**base("ping"), "x": msgpack.ExtType(1, b"ab")})], N_EMBD)
    assert info.value.code == "bad_request"


def test_show_never_echoes_a_whole_value() -> None:
    assert show("x" * 10_000).startswith("'xxx") and len(show("x" * 10_000)) <= 43
    assert show([[[]]] * 1000) == "list" and show({"a": 1}) == "dict" and show(7) == "7"


# -- sampling ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "allowed"),
    [
        ({"temperature": float("inf")}, "finite number in [0, inf]"),
        ({"temperature": float("nan")}, "finite number in [0, inf]"),
        ({"temperature": -1e-30}, "finite number in [0, inf]"),
        ({"temperature": True}, "finite number in [0, inf]"),
        ({"top_p": float("nan")}, "(0, 1]"),
        ({"top_p": 0}, "(0, 1]"),
        ({"top_p": 1.0000001}, "(0, 1]"),
        ({"top_k": -1}, ">= 0"),
        ({"seed": 1.5}, "integer"),
    ],
)  # fmt: skip
def test_sampling_out_of_range_names_the_range(sampling: dict[str, Any], allowed: str) -> None:
    with pytest.raises(WireError) as info:
        decode_request(frames(base("open", session="s", max_tokens=4, sampling=sampling)), N_EMBD)
    assert info.value.code == "bad_request" and info.value.rid == 7
    assert allowed in info.value.message, info.value.message


F32_TINY, F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    ("sampling", "taken"),
    [
        ({"temperature": 0}, Sampling()),
        ({"temperature": 150}, Sampling(temperature=150.0)),
        ({"temperature": 1e-30}, Sampling(temperature=1e-30)),
        ({"temperature": 1.2e-38}, Sampling()),  # the logits divided by it would overflow: greedy
        ({"temperature": 1e-40}, Sampling()),  # subnormal in float32: greedy, what it tends to
        ({"temperature": 5e-324}, Sampling()),
        ({"temperature": 1e300}, Sampling(temperature=F32_MAX)),  # float32 would make it infinite
        ({"temperature": 2**64 - 1}, Sampling(temperature=2.0**64)),
        ({"top_p": 1e-30}, Sampling(top_p=1e-30)),
        ({"top_p": 1e-45}, Sampling(top_p=F32_TINY)),  # keeps only the likeliest token either way
        ({"top_k": 2**31 - 1}, Sampling(top_k=2**31 - 1)),
        ({"top_k": 2**63}, Sampling()),  # more than any vocabulary: keeps all, as 0 does
        ({"seed": -(2**63)}, Sampling(seed=-(2**63))),
        ({"seed": 2**64 - 1}, Sampling(seed=2**64 - 1)),
    ],
)  # fmt: skip
def test_sampling_the_contract_allows_is_taken_as_float32_sampling_can(
    sampling: dict[str, Any], taken: Sampling
) -> None:
    """PROTOCOL.md: `temperature` float >= 0, `top_k` int >= 0, `top_p` in (0, 1]."""
    o = decode_request(frames(base("open", session="s", max_tokens=4, sampling=sampling)), N_EMBD)
    assert isinstance(o, Open) and o.sampling == taken


# -- replies of a next stage -------------------------------------------------------------------

STAGE = {"first": False, "last": True, "layers": [2, 4], "max_step_tokens": 64, "eog_tokens": [2]}
SENT_STEP = {
    "op": "step",
    "session": "f",
    "pos": 3,
    "n": 2,
    "input": "hidden",
    "dtype": "f32",
    "out": "hidden",
    "out_dtype": "f16",
}
HIDDEN_F16 = b"\0" * (2 * N_EMBD * 2)


def check_reply(
    sent: dict[str, Any], header: dict[str, Any], payload: list[bytes], n_embd: int, n_vocab: int
) -> tuple[dict[str, Any], list[bytes]]:
    """A next stage's reply (a header map, as a peer may send anything) checked against what was sent."""
    request: Request
    if sent["op"] == "open":
        request = Open(0, "s", 16)
    elif sent["op"] == "close":
        request = Close(0, "s")
    else:
        request = Step(0, "s", sent["pos"], sent["n"], sent["input"], sent["out"], sent["out_dtype"])
    return parse_reply(encode_reply(answer_to(request, {"rid": 0, **header}, payload, n_embd, n_vocab)))


def test_good_replies_pass_the_check() -> None:
    vocab = 100
    assert check_reply({"op": "open"}, {"op": "opened", "stage": STAGE}, [], N_EMBD, vocab)
    result = {"op": "result", "pos": 3, "n": 2, "out": "hidden", "dtype": "f16"}
    assert check_reply(SENT_STEP, result, [HIDDEN_F16], N_EMBD, vocab)
    token = {**SENT_STEP, "out": "token"}
    assert check_reply(token, {**result, "out": "token"}, [np.array([99], "<i4").tobytes()], N_EMBD, vocab)
    logits = {**SENT_STEP, "out": "logits"}
    assert check_reply(logits, {**result, "out": "logits"}, [b"\0" * 4 * vocab], N_EMBD, vocab)
    assert check_reply({"op": "close"}, {"op": "closed", "existed": True}, [], N_EMBD, vocab)
    error, _ = check_reply(SENT_STEP, {"op": "error", "code": "busy", "message": "m" * 9000}, [], N_EMBD, vocab)
    assert len(error["message"]) == 512


@pytest.mark.parametrize(
    ("sent", "header", "payload"),
    [
        ({"op": "open"}, {"op": "result"}, []),
        ({"op": "open"}, {"op": "opened"}, []),
        ({"op": "open"}, {"op": "opened", "stage": {**STAGE, "layers": [4, 2]}}, []),
        ({"op": "open"}, {"op": "opened", "stage": {**STAGE, "layers": [0, True]}}, []),
        ({"op": "open"}, {"op": "opened", "stage": {**STAGE, "max_step_tokens": 0}}, []),
        ({"op": "open"}, {"op": "opened", "stage": {**STAGE, "eog_tokens": [100]}}, []),
        ({"op": "open"}, {"op": "opened", "stage": {**STAGE, "eog_tokens": list(range(17))}}, []),
        ({"op": "close"}, {"op": "closed"}, [b"x"]),
        (SENT_STEP, {"op": "result", "pos": 3, "n": 2, "out": "hidden", "dtype": "f32"}, [HIDDEN_F16]),
        (SENT_STEP, {"op": "result", "pos": 3, "n": 2, "out": "hidden", "dtype": "f16"}, [HIDDEN_F16 + b"\0"]),
        (SENT_STEP, {"op": "result", "pos": 3, "n": 2, "out": "hidden", "dtype": "f16"}, []),
        (SENT_STEP, {"op": "result", "pos": 3.0, "n": 2, "out": "hidden", "dtype": "f16"}, [HIDDEN_F16]),
        (SENT_STEP, {"op": "result", "pos": 3, "n": 2, "out": "token"}, [b"\0" * 4]),
        ({**SENT_STEP, "out": "token"}, {"op": "result", "pos": 3, "n": 2, "out": "token"}, [b"\xff" * 4]),
        (SENT_STEP, {"op": "error", "code": 5, "message": "m"}, []),
        (SENT_STEP, {"op": "error", "code": "busy", "retry_after_ms": 2**40}, []),
        (SENT_STEP, {"op": "error", "code": "busy", "message": "m"}, [b"payload"]),
    ],
)  # fmt: skip
def test_malformed_replies_are_downstream(sent: dict[str, Any], header: dict[str, Any], payload: list[bytes]) -> None:
    with pytest.raises(WireError) as info:
        check_reply(sent, header, payload, N_EMBD, 100)
    assert info.value.code == "downstream" and len(info.value.message) < 200


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_reply_bytes_decode_or_are_downstream(raw: list[bytes]) -> None:
    try:
        header, payload = parse_reply(raw)
        check_reply(SENT_STEP, header, payload, N_EMBD, 100)
    except WireError as exc:
        assert exc.code == "downstream"
