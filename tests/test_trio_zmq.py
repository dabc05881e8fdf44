"""The Trio adapter over pyzmq and the socket pump: no lost messages, many peers, gone and slow
peers, and what the pump holds counted and bounded in bytes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import trio
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.pump import SocketPump, message_bytes
from transport.trio_zmq import TrioSocket

Ctx = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes what a failed test left open, so it fails instead of hanging


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


# -- bytes -------------------------------------------------------------------------------------


def test_the_outbox_is_bounded_in_bytes_and_always_takes_one_message(ctx: Ctx) -> None:
    sock = TrioSocket(dealer(ctx, "inproc://nobody-binds-here"))
    pump = SocketPump(sock, lambda frames: None, max_bytes=1000)  # never run: nothing leaves
    assert pump.send_nowait([b"h", b"x" * 499]) and pump.send_nowait([b"h", b"x" * 499])
    assert pump.queued_bytes == 1000
    assert not pump.send_nowait([b"y"]), "one byte more does not fit"
    assert pump.drop_outbox() == 2 and pump.queued_bytes == 0
    assert pump.send_nowait([b"z" * 5000]), "one message of any size is taken when nothing is queued"
    assert not pump.send_nowait([b"y"])
    assert pump.peak_bytes == 5000
    sock.close()


async def test_a_peer_behind_by_its_bytes_is_cut_off_then_served_once_it_drains(ctx: Ctx) -> None:
    gone: list[bytes] = []
    sock = TrioSocket(router(ctx, "inproc://behind", SNDHWM=2))
    pump = SocketPump(sock, lambda frames: None, routed=True, max_peer_bytes=1000, on_peer_gone=gone.append)
    slow = dealer(ctx, "inproc://behind", b"slow", RCVHWM=2)  # reads only when told to
    fast = TrioSocket(dealer(ctx, "inproc://behind", b"fast"))
    await fast.send([b"hi"])
    slow.send_multipart([b"hi"])
    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)
        await trio.sleep(0.05)
        sent = 0
        while not gone and sent < 1000:
            message = [b"slow", b"x" * 96]  # 100 bytes with the identity
            assert message_bytes(message) == 100
            sent += pump.send_nowait(message)
            await trio.sleep(0.005)  # the pump sends what fits in the pipe and parks the rest
            assert pump.peer_bytes(b"slow") <= 1000
        assert sent > 10, "the pipe took some, then 1000 bytes were parked, then it was cut off"
        assert gone == [b"slow"] and pump.cut_off == 1
        assert pump.peer_bytes(b"slow") == 0 and pump.queued_bytes == 0 and pump.peak_bytes == 1000
        assert not pump.send_nowait([b"slow", b"late"]), "a cut-off peer's replies are refused at once"
        pump.send_nowait([b"fast", b"answer"])
        with trio.fail_after(2):
            assert (await fast.recv()) == [b"answer"], "another peer is served meanwhile"
        drained = 0
        while slow.poll(100):
            assert slow.recv_multipart() == [b"x" * 96]
            drained += 1
        assert 0 < drained < sent, "it reads what its pipe held; what the pump held for it was dropped"
        slow.send_multipart([b"back"])
        with trio.fail_after(2):
            while b"slow" in pump.gone:
                await trio.sleep(0.01)
        assert pump.send_nowait([b"slow", b"again"])
        with trio.fail_after(2):
            while not slow.poll(0):
                await trio.sleep(0.01)
        assert slow.recv_multipart() == [b"again"], "served again"
        nursery.cancel_scope.cancel()
    slow.close()
    fast.close()
    sock.close()


async def test_past_the_total_the_peer_furthest_behind_is_cut_off_first(ctx: Ctx) -> None:
    gone: list[bytes] = []
    sock = TrioSocket(router(ctx, "inproc://total", SNDHWM=2))
    pump = SocketPump(
        sock, lambda frames: None, routed=True, max_bytes=3000, max_peer_bytes=10**6, on_peer_gone=gone.append
    )
    a, b = (dealer(ctx, "inproc://total", name, RCVHWM=2) for name in (b"a", b"b"))  # neither reads
    fast = TrioSocket(dealer(ctx, "inproc://total", b"fast"))
    for peer in (a, b):
        peer.send_multipart([b"hi"])
    await fast.send([b"hi"])

    async def park(peer: bytes, n: int) -> None:
        """Fill the peer's pipe, then have `n` messages of 100 bytes parked for it."""
        while not pump.backlog(peer):
            pump.send_nowait([peer, b"x" * 99])
            await trio.sleep(0.005)
        for _ in range(n - 1):
            pump.send_nowait([peer, b"x" * 99])
        await trio.sleep(0.02)
        assert pump.backlog(peer) == n and pump.peer_bytes(peer) == 100 * n

    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)
        await trio.sleep(0.05)
        await park(b"a", 15)
        await park(b"b", 5)
        assert pump.queued_bytes == 2000 and not gone
        assert pump.send_nowait([b"fast", b"y" * 1500]), "room is made for it"
        assert gone == [b"a"], "the peer furthest behind was cut off, the other one kept"
        assert pump.peer_bytes(b"b") == 500 and pump.cut_off == 1
        with trio.fail_after(2):
            assert (await fast.recv()) == [b"y" * 1500]
        pump.forget(b"b")  # its lease ran out: what waits for it goes
        assert pump.backlog(b"b") == 0 and pump.queued_bytes == 0 and gone == [b"a"]
        nursery.cancel_scope.cancel()
    for s in (a, b):
        s.close()
    fast.close()
    sock.close()


async def test_a_peer_that_catches_up_gets_its_parked_messages_in_order(ctx: Ctx) -> None:
    sock = TrioSocket(router(ctx, "inproc://catch-up", SNDHWM=2))
    pump = SocketPump(sock, lambda frames: None, routed=True)
    late = dealer(ctx, "inproc://catch-up", b"late", RCVHWM=2)
    late.send_multipart([b"hi"])
    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)
        await trio.sleep(0.05)
        sent = 0
        while not pump.backlog(b"late"):
            pump.send_nowait([b"late", str(sent).encode()])
            sent += 1
            await trio.sleep(0.005)
        for _ in range(5):
            pump.send_nowait([b"late", str(sent).encode()])
            sent += 1
        await trio.sleep(0.02)
        parked = [[b"late", str(i).encode()] for i in range(sent - 6, sent)]
        assert pump.backlog(b"late") == 6 and pump.peer_bytes(b"late") == sum(map(message_bytes, parked))
        received: list[int] = []
        with trio.fail_after(5):
            while len(received) < sent:
                if late.poll(0):
                    received.append(int(late.recv_multipart()[0]))
                else:
                    await trio.sleep(0.005)
        assert received == list(range(sent)), "every message once, in order"
        assert pump.backlog(b"late") == 0 and pump.queued_bytes == 0 and pump.peer_bytes(b"late") == 0
        nursery.cancel_scope.cancel()
    late.close()
    sock.close()


async def test_the_record_of_gone_peers_is_bounded(ctx: Ctx) -> None:
    gone: list[bytes] = []
    sock = TrioSocket(router(ctx, "inproc://record"))
    pump = SocketPump(sock, lambda frames: None, routed=True, max_gone=3, on_peer_gone=gone.append)
    nobody = [f"nobody{i}".encode() for i in range(5)]
    async with trio.open_nursery() as nursery:
        await nursery.start(pump.run)
        for peer in nobody:
            assert pump.send_nowait([peer, b"hello"])
        await trio.sleep(0.05)
        assert gone == nobody and list(pump.gone) == nobody[2:], "the oldest are forgotten"
        pump.forget(nobody[3])
        assert list(pump.gone) == [nobody[2], nobody[4]] and pump.queued_bytes == 0
        nursery.cancel_scope.cancel()
    sock.close()


KINDS = ["send"] * 4 + ["turn"] * 3 + ["read"] * 2 + ["forget"]  # forgetting often would leave little to count
OPS = st.lists(
    st.tuples(st.sampled_from(KINDS), st.sampled_from([b"a", b"b"]), st.integers(1, 300)), min_size=30, max_size=100
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_queued_bytes_are_counted_exactly_and_stay_within_the_bounds(ops: list[tuple[str, bytes, int]]) -> None:
    """Any mix of replies, pump turns, reads and forgets: the pump's byte counts are what it
    holds, the total stays within its bound, and so does each peer that is behind."""
    context: Ctx = zmq.Context()
    try:
        sock = TrioSocket(router(context, "inproc://property", SNDHWM=2))
        peers = {name: dealer(context, "inproc://property", name, RCVHWM=2) for name in (b"a", b"b")}
        for reader in peers.values():
            reader.send_multipart([b"hi"])
        for _ in peers:  # the router has heard from both
            assert sock.sock.poll(2000)
            sock.sock.recv_multipart()
        pump = SocketPump(sock, lambda frames: None, routed=True, max_bytes=3000, max_peer_bytes=1500)
        largest = 300 + 1
        for op, name, size in ops:
            if op == "send":
                pump.send_nowait([name, b"x" * size])
            elif op == "turn":
                sock.readable()  # as the pump's wait does: ZeroMQ takes note of what the peers read
                pump.send_pending()
            elif op == "read":
                while peers[name].poll(0):
                    peers[name].recv_multipart()
            else:
                pump.forget(name)
            parked = {peer: list(queue) for peer, queue in pump._parked.items()}
            entries = [*pump._outbox, *(entry for queue in parked.values() for entry in queue)]
            assert pump.queued_bytes == sum(size for _frames, size in entries)
            assert all(size == message_bytes(frames) for frames, size in entries)
            assert pump.queued_bytes == sum(pump.peer_bytes(peer) for peer in peers)
            assert pump.peak_bytes <= max(3000, largest)
            for peer in parked:
                assert pump.peer_bytes(peer) <= max(1500, largest), "a peer that is behind stays within its bound"
            assert not any(frames[0] in pump.gone for frames, _size in entries), "nothing waits for a gone peer"
        sock.close()
        for reader in peers.values():
            reader.close()
    finally:
        context.destroy(linger=0)
