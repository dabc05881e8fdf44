"""A Trio adapter over a pyzmq socket.

`ZMQ_FD` is edge-triggered: it signals that `ZMQ_EVENTS` may have changed, not that
a message is waiting. So every attempt first tries the non-blocking call, and only
on `zmq.Again` re-reads `ZMQ_EVENTS` and waits on the fd. A message is returned by
the same synchronous call that took it off the socket, so a cancellation can never
lose one. One task owns a socket; it alone waits on its fd.
"""

from __future__ import annotations

import trio
import zmq


class TrioSocket:
    """Non-blocking multipart send and receive on one zmq socket, for one owning task."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._fd = int(sock.getsockopt(zmq.FD))  # type: ignore[arg-type]
        self._wake: trio.CancelScope | None = None

    def try_recv(self) -> list[bytes] | None:
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def try_send(self, frames: list[bytes]) -> bool:
        """True when sent; False when the socket would block (high-water mark)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def readable(self) -> bool:
        return bool(int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)  # type: ignore[arg-type]

    def writable(self) -> bool:
        return bool(int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT)  # type: ignore[arg-type]

    async def wait(self, *, for_send: bool = False) -> None:
        """Wait until the socket may have a message (or room to send), or `wake()` is called.

        Returns at once when ZMQ_EVENTS already says so; the fd is only waited on
        after that check, which is what an edge-triggered fd needs.
        """
        if self.readable() or (for_send and self.writable()):
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope() as self._wake:
            await trio.lowlevel.wait_readable(self._fd)
        self._wake = None

    def wake(self) -> None:
        """Make a pending `wait()` return (another task has work for the owner)."""
        if self._wake is not None:
            self._wake.cancel()

    async def recv(self) -> list[bytes]:
        while True:
            frames = self.try_recv()
            if frames is not None:
                return frames
            await self.wait()

    async def send(self, frames: list[bytes]) -> None:
        while not self.try_send(frames):
            await self.wait(for_send=True)

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)
