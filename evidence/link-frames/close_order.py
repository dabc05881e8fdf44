"""Rounds of a chain head's link (`NextStage`) in one ZeroMQ context, plain and with CURVE:
connect, take a reply frame over the limit (dropped, dialled again), take one at the limit,
close. A round fails when its link does not connect within 6 s.

    python evidence/link-frames/close_order.py ROUNDS               # the link as it is
    python evidence/link-frames/close_order.py ROUNDS reader-first  # its event reader closed first

The second form replaces `_stop_monitor` with what the link did before: close the monitor's
reader, then the socket.
"""

import sys
import tempfile
from pathlib import Path

import msgpack
import trio
import zmq
import zmq.auth

from bench.processes import free_ports
from neuron_tai import downstream
from neuron_tai.security import ClientCurve, make_curve_server
from transport import wire


async def answer_one(router: zmq.Socket[bytes], payload: bytes) -> None:
    while True:
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await trio.sleep(0.01)
            continue
        rid = msgpack.unpackb(frames[1])["rid"]
        router.send_multipart([frames[0], msgpack.packb({"v": 1, "op": "pong", "rid": rid}), payload])
        return


async def one_round(keys: Path, encrypted: bool) -> bool:
    ctx = zmq.Context.instance()
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    router = ctx.socket(zmq.ROUTER)
    curve = None
    if encrypted:
        public, secret = zmq.auth.create_certificates(keys, "server")
        _, client = zmq.auth.create_certificates(keys, "client")
        make_curve_server(router, Path(secret))
        curve = ClientCurve(Path(client), Path(public))
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    link = downstream.NextStage(ctx, address, 30, 100, 64, 268, max_rows=512, curve=curve)
    connected = True
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            for size in (link.max_frame_bytes + 1, 512 * 64 * 4):
                with trio.move_on_after(6) as waited:
                    await link.wait_connected()
                    nursery.start_soon(answer_one, router, bytes(size))
                    await link.call(wire.Ping(0))
                if waited.cancelled_caught:
                    connected = False
                    break
            nursery.cancel_scope.cancel()
    finally:
        router.close()
        link.close()
    return connected


def reader_first(sock: zmq.Socket[bytes], monitor: object) -> None:
    monitor.close()  # type: ignore[attr-defined]


def main() -> None:
    rounds = int(sys.argv[1])
    if sys.argv[2:] == ["reader-first"]:
        downstream._stop_monitor = reader_first
    failed = {False: 0, True: 0}
    for _ in range(rounds):
        for encrypted in (False, True):
            with tempfile.TemporaryDirectory() as keys:
                failed[encrypted] += not trio.run(one_round, Path(keys), encrypted)
    print(f"{rounds} rounds each: plain links that did not connect {failed[False]}, CURVE {failed[True]}")


main()
