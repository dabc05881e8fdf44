"""A chain's head and the sessions it keeps below: every session it lets go is closed on the next
stage, and nothing done for one session touches another, also one opened again under its name.

The next stage is answered by hand (`tests/hand_stage.py`), so a test can hold, refuse or never
answer what the head forwards.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import zmq

from neuron_tai import generate_run
from neuron_tai.client import Client, NodeError, open_client
from neuron_tai.config import NodeConfig
from neuron_tai.downstream import NextStage
from neuron_tai.forwarding import forwarded_session
from neuron_tai.node import Node, open_node
from tests.hand_stage import HandStage
from tests.test_generate import RawPeer, int32
from tests.test_node import engine_config


@asynccontextmanager
async def head_over_hand(
    shard: Path, engine: dict[str, Any] | None = None, **node: Any
) -> AsyncIterator[tuple[Node, Client, HandStage]]:
    below = HandStage()
    config = NodeConfig(engine_config(shard, **(engine or {})), bind="tcp://127.0.0.1:0", next=below.address, **node)
    try:
        async with open_node(config) as head, open_client(head.address, timeout_s=30, retries=0) as client:
            yield head, client, below
    finally:
        below.close()


async def opened_below(client: Client, below: HandStage, session: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.open, session, 16)
        below.opened(await below.expect("open"))


async def stepped_below(client: Client, below: HandStage, tokens: list[int]) -> None:
    """Session "s" steps `tokens` from position 0, the stage below answering with a token."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(client.step, "s", 0, tokens=tokens))
        below.token(await below.expect("step"))


async def refused(codes: list[str], request: Callable[[], Awaitable[object]]) -> None:
    """Run `request`, which must fail; its error's code goes into `codes`."""
    with pytest.raises(NodeError) as error:
        await request()
    codes.append(error.value.code)


def test_forwarded_ids_tell_every_connection_and_session_apart() -> None:
    """Routing ids and session ids both take any bytes: no pair may name another pair's session."""
    assert forwarded_session(b"a", "b\0c") != forwarded_session(b"a\0b", "c")
    assert forwarded_session(b"ab", "c") != forwarded_session(b"a", "bc")


async def test_an_open_the_next_stage_answers_too_late_is_closed_there(tiny_shards2: list[Path]) -> None:
    async with head_over_hand(tiny_shards2[0], downstream_timeout_s=1.0) as (_, client, below):
        codes: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refused, codes, functools.partial(client.open, "t", 16))
            late = await below.expect("open")  # and never answered in time
        assert codes == ["downstream"]
        assert (await below.expect("close"))[1]["session"] == late[1]["session"]


async def test_a_step_undone_after_its_session_was_reopened_leaves_the_new_one_alone(
    tiny_shards2: list[Path],
) -> None:
    """A step held below while its session is closed and opened again: when the next stage then
    refuses it, undoing it here must not shorten (or close) the session opened since."""
    async with head_over_hand(tiny_shards2[0], recovery_attempts=0) as (head, client, below):
        await opened_below(client, below, "s")
        await stepped_below(client, below, [1, 5, 6, 7])
        outcome: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refused, outcome, functools.partial(client.step, "s", 4, tokens=[8]))
            held = await below.expect("step")
            async with trio.open_nursery() as closing:
                closing.start_soon(client.close, "s")
                below.closed(await below.expect("close"))
            await opened_below(client, below, "s")
            below.error(held, "position")
        assert outcome == ["position"]
        async with trio.open_nursery() as nursery:  # the session opened since is whole and goes on
            nursery.start_soon(functools.partial(client.step, "s", 0, tokens=[1, 5, 6, 7, 9, 9]))
            below.token(await below.expect("step"))
        peer = next(iter(head.leases.last_heard))
        assert head.engine.open_sessions.length_of(peer, "s") == 6


async def test_the_idle_clock_spares_a_step_on_its_way_below(
    tiny_shards2: list[Path],
) -> None:
    """`--idle-timeout` at a chain's head: a step this stage finished is still in flight while the
    stage below computes it. Its session is not idle then, and is not closed here or below."""
    async with head_over_hand(tiny_shards2[0], {"idle_timeout_s": 0.5}, downstream_timeout_s=30) as (_, client, below):
        await opened_below(client, below, "s")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(client.step, "s", 0, tokens=[1, 5, 6]))
            held = await below.expect("step")
            assert await below.recv(polls=200) is None  # four idle timeouts: no close came below
            below.token(held)
        async with trio.open_nursery() as nursery:  # the session is still open, here and below
            nursery.start_soon(functools.partial(client.step, "s", 3, tokens=[7]))
            below.token(await below.expect("step"))


async def refuse_the_step_then_its_replay(below: HandStage, replay: str) -> None:
    """The route breaks under a step, and the route recovery opens breaks (or refuses) its replay."""
    below.error(await below.expect("step"), "internal")
    while (got := await below.recv()) is not None:
        if got[1]["op"] == "open":
            below.opened(got)
        elif got[1]["op"] == "step":
            assert got[1]["pos"] == 0
            below.error(got, replay)
            return


@pytest.mark.parametrize("replay", ["internal", "shutting_down"])
async def test_a_recovery_that_fails_leaves_the_session_as_before_the_step(
    tiny_shards2: list[Path], replay: str
) -> None:
    async with head_over_hand(tiny_shards2[0], recovery_attempts=1) as (head, client, below):
        await opened_below(client, below, "s")
        await stepped_below(client, below, [1, 5, 6])
        codes: list[str] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(refused, codes, functools.partial(client.step, "s", 3, tokens=[7]))
            await refuse_the_step_then_its_replay(below, replay)
        stats = await client.stats()
        assert codes == ["downstream"]  # a replay refused below is a route no better than a broken one
        assert (stats["recoveries_total"], stats["recoveries_failed_total"]) == (0, 1)
        assert head.engine.open_sessions.length_of(next(iter(head.leases.last_heard)), "s") == 3


async def generating_over(raw: RawPeer, below: HandStage) -> None:
    """Session "s" opened (below too) and running `generate` (rid 2) of a 3-token prompt."""
    raw.send({"op": "open", "rid": 1, "session": "s", "max_tokens": 32})
    below.opened(await below.expect("open"))
    assert (await raw.recv())[0]["op"] == "opened"
    raw.send({"op": "generate", "rid": 2, "session": "s", "pos": 0, "n": 3, "max_new": 9}, int32([1, 5, 6]))


async def test_a_stream_whose_recovery_fails_keeps_what_it_streamed(tiny_shards2: list[Path]) -> None:
    async with head_over_hand(tiny_shards2[0], recovery_attempts=1) as (head, _, below):
        raw = RawPeer(head.address)
        try:
            await generating_over(raw, below)
            for token in (7, 8):
                below.token(await below.expect("step"), token)
            await refuse_the_step_then_its_replay(below, "internal")  # the pass at pos 4, feeding 8
            replies = [await raw.recv() for _ in range(3)]
        finally:
            raw.close()
    streamed = [t for header, frames in replies[:2] for t in np.frombuffer(frames[0], "<i4")]
    last = replies[2][0]
    assert streamed == [7, 8] and [h["op"] for h, _ in replies[:2]] == ["generated", "generated"]
    assert (last["op"], last["code"], last["rid"], last["session"], last["length"]) == (
        "error",
        "downstream",
        2,
        "s",
        4,
    )


async def test_a_head_that_stops_closes_its_sessions_below(tiny_shards2: list[Path]) -> None:
    below = HandStage()
    config = NodeConfig(engine_config(tiny_shards2[0]), bind="tcp://127.0.0.1:0", next=below.address)
    try:
        async with (
            open_node(config) as head,
            open_client(head.address, timeout_s=30, retries=0) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(client.open, "s", 16)
            forwarded = await below.expect("open")
            below.opened(forwarded)
        assert (await below.expect("close"))[1]["session"] == forwarded[1]["session"]
    finally:
        below.close()


async def test_a_next_stage_that_tells_its_lease_only_in_stats_is_kept_alive(tiny_shards2: list[Path]) -> None:
    """PROTOCOL.md puts `lease_ms` in `stats`; `opened` need not say it. The head asks, then pings."""
    async with head_over_hand(tiny_shards2[0]) as (_, client, below):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.open, "s", 16)
            below.opened(await below.expect("open"), lease_ms=None)
        peer, asked = await below.expect("stats")
        below.send(peer, {"op": "stats", "rid": asked["rid"], "stats": {"lease_ms": 400}})
        await below.expect("ping")  # due a quarter lease after the head last sent anything


async def next_open(stages: list[HandStage]) -> tuple[HandStage, tuple[bytes, dict[str, Any]]]:
    """The first `open` any of `stages` receives (pings answered, closes skipped)."""
    for _ in range(1000):
        for stage in stages:
            got = await stage.recv(polls=1)
            if got is not None and got[1]["op"] == "open":
                return stage, got
    raise AssertionError("no open came")


async def test_an_open_a_replica_has_no_room_for_goes_to_another(tiny_shards2: list[Path]) -> None:
    replicas = [HandStage(), HandStage()]
    config = NodeConfig(
        engine_config(tiny_shards2[0]), bind="tcp://127.0.0.1:0", next=",".join(r.address for r in replicas)
    )
    try:
        async with open_node(config) as head, open_client(head.address, timeout_s=30, retries=0) as client:
            for _ in replicas:  # each replica is checked (a session of one position) as it connects
                stage, probe = await next_open(replicas)
                stage.opened(probe)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.open, "s", 16)
                full, (peer, first) = await next_open(replicas)
                full.send(peer, {"op": "error", "rid": first["rid"], "code": "kv_budget", "message": "full",
                                 "retry_after_ms": 100})  # fmt: skip
                other, second = await next_open(replicas)
                assert other is not full and second[1]["session"] == first["session"]
                other.opened(second)
            assert head.next is not None and head.next.placed[first["session"]] == replicas.index(other)
    finally:
        for r in replicas:
            r.close()


async def test_a_close_the_links_outbox_has_no_room_for_goes_out_later(tiny_shards2: list[Path]) -> None:
    below = HandStage()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    link = NextStage(ctx, below.address, 5.0, 1, 64, 268)  # room for one message in its outbox
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            await link.wait_connected()
            link.core.pump.hold(True)  # nothing leaves: the outbox stays full
            link.close_soon("a")
            link.close_soon("b")  # no room for it now
            link.core.pump.hold(False)
            assert [(await below.expect("close"))[1]["session"] for _ in "ab"] == ["a", "b"]
            nursery.cancel_scope.cancel()
    finally:
        link.close()
        below.close()


async def answer_busy(below: HandStage) -> None:
    """Every step from now on is refused `busy` (what a congested stage says)."""
    while (got := await below.recv()) is not None:
        if got[1]["op"] == "step":
            peer, req = got
            below.send(peer, {"op": "error", "rid": req["rid"], "code": "busy", "message": "full",
                              "retry_after_ms": 10})  # fmt: skip


async def test_a_run_a_stage_below_keeps_answering_busy_fails_with_it(
    tiny_shards2: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `generate` waits out `busy` mid-run, but not for ever: past its patience the run ends in
    that `busy`, saying where the session stands."""
    monkeypatch.setattr(generate_run, "BUSY_PATIENCE_S", 0.3)
    async with head_over_hand(tiny_shards2[0]) as (head, _, below):
        raw = RawPeer(head.address)
        try:
            await generating_over(raw, below)
            below.token(await below.expect("step"), 7)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer_busy, below)
                replies = [await raw.recv() for _ in range(2)]
                nursery.cancel_scope.cancel()
        finally:
            raw.close()
    assert replies[0][0]["op"] == "generated"
    last = replies[1][0]
    assert (last["op"], last["code"], last["rid"], last["session"], last["length"]) == ("error", "busy", 2, "s", 3)


async def test_a_cancel_ends_a_run_that_waits_out_busy(tiny_shards2: list[Path]) -> None:
    """A stage below asks for an hour's patience: `cancel` still ends the run before its next
    token, with `done` ("cancelled") and then `cancelled`."""
    async with head_over_hand(tiny_shards2[0]) as (head, _, below):
        raw = RawPeer(head.address)
        try:
            await generating_over(raw, below)
            below.token(await below.expect("step"), 7)
            assert (await raw.recv())[0]["op"] == "generated"
            peer, req = await below.expect("step")
            below.send(peer, {"op": "error", "rid": req["rid"], "code": "busy", "message": "full",
                              "retry_after_ms": 3_600_000})  # fmt: skip
            raw.send({"op": "cancel", "rid": 3, "session": "s"})
            with trio.fail_after(30):  # a guard: the run used to sleep the hour out
                replies = [(await raw.recv())[0] for _ in range(2)]
        finally:
            raw.close()
    assert [(r["op"], r["rid"]) for r in replies] == [("done", 2), ("cancelled", 3)]
    assert (replies[0]["reason"], replies[0]["length"], replies[1]["length"]) == ("cancelled", 3, 3)  # 7 not in KV


async def test_a_step_the_drain_did_not_finish_is_answered_shutting_down(tiny_shards2: list[Path]) -> None:
    """A head stopping while the stage below holds a step: when the drain time is up, the step is
    answered `shutting_down` before the node's socket closes, not left to the client's timeout."""
    below = HandStage()
    config = NodeConfig(
        engine_config(tiny_shards2[0], drain_timeout_s=0.5),
        bind="tcp://127.0.0.1:0",
        next=below.address,
        drain_timeout_s=0.5,
    )
    try:
        async with open_node(config) as head:
            raw = RawPeer(head.address)
            raw.send({"op": "open", "rid": 1, "session": "s", "max_tokens": 16})
            below.opened(await below.expect("open"))
            assert (await raw.recv())[0]["op"] == "opened"
            raw.send({"op": "step", "rid": 2, "session": "s", "pos": 0, "n": 3, "input": "tokens", "out": "token"},
                     int32([1, 5, 6]))  # fmt: skip
            await below.expect("step")  # and never answered
        reply = (await raw.recv())[0]
        raw.close()
    finally:
        below.close()
    assert (reply["op"], reply["code"], reply["rid"]) == ("error", "shutting_down", 2)


async def test_a_next_stage_without_a_lease_is_asked_once(tiny_shards2: list[Path]) -> None:
    """Its `stats` says no `lease_ms`: it frees no session for silence, so it gets no pings,
    and later opens do not ask again."""
    async with head_over_hand(tiny_shards2[0]) as (_, client, below):
        for session in ("s", "t"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.open, session, 16)
                below.opened(await below.expect("open"), lease_ms=None)
            if session == "s":
                peer, asked = await below.expect("stats")
                below.send(peer, {"op": "stats", "rid": asked["rid"], "stats": {}})
        assert await below.recv(polls=50, pings=True) is None
