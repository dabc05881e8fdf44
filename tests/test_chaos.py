"""The chaos run: its hostile messages and broken replies are what they claim, and `just chaos quick` passes.

The first tests hold the bench's attack material against the wire decoder and the reply
check a head applies, so a builder that drifted into sending valid requests would be noticed.
The last runs the quick chaos run end to end on real node processes and reads its JSON.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import hostile
from bench.chaos_report import ANSWERED, CLASS_ORDER
from bench.fake_stage import OPEN_REPLIES, STEP_REPLIES, FakeStage
from neuron_tai.process_exists import process_exists
from protocol.errors import ErrorCode
from transport import wire

ROOT = Path(__file__).resolve().parent.parent
N_VOCAB, N_EMBD = 268, 64
TARGET = hostile.Target(
    "node", "tcp://127.0.0.1:1", first=True, last=True, n_vocab=N_VOCAB, n_embd=N_EMBD,
    max_text_bytes=wire.MAX_TEXT_BYTES, max_text_tokens=wire.MAX_TEXT_TOKENS,
    max_header_bytes=wire.request_limits().max_header_bytes, max_message_bytes=64 * 2**20,
)  # fmt: skip


def decode(frames: list[bytes]) -> wire.Request | wire.WireError:
    try:
        return wire.decode_request(frames, N_EMBD, wire.request_limits(), wire.MAX_TEXT_TOKENS)
    except wire.WireError as exc:
        return exc


@pytest.mark.parametrize("cls", ["random_bytes", "deep_msgpack", "wide_msgpack"])
def test_garbage_is_refused_by_the_wire_decoder(cls: str) -> None:
    rng = random.Random(3)
    outcomes = [decode(hostile.BUILDERS[cls](rng, i, TARGET)) for i in range(600)]
    # Only a ping header cut short and completed by random bytes can come out valid (and be answered `pong`).
    assert all(isinstance(o, wire.WireError | wire.Ping) for o in outcomes), [
        o for o in outcomes if not isinstance(o, Exception)
    ]
    assert {o.code for o in outcomes if isinstance(o, wire.WireError)} <= {ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE}
    assert sum(isinstance(o, wire.WireError) for o in outcomes) > 0.99 * len(outcomes)


def test_huge_strings_are_refused_except_the_ones_at_the_limit() -> None:
    rng = random.Random(4)
    accepted = []
    for i in range(80):
        got = decode(hostile.huge_strings(rng, i, TARGET))
        if not isinstance(got, wire.WireError):
            accepted.append(got)
    # Only the two cases that make a node tokenize or detokenize the most it takes are valid requests.
    assert accepted and all(isinstance(r, wire.Tokenize | wire.Detokenize) for r in accepted)
    assert all(len(r.text.encode()) == wire.MAX_TEXT_BYTES for r in accepted if isinstance(r, wire.Tokenize))
    assert all(len(r.tokens) == wire.MAX_TEXT_TOKENS for r in accepted if isinstance(r, wire.Detokenize))


def test_out_of_range_opens_never_open_a_session() -> None:
    rng = random.Random(5)
    for i in range(0, 600, 3):  # every third message is an open
        got = decode(hostile.out_of_range(rng, i, TARGET, "oor"))
        if isinstance(got, wire.WireError):
            continue
        assert isinstance(got, wire.Open) and got.max_tokens >= 2**31, got  # more KV than any node: kv_budget


def test_out_of_range_steps_never_run() -> None:
    """Steps that pass the decoder still cannot run: past the session's length, over max_step_tokens,
    outside the vocabulary or on a session that was never opened (the peer's own has length 0)."""
    rng = random.Random(6)
    for i in range(1, 600, 3):
        got = decode(hostile.out_of_range(rng, i, TARGET, "oor"))
        if isinstance(got, wire.WireError):
            continue
        assert isinstance(got, wire.Step), got
        in_vocab = got.tokens is None or bool(((got.tokens >= 0) & (got.tokens < N_VOCAB)).all())
        assert got.pos > 0 or got.n > 512 or got.session != "oor" or not in_vocab, got


def _reply_outcome(sent: dict[str, Any], messages: list[list[bytes]]) -> str:
    """What a head makes of the fake stage's answer: `downstream`, or what it would relay."""
    for frames in messages:
        try:
            header, payload = wire.parse_reply(frames, wire.NEXT_STAGE_REPLY_LIMITS)
        except wire.WireError:
            continue  # unreadable: dropped, the request times out
        if header.get("rid") != sent["rid"] or type(header.get("rid")) is not int:
            continue  # unmatched: dropped
        try:
            checked = wire.answer_to(_typed(sent), header, payload, N_EMBD, N_VOCAB)
        except wire.WireError as exc:
            return str(exc.code)
        return str(checked.code) if isinstance(checked, wire.ErrorReply) else wire.REPLY_OPS[type(checked)]
    return "downstream"  # no reply it can match: the head's --downstream-timeout answers `downstream`


def _typed(sent: dict[str, Any]) -> wire.Request:
    """The request a head forwarded, as the head holds it (only what the reply check reads)."""
    if sent["op"] == "open":
        return wire.Open(int(sent["rid"]), str(sent["session"]), int(sent["max_tokens"]))
    return wire.Step(
        int(sent["rid"]), str(sent["session"]), sent["pos"], sent["n"], "hidden", sent["out"], sent["out_dtype"]
    )


@pytest.mark.parametrize("out", ["token", "logits"])
@pytest.mark.parametrize("kind", sorted(STEP_REPLIES))
def test_every_fake_stage_step_reply_becomes_downstream(kind: str, out: str) -> None:
    sent = {
        "op": "step",
        "rid": 41,
        "session": "s",
        "pos": 3,
        "n": 4,
        "input": "hidden",
        "dtype": "f32",
        "out": out,
        "out_dtype": "f32",
    }
    assert _reply_outcome(sent, STEP_REPLIES[kind](sent, N_VOCAB, N_EMBD)) == "downstream"


@pytest.mark.parametrize("kind", sorted(OPEN_REPLIES))
def test_every_malformed_opened_becomes_downstream(kind: str) -> None:
    sent = {"op": "open", "rid": 7, "session": "s", "max_tokens": 16}
    assert _reply_outcome(sent, OPEN_REPLIES[kind](sent, N_VOCAB, N_EMBD)) == "downstream"


def test_the_fake_stage_opens_every_other_session_validly() -> None:
    fake = FakeStage(N_VOCAB, N_EMBD)
    outcomes = []
    for rid in range(1, 9):
        sent = {"v": 1, "op": "open", "rid": rid, "session": f"s{rid}", "max_tokens": 16}
        outcomes.append(_reply_outcome(sent, fake.answer([hostile.pack(sent)])))
    assert outcomes == ["opened", "downstream"] * 4


def test_quick_chaos_run_passes_every_criterion_and_stops_everything(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "quick", "--part", "hostile", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["failures"] == [] and report["crashes"] == []

    classes = report["hostile"]["classes"]
    assert all(classes[c]["sent"] > 0 for c in CLASS_ORDER)
    assert report["hostile"]["total"] == sum(c["sent"] for c in classes.values()) >= report["plan"]["min_hostile"]
    assert all(classes[c]["unanswered"] == 0 and classes[c]["answered"] > 0 for c in ANSWERED)
    # A ping header cut short and completed by a random byte is a valid ping now and then.
    assert set(classes["random_bytes"]["replies"]) <= {"error:bad_request", "error:too_large", "pong"}
    assert "error:too_large" in classes["huge_strings"]["replies"]

    for name in ("single", "chain-head"):
        valid = report["valid"][name]
        assert valid["sessions"] > 0 and valid["mismatches"] == 0 and not valid["failed"]
    assert all(h is not None and h["sessions_held"] == 0 for h in report["after_lease"].values())
    counters = report["node_counters"]
    assert sum(c["peers_gone_total"] for c in counters.values()) > 0  # never-readers were cut off
    assert sum(c["leases_expired_total"] for c in counters.values()) > 0  # vanished clients' sessions freed

    malformed = report["malformed_next"]
    assert malformed["steps"].get("downstream", 0) > 0 and set(malformed["steps"]) == {"downstream"}
    restart = report["tail_restart"]
    assert restart["cycles"] and restart["recovered_after_last_restart"]
    assert any(o.endswith("downstream") for o in restart["outcomes"])

    for name, memory in report["memory"].items():
        assert memory["within_bound"], (name, memory)
    assert report["processes"] and not any(process_exists(p["pid"]) for p in report["processes"])
