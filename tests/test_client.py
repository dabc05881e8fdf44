"""The client when its socket task stops: waiting and new requests fail at once, not at their timeout."""

from __future__ import annotations

import pytest
import trio
import trio.testing
import zmq

from neuron_tai.client import Client, ClientClosed
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
