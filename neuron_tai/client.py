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
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import trio
import zmq

from neuron_tai.security import client_curve
from neuron_tai.text_stream import TextStream
from protocol.errors import ErrorCode, Fault
from protocol.sampling import Sampling
from transport import wire
from transport.address import check_address
from transport.keepalive import LeaseKeeper
from transport.requester import ClientClosed, OutboxFull, Requester
from transport.trio_zmq import TrioSocket

__all__ = [
    "Client",
    "ClientClosed",
    "Done",
    "Fault",
    "Generated",
    "NoNodeAnswered",
    "NodeError",
    "StepReply",
    "open_client",
]

NodeError = Fault  # an `error` reply; the name stays for the callers that catch it
CONNECT_CHECK_S = 3.0  # how long `open_client` waits for a node to answer its first ping


class NoNodeAnswered(TimeoutError):
    """Nothing answered a `ping` at the address: no node runs there (or it refused our key)."""


def no_node(address: str, within_s: float, curve: bool) -> NoNodeAnswered:
    hint = " (is it running? with CURVE: does it admit this client's key?)" if curve else " (is it running?)"
    return NoNodeAnswered(f"no node answered at {address} within {within_s:g} s{hint}")


@dataclass(frozen=True, slots=True)
class StepReply:
    result: wire.Result | None  # None where no node answered (an engine driven in process)
    token: int | None = None
    logits: npt.NDArray[np.float32] | None = None
    hidden: npt.NDArray[np.float32] | None = None
    tokens: list[int] | None = None  # `out: "tokens"`: one per row


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
    passes: int | None = None  # passes through the chain, when the node says (speculative generate)


def as_sampling(sampling: Sampling | Mapping[str, Any] | None) -> Sampling:
    """The session's sampling settings; a map's unset (None) keys keep their defaults."""
    if sampling is None or isinstance(sampling, Sampling):
        return sampling or Sampling()
    try:
        return Sampling(**{k: v for k, v in sampling.items() if v is not None})
    except (TypeError, ValueError) as exc:
        raise Fault(ErrorCode.BAD_REQUEST, f"sampling: {exc}") from None


R = TypeVar("R", bound=wire.Reply)


def _expect(reply: wire.Reply, kind: type[R]) -> R:
    """`reply` when it is the answer expected; Fault for an `error` or any other answer."""
    if isinstance(reply, wire.ErrorReply):
        raise reply.fault()
    if not isinstance(reply, kind):
        raise Fault(ErrorCode.DOWNSTREAM, f"the node answered {wire.REPLY_OPS[type(reply)]!r} unexpectedly")
    return reply


class Client:
    """Requests to one node. With `check_s`, the first request waits at most that long for the
    node to answer a `ping` and raises `NoNodeAnswered` when none does (and the next request
    checks again), so nobody waits out a request's timeouts and retries at an empty address."""

    def __init__(
        self,
        sock: TrioSocket,
        timeout_s: float,
        retries: int,
        address: str = "the node",
        *,
        check_s: float | None = None,
        curve: bool = False,
    ) -> None:
        self.core = Requester(sock)
        self.keeper = LeaseKeeper(self.core)  # pings while sessions are open, so the node keeps them
        self.timeout_s = timeout_s
        self.retries = retries
        self.address = address
        self.check_s = check_s
        self.curve = curve
        self.answered = check_s is None  # whether the node has answered this client yet

    async def _check_answers(self) -> None:
        """Until the node has answered once: a `ping` within `check_s`, or NoNodeAnswered."""
        if self.answered or self.check_s is None:
            return
        try:
            await self.core.request(wire.Ping(0), self.check_s)  # an `error` reply too: a node is there
        except TimeoutError:
            raise no_node(self.address, self.check_s, self.curve) from None
        self.answered = True

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the socket and keep the sessions' lease; when this stops, the waiting requests fail."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.core.run)
            nursery.start_soon(self.keeper.run)
            task_status.started()

    async def call(self, request: wire.Request, *, retry: bool = True) -> wire.Reply:
        """Send one request (its `rid` is the client's business) and wait for its typed reply,
        `error` replies included; TimeoutError saying how long it waited in all."""
        await self._check_answers()
        attempts = 1 + (self.retries if retry else 0)
        for _attempt in range(attempts):
            try:
                header, payload = await self.core.request(request, self.timeout_s)
            except TimeoutError:
                continue
            except OutboxFull as exc:
                raise Fault(ErrorCode.BUSY, str(exc)) from None
            return wire.reply_from(header, payload)
        raise TimeoutError(
            f"no reply to {wire.op_of(request)!r} from {self.address} in {attempts * self.timeout_s:g} s"
            f" ({attempts} attempt{'s' if attempts > 1 else ''} of {self.timeout_s:g} s)"
        )

    async def ping(self, *, retry: bool = True) -> float:
        start = trio.current_time()
        _expect(await self.call(wire.Ping(0), retry=retry), wire.Pong)
        return trio.current_time() - start

    async def stats(self, *, retry: bool = True) -> dict[str, Any]:
        return _expect(await self.call(wire.Stats(0), retry=retry), wire.StatsReply).stats

    async def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        reply = _expect(await self.call(wire.Tokenize(0, text, add_special)), wire.Tokens)
        return [int(t) for t in reply.tokens]

    async def detokenize(self, tokens: list[int]) -> str:
        return _expect(await self.call(wire.Detokenize(0, np.array(tokens, np.int32))), wire.Text).text

    async def open(
        self, session: str, max_tokens: int, *, sampling: Sampling | Mapping[str, Any] | None = None, wait_ms: int = 0
    ) -> wire.Opened:
        """Open `session` for `max_tokens` positions; the node's typed `opened`."""
        request = wire.Open(0, session, max_tokens, as_sampling(sampling), wait_ms)
        opened = _expect(await self.call(request, retry=False), wire.Opened)
        self.keeper.opened(session, opened.lease_ms)
        return opened

    async def close(self, session: str) -> bool:
        self.keeper.closed(session)  # if the close is lost, the node's lease frees the session
        return _expect(await self.call(wire.Close(0, session)), wire.Closed).existed

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
        if tokens is not None:
            ids = np.asarray(tokens, np.int32)
            request = wire.Step(0, session, pos, len(ids), "tokens", out, out_dtype, tokens=ids)
        else:
            assert hidden is not None
            rows = np.asarray(hidden, np.float32)
            request = wire.Step(0, session, pos, len(rows), "hidden", out, out_dtype, hidden=rows)
        result = _expect(await self.call(request), wire.Result)
        if result.out == "token":
            return StepReply(result, token=result.token)
        if result.out == "logits":
            return StepReply(result, logits=result.data)
        if result.out == "tokens":
            return StepReply(result, tokens=[int(t) for t in result.data])
        return StepReply(result, hidden=result.data if result.out == "hidden" else None)

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
        speculate: int | None = None,
    ) -> AsyncGenerator[Generated | Done, None]:
        """Server-side generation in an open session: `Generated` pieces as they come (when
        streaming), then one `Done`. An `error` reply raises Fault. Not retried: each reply
        must come within `timeout_s` of the one before."""
        ids = np.asarray(tokens, np.int32)
        request = wire.Generate(
            0, session, pos, len(ids), ids, max_new, frozenset(int(t) for t in stop), ignore_eog, stream, speculate
        )
        await self._check_answers()
        replies = self.core.stream(request, self.timeout_s, final_ops=("done",), most=max_new + 1)
        try:
            async with aclosing(replies):
                async for header, payload in replies:
                    reply = wire.reply_from(header, payload)
                    if isinstance(reply, wire.Generated):
                        yield Generated(reply.pos, [int(t) for t in reply.tokens])
                    else:
                        done = _expect(reply, wire.Done)
                        got = [] if done.tokens is None else [int(t) for t in done.tokens]
                        yield Done(done.reason, done.generated, done.length, got, done.passes)
        except OutboxFull as exc:
            raise Fault(ErrorCode.BUSY, str(exc)) from None

    async def cancel(self, session: str) -> int:
        """End the session's running `generate` (if any); the session's length afterwards."""
        return _expect(await self.call(wire.Cancel(0, session)), wire.Cancelled).length

    async def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        *,
        sampling: Sampling | Mapping[str, Any] | None = None,
        wait_ms: int = 0,
        server_side: bool = True,
    ) -> AsyncIterator[str]:
        """Stream the text of a completion as it is produced; the session is closed at the end.
        End-of-generation tokens end it and are not part of the text. Each reply's tokens are
        detokenized with a short window of the ones before (`TextStream`), not the whole answer."""
        ids = await self.tokenize(prompt)
        session = uuid.uuid4().hex
        opened = await self.open(session, len(ids) + max_new_tokens, sampling=sampling, wait_ms=wait_ms)
        eog = set(opened.stage.eog_tokens)
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
    check_s: float | None = CONNECT_CHECK_S,
) -> AsyncIterator[Client]:
    """A client of the node at `address` (`tcp://HOST:PORT` or `ipc://PATH`; AddressError, a
    ValueError, otherwise).

    Unless `check_s` is None, the first request finds out whether a node answers at all: a
    `ping` within `check_s` (or `timeout_s` if shorter), else `NoNodeAnswered` (a TimeoutError)
    at once instead of the request waiting out its timeouts. For a node that requires CURVE give
    both `server_key` (the node's public key file) and `key` (this client's .key_secret file).
    A node that does not admit the key never answers: ZeroMQ drops the connection in its handshake.
    """
    check_address(address)
    curve = client_curve(key, server_key)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            curve.apply(sock)
        sock.connect(address)
        within = None if check_s is None else min(check_s, timeout_s)
        client = Client(TrioSocket(sock), timeout_s, retries, address, check_s=within, curve=curve is not None)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()
    finally:
        sock.close(linger=0)
