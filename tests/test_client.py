"""The client: when its socket task stops, when no node is there, and against a real node."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing
import zmq

from bench.processes import free_ports
from neuron_tai.client import Client, ClientClosed, Done, NodeError, NoNodeAnswered, open_client
from protocol.errors import ErrorCode, Fault
from tests.nodes import NodeProcess, running
from transport import wire
from transport.address import AddressError
from transport.trio_zmq import TrioSocket


async def test_requests_fail_at_once_when_the_socket_task_stops(autojump_clock: trio.testing.MockClock) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("inproc://nobody-answers")
    # The autojump clock turns a wait for the hour-long timeout into an instant TimeoutError.
    client = Client(TrioSocket(sock), timeout_s=3600, retries=0)
    failures: list[Exception] = []

    async def ping() -> None:
        try:
            await client.ping()
        except ClientClosed as exc:
            failures.append(exc)

    try:
        pump = trio.CancelScope()

        async def run_client(*, task_status: trio.TaskStatus[None]) -> None:
            with pump:
                await client.run(task_status=task_status)

        async with trio.open_nursery() as nursery:
            await nursery.start(run_client)
            nursery.start_soon(ping)
            nursery.start_soon(ping)
            await trio.testing.wait_all_tasks_blocked()
            pump.cancel()
        assert len(failures) == 2 and trio.current_time() < 3600
        with pytest.raises(ClientClosed, match="'ping': the client is closed"):
            await client.ping()
        with trio.CancelScope() as cancelled:  # a cancelled caller still sees its cancellation
            cancelled.cancel()
            await client.ping()
        assert cancelled.cancelled_caught
    finally:
        sock.close()
        ctx.term()


# -- finding out that nobody is there, and saying so ------------------------------------------


@asynccontextmanager
async def pong_only(address: str) -> AsyncIterator[None]:
    """A ROUTER at `address` that answers `ping` and nothing else."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    router = TrioSocket(sock)

    async def serve() -> None:
        while True:
            peer, *frames = await router.recv()
            request = wire.decode_request(frames, n_embd=8)
            if isinstance(request, wire.Ping):
                await router.send([peer, *wire.encode_reply(wire.Pong(request.rid))])

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            yield
            nursery.cancel_scope.cancel()
    finally:
        sock.close()


async def test_no_node_at_the_address_is_said_at_once(autojump_clock: trio.testing.MockClock) -> None:
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    # The autojump clock makes every wait instant: what counts is which wait ended the request.
    async with open_client(address, timeout_s=3600, retries=2) as client:
        with pytest.raises(NoNodeAnswered, match=f"^no node answered at {address} within 3 s"):
            await client.stats()
        assert trio.current_time() < 3600  # not the request's timeout, nor its retries
        with pytest.raises(NoNodeAnswered):  # checked again; a TimeoutError, for callers that catch those
            await client.tokenize("again")
        assert not client.answered


async def test_a_node_that_appears_later_is_found_and_a_request_that_gives_up_says_how_long() -> None:
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    async with open_client(address, timeout_s=2, retries=1) as client:
        with pytest.raises(NoNodeAnswered, match=f"^no node answered at {address} within 2 s"):
            await client.ping()
        async with pong_only(address):  # something answers pings now: requests go out and wait as usual
            assert await client.ping() >= 0 and client.answered
            with pytest.raises(
                TimeoutError, match=rf"^no reply to 'stats' from {address} in 4 s \(2 attempts of 2 s\)"
            ):
                await client.stats()


async def test_an_address_in_the_wrong_form_is_refused_before_zeromq_sees_it() -> None:
    with pytest.raises(AddressError, match=r"did you mean tcp://127\.0\.0\.1:5555\?"):
        async with open_client("127.0.0.1:5555"):
            pass
    with pytest.raises(AddressError, match="port"):
        async with open_client("tcp://127.0.0.1:99999"):
            pass


def test_a_real_node_is_found_and_answers_typed_replies(tiny_model: Path) -> None:
    node = NodeProcess(tiny_model, f"tcp://127.0.0.1:{free_ports(1)[0]}")

    async def talk() -> None:
        async with open_client(node.address, timeout_s=30) as client:
            ids = await client.tokenize("the cat sat")
            opened = await client.open_session("s", len(ids) + 4)
            assert isinstance(opened, wire.Opened) and opened.stage.first and opened.stage.last
            assert opened.kv_reserved >= len(ids) + 4 and opened.lease_ms
            step = await client.step("s", 0, tokens=ids)
            assert step.result is not None and step.result.out == "token" and step.token == step.result.token
            pieces = [p async for p in client.generate_tokens("s", len(ids), [step.token or 0], 3, ignore_eog=True)]
            assert isinstance(pieces[-1], Done) and pieces[-1].length == len(ids) + 3
            assert await client.cancel("s") == len(ids) + 3
            assert await client.close("s") is True and await client.close("s") is False
            with pytest.raises(NodeError) as info:  # NodeError is Fault
                await client.step("s", 0, tokens=ids)
            assert isinstance(info.value, Fault) and info.value.code == ErrorCode.UNKNOWN_SESSION
            assert isinstance(await client.detokenize(ids), str)
            assert (await client.stats())["sessions_active"] == 0

    with running(node):
        trio.run(talk)
