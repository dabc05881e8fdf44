"""Hostile peers against real node processes: nothing a peer sends stops a node.

Each test plays an attacker (or a broken next stage) and a well-behaved second peer,
and checks the attacker gets an error reply (or nothing) while the other is served.
What the node holds for an attacker is read from its own `stats`, never from its RSS.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from bench.processes import free_ports
from tests.nodes import NodeProcess, running
from tests.test_wire import STAGE

REPLY_TIMEOUT_MS = 30_000  # "no reply" only: no assertion depends on how fast a reply is


class Peer:
    """A plain DEALER speaking protocol v1 by hand."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, **options: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.sock.connect(address)
        self.rids = itertools.count(1)

    def send(self, op: str, *payload: bytes, **keys: Any) -> int:
        rid = next(self.rids)
        self.sock.send_multipart([msgpack.packb({"v": 1, "op": op, "rid": rid, **keys}), *payload])
        return rid

    def recv(self) -> tuple[dict[str, Any], list[bytes]]:
        if not self.sock.poll(REPLY_TIMEOUT_MS):
            raise AssertionError("no reply")
        frames = self.sock.recv_multipart()
        return msgpack.unpackb(frames[0]), frames[1:]

    def request(self, op: str, *payload: bytes, **keys: Any) -> tuple[dict[str, Any], list[bytes]]:
        rid = self.send(op, *payload, **keys)
        header, frames = self.recv()
        assert header["rid"] == rid
        return header, frames


@contextmanager
def node_process(model: Path, *extra: str) -> Iterator[tuple[NodeProcess, zmq.Context[zmq.Socket[bytes]]]]:
    node = NodeProcess(model, f"tcp://127.0.0.1:{free_ports(1)[0]}", extra)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with running(node):
            yield node, ctx
            assert node.proc is not None and node.proc.poll() is None, "the node stopped"
            assert node.stop() == 0
    finally:
        ctx.destroy(linger=0)


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value))


def header_with(op_bytes: bytes) -> bytes:
    """A request header whose `op` value is the raw msgpack `op_bytes`."""
    return b"\x83" + pack("v") + pack(1) + pack("rid") + pack(9) + pack("op") + op_bytes


def reply(op: str, rid: Any, **keys: Any) -> bytes:
    return pack({"v": 1, "op": op, "rid": rid, **keys})


@contextmanager
def fake_next_stage() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A ROUTER standing in for a head's next stage, answering what the test tells it to: the
    socket and its address."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close()
        ctx.destroy(linger=0)


def forwarded(fake_next: zmq.Socket[bytes], op: str | None = None) -> tuple[bytes, dict[str, Any]]:
    """The next request the head sends on; with `op`, the next of that kind (pings answered, the
    rest let be)."""
    while True:
        assert fake_next.poll(REPLY_TIMEOUT_MS), f"no {op or 'request'} was forwarded"
        frames = fake_next.recv_multipart()
        req = msgpack.unpackb(frames[1])
        if op is None or req["op"] == op:
            return frames[0], req
        if req["op"] == "ping":
            fake_next.send_multipart([frames[0], reply("pong", req["rid"])])


def test_nested_and_huge_headers_do_not_stop_the_node(tiny_model: Path) -> None:
    with node_process(tiny_model) as (node, ctx):
        attacker, other = Peer(ctx, node.address), Peer(ctx, node.address)
        attacker.sock.send_multipart([header_with(b"\x91" * 1000 + b"\xc0")])  # op: [[[...[nil]...]]], about 1 KB
        nested, _ = attacker.recv()
        assert nested["code"] == "bad_request" and len(nested["message"]) < 200
        huge = b"\xdd" + (8 * 2**20).to_bytes(4, "big") + b"\x90" * (8 * 2**20)  # 8 MiB array of empty arrays
        for _ in range(10):
            attacker.sock.send_multipart([huge])
        pong, _ = other.request("ping")  # the other peer is answered while those are refused
        assert pong["op"] == "pong"
        refusals = [attacker.recv()[0] for _ in range(10)]
        assert {r["code"] for r in refusals} == {"too_large"} and all(r["rid"] is None for r in refusals)
        stats, _ = other.request("stats")
        assert stats["stats"]["errors_total"]["too_large"] == 10
        assert stats["stats"]["max_header_bytes"] < 2 * 2**20
        deep_map = header_with(b"\x81\xa1k" * 3000 + b"\xc0")  # maps nested far past msgpack's own stack
        wide = header_with(pack([[0] * 60] * 60))  # more arrays than a header may hold
        for frame in (deep_map, wide, b"\xc1" * 100):
            attacker.sock.send_multipart([frame])
            assert attacker.recv()[0]["code"] == "bad_request"
        opened, _ = other.request("open", session="s", max_tokens=8)
        assert opened["op"] == "opened"


def test_a_header_refused_unread_is_answered_with_its_rid(tiny_model: Path) -> None:
    """PROTOCOL.md, Framing: too large or too complex to parse, yet answered with its rid.
    Both sizes are over the header limit (1 MiB of text plus 64 KiB) and under the node's
    max_message_bytes (64 MiB), so ZeroMQ delivers them and the node itself answers."""
    with node_process(tiny_model) as (node, ctx):
        peer = Peer(ctx, node.address)
        for size in (1_500_000, 24_000_000):
            refused, _ = peer.request("tokenize", text="x" * size)  # the rid comes first in the map
            assert refused["code"] == "too_large" and "retry_after_ms" not in refused, refused
            rid = next(peer.rids)  # and the rid after the text: the scan steps over the text
            peer.sock.send_multipart([pack({"v": 1, "op": "tokenize", "text": "x" * size, "rid": rid})])
            refused, _ = peer.recv()
            assert refused["code"] == "too_large" and refused["rid"] == rid, refused
        rid = next(peer.rids)
        deep = b"\x83" + pack("v") + pack(1) + pack("rid") + pack(rid) + pack("op") + b"\x91" * 100 + b"\xc0"
        peer.sock.send_multipart([deep])
        refused, _ = peer.recv()
        assert refused["code"] == "bad_request" and refused["rid"] == rid, refused
        assert peer.request("ping")[0]["op"] == "pong"


def test_max_size_tokenize_runs_off_the_event_loop(tiny_model: Path) -> None:
    limit = 2**20
    words = np.random.default_rng(0).choice(["the", "cat", "sat", "on", "a", "mat"], size=limit // 2)
    text = " ".join(words.tolist())[:limit]
    flags = ("--max-text-bytes", str(limit), "--max-text-tokens", str(2 * limit))  # the tiny vocab: ~1 token a byte
    with node_process(tiny_model, *flags) as (node, ctx):
        tokenizer, pinger = Peer(ctx, node.address), Peer(ctx, node.address)
        too_large, _ = tokenizer.request("tokenize", text=text + "x")
        assert too_large["code"] == "too_large" and str(limit) in too_large["message"]
        rids = [tokenizer.send("tokenize", text=text) for _ in range(4)]
        own_ping = tokenizer.send("ping")  # behind the tokenizes on the same connection
        events: list[str] = []
        poller = zmq.Poller()
        poller.register(tokenizer.sock, zmq.POLLIN)
        poller.register(pinger.sock, zmq.POLLIN)
        pinger.send("ping")
        replies: list[tuple[dict[str, Any], list[bytes]]] = []
        while len(replies) < len(rids) or "own pong" not in events:
            ready = dict(poller.poll(REPLY_TIMEOUT_MS))
            assert ready, "no reply"
            if tokenizer.sock in ready:
                header, frames = tokenizer.recv()
                if header["rid"] == own_ping:
                    events.append("own pong")
                else:
                    replies.append((header, frames))
                    events.append("tokens")
            if pinger.sock in ready:
                assert pinger.recv()[0]["op"] == "pong"
                events.append("pong")
                pinger.send("ping")
        for header, frames in replies:
            assert header["op"] == "tokens", header["message"]
            assert header["n"] == len(frames[0]) // 4 > limit // 4
        # The ping that arrived after the tokenizes was answered before any of them: their work
        # did not hold up the pump. The other peer's pings were answered while it went on.
        assert events.index("own pong") < events.index("tokens"), events
        assert "pong" in events[events.index("tokens") :], events
        ids = np.frombuffer(replies[0][1][0], "<i4")
        text_reply, _ = tokenizer.request("detokenize", ids[: 2**12].tobytes())
        assert text_reply["op"] == "text" and text_reply["text"]
        over, _ = tokenizer.request("detokenize", np.resize(ids, 2 * limit + 1).tobytes())
        assert over["code"] == "too_large"


def test_garbage_from_the_next_stage_is_downstream_not_a_stopped_node(tiny_shards2: list[Path]) -> None:
    with (
        fake_next_stage() as (fake_next, address),
        node_process(tiny_shards2[0], "--next", address, "--recovery-attempts", "0") as (head, node_ctx),
    ):
        client = Peer(node_ctx, head.address)

        def open_answered_with(make: Any) -> dict[str, Any]:
            client.send("open", session="s", max_tokens=16)
            peer, req = forwarded(fake_next, "open")  # after the close of an open left unanswered
            fake_next.send_multipart([peer, *make(req["rid"])])
            return client.recv()[0]

        garbage = [
            lambda rid: [reply("result", rid)],  # the wrong answer
            lambda rid: [reply("opened", rid, stage={"last": "yes"})],
            lambda rid: [reply("opened", rid, stage={**STAGE, "layers": [9]})],
            lambda rid: [reply("opened", rid, stage=STAGE), b"extra"],
            lambda rid: [reply("error", rid, code=[1], message="x")],
            lambda rid: [reply("error", rid, code="busy", retry_after_ms=-5)],
            lambda rid: [b"\x91" * 2000 + b"\xc0"],  # not readable at all: no answer, then downstream
            lambda rid: [reply("opened", [rid], stage=STAGE)],  # cannot be matched: no answer
        ]
        for make in garbage:
            answer = open_answered_with(make)
            assert answer["op"] == "error" and answer["code"] == "downstream", answer
        relayed = open_answered_with(lambda rid: [reply("error", rid, code="busy", message="m" * 5000)])
        assert relayed["code"] == "busy" and len(relayed["message"]) <= 512
        opened = open_answered_with(lambda rid: [reply("opened", rid, stage=STAGE, kv_reserved=16, lease_ms=60_000)])
        assert opened["op"] == "opened" and opened["stage"]["layers"] == [0, 4]

        def step_answered_with(make: Any) -> dict[str, Any]:
            client.send("step", np.array([1, 5], "<i4").tobytes(), session="s", pos=0, n=2, input="tokens", out="token")
            peer, req = forwarded(fake_next)
            while req["op"] != "step":  # a failed step closed the session there: it is opened again
                assert req["op"] in ("close", "open"), req
                if req["op"] == "open":
                    fake_next.send_multipart(
                        [peer, reply("opened", req["rid"], stage=STAGE, kv_reserved=16, lease_ms=60_000)]
                    )
                peer, req = forwarded(fake_next)
            assert req["n"] == 2
            fake_next.send_multipart([peer, *make(req)])
            return client.recv()[0]

        def result(req: dict[str, Any], **changes: Any) -> bytes:
            keys = {"session": req["session"], "pos": 0, "n": 2, "out": "token", **changes}
            return reply("result", req["rid"], **keys)

        token = np.array([7], "<i4").tobytes()
        for make in [
            lambda req: [result(req), token + token],  # wrong payload size
            lambda req: [result(req), np.array([10**6], "<i4").tobytes()],  # not a token id
            lambda req: [result(req, pos=1), token],
            lambda req: [result(req, out="logits"), token],
            lambda req: [result(req)],
        ]:
            answer = step_answered_with(make)
            assert answer["code"] == "downstream", answer
        done = step_answered_with(lambda req: [result(req), token])  # rolled back: resend works
        assert done["op"] == "result" and done["pos"] == 0
        stats, _ = client.request("stats")
        downstream = stats["stats"]["downstream"]
        assert downstream["malformed_total"] == 11 and downstream["replies_dropped_total"] >= 2


def test_a_peer_that_never_reads_is_cut_off_and_served_again_once_it_drains(tiny_model: Path) -> None:
    """It asks for far more replies than the bounds hold (tokenize answers are the tiny model's
    largest) and reads none: the node holds at most its bounds for it, frees its session, serves
    the others meanwhile, and serves it again once it has drained its socket and asks again."""
    bounds = ("--send-hwm", "2", "--max-peer-reply-bytes", "256K", "--max-reply-bytes", "1M")
    text = " ".join(["the cat sat on a mat"] * 800)  # 16 KB: a reply of about 64 KB of token ids
    asked = 100
    with node_process(tiny_model, *bounds) as (node, ctx):
        reader, hog = Peer(ctx, node.address), Peer(ctx, node.address, RCVHWM=2, RCVBUF=4096)
        assert hog.request("open", session="s", max_tokens=16)[0]["op"] == "opened"
        for _ in range(asked):
            hog.send("tokenize", text=text)
        samples = []
        deadline = time.monotonic() + 60  # a bound on the loop, not a speed assertion
        while time.monotonic() < deadline:
            stats = reader.request("stats")[0]["stats"]
            samples.append(stats)
            if stats["peers_cut_off_total"] and not stats["handlers_active"]:
                break
            time.sleep(0.05)
        assert stats["peers_cut_off_total"] >= 1 and stats["peers_gone_total"] >= 1, stats
        assert stats["sessions_active"] == 0, "the hog's session was freed"
        assert stats["max_peer_reply_bytes"] == 2**18 and stats["max_reply_bytes"] == 2**20
        assert stats["send_hwm"] == 2
        for sample in samples:
            assert sample["peer_reply_bytes"] <= 2**18 and sample["reply_bytes"] <= 2**20
        asked_bytes = asked * 4 * reader.request("tokenize", text=text)[0]["n"]
        assert stats["reply_bytes_peak"] <= 2**20 < asked_bytes // 4, "the node held a fraction of what was asked"
        assert stats["reply_bytes"] == 0, "nothing waits for the hog any more"
        opened, _ = reader.request("open", session="r", max_tokens=16)
        assert opened["op"] == "opened"
        result, frames = reader.request(
            "step", np.array([1, 5], "<i4").tobytes(), session="r", pos=0, n=2, input="tokens", out="logits"
        )
        assert result["op"] == "result" and len(frames[0]) == 4 * opened["stage"]["n_vocab"]
        drained = 0
        while hog.sock.poll(500):
            header = msgpack.unpackb(hog.sock.recv_multipart()[0])
            assert header["op"] == "tokens"
            drained += 1
        assert 0 < drained < asked, "it read what was in flight to it; the rest was dropped"
        opened, _ = hog.request("open", session="s", max_tokens=16)  # served again
        assert opened["op"] == "opened"
        result, frames = hog.request(
            "step", np.array([1, 5], "<i4").tobytes(), session="s", pos=0, n=2, input="tokens", out="logits"
        )
        assert result["op"] == "result" and len(frames[0]) == 4 * opened["stage"]["n_vocab"]


def test_a_flood_of_big_payloads_is_busy_beyond_the_byte_bounds_and_nothing_accepted_is_lost(
    tiny_shards2: list[Path],
) -> None:
    """A head whose next stage holds every step until told to answer: what the steps hold
    (tokens in, hidden states sent on) stays within a connection's bound and the node's; the
    rest is `busy` at once, a close is still served, and every step taken is answered."""
    n, n_embd = 32, 64
    step_bytes = n * 4 + n * n_embd * 4  # the tokens, and the f32 hidden states sent on
    bounds = ("--max-peer-request-bytes", str(2 * step_bytes + 100), "--max-request-bytes", str(3 * step_bytes + 100))
    tokens = np.arange(1, n + 1, dtype="<i4").tobytes()
    with fake_next_stage() as (fake_next, address):
        flags = ("--next", address, "--max-sessions", "8", "--downstream-timeout", "60", *bounds)
        with node_process(tiny_shards2[0], *flags) as (head, node_ctx):
            flood, other = Peer(node_ctx, head.address), Peer(node_ctx, head.address)

            def open_session(peer: Peer, session: str) -> None:
                peer.send("open", session=session, max_tokens=64)
                link, req = forwarded(fake_next, "open")
                fake_next.send_multipart([link, reply("opened", req["rid"], stage=STAGE, kv_reserved=64)])
                assert peer.recv()[0]["op"] == "opened"

            def step(peer: Peer, session: str) -> int:
                return peer.send("step", tokens, session=session, pos=0, n=n, input="tokens", out="token")

            def answer(link: bytes, req: dict[str, Any]) -> None:
                keys = {"session": req["session"], "pos": 0, "n": n, "out": "token"}
                fake_next.send_multipart([link, reply("result", req["rid"], **keys), np.array([7], "<i4").tobytes()])

            for i in range(6):
                open_session(flood, f"f{i}")
            for i in range(2):
                open_session(other, f"o{i}")
            sessions = {step(flood, f"f{i}"): f"f{i}" for i in range(6)}
            held = [forwarded(fake_next, "step") for _ in range(2)]  # the first two are taken and sent on
            busy = [flood.recv()[0] for _ in range(4)]  # the rest are refused at once
            for refusal in busy:
                assert refusal["code"] == "busy" and refusal["retry_after_ms"] > 0, refusal
                assert "connection" in refusal["message"]
            taken = set(sessions) - {refusal["rid"] for refusal in busy}
            assert len(taken) == 2
            # Another connection has room of its own, up to the node's total.
            other_rid = step(other, "o0")
            held.append(forwarded(fake_next, "step"))
            refusal = other.request("step", tokens, session="o1", pos=0, n=n, input="tokens", out="token")[0]
            assert refusal["code"] == "busy" and "node" in refusal["message"], refusal
            stats = other.request("stats")[0]["stats"]
            assert stats["request_bytes"] == 3 * step_bytes and stats["peer_request_bytes"] == 2 * step_bytes
            assert stats["max_peer_request_bytes"] == 2 * step_bytes + 100
            assert stats["max_request_bytes"] == 3 * step_bytes + 100
            assert stats["request_bytes_refused_total"] == 5 and stats["handlers_refused_total"] == 0
            # Cleanup is never refused for lack of room.
            closing = sessions[busy[0]["rid"]]
            closed = flood.request("close", session=closing)[0]
            assert closed["op"] == "closed" and closed["existed"], closed
            # Every step taken is answered.
            for link, req in held:
                answer(link, req)
            results = [flood.recv()[0] for _ in range(2)]
            assert {r["rid"] for r in results} == taken and all(r["op"] == "result" for r in results), results
            mine = other.recv()[0]
            assert mine["rid"] == other_rid and mine["op"] == "result", mine
            # The refused ones go through when sent again.
            for refused in busy[1:]:
                rid = step(flood, sessions[refused["rid"]])
                answer(*forwarded(fake_next, "step"))
                result = flood.recv()[0]
                assert result["rid"] == rid and result["op"] == "result", result
            stats = other.request("stats")[0]["stats"]
            assert stats["request_bytes"] == 0 and stats["peer_request_bytes"] == 0
            assert stats["request_bytes_peak"] == 3 * step_bytes


def generate_by_steps(peer: Peer, session: str, steps: int) -> int:
    """A client-side generation of `steps` tokens after a short prompt, one `step` per token;
    `busy` answers are retried after `retry_after_ms`. Returns how many there were."""
    busy = 0
    pos, feed = 0, [1, 5, 9, 13]
    for _ in range(steps + 1):
        while True:
            answer, frames = peer.request(
                "step",
                np.array(feed, "<i4").tobytes(),
                session=session,
                pos=pos,
                n=len(feed),
                input="tokens",
                out="token",
            )
            if answer["op"] == "result":
                break
            assert answer["code"] == "busy", answer
            busy += 1
            time.sleep(answer["retry_after_ms"] / 1000)
        pos, feed = pos + len(feed), [int(np.frombuffer(frames[0], "<i4")[0])]
    return busy


# Requests per burst: a flooder reads its replies between bursts, so it stays below the
# 256 replies a node holds for a connection before cutting it off as one that never reads.
BURST = 200


@contextmanager
def flooding(peer: Peer, make: Callable[[int], int], burst: int) -> Iterator[Counter[str]]:
    """While inside: a thread sends `burst` requests (`make(i)` sends the i-th) and reads their
    replies, over and over; replies are tallied by op (and by code for errors). On the way out
    it finishes its burst and stops."""
    stop, tally = threading.Event(), Counter[str]()

    def run() -> None:
        sent = 0
        while not stop.is_set():
            for _ in range(burst):
                make(sent)
                sent += 1
            for _ in range(burst):
                header, _ = peer.recv()
                tally[header["op"] if header["op"] != "error" else header["code"]] += 1
                tally["existed"] += header.get("existed") is True

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield tally
    finally:
        stop.set()
        thread.join()


def test_a_flood_of_closes_never_makes_another_peer_busy_and_is_never_busy(tiny_model: Path) -> None:
    with node_process(tiny_model) as (node, ctx):
        attacker, victim = Peer(ctx, node.address), Peer(ctx, node.address)
        for session in ("a0", "a1"):
            assert attacker.request("open", session=session, max_tokens=8)[0]["op"] == "opened"
        assert victim.request("open", session="v", max_tokens=64)[0]["op"] == "opened"
        names = ["a0", "a1", *(f"gone{i}" for i in range(50))]
        with flooding(attacker, lambda i: attacker.send("close", session=names[i % len(names)]), BURST) as tally:
            busy = generate_by_steps(victim, "v", 40)
        assert busy == 0, f"the victim's generation was answered busy {busy} times"
        assert set(tally) == {"closed", "existed"} and tally["closed"] >= BURST, tally
        assert tally["existed"] == 2, "each of the attacker's sessions was closed once, by the first close"
        stats = victim.request("stats")[0]["stats"]
        assert stats["sessions_active"] == 1 and stats["closes_pending"] == 0
        assert stats["handlers_refused_total"] == 0 and "busy" not in stats["errors_total"]


def test_a_flood_of_opens_and_steps_never_makes_another_peer_busy(tiny_model: Path) -> None:
    with node_process(tiny_model) as (node, ctx):
        attacker, victim = Peer(ctx, node.address), Peer(ctx, node.address)
        assert victim.request("open", session="v", max_tokens=64)[0]["op"] == "opened"
        one = np.array([1], "<i4").tobytes()

        def send(i: int) -> int:
            if i % 4 == 0:
                return attacker.send("open", session=f"o{i % 64}", max_tokens=4)
            return attacker.send("step", one, session=f"x{i}", pos=0, n=1, input="tokens", out="token")

        with flooding(attacker, send, BURST) as tally:
            busy = generate_by_steps(victim, "v", 40)
        assert busy == 0, f"the victim's generation was answered busy {busy} times"
        assert tally["unknown_session"] > 0 and tally["opened"] == 3, tally  # the node holds 4 sessions
        stats = victim.request("stats")[0]["stats"]
        assert stats["max_queued_per_peer"] == 128 and stats["inbox_size"] == 256
        assert stats["peer_quota_refused_total"]["queued"] + stats["handlers_refused_total"] == tally["busy"]


def test_per_connection_quotas_answer_as_documented(tiny_model: Path) -> None:
    flags = ("--max-sessions-per-peer", "2", "--max-waiting-per-peer", "1")
    with node_process(tiny_model, *flags) as (node, ctx):  # the node holds 4 sessions
        a, b, c, d = (Peer(ctx, node.address) for _ in range(4))
        for peer, names in ((a, ("a1", "a2")), (b, ("b1", "b2"))):
            for name in names:
                assert peer.request("open", session=name, max_tokens=8)[0]["op"] == "opened"
        third, _ = a.request("open", session="a3", max_tokens=8, wait_ms=60_000)
        assert third["code"] == "session_limit" and third["retry_after_ms"] > 0  # at once, despite wait_ms
        assert "quota of 2 sessions" in third["message"]

        def waiting_opens(n: int) -> None:
            for _ in range(3000):
                if a.request("stats")[0]["stats"]["sessions_waiting"] == n:
                    return
                time.sleep(0.01)
            raise AssertionError(f"never {n} waiting opens")

        waiting = c.send("open", session="c1", max_tokens=8, wait_ms=60_000)  # the node is full: it waits
        waiting_opens(1)
        second, _ = c.request("open", session="c2", max_tokens=8, wait_ms=60_000)
        assert second["code"] == "session_limit" and "quota of 1 waiting opens" in second["message"]
        d_waiting = d.send("open", session="d1", max_tokens=8, wait_ms=60_000)  # another connection still waits
        waiting_opens(2)
        assert a.request("close", session="a1")[0]["existed"] is True
        admitted, _ = c.recv()
        assert admitted["rid"] == waiting and admitted["op"] == "opened"
        assert a.request("close", session="a2")[0]["existed"] is True
        admitted, _ = d.recv()
        assert admitted["rid"] == d_waiting and admitted["op"] == "opened"
        stats = a.request("stats")[0]["stats"]
        assert (stats["max_sessions_per_peer"], stats["max_waiting_per_peer"], stats["max_queued_per_peer"]) == (
            2,
            1,
            128,
        )
        assert stats["peer_quota_refused_total"] == {"sessions": 1, "waiting": 1, "queued": 0}
        assert stats["admissions_rejected_total"]["session_limit"] == 2


def test_the_default_quotas_let_a_chain_head_use_its_whole_next_stage(tiny_shards2: list[Path]) -> None:
    """A head forwards every session over one connection: the next stage's defaults must not cap it."""
    with (
        node_process(tiny_shards2[1]) as (tail, ctx),
        node_process(tiny_shards2[0], "--next", tail.address) as (head, _),
    ):
        clients = [Peer(ctx, head.address) for _ in range(4)]  # the nodes hold 4 sessions each
        for client in clients:
            assert client.request("open", session="s", max_tokens=16)[0]["op"] == "opened"
        prompt = np.array([1, 5, 9], "<i4").tobytes()
        for client in clients:  # all at once: the head forwards them together
            client.send("step", prompt, session="s", pos=0, n=3, input="tokens", out="token")
        assert [client.recv()[0]["op"] for client in clients] == ["result"] * 4
        stats = Peer(ctx, tail.address).request("stats")[0]["stats"]
        assert stats["sessions_active"] == 4 and stats["max_sessions_per_peer"] == 4
        assert stats["peer_quota_refused_total"] == {"sessions": 0, "waiting": 0, "queued": 0}
