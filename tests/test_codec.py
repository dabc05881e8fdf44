"""The one codec: every request and reply of PROTOCOL.md survives encode then decode, and the
bounded scan that finds a refused header's `rid`."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ErrorCode, Fault
from protocol.sampling import Sampling
from protocol.stage import Stage
from transport import wire
from transport.header_scan import scan_rid, skip_value
from transport.wire_replies import REASONS
from transport.wire_requests import OPS

N_EMBD = 8
F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)

rids = st.integers(0, 2**63 - 1)
sessions = st.text(min_size=1, max_size=24)
int32s = st.integers(-(2**31), 2**31 - 1)
naturals = st.integers(0, 2**31 - 1)


def token_arrays(min_size: int = 0, max_size: int = 8) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    return st.lists(int32s, min_size=min_size, max_size=max_size).map(lambda t: np.array(t, np.int32))


def hidden_rows(n: int, dtype: str) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    """float32 rows the wire's `dtype` holds exactly (f16 values for f16)."""
    values = st.floats(width=16 if dtype == "f16" else 32, allow_nan=False, allow_infinity=False)
    return st.lists(values, min_size=n * N_EMBD, max_size=n * N_EMBD).map(
        lambda v: np.array(v, np.float32).reshape(n, N_EMBD)
    )


samplings = st.builds(
    Sampling,
    st.one_of(st.just(0.0), st.floats(1e-30, float(np.finfo(np.float32).max))),
    naturals,
    st.floats(F32_MIN_NORMAL, 1.0),
    st.integers(-(2**63), 2**64 - 1),
)


@st.composite
def steps(draw: st.DrawFn) -> wire.Step:
    n = draw(st.integers(1, 4))
    common = (draw(rids), draw(sessions), draw(naturals), n)
    out, out_dtype = draw(st.sampled_from(wire.OUTS)), draw(st.sampled_from(sorted(wire.DTYPES)))
    if draw(st.booleans()):
        return wire.Step(*common, "tokens", out, out_dtype, tokens=draw(token_arrays(n, n)))
    dtype = draw(st.sampled_from(sorted(wire.DTYPES)))
    return wire.Step(*common, "hidden", out, out_dtype, hidden=draw(hidden_rows(n, dtype)), dtype=dtype)


@st.composite
def generates(draw: st.DrawFn) -> wire.Generate:
    tokens = draw(token_arrays(1))
    return wire.Generate(
        draw(rids),
        draw(sessions),
        draw(naturals),
        len(tokens),
        tokens,
        draw(st.integers(1, 2**31)),
        frozenset(draw(st.lists(int32s, max_size=4))),
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.one_of(st.none(), st.integers(0, 64))),
    )


requests = st.one_of(
    st.builds(wire.Open, rids, sessions, st.integers(1, 2**31), samplings, naturals),
    steps(),
    generates(),
    st.builds(wire.Cancel, rids, sessions),
    st.builds(wire.Close, rids, sessions),
    st.builds(wire.Tokenize, rids, st.text(max_size=64), st.booleans()),
    st.builds(wire.Detokenize, rids, token_arrays()),
    st.builds(wire.Stats, rids),
    st.builds(wire.Ping, rids),
)

stages = st.builds(
    Stage,
    st.booleans(),
    st.booleans(),
    st.tuples(st.integers(0, 2**30), st.integers(1, 2**30)).map(lambda ab: (ab[0], ab[0] + ab[1])),
    naturals,
    naturals,
    st.text(max_size=24),
    st.integers(1, 2**31 - 1),
    st.lists(naturals, max_size=16).map(tuple),
)


@st.composite
def results(draw: st.DrawFn) -> wire.Result:
    n, out = draw(st.integers(1, 4)), draw(st.sampled_from(wire.OUTS))
    common = (draw(rids), draw(sessions), draw(naturals), n, out)
    if out == "hidden":
        dtype = draw(st.sampled_from(sorted(wire.DTYPES)))
        return wire.Result(*common, draw(hidden_rows(n, dtype)), dtype)
    if out == "logits":
        logits = st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=16)
        return wire.Result(*common, np.array(draw(logits), np.float32))
    return wire.Result(*common, draw(token_arrays(1 if out == "token" else n, 1 if out == "token" else n)))


@st.composite
def dones(draw: st.DrawFn) -> wire.Done:
    tokens = draw(st.one_of(st.none(), token_arrays()))
    generated = draw(naturals) if tokens is None else len(tokens)
    common = (draw(rids), draw(sessions), draw(st.sampled_from(REASONS)))
    return wire.Done(*common, generated, draw(naturals), tokens, draw(st.one_of(st.none(), naturals)))


stats_values = st.recursive(
    st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.booleans(), st.none()),
    lambda inner: st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
replies = st.one_of(
    st.builds(wire.Opened, rids, sessions, naturals, stages, st.one_of(st.none(), naturals)),
    results(),
    st.builds(wire.Generated, rids, sessions, naturals, token_arrays(1)),
    dones(),
    st.builds(wire.Cancelled, rids, sessions, naturals),
    st.builds(wire.Closed, rids, sessions, st.booleans()),
    st.builds(wire.Tokens, rids, token_arrays()),
    st.builds(wire.Text, rids, st.text(max_size=64)),
    st.builds(wire.StatsReply, rids, st.dictionaries(st.text(max_size=8), stats_values, max_size=6)),
    st.builds(wire.Pong, rids),
    st.builds(
        wire.ErrorReply,
        st.one_of(st.none(), rids),
        st.sampled_from(list(ErrorCode)),
        st.text(max_size=64),
        st.one_of(st.none(), st.integers(0, 2**31 - 1)),
        st.one_of(st.none(), sessions),
    ),
)


def same(a: object, b: object) -> bool:
    """Dataclass equality that compares arrays by dtype and value."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


@settings(max_examples=600, deadline=None)
@given(requests)
def test_every_request_survives_encode_then_decode(request: wire.Request) -> None:
    decoded = wire.decode_request(wire.encode_request(request), N_EMBD, outs=wire.OUTS)
    assert same(decoded, request), (decoded, request)


@settings(max_examples=600, deadline=None)
@given(replies)
def test_every_reply_survives_encode_then_decode(reply: wire.Reply) -> None:
    decoded = wire.decode_reply(wire.encode_reply(reply))
    assert same(decoded, reply), (decoded, reply)


def test_every_message_type_is_covered() -> None:
    """The strategies above draw every request and every reply type the codec has."""
    assert set(OPS) == set(wire.Request.__args__)  # type: ignore[attr-defined]
    assert set(wire.REPLY_OPS) == set(wire.Reply.__args__)  # type: ignore[attr-defined]
    assert len(wire.REPLY_OPS) == 11 and len(OPS) == 9


def test_the_node_serves_every_output_and_refuses_others() -> None:
    ids = np.array([1, 2], np.int32)
    step = wire.Step(4, "s", 0, 2, "tokens", "tokens", "f32", tokens=ids)
    decoded = wire.decode_request(wire.encode_request(step), N_EMBD)
    assert isinstance(decoded, wire.Step) and decoded.out == "tokens"
    frames = wire.encode_request(dataclasses.replace(step, out="probabilities"))
    with pytest.raises(Fault) as info:
        wire.decode_request(frames, N_EMBD)
    assert info.value.code == ErrorCode.BAD_REQUEST and info.value.rid == 4


def test_a_negative_speculate_is_a_bad_request() -> None:
    request = wire.Generate(5, "s", 0, 1, np.array([1], np.int32), 4, speculate=0)
    frames = wire.encode_request(request)
    decoded = wire.decode_request(frames, N_EMBD)
    assert isinstance(decoded, wire.Generate) and decoded.speculate == 0
    bad = [msgpack.packb({**msgpack.unpackb(frames[0]), "speculate": -1}), *frames[1:]]
    with pytest.raises(Fault) as info:
        wire.decode_request(bad, N_EMBD)
    assert info.value.code == ErrorCode.BAD_REQUEST and info.value.rid == 5


def test_an_error_reply_is_built_from_a_fault() -> None:
    busy = wire.ErrorReply.of(Fault(ErrorCode.BUSY, "full"), rid=3)
    assert busy == wire.ErrorReply(3, ErrorCode.BUSY, "full", 100)
    refused = wire.ErrorReply.of(Fault(ErrorCode.TOO_LARGE, "never", 50, rid=9))
    assert refused == wire.ErrorReply(9, ErrorCode.TOO_LARGE, "never", None)
    fault = busy.fault()
    assert (fault.code, fault.message, fault.retry_after_ms, fault.rid) == (ErrorCode.BUSY, "full", 100, 3)


@pytest.mark.parametrize(
    ("header", "payload"),
    [
        ({"op": "opened", "rid": 1, "session": "s", "kv_reserved": 4, "stage": {"last": "yes", "layers": [0, 1]}}, []),
        ({"op": "result", "rid": 1, "session": "s", "pos": 0, "n": 2, "out": "tokens"}, [b"\0" * 4]),
        ({"op": "result", "rid": 1, "session": "s", "pos": 0, "n": 2, "out": "hidden", "dtype": "f32"}, [b"\0" * 4]),
        ({"op": "done", "rid": 1, "session": "s", "reason": "tired", "generated": 0, "length": 0}, []),
        ({"op": "done", "rid": 1, "session": "s", "reason": "eog", "generated": 2, "length": 0}, [b"\0" * 4]),
        ({"op": "closed", "rid": 1, "session": "s"}, []),
        ({"op": "pong", "rid": "1"}, []),
        ({"op": "stats", "rid": 1, "stats": [1]}, []),
        ({"op": "teapot", "rid": 1}, []),
        ({"op": "error", "rid": -1, "code": "busy", "message": "m"}, []),
    ],
)
def test_malformed_replies_are_downstream(header: dict[str, Any], payload: list[bytes]) -> None:
    with pytest.raises(Fault) as info:
        wire.decode_reply([msgpack.packb({"v": 1, **header}), *payload])
    assert info.value.code == ErrorCode.DOWNSTREAM and len(info.value.message) < 200


# -- the rid of a header refused unread ------------------------------------------------------


def packed_map(items: list[tuple[Any, Any]]) -> tuple[bytes, list[int]]:
    """A msgpack map of `items` in this order, and where each item's value ends."""
    out, ends = bytearray(msgpack.Packer().pack_map_header(len(items))), []
    for key, value in items:
        out += msgpack.packb(key) + msgpack.packb(value)
        ends.append(len(out))
    return bytes(out), ends


values = st.recursive(
    st.one_of(
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=40),
        st.binary(max_size=40),
        st.booleans(),
        st.none(),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=20,
)
# Keys of any kind: a header whose keys are not all strings is refused unread, and scanned.
other_keys = st.one_of(st.text(max_size=6), values).filter(lambda k: k != "rid")


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(other_keys, values), max_size=6), rids, st.integers(0, 6), st.data())
def test_the_scan_finds_a_top_level_rid_and_reads_nothing_past_the_frame(
    others: list[tuple[Any, Any]], rid: int, at: int, data: st.DataObject
) -> None:
    items = [*others[:at], ("rid", rid), *others[at:]]
    frame, ends = packed_map(items)
    assert scan_rid(frame) == rid
    rid_end = ends[min(at, len(others))]
    cut = data.draw(st.integers(0, len(frame)))
    found = scan_rid(frame[:cut])  # a frame cut short: only what lies within it counts
    assert found == (rid if cut >= rid_end else None)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=200))
def test_the_scan_never_raises(frame: bytes) -> None:
    found = scan_rid(frame)
    assert found is None or 0 <= found < 2**63


def test_the_scan_ignores_what_is_not_a_top_level_rid() -> None:
    assert scan_rid(msgpack.packb({"x": {"rid": 5}})) is None
    assert scan_rid(msgpack.packb([{"rid": 5}])) is None
    assert scan_rid(msgpack.packb({"rid": -5})) is None
    assert scan_rid(msgpack.packb({"rid": 2**63})) is None
    assert scan_rid(msgpack.packb({"rid": "5"})) is None
    assert scan_rid(msgpack.packb({"rid": 1, "x": 0, "rid ": 2})) == 1


def test_the_scan_steps_over_keys_that_are_not_strings() -> None:
    assert scan_rid(packed_map([(1, "x"), ("rid", 5)])[0]) == 5
    assert scan_rid(packed_map([({"rid": 6}, 0), (["a"], [1]), ("rid", 7)])[0]) == 7
    assert scan_rid(packed_map([(b"rid", 8)])[0]) is None  # bytes, not the string key


def test_the_scan_steps_over_large_values_by_their_length_and_is_bounded_in_items() -> None:
    text = "x" * (24 * 2**20)
    frame, _ = packed_map([("v", 1), ("op", "tokenize"), ("text", text), ("rid", 12)])
    assert scan_rid(frame) == 12  # one item for the whole string
    deep = b"\x91" * 10_000 + b"\xc0"  # arrays nested 10,000 deep
    assert skip_value(deep, 0, budget=10_001) == (len(deep), 0)
    assert skip_value(deep, 0, budget=10_000) is None
    before = msgpack.Packer().pack_map_header(2) + msgpack.packb("rid") + msgpack.packb(7)
    after = msgpack.Packer().pack_map_header(2) + msgpack.packb("x") + deep + msgpack.packb("rid")
    assert scan_rid(before + msgpack.packb("x") + deep, max_items=100) == 7
    assert scan_rid(after + msgpack.packb(7), max_items=100) is None  # the budget ran out first
    assert scan_rid(after + msgpack.packb(7), max_items=20_000) == 7


def test_a_header_refused_unread_is_answered_with_its_rid() -> None:
    big = msgpack.packb({"v": 1, "op": "tokenize", "text": "x" * (3 * 2**20 // 2), "rid": 41})
    with pytest.raises(Fault) as info:
        wire.decode_request([big], N_EMBD)
    assert info.value.code == ErrorCode.TOO_LARGE and info.value.rid == 41
    deep = msgpack.Packer().pack_map_header(3) + msgpack.packb("rid") + msgpack.packb(42)
    deep += msgpack.packb("v") + msgpack.packb(1) + msgpack.packb("x") + b"\x91" * 50 + b"\xc0"
    with pytest.raises(Fault) as info:
        wire.decode_request([deep], N_EMBD)
    assert info.value.code == ErrorCode.BAD_REQUEST and info.value.rid == 42 and "deep" in info.value.message
    wide = msgpack.packb({"rid": 43, "v": 1, "op": "ping", "x": [[]] * 100})
    with pytest.raises(Fault) as info:
        wire.decode_request([wide], N_EMBD)
    assert info.value.rid == 43
