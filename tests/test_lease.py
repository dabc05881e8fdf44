"""Leases (PROTOCOL.md, "Leases"): real node processes, a 1 s lease, bounded waits on stats."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import zmq

from bench.processes import free_ports
from neuron_tai.client import Client, NodeError, open_client
from neuron_tai.downstream import NextStage, largest_reply_frame
from neuron_tai.security import ClientCurve, make_curve_server
from tests.nodes import NodeProcess, running
from transport import wire

LEASE = ["--lease", "1"]
SAMPLING = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "seed": 7}


async def wait_for(client: Client, check: Callable[[dict[str, Any]], bool], limit_s: float = 30) -> dict[str, Any]:
    """Poll `stats` until `check` holds (bounded: the test fails after `limit_s`)."""
    with trio.move_on_after(limit_s):
        while not check(stats := await client.stats()):
            await trio.sleep(0.05)
        return stats
    raise AssertionError(f"not reached within {limit_s}s: {stats}")


def chain(shards: list[Path], head_extra: Sequence[str] = ()) -> tuple[NodeProcess, NodeProcess]:
    head_addr, tail_addr = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    tail = NodeProcess(shards[1], tail_addr, LEASE)
    head = NodeProcess(shards[0], head_addr, ["--next", tail_addr, *LEASE, *head_extra])
    return head, tail


def test_a_vanished_client_holds_nothing_anywhere_in_the_chain(tiny_shards2: list[Path]) -> None:
    head, tail = chain(tiny_shards2)

    async def main() -> None:
        async with open_client(head.address) as at_head, open_client(tail.address) as at_tail:
            assert (await at_head.stats())["lease_ms"] == 1000
            sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(head.address)
            for rid, name in enumerate(("a", "b"), 1):
                open_ = {"v": 1, "op": "open", "rid": rid, "session": name, "max_tokens": 32}
                sock.send_multipart([msgpack.packb(open_)])
                assert sock.poll(30_000) and msgpack.unpackb(sock.recv_multipart()[0])["op"] == "opened"
            assert (await at_tail.stats())["sessions_active"] == 2
            sock.close()  # vanish: no close, no reply outstanding
            # The engine frees them first, then the node closes them below: a snapshot may fall between.
            freed = await wait_for(at_head, lambda s: s["sessions_active"] == 0 and s["downstream"]["sessions"] == 0)
            assert freed["leases_expired_total"] == 1 and freed["kv_cells_reserved"] == 0
            there = await wait_for(at_tail, lambda s: s["sessions_active"] == 0)
            assert there["kv_cells_reserved"] == 0

    with running(tail, head):
        trio.run(main)


def test_a_client_that_only_pings_keeps_its_sessions(tiny_shards2: list[Path]) -> None:
    head, tail = chain(tiny_shards2)
    ids = [1, 259, 263, 107, 262, 261, 113]

    async def main() -> None:
        async with open_client(head.address) as c, open_client(tail.address) as at_tail:
            await c.open("s", 32)
            first = await c.step("s", 0, tokens=ids)
            start = c.keeper.pings
            await trio.sleep(4.0)  # four leases with nothing but the client's own pings
            assert c.keeper.pings >= start + 4  # at least every lease/3 (it pings every lease/4)
            second = await c.step("s", len(ids), tokens=[first.token or 0])  # the tail still holds it
            assert second.token is not None
            head_stats, tail_stats = await c.stats(), await at_tail.stats()
            assert head_stats["leases_expired_total"] == 0 and tail_stats["leases_expired_total"] == 0
            assert head_stats["downstream"]["pings_total"] >= 3  # the head's link kept its lease there
            assert tail_stats["sessions_active"] == 1
            await c.close("s")
            idle = c.keeper.pings
            await trio.sleep(1.5)
            assert c.keeper.pings == idle  # no session, no pings
            await wait_for(at_tail, lambda s: s["sessions_active"] == 0)

    with running(tail, head):
        trio.run(main)


def test_a_killed_tail_fails_a_step_at_once_with_downstream(tiny_shards2: list[Path]) -> None:
    head, tail = chain(tiny_shards2, head_extra=["--downstream-timeout", "30"])

    async def main() -> None:
        async with open_client(head.address, timeout_s=60, retries=0) as c:
            await c.open("s", 32)
            first = await c.step("s", 0, tokens=[1, 259, 263])
            tail.kill()
            await wait_for(c, lambda s: not s["downstream"]["connected"])
            started = trio.current_time()
            with pytest.raises(NodeError) as info:
                await c.step("s", 3, tokens=[first.token or 0])
            assert info.value.code == "downstream"
            assert trio.current_time() - started < 10  # a correctness bound: the timeout is 30 s
            stats = await c.stats()
            assert stats["downstream"]["disconnects_total"] == 1 and stats["sessions_active"] == 1
            assert stats["downstream"]["redials_total"] == 0  # ZeroMQ keeps trying on its own here
            assert stats["downstream"]["max_reply_frame_bytes"] == largest_reply_frame(512, 64, 268)

    with running(tail, head):
        trio.run(main)


def test_a_reopened_session_keeps_its_sampling(tiny_shards2: list[Path]) -> None:
    head, tail = chain(tiny_shards2)
    ids = [1, 259, 263, 107]

    async def run(c: Client, session: str, sampling: dict[str, Any] | None, *, restart: bool = False) -> list[int]:
        await c.open(session, 32, sampling=sampling)
        if restart:  # the tail loses every session; the head reopens this one at pos 0
            tail.kill()
            await trio.to_thread.run_sync(tail.start)  # the event loop runs on: the client keeps pinging
            await wait_for(c, lambda s: s["downstream"]["connected"])
        tokens, pos, feed = [], 0, ids
        for _ in range(12):
            token = (await c.step(session, pos, tokens=feed)).token
            assert token is not None
            tokens.append(token)
            pos, feed = pos + len(feed), [token]
        await c.close(session)
        return tokens

    async def main() -> None:
        async with open_client(head.address, timeout_s=20) as c:
            greedy = await run(c, "g", None)
            sampled = await run(c, "a", SAMPLING)
            assert sampled != greedy  # the test can tell sampled from greedy tokens
            assert await run(c, "b", SAMPLING, restart=True) == sampled

    with running(tail, head):
        trio.run(main)


async def _answer_one_ping(router: zmq.Socket[bytes], *payload: bytes) -> tuple[bytes, str]:
    """Answer the next request on `router` with a `pong` (and `payload` frames); the request's
    routing id and op."""
    while True:
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await trio.sleep(0.01)
            continue
        header = msgpack.unpackb(frames[1])
        router.send_multipart([frames[0], msgpack.packb({"v": 1, "op": "pong", "rid": header["rid"]}), *payload])
        return frames[0], header["op"]


async def test_the_link_never_replays_old_work_and_keeps_its_identity() -> None:
    """Nothing listens at first: a request fails at once and is not sent later. Then two next
    stages in turn at the same address see the same routing id."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    link = NextStage(ctx, address, timeout_s=30, hwm=100, n_embd=64, n_vocab=268, connect_wait_s=0.2)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            assert await link.call(wire.Open(0, "old", 8)) is None
            # Queued while down: held back, then dropped, never sent late.
            assert link.core.send_nowait(wire.Open(0, "older", 8))
            # And straight into the socket: ZMQ_IMMEDIATE refuses it instead of keeping it for later.
            assert not link.sock.try_send(wire.encode_request(wire.Open(0, "oldest", 8)))
            seen = []
            for _ in range(2):
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(address)
                try:
                    answered = trio.Event()

                    async def answer(router: zmq.Socket[bytes] = router, done: trio.Event = answered) -> None:
                        seen.append(await _answer_one_ping(router))
                        done.set()

                    nursery.start_soon(answer)
                    with trio.fail_after(20):
                        while not link.connected:
                            await trio.sleep(0.01)
                        reply = await link.call(wire.Ping(0))
                        await answered.wait()
                    assert isinstance(reply, wire.Pong)
                finally:
                    router.close()
                with trio.fail_after(20):
                    while link.connected:
                        await trio.sleep(0.01)
            assert seen == [(link.routing_id, "ping"), (link.routing_id, "ping")]  # never the old open
            nursery.cancel_scope.cancel()
    finally:
        link.close()


@pytest.mark.parametrize("encrypted", [False, True])
async def test_a_reply_frame_larger_than_a_step_needs_is_never_taken_in(encrypted: bool, tmp_path: Path) -> None:
    """A next stage's reply frame over the largest a step of `max_rows` rows needs drops the
    link (the request fails, nothing is read); the link is dialled again, and a reply of the
    largest size a step needs is read, with CURVE too (and refused: a `pong` has no payload).
    Three rounds in one ZeroMQ context, each needing a new link to connect: a link that closed
    its event reader before its socket left the context's I/O thread stopped (in 2 of 6 runs of
    this file's link tests), and later links unconnected."""
    server_key, curve = None, None
    if encrypted:
        server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
        _, client_secret = zmq.auth.create_certificates(tmp_path, "client")
        server_key, curve = Path(server_secret), ClientCurve(Path(client_secret), Path(server_public))
    for _ in range(3):
        await _drop_a_large_frame_and_redial(server_key, curve)


async def _drop_a_large_frame_and_redial(server_secret: Path | None, curve: ClientCurve | None) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    router = ctx.socket(zmq.ROUTER)
    if server_secret is not None:
        make_curve_server(router, server_secret)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # as a node's: the link comes back under its routing id
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    link = NextStage(ctx, address, timeout_s=30, hwm=100, n_embd=64, n_vocab=268, max_rows=512, curve=curve)
    hidden = 512 * 64 * 4  # the f32 hidden states of 512 rows: the largest reply here
    assert link.max_frame_bytes == largest_reply_frame(512, 64, 268) > hidden
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            for size, disconnects, malformed in ((link.max_frame_bytes + 1, 1, 0), (hidden, 1, 1)):
                with trio.fail_after(20):
                    await link.wait_connected()
                    nursery.start_soon(_answer_one_ping, router, bytes(size))
                    assert await link.call(wire.Ping(0)) is None
                assert (link.disconnects, link.malformed) == (disconnects, malformed)
            assert link.redials >= 1  # ZeroMQ does not reconnect a link it dropped for that frame
            assert link.stats()["max_reply_frame_bytes"] == link.max_frame_bytes
            nursery.cancel_scope.cancel()
    finally:
        router.close()
        link.close()
