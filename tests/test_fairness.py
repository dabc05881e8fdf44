"""Fairness between connections on an in-process node whose decodes are held: closes are never
refused, and a connection past its share of the engine's queue is `busy` alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from neuron_tai.client import NodeError, open_client
from neuron_tai.config import NodeConfig
from neuron_tai.node import open_node
from neuron_tai.sessions import MAX_REPEATED_CLOSES
from tests.held import held_decodes, wait_until
from tests.test_generate import IDS, RawPeer, generating, int32
from tests.test_node import engine_config, prompt


async def test_closes_are_answered_while_the_connection_holds_its_cap_of_handlers(tiny_model: Path) -> None:
    cfg = NodeConfig(engine_config(tiny_model), bind="tcp://127.0.0.1:0", max_handlers_per_peer=4)
    async with open_node(cfg) as node, open_client(node.address, timeout_s=30, retries=0) as c:
        for i in range(4):
            await c.open(f"s{i}", 200)
        steps: list[str] = []
        closes: list[bool] = []

        async def step(i: int) -> None:
            try:
                await c.step(f"s{i}", 0, tokens=prompt(i, 20))
                steps.append("result")
            except NodeError as exc:
                steps.append(exc.code)

        async def close(name: str) -> None:
            closes.append(await c.close(name))

        with held_decodes(node.engine) as (entered, release):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(step, 0)
                await wait_until(entered.is_set)  # the engine is inside llama_decode, and stays there
                for i in range(1, 4):
                    nursery.start_soon(step, i)
                await wait_until(lambda: node.pool.active == 4)
                with pytest.raises(NodeError) as info:
                    await c.open("s4", 10)  # a fifth task for this connection: refused
                assert info.value.code == "busy"
                assert await c.close("nope") is False  # nothing to close: answered at once, engine held or not
                nursery.start_soon(close, "s3")  # a real close: no task, no queue, answered once it is done
                await wait_until(lambda: node.sessions.closing)
                assert await c.close("s3") is False  # its close is under way: answered at once
                stats = await c.stats()
                assert stats["closes_pending"] == 1 and stats["handlers_refused_total"] == 1
                release.set()
        assert closes == [True]
        assert sorted(steps) == ["result", "result", "result", "unknown_session"]  # s3's step: closed before it ran
        stats = await c.stats()
        assert stats["sessions_active"] == 3 and stats["closes_pending"] == 0 and stats["errors_total"]["busy"] == 1


async def test_a_connection_past_its_queue_share_is_busy_and_another_is_served(tiny_model: Path) -> None:
    cfg = NodeConfig(engine_config(tiny_model, max_queued_per_peer=2), bind="tcp://127.0.0.1:0")
    async with open_node(cfg) as node, open_client(node.address, timeout_s=30, retries=0) as victim:
        await victim.open("v1", 64)
        await victim.open("v2", 64)
        attacker = RawPeer(node.address)
        results: list[int | None] = []

        async def step(name: str) -> None:
            results.append((await victim.step(name, 0, tokens=IDS)).token)

        try:
            with held_decodes(node.engine) as (entered, release):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(step, "v1")
                    await wait_until(entered.is_set)  # nothing leaves the engine's queue meanwhile
                    for rid in range(1, 6):
                        attacker.send(
                            {
                                "op": "step",
                                "rid": rid,
                                "session": f"x{rid}",
                                "pos": 0,
                                "n": 1,
                                "input": "tokens",
                                "out": "token",
                            },
                            int32([1]),
                        )
                    refused = [await attacker.recv() for _ in range(3)]  # at once, while the engine is held
                    nursery.start_soon(step, "v2")  # the victim's second step is queued, not refused
                    await wait_until(lambda: node.pool.active == 4)  # v1's, v2's and the two queued ones
                    release.set()
                    late = [await attacker.recv() for _ in range(2)]
        finally:
            attacker.close()
        assert all(
            h["code"] == "busy" and "quota of 2 requests" in h["message"] and h["retry_after_ms"] for h, _ in refused
        )
        assert [h["code"] for h, _ in late] == ["unknown_session"] * 2
        assert len(results) == 2 and all(t is not None for t in results)
        stats = await victim.stats()
        assert stats["peer_quota_refused_total"]["queued"] == 3 and stats["max_queued_per_peer"] == 2


@pytest.mark.parametrize("flood", ["close", "step"])
async def test_a_flood_during_a_long_decode_leaves_another_connection_its_room(tiny_model: Path, flood: str) -> None:
    """While the engine is inside a decode (a real model's take tens of ms) nothing leaves its
    queue: one peer's flood of closes takes no place in it, and one of steps at most its share."""
    async with (
        open_node(NodeConfig(engine_config(tiny_model), bind="tcp://127.0.0.1:0")) as node,
        open_client(node.address, timeout_s=30, retries=0) as victim,
    ):
        await victim.open("v1", 64)
        await victim.open("v2", 64)
        # The flooder reads only after its whole flood: let the pump hold all 600 replies for it
        # (by default it cuts off a connection 256 behind), so this measures the inbox alone.
        node.pump.max_parked = 1000
        attacker = RawPeer(node.address)
        results: list[int | None] = []

        async def step(name: str) -> None:
            results.append((await victim.step(name, 0, tokens=IDS)).token)

        try:
            attacker.send({"op": "open", "rid": 1, "session": "mine", "max_tokens": 8})
            assert (await attacker.recv())[0]["op"] == "opened"
            inbox = node.engine._inbox.receiver.statistics
            with held_decodes(node.engine) as (entered, release):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(step, "v1")
                    await wait_until(entered.is_set)
                    for rid in range(2, 602):
                        if flood == "close":
                            attacker.send({"op": "close", "rid": rid, "session": "mine" if rid % 7 else f"g{rid}"})
                        else:
                            attacker.send(
                                {
                                    "op": "step",
                                    "rid": rid,
                                    "session": f"x{rid}",
                                    "pos": 0,
                                    "n": 1,
                                    "input": "tokens",
                                    "out": "token",
                                },
                                int32([1]),
                            )
                    attacker.send({"op": "ping", "rid": 602})
                    replies = [(await attacker.recv())[0]]
                    while replies[-1]["op"] != "pong":  # the node has read the whole flood
                        replies.append((await attacker.recv())[0])
                    # Every request of the flood has been answered or waits in the engine's queue.
                    await wait_until(lambda: node.pool.active == 1 + inbox().current_buffer_used)
                    nursery.start_soon(step, "v2")  # queued: room is left for it (refused, it would raise)
                    waiting = node.pool.active + 1
                    await wait_until(lambda: node.pool.active == waiting == 1 + inbox().current_buffer_used)
                    release.set()
                while len(replies) < 601:
                    replies.append((await attacker.recv())[0])
        finally:
            attacker.close()
        assert len(results) == 2 and all(t is not None for t in results), "the other connection was refused"
        stats = await victim.stats()
        if flood == "close":
            assert {r["op"] for r in replies} == {"closed", "pong"}, "a close was refused"
            assert sum(r.get("existed") is True for r in replies) == 1
            assert stats["closes_pending"] == 0 and stats["handlers_refused_total"] == 0
        else:
            busy = [r for r in replies if r["op"] == "error" and r["code"] == "busy"]
            assert len([r for r in replies if r.get("code") == "unknown_session"]) == 128  # its share of 256
            assert len(busy) == 600 - 128 and stats["peer_quota_refused_total"]["queued"] >= 1
            assert all(r["retry_after_ms"] for r in busy)


async def test_closes_of_a_generating_session_wait_for_its_done_up_to_a_bound(tiny_model: Path) -> None:
    """Every close during a `generate` is answered after the run's `done` (the contract's order),
    the repeats `existed: false`; past MAX_REPEATED_CLOSES of one session, at once: a flood of
    closes queues nothing."""
    last = 3 + MAX_REPEATED_CLOSES
    async with open_node(NodeConfig(engine_config(tiny_model), bind="tcp://127.0.0.1:0")) as node:
        async with generating(node, stream=False) as (peer, release):
            for rid in range(3, last + 1):
                peer.send({"op": "close", "rid": rid, "session": "s"})
            past, _ = await peer.recv()  # while the run still holds the session
            assert past == {"v": 1, "op": "closed", "rid": last, "session": "s", "existed": False}
            release.set()
            replies = [(await peer.recv())[0] for _ in range(1 + MAX_REPEATED_CLOSES)]
        assert [(r["op"], r["rid"]) for r in replies] == [("done", 2), *(("closed", rid) for rid in range(3, last))]
        assert [r["existed"] for r in replies[1:]] == [True] + [False] * (MAX_REPEATED_CLOSES - 1)
        assert node.stats()["sessions_active"] == 0 and not node.sessions.closing
