"""The Trio adapter over pyzmq and the socket pump: no lost messages, many peers, gone and slow peers."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import trio
import zmq

from transport.pump import SocketPump
from transport.trio_zmq import TrioSocket

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.term()


def router(ctx: Ctx, address: str, **options: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.bind(address)
    return sock


def dealer(ctx: Ctx, address: str, identity: bytes | None = None, **options: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


async def test_cancelled_receives_lose_no_message(ctx: Ctx) -> None:
    server = TrioSocket(router(ctx, "inproc://cancel"))
    client = TrioSocket(dealer(ctx, "inproc://cancel"))
    n = 300
    got: list[int] = []
    rng = np.random.default_rng(7)

    async def send_all() -> None:
        for i in range(n):
            await client.send([i.to_bytes(4, "little")])
            if i % 7 == 0:
                await trio.sleep(0.0005)

    cancelled = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all)
        while len(got) < n:
            with trio.move_on_after(float(rng.choice([0.0, 0.0001, 0.001]))) as scope:
                frames = await server.recv()
                got.append(int.from_bytes(frames[1], "little"))
            cancelled += scope.cancelled_caught
    assert got == list(range(n)), "every message once, in order"
    assert cancelled > 10, "receives really were cancelled while messages were arriving"
    server.close()
    client.close()


async def test_many_dealers_each_get_their_own_replies(ctx: Ctx) -> None:
    sock = TrioSocket(router(ctx, "inproc://many"))

    def echo(frames: list[bytes]) -> None:
        pump.send_nowait(frames)

    pump = SocketPump(sock, echo, routed=True)
    clients = [TrioSocket(dealer(ctx, "inproc://many")) for _ in range(20)]
    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)

        async def talk(k: int, c: TrioSocket) -> None:
            for i in range(50):
                await c.send([f"{k}:{i}".encode()])
            replies = [(await c.recv())[0].decode() for _ in range(50)]
            assert replies == [f"{k}:{i}" for i in range(50)]

        async with trio.open_nursery() as talkers:
            for k, c in enumerate(clients):
                talkers.start_soon(talk, k, c)
        nursery.cancel_scope.cancel()
    for c in clients:
        c.close()
    sock.close()


async def test_router_mandatory_reports_a_gone_peer_and_keeps_serving(ctx: Ctx) -> None:
    gone: list[bytes] = []
    sock = TrioSocket(router(ctx, "inproc://gone"))

    def echo(frames: list[bytes]) -> None:
        pump.send_nowait(frames)

    pump = SocketPump(sock, echo, routed=True, on_peer_gone=gone.append)
    alive = TrioSocket(dealer(ctx, "inproc://gone"))
    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)
        assert pump.send_nowait([b"nobody", b"hello"])
        await trio.sleep(0.05)
        assert gone == [b"nobody"]
        assert not pump.send_nowait([b"nobody", b"again"]), "a gone peer's replies are refused at once"
        await alive.send([b"ping"])
        assert (await alive.recv()) == [b"ping"]
        nursery.cancel_scope.cancel()
    alive.close()
    sock.close()


async def test_a_slow_peer_is_parked_without_holding_up_others(ctx: Ctx) -> None:
    gone: list[bytes] = []
    sock = TrioSocket(router(ctx, "inproc://slow", SNDHWM=4))
    pump = SocketPump(sock, lambda frames: None, routed=True, max_parked=20, on_peer_gone=gone.append)
    slow = dealer(ctx, "inproc://slow", b"slow", RCVHWM=4)  # never reads
    fast = TrioSocket(dealer(ctx, "inproc://slow", b"fast"))
    await fast.send([b"hi"])  # let the router learn both identities
    slow.send_multipart([b"hi"])
    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)
        await trio.sleep(0.05)
        for i in range(10):
            pump.send_nowait([b"slow", b"x" * 10, str(i).encode()])
        await trio.sleep(0.05)
        assert pump.queued > 0 and not gone, "the full pipe's messages wait, parked"
        pump.send_nowait([b"fast", b"answer"])
        with trio.fail_after(2):
            assert (await fast.recv()) == [b"answer"], "another peer is served meanwhile"
        for i in range(30):
            pump.send_nowait([b"slow", b"y", str(i).encode()])
        await trio.sleep(0.05)
        assert gone == [b"slow"], "past max_parked the slow peer counts as gone"
        nursery.cancel_scope.cancel()
    slow.close()
    fast.close()
    sock.close()


async def test_a_handler_that_raises_costs_one_message_not_the_pump(ctx: Ctx) -> None:
    sock = TrioSocket(router(ctx, "inproc://faulty"))

    def echo_or_fail(frames: list[bytes]) -> None:
        if frames[1] == b"boom":
            raise RecursionError("a handler bug")
        pump.send_nowait(frames)

    pump = SocketPump(sock, echo_or_fail, routed=True)
    client = TrioSocket(dealer(ctx, "inproc://faulty"))
    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)
        for body in (b"boom", b"one", b"boom", b"two"):
            await client.send([body])
        assert [(await client.recv())[0] for _ in range(2)] == [b"one", b"two"]
        assert pump.failed == 2
        nursery.cancel_scope.cancel()
    client.close()
    sock.close()
