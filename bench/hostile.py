"""What hostile peers send: one builder per class of bad input, each a cycle of cases.

Pure: a builder takes a random generator, the message's index and what it knows of the
node it attacks (`Target`), and returns the frames of one message. The index walks
through the class's cases in turn, so every case is sent however few messages the run
sends; the generator varies the bytes within a case. Nothing here is ever valid enough
to change a node's state, except what `flood_open` opens (and closes right after).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

Frames = list[bytes]


@dataclass(frozen=True, slots=True)
class Target:
    """A node under attack, as the hostile peers see it."""

    name: str
    address: str
    first: bool  # takes token input
    last: bool  # gives tokens (a whole model, or a chain's head: it relays the tail's)
    n_vocab: int
    n_embd: int
    max_text_bytes: int
    max_text_tokens: int
    max_header_bytes: int
    max_message_bytes: int


class Stop:
    """Set by SIGTERM or SIGINT in the chaos run's own processes (the peers, the fake stage): their loops end
    and they report what they did."""

    requested = False

    @classmethod
    def on_signals(cls) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda _signum, _frame: setattr(cls, "requested", True))


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True))


def header(op: Any, rid: int, **keys: Any) -> bytes:
    return pack({"v": 1, "op": op, "rid": rid, **keys})


def with_raw(rid: int, key: str, raw: bytes) -> bytes:
    """A request header (a ping) whose `key` holds the raw msgpack `raw`: a bad value inside a good map."""
    return b"\x84" + pack("v") + pack(1) + pack("rid") + pack(rid) + pack("op") + pack("ping") + pack(key) + raw


def int32(ids: Any) -> bytes:
    return np.asarray(ids, "<i4").tobytes()


# -- random bytes -----------------------------------------------------------------------

_SIZES = (0, 1, 2, 3, 5, 8, 16, 64, 256, 1024, 4096)
# Markers that put msgpack's parser somewhere deep: map16, map32, array32, str32, bin32, ext32, fixmap.
_PREFIXES = (
    b"\xde\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xdd\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xc9\xff\xff\xff\xff\x01",
    b"\x8f",
)


def random_bytes(rng: random.Random, i: int, t: Target) -> Frames:
    size = rng.choice(_SIZES)
    case = i % 4
    if case == 0:
        return [rng.randbytes(size)]
    if case == 1:
        return [rng.randbytes(rng.choice(_SIZES)) for _ in range(rng.randint(2, 6))]
    if case == 2:
        return [rng.choice(_PREFIXES) + rng.randbytes(size)]
    good = header(rng.choice(["step", "open", "tokenize", "ping"]), i, session="s", pos=0, n=1)
    return [good[: rng.randrange(1, len(good))] + rng.randbytes(size % 17)]  # a valid header, cut short


# -- deep and wide msgpack --------------------------------------------------------------


def _deep(kind: int, depth: int) -> bytes:
    if kind == 0:
        return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    if kind == 1:
        return b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ... nil}}
    return (b"\x91\x81\xa1k" * (depth // 2 + 1)) + b"\xc0"  # arrays and maps alternating


_DEPTHS = (5, 8, 64, 1000, 20_000)


def deep_msgpack(rng: random.Random, i: int, t: Target) -> Frames:
    depth = _DEPTHS[(i // 6) % len(_DEPTHS)]
    body = _deep(i % 3, depth)
    if (i // 3) % 2 == 0:
        return [body]  # the whole header is the deep value
    return [with_raw(i, rng.choice(["op", "session", "sampling", "stop", "x"]), body)]


def _wide_cases(i: int, rng: random.Random) -> bytes:
    case = i % 12
    if case == 0:
        return header([0] * 65, i)  # one array over 64 entries
    if case == 1:
        return pack({"v": 1, "op": "ping", "rid": i, **{f"k{j}": j for j in range(70)}})  # a map over 64
    if case == 2:
        return header("ping", i, x=[[[0] * 2] * 8] * 8)  # 73 arrays: more than 64 in one header
    if case == 3:
        return with_raw(i, "x", b"\xdc\xff\xff" + b"\xc0" * 65535)  # 65535 nils
    if case == 4:
        return with_raw(i, "x", b"\xdd\xff\xff\xff\xff" + b"\xc0" * 16)  # array32 claiming 4 G entries
    if case == 5:
        return with_raw(i, "x", b"\xdf\xff\xff\xff\xff" + b"\xa1k\xc0" * 16)  # map32 claiming 4 G entries
    if case == 6:
        return with_raw(i, "text", b"\xdb\xff\xff\xff\xf0" + b"a" * 64)  # str32 claiming 4 GiB
    if case == 7:
        return header("ping", i, blob=rng.randbytes(2048))  # bin over 1 KiB
    if case == 8:
        return with_raw(i, "x", b"\xd4\x01\x00")  # an extension type
    if case == 9:
        return with_raw(i, "when", b"\xd6\xff" + b"\x00\x00\x00\x01")  # a msgpack timestamp
    if case == 10:
        return bytes(msgpack.packb({1: 2, "v": 1, "op": "ping", "rid": i, 2.5: None, b"k": 1}, use_bin_type=True))
    return pack([{"v": 1, "op": "ping", "rid": i}] * 3)  # a header that is an array of headers


def wide_msgpack(rng: random.Random, i: int, t: Target) -> Frames:
    return [_wide_cases(i, rng)]


# -- huge strings and frames --------------------------------------------------------------


def _text(n: int) -> str:
    letters = "the quick brown fox jumps over a lazy dog "
    return (letters * (n // len(letters) + 1))[:n]


# The two cases that make a node tokenize or detokenize for real come once in 40 messages. Their
# texts are words: llama.cpp's SPM tokenizer is quadratic in the length of a run without spaces,
# which on the tiny test vocabulary makes one 1 MiB tokenize of such a run cost over a minute.
HEAVY_EVERY = 4


def huge_strings(rng: random.Random, i: int, t: Target) -> Frames:
    """Texts and strings at and past the node's limits, and at them: the most a node tokenizes for real."""
    case = i % 10
    if case in (5, 7) and (i // 10) % HEAVY_EVERY:
        case = 0
    if case == 0:
        return [header("tokenize", i, text=_text(t.max_text_bytes + 1))]  # too_large, unparsed work
    if case == 1:
        return [header("ping", i, pad=_text(t.max_header_bytes + 1))]  # too_large: the header frame
    if case == 2:
        return [header("ping", i, pad=_text(2 * t.max_header_bytes))]
    if case == 3:
        return [header("close", i, session=_text(t.max_text_bytes))]  # a 1 MiB session id
    if case == 4:
        return [header(_text(t.max_text_bytes // 2), i)]  # a 512 KiB op
    if case == 5:  # the most text a tokenize takes: real work, then more ids than the node gives back
        return [header("tokenize", i, text=_text(t.max_text_bytes))]
    if case == 6:
        return [header("detokenize", i), int32(np.zeros(t.max_text_tokens + 1, np.int32))]  # too_large
    if case == 7:  # the most ids a detokenize takes: real work, a long text back
        return [header("detokenize", i), int32(np.arange(t.max_text_tokens) % t.n_vocab)]
    if case == 8:
        return [with_raw(i, "text", b"\xdb" + (2**20).to_bytes(4, "big") + b"\xff\xfe" * 2**19)]  # not UTF-8
    return [header("tokenize", i, text="\U0001f600" * (t.max_text_bytes // 4 + 1))]  # 4-byte characters


def huge_frames(rng: random.Random, i: int, t: Target) -> Frames:
    """Payload frames of MiBs, and messages of thousands of frames (each answered)."""
    case = i % 5
    if case == 0:
        return [header("step", i, session="s", pos=0, n=4, input="tokens", out="token"), bytes(16 * 2**20)]
    if case == 1:
        n = 4 * 2**20 // 4
        return [header("step", i, session="s", pos=0, n=n, input="tokens", out="token"), bytes(4 * n)]
    if case == 2:
        return [header("detokenize", i)] + [b""] * 10_000
    if case == 3:
        return [header("ping", i)] + [bytes(65536)] * 256
    hidden = header("step", i, session="s", pos=0, n=2**16, input="hidden", dtype="f32", out="hidden")
    return [hidden, bytes(2**16 * t.n_embd * 4)]  # a right-sized hidden payload of 16 MiB (n_embd 64)


def oversize_frame(t: Target) -> Frames:
    """One frame over the node's message limit: ZeroMQ drops the connection, nothing is answered."""
    return [bytes(t.max_message_bytes + 1)]


# -- out-of-range fields -----------------------------------------------------------------

F32_DENORMAL = 1e-40
_TEMPERATURES = (float("inf"), float("-inf"), float("nan"), -F32_DENORMAL, -5e-324, -1.0, -1e308, True, "hot")
_TOP_K = (-1, -(2**63), 1.5, None, "3")
_TOP_P = (0, 0.0, 1.0000001, float("nan"), 2, -F32_DENORMAL, -0.5)
_SESSIONS = ("", "x" * 129, "é" * 65, 5, None, b"bytes", ["s"])
_MAX_TOKENS = (0, -1, 2**63 - 1, 2**31, "8", 1.0, None)


def _bad_open(rng: random.Random, i: int) -> dict[str, Any]:
    """An open with one field out of range (never a valid one: it would hold a session)."""
    case = i % 8
    keys: dict[str, Any] = {"session": f"oor-{i}", "max_tokens": 8}
    if case == 0:
        keys["sampling"] = {"temperature": _TEMPERATURES[i // 8 % len(_TEMPERATURES)]}
    elif case == 1:
        keys["sampling"] = {"temperature": 0.7, "top_k": _TOP_K[i // 8 % len(_TOP_K)]}
    elif case == 2:
        keys["sampling"] = {"temperature": 0.7, "top_p": _TOP_P[i // 8 % len(_TOP_P)]}
    elif case == 3:
        keys["sampling"] = {"seed": rng.choice([1.5, "seed", True])}
    elif case == 4:
        keys["session"] = _SESSIONS[i // 8 % len(_SESSIONS)]
    elif case == 5:
        keys["max_tokens"] = _MAX_TOKENS[i // 8 % len(_MAX_TOKENS)]
    elif case == 6:
        keys.update(max_tokens=2**40, wait_ms=2**62)  # more KV than any node: kv_budget at once, no wait
    else:
        keys["sampling"] = rng.choice(["greedy", [1, 2], {1: 2}, {"temperature": [0.5]}])
    return keys


def _bad_step(rng: random.Random, i: int, t: Target, session: str) -> Frames:
    """A step on the peer's own open session (or a made-up one) with one field out of range."""
    case = i % 12
    tokens = {"input": "tokens", "out": "token"}
    if not t.first:
        tokens = {"input": "hidden", "dtype": "f32", "out": "hidden" if not t.last else "token"}
    one = int32([1]) if t.first else np.zeros(t.n_embd, "<f4").tobytes()
    if case == 0:
        return [header("step", i, session=session, pos=rng.choice([1, 2**31, 2**62, 2**64 - 1]), n=1, **tokens), one]
    if case == 1:
        return [header("step", i, session=session, pos=rng.choice([-1, -(2**63)]), n=1, **tokens), one]
    if case == 2:
        return [header("step", i, session=session, pos=0, n=rng.choice([0, -5, 2**31]), **tokens), one]
    if case == 3:
        return [header("step", i, session=session, pos=0, n=513, **tokens), bytes(513 * len(one))]  # too_large
    if case == 4:
        return [header("step", i, session=session, pos=0, n=2, **tokens), one]  # payload of the wrong size
    if case == 5:
        if t.first:
            bad = rng.choice([-1, t.n_vocab, 2**31 - 1, -(2**31)])
            return [header("step", i, session=session, pos=0, n=1, **tokens), int32([bad])]
        row = np.zeros(t.n_embd, "<f4")
        row[rng.randrange(t.n_embd)] = rng.choice([np.nan, np.inf, -np.inf])
        return [header("step", i, session=session, pos=0, n=1, **tokens), row.tobytes()]
    if case == 6:
        return [header("step", i, session=f"never-opened-{i}", pos=0, n=1, **tokens), one]
    if case == 7:
        keys = {**tokens, rng.choice(["input", "out", "out_dtype"]): rng.choice(["bogus", 5, None])}
        return [header("step", i, session=session, pos=0, n=1, **keys), one]
    if case == 8:
        return [header("step", i, session=session, pos=0, n=1, **tokens)]  # no payload
    if case == 9:
        return [header("step", i, session=session, pos=4, n=1, **tokens), one, one]  # two payloads
    if case == 10:
        return [header("generate", i, session=session, pos=0, n=1, max_new=rng.choice([0, -1, "8"])), int32([1])]
    return [
        header("generate", i, session=session, pos=0, n=1, max_new=4, stop=rng.choice(["x", [1.5], {}])),
        int32([1]),
    ]


def _bad_envelope(rng: random.Random, i: int) -> Frames:
    """The keys every message carries, out of range: `v`, `rid`, `op`, stray payloads."""
    case = i % 10
    if case == 0:
        return [pack({"v": rng.choice([0, 2, -1, 2**64 - 1, "1", True, 1.0, None]), "op": "ping", "rid": i})]
    if case == 1:
        return [pack({"v": 1, "op": "ping", "rid": rng.choice([-1, 2**63, 2**64 - 1, 1.5, "7", True, None])})]
    if case == 2:
        return [pack({"v": 1, "op": rng.choice(["explode", "", 5, None, True, "PING"]), "rid": i})]
    if case == 3:
        return [pack({"v": 1, "rid": i})]  # no op
    if case == 4:
        return [header(rng.choice(["ping", "stats", "open", "close", "tokenize"]), i), b"stray"]
    if case == 5:
        return [header("tokenize", i, text=rng.choice([5, None, b"bytes", ["a"]]))]
    if case == 6:
        return [header("tokenize", i, text="a", add_special=rng.choice(["yes", 1, None]))]
    if case == 7:
        return [header("detokenize", i), rng.choice([int32([-1]), int32([2**31 - 1]), b"\x00\x01\x02"])]
    if case == 8:
        return [header("detokenize", i)]  # no payload
    return [header(rng.choice(["close", "cancel"]), i, session=rng.choice(_SESSIONS))]


def out_of_range(rng: random.Random, i: int, t: Target, session: str) -> Frames:
    """Sampling, positions, sessions and envelope keys out of range, in turn."""
    kind = i % 3
    if kind == 0:
        return [header("open", i, **_bad_open(rng, i // 3))]
    if kind == 1:
        return _bad_step(rng, i // 3, t, session)
    return _bad_envelope(rng, i // 3)


# -- floods of cheap requests --------------------------------------------------------------


def flood(kind: str, i: int) -> Frames:
    """One cheap request; the peer closes a flood `open` once it is opened (chaos_peer `_close_when_opened`)."""
    if kind == "ping":
        return [header("ping", i)]
    if kind == "stats":
        return [header("stats", i)]
    if kind == "close":
        return [header("close", i, session=f"flood-never-{i % 97}")]
    return [header("open", i, session=f"flood-{i}", max_tokens=16)]


# -- the classes, by name -------------------------------------------------------------------

Builder = Callable[[random.Random, int, Target], Frames]
BUILDERS: dict[str, Builder] = {
    "random_bytes": random_bytes,
    "deep_msgpack": deep_msgpack,
    "wide_msgpack": wide_msgpack,
    "huge_strings": huge_strings,
    "huge_frames": huge_frames,
}
