"""Server-side generation (`generate`, `cancel`) on real nodes with the tiny model, greedy."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
import zmq

from engine.backend import DecodeFailed, DecodeOutcome
from neuron_tai.client import Client, Done, Generated, NodeError, open_client
from neuron_tai.config import NodeConfig
from neuron_tai.node import Node, open_node
from testkit.models import TinySpec, write_tiny_model
from tests.held import held_decodes, wait_until
from tests.test_node import engine_config, node_and_client, prompt

IDS = prompt(1, 8)


async def step_path(client: Client, session: str, ids: list[int], count: int) -> list[int]:
    """`count` greedy tokens the client way: one step per token."""
    r = await client.step(session, 0, tokens=ids)
    out: list[int] = []
    while True:
        assert r.token is not None
        out.append(r.token)
        if len(out) == count:
            return out
        r = await client.step(session, len(ids) + len(out) - 1, tokens=[r.token])


async def generate(client: Client, session: str, pos: int, ids: list[int], max_new: int, **kw: Any) -> Done:
    """Run one generate; the tokens (streamed or not) go into the returned Done's `tokens`."""
    streamed: list[int] = []
    done = None
    async for reply in client.generate_tokens(session, pos, ids, max_new, **kw):
        if isinstance(reply, Generated):
            assert reply.pos == pos + len(ids) + len(streamed), "streamed positions are contiguous"
            streamed += reply.tokens
        else:
            done = reply
    assert done is not None
    if kw.get("stream", True):
        assert done.tokens == []
        return Done(done.reason, done.generated, done.length, streamed)
    return done


def stop_asked(node: Node) -> bool:
    """The node's running generates have all been asked to stop."""
    return bool(node.generations.runs) and all(run.cancel.is_set() for run in node.generations.runs.values())


class RawPeer:
    """A DEALER speaking the wire protocol directly, to see replies in the order they arrive."""

    def __init__(self, address: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, header: dict[str, Any], *payload: bytes) -> None:
        self.sock.send_multipart([msgpack.packb({"v": 1, **header}), *payload])

    async def recv(self) -> tuple[dict[str, Any], list[bytes]]:
        for _ in range(2000):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
                return msgpack.unpackb(frames[0]), frames[1:]
            except zmq.Again:
                await trio.sleep(0.005)
        raise AssertionError("no reply")

    def close(self) -> None:
        self.sock.close()


def int32(ids: list[int]) -> bytes:
    return np.array(ids, "<i4").tobytes()


@asynccontextmanager
async def generating(node: Node, **fields: Any) -> AsyncIterator[tuple[RawPeer, threading.Event]]:
    """A raw peer whose session "s" runs `generate` (rid 2, up to 30 tokens, with `fields`),
    held inside its prompt's llama_decode until the caller sets `release` (set on the way
    out too)."""
    peer = RawPeer(node.address)
    try:
        peer.send({"op": "open", "rid": 1, "session": "s", "max_tokens": 40})
        assert (await peer.recv())[0]["op"] == "opened"
        with held_decodes(node.engine) as (entered, release):
            peer.send(
                {"op": "generate", "rid": 2, "session": "s", "pos": 0, "n": 8, "max_new": 30, **fields}, int32(IDS)
            )
            await wait_until(entered.is_set)
            yield peer, release
    finally:
        peer.close()


# -- the same tokens as the step path ----------------------------------------------------------


async def test_streamed_and_whole_generations_equal_the_step_path(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (_node, c):
        await c.open("s", 40)
        expected = await step_path(c, "s", IDS, 12)
        streamed = await generate(c, "s", 0, IDS, 12, ignore_eog=True)
        whole = await generate(c, "s", 0, IDS, 12, ignore_eog=True, stream=False)
        assert streamed == whole == Done("length", 12, len(IDS) + 11, expected)
        # The last token is not in the KV yet: the session continues with it at `length`.
        assert (await c.step("s", whole.length, tokens=[expected[-1]])).token is not None
        stats = await c.stats()
        assert stats["generated_tokens_total"] == 24 and stats["generations_active"] == 0


async def test_stop_tokens_end_the_run_and_are_returned(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (_node, c):
        await c.open("s", 40)
        expected = await step_path(c, "s", IDS, 12)
        stop = expected[5]
        k = expected.index(stop)
        done = await generate(c, "s", 0, IDS, 12, stop=[stop, 99999])
        assert done == Done("stop", k + 1, len(IDS) + k, expected[: k + 1])


async def test_end_of_generation_token_ends_the_run(tiny_model: Path, model_dir: Path) -> None:
    async with node_and_client(tiny_model) as (_node, c):
        await c.open("s", 40)
        expected = await step_path(c, "s", IDS, 12)
    # The same weights, with a token the model emits declared its end of generation.
    eos = expected[4]
    k = expected.index(eos)
    model = write_tiny_model(model_dir / "tiny-llama-eos.gguf", TinySpec(eos_token=eos))
    async with node_and_client(model) as (_node, c):
        opened = await c.open("s", 40)
        assert eos in opened.stage.eog_tokens
        assert await generate(c, "s", 0, IDS, 12) == Done("eog", k + 1, len(IDS) + k, expected[: k + 1])
        assert await generate(c, "s", 0, IDS, 12, ignore_eog=True, stream=False) == Done(
            "length", 12, len(IDS) + 11, expected
        )
        # The client's text generation stops at it too, on both paths.
        text = "".join([p async for p in c.generate("the cat", 8)])
        assert text == "".join([p async for p in c.generate("the cat", 8, server_side=False)])


async def test_length_by_max_new_and_by_max_tokens(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (_node, c):
        await c.open("s", len(IDS) + 3)
        expected = await step_path(c, "s", IDS, 4)
        # max_tokens = 11: positions 8, 9, 10 take generated tokens 1-3; token 4 has no room.
        assert await generate(c, "s", 0, IDS, 50, ignore_eog=True) == Done("length", 4, len(IDS) + 3, expected)
        assert await generate(c, "s", 0, IDS, 2, ignore_eog=True) == Done("length", 2, len(IDS) + 1, expected[:2])


async def test_continuing_with_step_or_generate_equals_one_longer_run(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (_node, c):
        await c.open("s", 40)
        single = await generate(c, "s", 0, IDS, 10, ignore_eog=True)
        first = await generate(c, "s", 0, IDS, 4, ignore_eog=True)
        second = await generate(c, "s", first.length, [first.tokens[-1]], 6, ignore_eog=True, stream=False)
        assert first.tokens + second.tokens == single.tokens and second.length == single.length
        first = await generate(c, "s", 0, IDS, 4, ignore_eog=True)
        stepped = await c.step("s", first.length, tokens=[first.tokens[-1]])
        assert stepped.token == single.tokens[4]


async def test_an_ended_run_is_not_waited_for(tiny_model: Path) -> None:
    """Once a generate has ended, the engine stops expecting its session's next step (it would
    hold a batch for it), while the session stays open for another run."""
    async with node_and_client(tiny_model) as (node, c):
        await c.open("s", 40)
        await c.open("t", 40)
        await generate(c, "s", 0, IDS, 3, ignore_eog=True)
        await generate(c, "t", 0, IDS, 3, ignore_eog=True)
        await wait_until(lambda: not node.engine.sessions.coming_back)
        assert len(node.engine.scheduler.sessions) == 2
        again = await generate(c, "s", 0, IDS, 3, ignore_eog=True)
        assert again.tokens == (await generate(c, "t", 0, IDS, 3, ignore_eog=True)).tokens


async def test_runs_that_never_stepped_put_no_hint_in_the_shared_inbox(tiny_model: Path) -> None:
    """Any peer can end runs that had no step answered (`generate`, then `cancel`): nothing waits
    for those sessions, so they hint nothing and cannot fill the inbox that every peer's steps
    need while the engine computes."""
    async with node_and_client(tiny_model) as (node, _c), generating(node, ignore_eog=True) as (_peer, release):
        inbox = node.engine._inbox  # the engine is inside llama_decode: nothing takes from it
        for i in range(inbox.size + 1):
            node.engine.steps_ended(b"a peer", f"never stepped {i}")
        assert inbox.receiver.statistics().current_buffer_used == 0
        release.set()


# -- cancel, close, busy -------------------------------------------------------------------------


async def test_cancel_ends_the_run_at_the_next_token(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (node, c):
        await c.open("s", 40)
        expected = await step_path(c, "s", IDS, 12)
        assert await c.cancel("s") == len(IDS) + 11  # not generating: answered at once
        assert await c.cancel("nobody") == 0
        async with generating(node, ignore_eog=True) as (peer, release):  # the prompt step is inside llama_decode
            peer.send({"op": "cancel", "rid": 3, "session": "s"})
            await wait_until(lambda: stop_asked(node))
            release.set()
            replies = [await peer.recv() for _ in range(3)]
        (gen, tokens), (done, _), (cancelled, _) = replies
        assert gen["op"] == "generated" and gen["rid"] == 2 and gen["pos"] == 8 and gen["session"] == "s"
        assert np.frombuffer(tokens[0], "<i4").tolist() == expected[:1]
        assert done == {
            "v": 1,
            "op": "done",
            "rid": 2,
            "session": "s",
            "reason": "cancelled",
            "generated": 1,
            "length": 8,
        }
        assert cancelled == {"v": 1, "op": "cancelled", "rid": 3, "session": "s", "length": 8}


async def test_a_cancel_is_answered_even_when_its_connection_has_no_room_for_another_request(
    tiny_model: Path,
) -> None:
    """A cancel is no task of its own: with the connection's one handler place taken by the
    run itself, four cancels are answered after its `done`; a fifth waiting one is `busy`."""
    cfg = NodeConfig(engine_config(tiny_model), bind="tcp://127.0.0.1:0", max_handlers_per_peer=1)
    async with open_node(cfg) as node, generating(node, stream=False) as (peer, release):
        step = {"op": "step", "rid": 3, "session": "t", "pos": 0, "n": 1, "input": "tokens", "out": "token"}
        peer.send(step, int32([1]))
        refused, _ = await peer.recv()  # the connection's one place is the run's
        assert refused["code"] == "busy" and refused["rid"] == 3
        for rid in range(4, 9):
            peer.send({"op": "cancel", "rid": rid, "session": "s"})
        fifth, _ = await peer.recv()
        assert fifth["op"] == "error" and fifth["code"] == "busy" and fifth["rid"] == 8
        assert "4 cancels" in fifth["message"] and stop_asked(node)
        release.set()
        replies = [(await peer.recv())[0] for _ in range(5)]
    done, *cancelled = replies
    assert done["op"] == "done" and done["reason"] == "cancelled" and done["length"] == 8
    assert cancelled == [{"v": 1, "op": "cancelled", "rid": rid, "session": "s", "length": 8} for rid in range(4, 8)]


async def test_close_during_a_run_answers_done_before_closed(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (node, c):
        async with generating(node, stream=False) as (peer, release):
            peer.send({"op": "close", "rid": 3, "session": "s"})
            await wait_until(lambda: stop_asked(node))
            peer.send({"op": "close", "rid": 4, "session": "s"})  # a repeat waits for the first
            await wait_until(lambda: [3, 4] in node.sessions.closing.values())
            release.set()
            (done, payload), (closed, _), (again, _) = [await peer.recv() for _ in range(3)]
        assert done["op"] == "done" and done["reason"] == "cancelled" and done["generated"] == 1
        assert len(payload) == 1 and len(np.frombuffer(payload[0], "<i4")) == 1
        assert (closed["op"], closed["rid"], closed["existed"]) == ("closed", 3, True)
        assert (again["op"], again["rid"], again["existed"]) == ("closed", 4, False)  # one close closed it
        assert (await c.stats())["sessions_active"] == 0


async def test_a_generating_session_is_busy(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (node, c):
        c.retries = 0
        await c.open("s", 40)
        await c.open("other", 40)
        outcome: list[Done] = []

        async def run() -> None:
            outcome.append(await generate(c, "s", 0, IDS, 30, ignore_eog=True))

        with held_decodes(node.engine) as (entered, release):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await wait_until(entered.is_set)
                for attempt in (c.step("s", 0, tokens=IDS), generate(c, "s", 0, IDS, 3)):
                    with pytest.raises(NodeError) as info:
                        await attempt
                    assert info.value.code == "busy" and info.value.retry_after_ms
                assert (await c.stats())["generations_active"] == 1
                # The cancel is in before the held decode ends, so the run ends at its first token.
                nursery.start_soon(c.cancel, "s")
                await wait_until(lambda: any(run.cancel.is_set() for run in node.generations.runs.values()))
                release.set()
        assert outcome[0].reason == "cancelled" and outcome[0].generated == 1
        # Free again: another run, the same tokens as in a session that was never generating.
        again = await generate(c, "s", 0, IDS, 3, ignore_eog=True)
        assert again.tokens == (await generate(c, "other", 0, IDS, 3, ignore_eog=True)).tokens
        assert again.tokens[:1] == outcome[0].tokens


async def test_a_vanished_reader_ends_the_run_and_frees_the_session(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (node, watcher):
        peer = RawPeer(node.address)
        peer.send({"op": "open", "rid": 1, "session": "gone", "max_tokens": 1000})
        assert (await peer.recv())[0]["op"] == "opened"
        peer.send(
            {"op": "generate", "rid": 2, "session": "gone", "pos": 0, "n": 8, "max_new": 900, "ignore_eog": True},
            int32(IDS),
        )
        assert (await peer.recv())[0]["op"] == "generated"
        peer.close()  # vanish mid-run
        await wait_until(lambda: not node.generations.runs and not node.engine.scheduler.sessions)
        stats = await watcher.stats()
        assert stats["sessions_active"] == 0 and stats["peers_gone_total"] >= 1
        assert stats["generated_tokens_total"] < 900


def reporting_backlog(node: Node, backlog: Callable[[int], int]) -> None:
    """A stand-in for the pump's report of a peer's backlog: `backlog(n)` at its n-th report."""
    reports = 0

    def report(_peer: bytes) -> int:
        nonlocal reports
        reports += 1
        return backlog(reports)

    node.pump.backlog = report  # type: ignore[method-assign,assignment]


async def test_tokens_are_held_back_while_the_reader_is_behind(tiny_model: Path) -> None:
    """A stand-in for a full pipe (the pump reports a backlog for the first tokens): those are
    sent together once it clears, none lost, none repeated."""
    async with node_and_client(tiny_model) as (node, c):
        await c.open("s", 40)
        expected = await generate(c, "s", 0, IDS, 12, ignore_eog=True)
        reporting_backlog(node, lambda report: 1 if report <= 5 else 0)
        pieces = [r async for r in c.generate_tokens("s", 0, IDS, 12, ignore_eog=True)]
        messages = [p for p in pieces if isinstance(p, Generated)]
        assert [len(m.tokens) for m in messages] == [6, 1, 1, 1, 1, 1, 1]
        assert [t for m in messages for t in m.tokens] == expected.tokens


async def test_tokens_held_back_go_out_before_the_done_of_a_cancel(tiny_model: Path) -> None:
    """The reader stays behind, so every token is held back; a cancel comes in while three wait
    (a stand-in: set at the pump's third report). All three are sent before `done`."""
    async with node_and_client(tiny_model) as (node, c):
        await c.open("s", 40)
        expected = await generate(c, "s", 0, IDS, 12, ignore_eog=True)

        def behind(report: int) -> int:
            if report == 3:
                for run in node.generations.runs.values():
                    run.cancel.set()
            return 1

        reporting_backlog(node, behind)
        got = await generate(c, "s", 0, IDS, 12, ignore_eog=True)
        assert (got.reason, got.generated, got.tokens) == ("cancelled", 3, expected.tokens[:3])
        assert got.length == len(IDS) + 2


# -- batching ----------------------------------------------------------------------------------


async def test_concurrent_runs_share_decode_batches(tiny_model: Path) -> None:
    async with node_and_client(tiny_model, max_sessions=8) as (_node, c):
        solo: list[list[int]] = []
        for i in range(8):
            await c.open(f"s{i}", 60)
            solo.append((await generate(c, f"s{i}", 0, prompt(i, 8), 40, ignore_eog=True)).tokens)
        before = await c.stats()
        together: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            together[i] = (await generate(c, f"s{i}", 0, prompt(i, 8), 40, ignore_eog=True)).tokens

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(run, i)
        after = await c.stats()
        rows = after["decode_rows_total"] - before["decode_rows_total"]
        batches = after["decode_batches_total"] - before["decode_batches_total"]
        assert rows == 8 * 39  # every generated token after the first is one decode row
        assert rows / batches > 4, (rows, batches)  # one at a time would be 1 row per batch
        assert [together[i] for i in range(8)] == solo


# -- chains and errors -------------------------------------------------------------------------


@asynccontextmanager
async def chain(shards: list[Path], **engine: Any) -> AsyncIterator[tuple[Node, Node]]:
    async with open_node(NodeConfig(engine_config(shards[1], **engine), bind="tcp://127.0.0.1:0")) as tail:
        cfg = NodeConfig(engine_config(shards[0], **engine), bind="tcp://127.0.0.1:0", next=tail.address)
        async with open_node(cfg) as head:
            yield head, tail


async def test_a_two_stage_chain_generates_what_one_node_does(tiny_model: Path, tiny_shards2: list[Path]) -> None:
    async with node_and_client(tiny_model) as (_node, one):
        await one.open("s", 40)
        expected = await generate(one, "s", 0, IDS, 16, ignore_eog=True)
        stopped = await generate(one, "s", 0, IDS, 16, stop=[expected.tokens[6]])
    async with chain(tiny_shards2) as (head, tail), open_client(head.address, timeout_s=10) as c:
        await c.open("s", 40)
        assert await generate(c, "s", 0, IDS, 16, ignore_eog=True) == expected
        assert await generate(c, "s", 0, IDS, 16, ignore_eog=True, stream=False) == expected
        assert await generate(c, "s", 0, IDS, 16, stop=[expected.tokens[6]]) == stopped
        assert (await c.stats())["generated_tokens_total"] == 32 + stopped.generated
        # Only the head runs the loop: the tail saw ordinary steps.
        assert tail.stats()["generated_tokens_total"] == 0


async def test_filler_rows_at_both_stages_change_no_session_s_tokens(
    tiny_model: Path, tiny_shards2: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row blocks of 16 and 4 on every kernel path: 7 sessions generating through a chain whose
    head runs them as micro-batches of 4 and 3 give each 3-row call a filler row, a token at the
    head and a hidden state at the tail, in a sequence of their own. Every session gets the
    tokens of its solo run on one node, and no filler cell is left behind."""
    async with node_and_client(tiny_model) as (_node, one):
        solo = []
        for i in range(7):
            await one.open(f"s{i}", 40)
            solo.append((await generate(one, f"s{i}", 0, prompt(i, 6), 24, ignore_eog=True)).tokens)
            await one.close(f"s{i}")
    monkeypatch.setattr("engine.engine.CALL_ROW_BLOCKS", dict.fromkeys(("plain", "repack", "amx"), (16, 4)))
    together: dict[int, list[int]] = {}
    async with chain(tiny_shards2, max_sessions=8) as (head, tail), open_client(head.address, timeout_s=10) as c:

        async def run(i: int) -> None:
            await c.open(f"s{i}", 40)
            together[i] = (await generate(c, f"s{i}", 0, prompt(i, 6), 24, ignore_eog=True)).tokens
            await c.close(f"s{i}")

        async with trio.open_nursery() as nursery:
            for i in range(7):
                nursery.start_soon(run, i)
        await wait_until(lambda: tail.stats()["sessions_active"] == 0)  # closes reach the tail after
        stats = [head.stats(), tail.stats()]
    assert [together[i] for i in range(7)] == solo
    for s in stats:
        assert s["padding_rows_total"] > 0 and s["kv_cells_used"] == 0, s


async def test_generate_errors(tiny_model: Path, tiny_shards2: list[Path]) -> None:
    async def expect(code: str, c: Client, session: str, pos: int, ids: list[int], max_new: int = 4) -> None:
        with pytest.raises(NodeError) as info:
            await generate(c, session, pos, ids, max_new)
        assert info.value.code == code, info.value

    async with node_and_client(tiny_model) as (node, c):
        await expect("unknown_session", c, "nope", 0, IDS)
        await c.open("s", 20)
        await expect("position", c, "s", 3, IDS)  # pos > L
        await expect("position", c, "s", 0, prompt(2, 21))  # pos + n > max_tokens
        peer = RawPeer(node.address)
        try:
            for bad in ({"max_new": 0}, {"max_new": 2, "stop": [1.5]}, {"max_new": 2, "stream": 1}, {}):
                peer.send({"op": "generate", "rid": 5, "session": "s", "pos": 0, "n": 8, **bad}, int32(IDS))
                reply = (await peer.recv())[0]
                assert (reply["op"], reply["code"], reply["rid"], reply["session"]) == ("error", "bad_request", 5, "s")
        finally:
            peer.close()
        assert (await generate(c, "s", 0, IDS, 2, ignore_eog=True)).generated == 2  # nothing was harmed
    # A stage that cannot sample and has no next stage, and a stage that takes hidden input.
    for shard in tiny_shards2:
        async with node_and_client(shard) as (node, c):
            await c.open("s", 20)
            await expect("wrong_stage", c, "s", 0, IDS)
            peer = RawPeer(node.address)
            try:  # every reply of a generate carries its session, a refusal's too
                peer.send({"op": "generate", "rid": 6, "session": "t", "pos": 0, "n": 8, "max_new": 2}, int32(IDS))
                reply = (await peer.recv())[0]
                assert (reply["code"], reply["rid"], reply["session"]) == ("wrong_stage", 6, "t")
            finally:
                peer.close()


def failing_at(node: Node, pos: int) -> None:
    """The node's next llama_decode that writes position `pos` fails, once."""
    original = node.engine.backend.decode

    def decode(segments: Any) -> Any:
        if any(seg.pos <= pos < seg.pos + seg.n for seg in segments):
            node.engine.backend.decode = original  # type: ignore[method-assign]
            raise DecodeFailed(DecodeOutcome.FATAL, -3)
        return original(segments)

    node.engine.backend.decode = decode  # type: ignore[method-assign]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_run_that_fails_keeps_what_it_delivered_and_says_where_it_stands(
    tiny_model: Path, stream: bool
) -> None:
    """Tokens 1-3 are made; feeding token 3 fails. Streamed, the session keeps tokens 1 and 2 in
    its KV and `length` is token 3's position; not streamed, nothing was delivered: it keeps the
    payload, and `length` is where the payload ends."""
    async with node_and_client(tiny_model) as (node, c):
        await c.open("s", 40)
        expected = await generate(c, "s", 0, IDS, 6, ignore_eog=True)
        failing_at(node, len(IDS) + 2)
        peer = RawPeer(node.address)
        try:
            peer.send({"op": "open", "rid": 1, "session": "s", "max_tokens": 40})
            assert (await peer.recv())[0]["op"] == "opened"
            run = {"op": "generate", "rid": 2, "session": "s", "pos": 0, "n": 8, "max_new": 6, "ignore_eog": True}
            peer.send({**run, "stream": stream}, int32(IDS))
            streamed: list[int] = []
            while (reply := await peer.recv())[0]["op"] == "generated":
                streamed += np.frombuffer(reply[1][0], "<i4").tolist()
            error = reply[0]
            assert (error["op"], error["code"], error["rid"], error["session"]) == ("error", "internal", 2, "s")
            assert streamed == (expected.tokens[:3] if stream else [])
            length = len(IDS) + 2 if stream else len(IDS)
            assert error["length"] == length
            step = {"op": "step", "rid": 3, "session": "s", "n": 1, "input": "tokens", "out": "token"}
            feed, at, following = (expected.tokens[2], length, 3) if stream else (IDS[-1], length - 1, 0)
            peer.send({**step, "pos": length + 1}, int32([feed]))
            assert (await peer.recv())[0]["code"] == "position"  # nothing past `length` is kept
            peer.send({**step, "pos": at}, int32([feed]))
            result, frames = await peer.recv()
            assert result["op"] == "result" and np.frombuffer(frames[0], "<i4").tolist() == [expected.tokens[following]]
        finally:
            peer.close()
