"""A TCP proxy that adds one-way latency: the bench's stand-in for a link between machines.

    python -m bench.delay_proxy --listen 10.77.0.2:20100 --to 10.77.0.2:20000 --delay-ms 5

Every chunk read from one side is written to the other `--delay-ms` after it arrived, in
order, in both directions independently: a reader stamps each chunk with its due time and
queues it, a writer sleeps until the head of its queue is due. A slow or delayed direction
never holds up the other, and back-to-back chunks are not delayed one after another (a
sleep per chunk in the reader would add the delay once per chunk in flight). The queue is
bounded: when it is full the reader stops reading and TCP's own flow control pushes back.
Prints `ready HOST:PORT` once it accepts connections.
"""

from __future__ import annotations

import argparse
import signal
import sys

import trio

CHUNK_BYTES = 65536
QUEUE_CHUNKS = 256  # per direction and connection: at most 16 MiB in flight


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def _forward(src: trio.SocketStream, dst: trio.SocketStream, delay_s: float) -> None:
    """Copy `src` to `dst`, each chunk `delay_s` after it was read; half-close `dst` at `src`'s end."""
    send, receive = trio.open_memory_channel[tuple[float, bytes]](QUEUE_CHUNKS)

    async def read() -> None:
        async with send:
            while data := await src.receive_some(CHUNK_BYTES):
                await send.send((trio.current_time() + delay_s, data))

    async def write() -> None:
        async with receive:
            async for due, data in receive:
                await trio.sleep_until(due)
                await dst.send_all(data)
        await dst.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(write)


async def _relay(client: trio.SocketStream, target: tuple[str, int], delay_s: float) -> None:
    """One connection: both directions until both ends have finished; a reset on either side ends both."""
    async with client:
        try:
            upstream = await trio.open_tcp_stream(*target)
        except OSError:
            return  # the target is not up (yet): the client sees its connection close and retries
        async with upstream:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_forward, client, upstream, delay_s)
                    nursery.start_soon(_forward, upstream, client, delay_s)
            except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass


async def serve(listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await _relay(stream, target, delay_s)

    # Stopped by the bench with SIGTERM (or Ctrl-C): every relay ends at its next checkpoint and
    # the proxy exits 0. The receiver is in place before `ready`, so no signal finds it without one.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        listeners = await trio.open_tcp_listeners(listen[1], host=listen[0])
        print(f"ready {listen[0]}:{listen[1]} -> {target[0]}:{target[1]} delay {delay_s * 1e3:g} ms", flush=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, handler, listeners)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_endpoint, required=True, metavar="HOST:PORT")
    parser.add_argument("--to", type=_endpoint, required=True, metavar="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    if args.delay_ms < 0:
        parser.error("--delay-ms must be 0 or more")
    trio.run(serve, args.listen, args.to, args.delay_ms / 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
