"""An OpenAI-compatible HTTP gateway in front of a node or the head of a chain.

Starlette serves the endpoints, Hypercorn's Trio worker serves Starlette, and one
protocol client connection, owned by the gateway's nursery, carries every request to the
node. Each HTTP request opens its own session (prompt plus `max_tokens` positions), runs
a server-side `generate` and closes the session on the way out, also when the HTTP
client disconnects or anything fails (`cancel`, then `close`, shielded).

Node refusals map to HTTP: `busy`, `session_limit` and `kv_budget` are 429 with
`Retry-After`; bad input is 400; a node that does not answer is 502. Bodies of errors
are OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from neuron_tai.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from neuron_tai.client import Client, ClientClosed, Done, NodeError, open_client
from neuron_tai.metrics import SnapshotCollector
from neuron_tai.openai_api import (
    ApiError,
    GenerationParams,
    Shape,
    Usage,
    bad,
    chat_messages,
    completion_prompt,
    event,
    generation_params,
    parse_json,
)
from neuron_tai.stop_text import StopText
from protocol.errors import ErrorCode

RATE_LIMITED = {ErrorCode.BUSY, ErrorCode.SESSION_LIMIT, ErrorCode.KV_BUDGET}
BAD_INPUT = {ErrorCode.BAD_REQUEST, ErrorCode.POSITION, ErrorCode.TOO_LARGE}
STATS_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What the gateway serves; each field's `metadata` is its `neuron-tai gateway` option (cli_options.py)."""

    node: str = field(
        metadata={
            "help": "the node (or chain head) to serve from",
            "group": "start",
            "kind": "address",
            "metavar": "ADDR",
        }
    )
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP address to listen on", "group": "start"})
    port: int = field(
        default=8080, metadata={"help": "HTTP port (0: any free port)", "group": "start", "min": 0, "max": 65535}
    )
    model_name: str = field(
        default="neuron-tai", metadata={"help": "the model id clients see and send", "group": "start"}
    )
    # The GGUF file, for its chat template.
    model: Path | None = field(
        default=None,
        metadata={
            "help": "the GGUF model (or its first shard): chat prompts use its template",
            "group": "start",
            "metavar": "FILE",
            "shown": "none: plain 'role: content' prompts",
        },
    )
    server_key: Path | None = field(
        default=None, metadata={"help": "the node's public key (CURVE)", "metavar": "FILE", "shown": "no CURVE"}
    )
    key: Path | None = field(
        default=None,
        metadata={"help": "this client's key pair, .key_secret (CURVE)", "metavar": "FILE", "shown": "no CURVE"},
    )
    # The node's replies, each within this of the one before.
    timeout_s: float = field(
        default=60.0, metadata={"help": "seconds to wait for each reply of the node", "flag": "timeout", "min": 0}
    )
    max_requests: int = field(
        default=64, metadata={"help": "generations in flight; more get 429", "group": "limits", "min": 1}
    )
    # How long a request may wait at a full node (its bounded queue) before 429.
    open_wait_ms: int = field(
        default=0,
        metadata={
            "help": "a request may wait this long in a full node's queue before 429",
            "group": "limits",
            "min": 0,
        },
    )


def node_error(exc: NodeError) -> ApiError:
    if exc.code in RATE_LIMITED:
        wait = max(1, math.ceil((exc.retry_after_ms or 1000) / 1000))
        return ApiError(429, f"the node is at capacity ({exc.code}): {exc.message}", type_="rate_limit_error",
                        code=exc.code, retry_after_s=wait)  # fmt: skip
    if exc.code in BAD_INPUT:
        return ApiError(400, f"the node refused the request ({exc.code}): {exc.message}", code=exc.code)
    if exc.code == ErrorCode.SHUTTING_DOWN:
        return ApiError(503, "the node is shutting down", type_="server_error", code=exc.code, retry_after_s=1)
    return ApiError(502, f"the node failed ({exc.code}): {exc.message}", type_="server_error", code=exc.code)


def unreachable(exc: Exception) -> ApiError:
    return ApiError(502, f"the node is unreachable: {exc}", type_="server_error", code="node_unreachable")


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" or "length"
    usage: Usage


@dataclass(slots=True)
class NodeSession:
    """A request's session on the node; `ended` once cancelled and closed (done once, whoever asks first)."""

    id: str
    eog: set[int]
    finished: bool = False  # its generate has ended: nothing to cancel
    ended: bool = False


class EventStream(StreamingResponse):
    """A streaming response that always closes its body and then runs `on_close`, so a generation's
    cleanup runs at once when the HTTP client goes away (even before the body was started), not
    whenever the iterator is collected."""

    def __init__(self, content: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def stream_response(self, send: Send) -> None:
        body = self.body_iterator
        assert isinstance(body, AsyncGenerator)
        try:
            async with aclosing(body):
                await super().stream_response(send)
        finally:
            await self.on_close()


class GatewayMetrics:
    """The gateway's own counters, and the node's `stats` under `neuron_tai_node_`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("neuron_tai_gateway_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)  # fmt: skip
        self.latency = Histogram("neuron_tai_gateway_request_seconds", "time to the full response (or stream end)",
                                 ["endpoint"], registry=self.registry)  # fmt: skip
        self.ttft = Histogram("neuron_tai_gateway_ttft_seconds", "time to the first generated text",
                              registry=self.registry)  # fmt: skip
        self.tokens = Counter("neuron_tai_gateway_completion_tokens", "tokens generated", registry=self.registry)
        self.in_flight = Gauge("neuron_tai_gateway_generations_active", "generations running", registry=self.registry)
        self.node_up = Gauge("neuron_tai_gateway_node_up", "1 when the node answered stats", registry=self.registry)
        self.node = SnapshotCollector(prefix="neuron_tai_node_")
        self.registry.register(self.node)


class Gateway:
    def __init__(self, client: Client, config: GatewayConfig, template: ChatTemplate) -> None:
        self.client = client
        self.config = config
        self.template = template
        self.metrics = GatewayMetrics()
        self.active = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ]
        )

    # -- endpoints -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def models(self, _request: Request) -> Response:
        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "neuron-tai"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, _request: Request) -> Response:
        with trio.move_on_after(STATS_TIMEOUT_S):
            with suppress(NodeError, ClientClosed, TimeoutError):
                await self.client.request({"op": "ping"}, retry=False)
                return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "node": self.config.node}, status_code=503)

    async def prometheus(self, _request: Request) -> Response:
        stats: dict[str, Any] = {}
        with trio.move_on_after(STATS_TIMEOUT_S), suppress(NodeError, ClientClosed, TimeoutError):
            stats = (await self.client.request({"op": "stats"}, retry=False))[0]["stats"]
        self.metrics.node_up.set(1 if stats else 0)
        self.metrics.node.snapshot = stats
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    # -- one generation --------------------------------------------------------------------

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        endpoint = request.url.path
        start = time.perf_counter()
        try:
            response = await self._respond(request, chat, start)
        except ApiError as err:
            response = error_response(err)
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if not isinstance(response, StreamingResponse):
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    async def _respond(self, request: Request, chat: bool, start: float) -> Response:
        body = parse_json(await request.body())
        params = generation_params(body, chat=chat)
        shape = Shape.new(chat, self.config.model_name)
        if self.active >= self.config.max_requests:
            raise ApiError(429, "the gateway has too many requests in flight", type_="rate_limit_error",
                           code="too_many_requests", retry_after_s=1)  # fmt: skip
        self.active += 1
        self.metrics.in_flight.inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1
                self.metrics.in_flight.dec()

        opened: NodeSession | None = None
        try:
            ids = await self._prompt_ids(body, chat)
            opened = await self._open(ids, params)
            pieces = self._generate(opened, ids, params)
            if params.stream:
                endpoint = request.url.path

                async def on_close() -> None:
                    await self._end_session(opened)
                    release()
                    self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

                return EventStream(self._events(pieces, shape, params, start), on_close)
            text: list[str] = []
            async with aclosing(pieces):
                async for piece in pieces:
                    if isinstance(piece, Finish):
                        self.metrics.tokens.inc(piece.usage.completion_tokens)
                        return JSONResponse(shape.full("".join(text), piece.reason, piece.usage))
                    text.append(piece)
            raise ApiError(502, "the generation ended without a result", type_="server_error")
        except NodeError as exc:
            raise node_error(exc) from None
        except (TimeoutError, ClientClosed) as exc:
            raise unreachable(exc) from None
        finally:
            if not params.stream:
                if opened is not None:
                    await self._end_session(opened)
                release()

    async def _events(
        self,
        pieces: AsyncGenerator[str | Finish, None],
        shape: Shape,
        params: GenerationParams,
        start: float,
    ) -> AsyncGenerator[bytes, None]:
        timed = True
        try:
            if shape.chat:
                yield event(shape.chunk("", first=True))
            async with aclosing(pieces):
                async for piece in pieces:
                    if isinstance(piece, Finish):
                        self.metrics.tokens.inc(piece.usage.completion_tokens)
                        yield event(shape.chunk(None, piece.reason))
                        if params.include_usage:
                            yield event(shape.usage_chunk(piece.usage))
                        break
                    if not piece:
                        continue
                    if timed:
                        self.metrics.ttft.observe(time.perf_counter() - start)
                        timed = False
                    yield event(shape.chunk(piece))
        except NodeError as exc:
            yield event(node_error(exc).body())
        except (TimeoutError, ClientClosed) as exc:
            yield event(unreachable(exc).body())
        yield event("[DONE]")

    async def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if not chat:
            prompt = completion_prompt(body)
            return prompt if isinstance(prompt, list) else await self.client.tokenize(prompt)
        try:
            text = self.template.render(chat_messages(body))
        except ChatTemplateError as exc:
            raise bad(str(exc), "messages") from None
        specials = self.template.specials
        if not specials.ids:
            return await self.client.tokenize(text)
        ids: list[int] = []
        for part in specials.split(text):
            ids += [part] if isinstance(part, int) else await self.client.tokenize(part, add_special=False)
        if specials.add_bos and specials.bos_id is not None and ids[:1] != [specials.bos_id]:
            ids.insert(0, specials.bos_id)
        return ids

    async def _open(self, ids: list[int], params: GenerationParams) -> NodeSession:
        if not ids:
            raise bad("the prompt is empty", "prompt")
        session = uuid.uuid4().hex
        opened = await self.client.open(
            session, len(ids) + params.max_tokens, sampling=params.sampling(), wait_ms=self.config.open_wait_ms
        )
        return NodeSession(session, {int(t) for t in opened.get("stage", {}).get("eog_tokens", [])})

    async def _generate(
        self, opened: NodeSession, ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[str | Finish, None]:
        """Text as it becomes safe to show (stop strings held back), then one `Finish`.
        The session is closed on the way out, whatever the way."""
        session, eog = opened.id, opened.eog
        out: list[int] = []  # the answer's tokens: end-of-generation tokens left out of the text
        made = 0  # tokens generated, counted in `usage`
        stop = StopText(params.stop)
        reason = "length"
        try:
            replies = self.client.generate_tokens(session, 0, ids, params.max_tokens, ignore_eog=params.ignore_eos)
            async with aclosing(replies):
                async for reply in replies:
                    if isinstance(reply, Done):
                        opened.finished = True
                        reason = "stop" if reply.reason in ("eog", "stop") else "length"
                        made -= reply.reason == "eog"  # the token that ended the run is not part of the answer
                        break
                    made += len(reply.tokens)
                    new = [t for t in reply.tokens if t not in eog]
                    if not new:
                        continue
                    out += new
                    text = await self.client.detokenize(out)
                    if shown := stop.feed(text.rstrip("\ufffd")):  # a character's rest is still to come
                        yield shown
                    if stop.stopped:
                        reason = "stop"
                        break
            if not stop.stopped:
                if shown := stop.feed(await self.client.detokenize(out) if out else ""):
                    yield shown
                if shown := stop.flush():
                    yield shown
            yield Finish(reason, Usage(len(ids), made))
        finally:
            await self._end_session(opened)

    async def _end_session(self, session: NodeSession) -> None:
        if session.ended:
            return
        session.ended = True
        with trio.CancelScope(shield=True), trio.move_on_after(self.config.timeout_s):
            with suppress(NodeError, ClientClosed, TimeoutError):
                if not session.finished:
                    await self.client.cancel(session.id)
            await self.client.close_on_exit(session.id)


async def serve_gateway(
    config: GatewayConfig,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown` is set (or forever); `task_status.started` gets the bound URLs."""
    template = load_chat_template(config.model)
    async with open_client(
        config.node, timeout_s=config.timeout_s, retries=0, server_key=config.server_key, key=config.key
    ) as client:
        gateway = Gateway(client, config, template)
        hc = hypercorn.config.Config()
        hc.bind = [f"{config.host}:{config.port}"]
        hc.accesslog = None
        hc.errorlog = None
        trigger = shutdown.wait if shutdown is not None else None
        app = gateway.app()

        async def serve_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn.trio.serve(app, hc, shutdown_trigger=trigger, task_status=task_status)  # type: ignore[arg-type]

        async with trio.open_nursery() as nursery:
            task_status.started(await nursery.start(serve_http))
