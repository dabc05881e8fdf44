"""A Trio client for a node (or the head of a chain).

    async with open_client("tcp://127.0.0.1:5555") as client:
        async for piece in client.generate("Once upon a time", max_new_tokens=32):
            print(piece, end="")

`generate` asks the node to run the token loop (`generate` in PROTOCOL.md: one request,
tokens streamed back); `generate(..., server_side=False)` runs it here, one `step` per
token. Requests time out (`timeout_s`); steps and the read-only operations are retried on
timeout, which is safe because a resent step rewinds to its `pos` (PROTOCOL.md).
Once the client's socket task has stopped, every waiting or new request raises
`ClientClosed` at once instead of waiting out its timeout. While the client holds open
sessions it pings whenever it has sent nothing for a quarter of the node's lease
(`lease_ms` in `opened`), so the node keeps them (transport.keepalive).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import trio
import zmq

from neuron_tai.security import client_curve
from neuron_tai.text_stream import TextStream
from protocol.errors import ErrorCode
from transport.keepalive import LeaseKeeper
from transport.requester import ClientClosed, OutboxFull, Requester
from transport.trio_zmq import TrioSocket

__all__ = ["Client", "ClientClosed", "Done", "Generated", "NodeError", "StepReply", "open_client"]


class NodeError(Exception):
    """An `error` reply: `code` is a PROTOCOL.md error code."""

    def __init__(self, code: str, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


@dataclass(frozen=True, slots=True)
class StepReply:
    header: dict[str, Any]
    token: int | None = None
    logits: npt.NDArray[np.float32] | None = None
    hidden: npt.NDArray[np.float32] | None = None


@dataclass(frozen=True, slots=True)
class Generated:
    """Tokens of a running `generate`; the first sits at position `pos`."""

    pos: int
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Done:
    """The end of a `generate`: why, how many tokens, the session's length after it, and (when not
    streamed) the tokens themselves."""

    reason: str
    generated: int
    length: int
    tokens: list[int]


def _ids(frame: bytes) -> list[int]:
    return [int(t) for t in np.frombuffer(frame, "<i4")]


class Client:
    def __init__(self, sock: TrioSocket, timeout_s: float, retries: int) -> None:
        self.core = Requester(sock)
        self.keeper = LeaseKeeper(self.core)  # pings while sessions are open, so the node keeps them
        self.timeout_s = timeout_s
        self.retries = retries

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the socket and keep the sessions' lease; when this stops, the waiting requests fail."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.core.run)
            nursery.start_soon(self.keeper.run)
            task_status.started()

    async def request(
        self, header: dict[str, Any], *payload: bytes, retry: bool = True
    ) -> tuple[dict[str, Any], list[bytes]]:
        """Send one request and wait for its reply; NodeError for an `error` reply."""
        attempts = 1 + (self.retries if retry else 0)
        for _attempt in range(attempts):
            try:
                reply, frames = await self.core.request(header, list(payload), self.timeout_s)
            except TimeoutError:
                continue
            except OutboxFull as exc:
                raise NodeError(ErrorCode.BUSY, str(exc)) from None
            if reply.get("op") == "error":
                raise NodeError(str(reply.get("code")), str(reply.get("message")), reply.get("retry_after_ms"))
            return reply, frames
        raise TimeoutError(f"no reply to {header.get('op')!r} within {self.timeout_s}s ({attempts} attempts)")

    async def ping(self) -> float:
        start = trio.current_time()
        await self.request({"op": "ping"})
        return trio.current_time() - start

    async def stats(self) -> dict[str, Any]:
        return (await self.request({"op": "stats"}))[0]["stats"]  # type: ignore[no-any-return]

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        _, frames = await self.request({"op": "tokenize", "text": text, "add_special": add_special})
        return [int(t) for t in np.frombuffer(frames[0], "<i4")]

    async def detokenize(self, tokens: list[int]) -> str:
        reply, _ = await self.request({"op": "detokenize"}, np.array(tokens, "<i4").tobytes())
        return str(reply["text"])

    async def open(
        self, session: str, max_tokens: int, *, sampling: dict[str, Any] | None = None, wait_ms: int = 0
    ) -> dict[str, Any]:
        header: dict[str, Any] = {"op": "open", "session": session, "max_tokens": max_tokens, "wait_ms": wait_ms}
        if sampling:
            header["sampling"] = sampling
        opened = (await self.request(header, retry=False))[0]
        self.keeper.opened(session, opened.get("lease_ms"))
        return opened

    async def close(self, session: str) -> bool:
        self.keeper.closed(session)  # if the close is lost, the node's lease frees the session
        return bool((await self.request({"op": "close", "session": session}))[0]["existed"])

    async def close_on_exit(self, session: str) -> None:
        """Close `session` on the way out of its user, even one being cancelled.

        Shielded and bounded by `timeout_s`; nothing to do once the client itself is closed
        (the node frees sessions nobody renews once its lease runs out).
        """
        with trio.CancelScope(shield=True), trio.move_on_after(self.timeout_s), suppress(ClientClosed):
            await self.close(session)

    async def step(
        self,
        session: str,
        pos: int,
        *,
        tokens: list[int] | npt.NDArray[np.int32] | None = None,
        hidden: npt.NDArray[np.float32] | None = None,
        out: str = "token",
        out_dtype: str = "f32",
    ) -> StepReply:
        header: dict[str, Any] = {"op": "step", "session": session, "pos": pos, "out": out, "out_dtype": out_dtype}
        if tokens is not None:
            data = np.asarray(tokens, "<i4")
            header.update(input="tokens", n=len(data))
        else:
            assert hidden is not None
            data = np.asarray(hidden, "<f4")
            header.update(input="hidden", n=len(data), dtype="f32")
        reply, frames = await self.request(header, data.tobytes())
        if out == "token":
            return StepReply(reply, token=int(np.frombuffer(frames[0], "<i4")[0]))
        if out == "logits":
            return StepReply(reply, logits=np.frombuffer(frames[0], "<f4").copy())
        dtype = "<f2" if reply.get("dtype") == "f16" else "<f4"
        return StepReply(reply, hidden=np.frombuffer(frames[0], dtype).astype(np.float32).reshape(reply["n"], -1))

    async def generate_tokens(
        self,
        session: str,
        pos: int,
        tokens: list[int] | npt.NDArray[np.int32],
        max_new: int,
        *,
        stop: Iterable[int] = (),
        ignore_eog: bool = False,
        stream: bool = True,
    ) -> AsyncGenerator[Generated | Done, None]:
        """Server-side generation in an open session: `Generated` pieces as they come (when
        streaming), then one `Done`. An `error` reply raises NodeError. Not retried: each reply
        must come within `timeout_s` of the one before."""
        data = np.asarray(tokens, "<i4")
        header = {"op": "generate", "session": session, "pos": pos, "n": len(data), "max_new": max_new,
                  "stop": [int(t) for t in stop], "ignore_eog": ignore_eog, "stream": stream}  # fmt: skip
        replies = self.core.stream(header, [data.tobytes()], self.timeout_s, final_ops=("done",), most=max_new + 1)
        try:
            async with aclosing(replies):
                async for reply, frames in replies:
                    op = reply.get("op")
                    if op == "error":
                        raise NodeError(str(reply.get("code")), str(reply.get("message")), reply.get("retry_after_ms"))
                    if op == "generated":
                        yield Generated(int(reply["pos"]), _ids(frames[0]))
                    elif op == "done":
                        got = _ids(frames[0]) if frames else []
                        yield Done(str(reply["reason"]), int(reply["generated"]), int(reply["length"]), got)
        except OutboxFull as exc:
            raise NodeError(ErrorCode.BUSY, str(exc)) from None

    async def cancel(self, session: str) -> int:
        """End the session's running `generate` (if any); the session's length afterwards."""
        return int((await self.request({"op": "cancel", "session": session}))[0]["length"])

    async def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        *,
        sampling: dict[str, Any] | None = None,
        wait_ms: int = 0,
        server_side: bool = True,
    ) -> AsyncIterator[str]:
        """Stream the text of a completion as it is produced; the session is closed at the end.
        End-of-generation tokens end it and are not part of the text. Each reply's tokens are
        detokenized with a short window of the ones before (`TextStream`), not the whole answer."""
        ids = await self.tokenize(prompt)
        session = uuid.uuid4().hex
        opened = await self.open(session, len(ids) + max_new_tokens, sampling=sampling, wait_ms=wait_ms)
        eog = set(opened.get("stage", {}).get("eog_tokens", []))
        batches = self._server_loop if server_side else self._step_loop
        text = TextStream(self.detokenize)
        try:
            async with aclosing(batches(session, ids, max_new_tokens, eog)) as produced:
                async for tokens in produced:
                    if piece := await text.push(tokens):
                        yield piece
            if piece := text.flush():
                yield piece
        finally:
            await self.close_on_exit(session)

    async def _server_loop(
        self, session: str, ids: list[int], max_new: int, eog: set[int]
    ) -> AsyncGenerator[list[int], None]:
        """The tokens of each `generated` reply, up to the first end-of-generation token."""
        async with aclosing(self.generate_tokens(session, 0, ids, max_new)) as replies:
            async for reply in replies:
                if isinstance(reply, Generated):
                    ended = next((i for i, t in enumerate(reply.tokens) if t in eog), None)
                    yield reply.tokens[:ended]
                    if ended is not None:
                        return

    async def _step_loop(
        self, session: str, ids: list[int], max_new: int, eog: set[int]
    ) -> AsyncGenerator[list[int], None]:
        step = await self.step(session, 0, tokens=ids)
        produced = 0
        while step.token is not None and step.token not in eog:
            yield [step.token]
            produced += 1
            if produced >= max_new:
                return
            step = await self.step(session, len(ids) + produced - 1, tokens=[step.token])


@asynccontextmanager
async def open_client(
    address: str,
    *,
    timeout_s: float = 30.0,
    retries: int = 2,
    server_key: Path | str | None = None,
    key: Path | str | None = None,
) -> AsyncIterator[Client]:
    """A client of the node at `address`.

    For a node that requires CURVE give both `server_key` (the node's public key file) and
    `key` (this client's .key_secret file). A node that does not admit the key never
    answers: ZeroMQ drops the connection in its handshake, so requests time out.
    """
    curve = client_curve(key, server_key)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            curve.apply(sock)
        sock.connect(address)
        client = Client(TrioSocket(sock), timeout_s, retries)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()
    finally:
        sock.close(linger=0)
