"""The bench's one session driver: open, prefill, decode, close, the way an upstream client does.

It drives anything with the node client's session calls (`SessionClient`): a node over
ZeroMQ (`neuron_tai.client.Client`) or the engine in process (`bench.engine_sweep`). A node
client generates on the node (server-side `generate`, as `neuron-tai generate` does)
unless the run feeds forced tokens or reads logits, which take one step per token.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt
import trio

from bench.latency import Trace
from bench.workload import Request
from neuron_tai.client import Done, Generated, NodeError, StepReply


class SessionClient(Protocol):
    async def open(self, session: str, max_tokens: int, *, wait_ms: int = 0) -> object: ...

    async def step(self, session: str, pos: int, *, tokens: list[int], out: str) -> StepReply: ...

    async def close_on_exit(self, session: str) -> None: ...


@runtime_checkable
class GeneratingClient(SessionClient, Protocol):
    """A client of a node that runs the token loop itself (server-side `generate`)."""

    def generate_tokens(
        self, session: str, pos: int, tokens: list[int], max_new: int, *, ignore_eog: bool = ...
    ) -> AsyncGenerator[Generated | Done, None]: ...


R = TypeVar("R")
WAIT_MS = 120_000  # opens beyond the node's session limit wait for room rather than fail


class OpenRefused(Exception):
    """The node refused to open the session (an admission rejection, not a failure)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


LogitsSink = Callable[[int, int, npt.NDArray[np.float32]], None]


async def generate(
    client: SessionClient,
    req: Request,
    session: str,
    *,
    forced: Sequence[int] | None = None,
    on_logits: LogitsSink | None = None,
    busy: list[int] | None = None,
) -> Trace:
    """One request in its own session: `max_new` tokens, end-of-text ignored.

    With `forced`, the decode steps feed those tokens instead of the generated ones
    (teacher forcing), so two runs see identical inputs; `on_logits(rid, step, logits)`
    then receives every step's logits. A `busy` answer to a step is retried after the
    node's `retry_after_ms`, as a well-behaved client does; each one is appended to `busy`.
    """
    trace = Trace(req.rid)
    out = "logits" if on_logits is not None else "token"
    try:
        await client.open(session, req.max_tokens, wait_ms=WAIT_MS)
    except NodeError as exc:
        raise OpenRefused(str(exc.code), str(exc)) from exc
    if isinstance(client, GeneratingClient) and forced is None and on_logits is None:
        try:  # the node runs the token loop: no round trip per token; resent only if refused before a token
            await _retry_busy(lambda: _generate_on_node(client, req, session, trace), busy, lambda: not trace.tokens)
        finally:
            await client.close_on_exit(session)
        return trace
    try:
        reply = await _step(client, session, 0, list(req.prompt), out, busy)
        pos = len(req.prompt)
        for i in range(req.max_new):
            if reply.logits is not None:
                assert on_logits is not None
                on_logits(req.rid, i, reply.logits)
                trace.add(int(np.argmax(reply.logits)))
            else:
                assert reply.token is not None
                trace.add(reply.token)
            if i + 1 == req.max_new:
                break
            feed = forced[i] if forced is not None else trace.tokens[-1]
            reply = await _step(client, session, pos, [feed], out, busy)
            pos += 1
    finally:
        await client.close_on_exit(session)
    return trace


async def _generate_on_node(client: GeneratingClient, req: Request, session: str, trace: Trace) -> None:
    """Server-side `generate`, streamed: every token's arrival is recorded as it comes."""
    pieces = client.generate_tokens(session, 0, list(req.prompt), req.max_new, ignore_eog=True)
    async with aclosing(pieces):
        async for piece in pieces:
            if isinstance(piece, Generated) or not trace.tokens:
                for token in piece.tokens:
                    trace.add(token)


async def _step(
    client: SessionClient, session: str, pos: int, tokens: list[int], out: str, busy: list[int] | None
) -> StepReply:
    return await _retry_busy(lambda: client.step(session, pos, tokens=tokens, out=out), busy)


async def _retry_busy(
    attempt: Callable[[], Awaitable[R]], busy: list[int] | None, resendable: Callable[[], bool] = lambda: True
) -> R:
    """`attempt()`, made again after the node's `retry_after_ms` while it answers `busy` (each one
    appended to `busy`; without that list, or once `resendable()` is false, `busy` is raised)."""
    while True:
        try:
            return await attempt()
        except NodeError as exc:
            if exc.code != "busy" or busy is None or not resendable():
                raise
            busy.append(exc.retry_after_ms or 0)
            await trio.sleep(max(exc.retry_after_ms or 0, 1) / 1000)


async def run_closed_loop(
    requests: Sequence[Request], concurrency: int, one: Callable[[Request], Awaitable[R]]
) -> tuple[dict[int, R], float]:
    """The closed loop every suite drives: `concurrency` workers each take the next request as soon as
    their last one is done. Returns each request's result by rid, and the run's wall time."""
    pending = iter(requests)
    results: dict[int, R] = {}

    async def worker() -> None:
        for req in pending:
            results[req.rid] = await one(req)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return results, time.perf_counter() - start


async def closed_loop(
    client: SessionClient,
    requests: Sequence[Request],
    concurrency: int,
    tag: str,
    *,
    forced: Mapping[int, Sequence[int]] | None = None,
    on_logits: LogitsSink | None = None,
) -> tuple[list[Trace], float]:
    """Sessions of `client` in a closed loop; the traces in request order and the run's wall time."""

    async def one(req: Request) -> Trace:
        return await generate(
            client, req, f"{tag}-{req.rid}", forced=forced.get(req.rid) if forced else None, on_logits=on_logits
        )

    traces, wall = await run_closed_loop(requests, concurrency, one)
    return [traces[r.rid] for r in requests], wall


async def each_alone(
    client: SessionClient,
    requests: Sequence[Request],
    tag: str,
    *,
    forced: Mapping[int, Sequence[int]] | None = None,
    on_logits: LogitsSink | None = None,
) -> dict[int, list[int]]:
    """Each request in a session of its own, one after another: the tokens by rid (the solo reference)."""
    out: dict[int, list[int]] = {}
    for req in requests:
        traces, _ = await closed_loop(client, [req], 1, f"{tag}-{req.rid}", forced=forced, on_logits=on_logits)
        out[req.rid] = traces[0].tokens
    return out
