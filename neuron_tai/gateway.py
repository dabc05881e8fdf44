"""An OpenAI-compatible HTTP gateway in front of a node or the head of a chain.

Starlette serves the endpoints, Hypercorn's Trio worker serves Starlette, and one
protocol client connection, owned by the gateway's nursery, carries every request to the
node. Each HTTP request opens its own session (prompt plus `max_tokens` positions), runs
a server-side `generate` and closes the session on the way out, also when the HTTP
client disconnects or anything fails (`cancel`, then `close`, shielded).

Requests name one of the served models (`model_name` or an alias); node refusals map to
HTTP as `gateway_errors` says. `/health` is 200 only when the node answers and, at the
head of a chain, reports its link to the next stage up. Every request gets an access-log
line (`access_log`), every failure a line on `neuron_tai.gateway`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import hypercorn.config
import hypercorn.trio.run
import hypercorn.utils
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Send

from neuron_tai.access_log import ACCESS_LOG, Access, AccessLog, access_of
from neuron_tai.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from neuron_tai.client import Client, ClientClosed, Done, NodeError, open_client
from neuron_tai.gateway_errors import (
    error_response,
    http_error,
    never_fits,
    node_error,
    unreachable,
)
from neuron_tai.gateway_text import GatewayText, NodeText, gateway_text
from neuron_tai.http_request import cancel_when_gone, read_body
from neuron_tai.metrics import SnapshotCollector
from neuron_tai.openai_api import (
    ApiError,
    GenerationParams,
    Shape,
    TextEvents,
    Usage,
    bad,
    chat_messages,
    completion_prompt,
    event,
    generation_params,
    parse_json,
    requested_model,
)
from neuron_tai.stop_text import StopText
from neuron_tai.text_stream import TextStream, answer_piece
from protocol.errors import ErrorCode

STATS_TIMEOUT_S = 2.0
T = TypeVar("T")
log = logging.getLogger("neuron_tai.gateway")


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
    model_aliases: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "more model ids requests may name, separated by commas (answers name --model-name)",
            "group": "start",
            "kind": "names",
            "flag": "model-alias",
            "shown": "none",
        },
    )
    max_body_bytes: int = field(
        default=4 * 2**20,
        metadata={
            "help": "the largest request body; a larger one gets 413",
            "group": "limits",
            "kind": "bytes",
            "min": 1,
        },
    )
    body_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "seconds a request body may take to arrive; a slower one gets 408",
            "group": "limits",
            "flag": "body-timeout",
            "min": 0,
        },
    )
    access_log: bool = field(
        default=True, metadata={"help": "log one line per HTTP request (method, path, status, tokens, time)"}
    )

    def __post_init__(self) -> None:
        if self.open_wait_ms and self.open_wait_ms >= self.timeout_s * 1000:  # admitted after the gateway gave up
            raise ValueError(
                f"--open-wait-ms ({self.open_wait_ms}) must be under --timeout ({self.timeout_s:g} s): an open "
                "still waiting in the node's queue when the gateway stops waiting would be admitted for nobody"
            )

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every id a request may name: the served name first, then the aliases."""
        return (self.model_name, *(a for a in self.model_aliases if a != self.model_name))


class ListenError(ConnectionError):
    """The gateway cannot listen on its HTTP address (in use, or not this host's). A
    ConnectionError, so the command line reports it in one line like an address it cannot reach."""


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" or "length"
    usage: Usage


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    param: str  # the request field it came from ("prompt" or "messages"): what to shorten when it is too long
    stops: tuple[str, ...] = ()  # the next turn's markers of the plain chat form


@dataclass(slots=True)
class NodeSession:
    """A request's session on the node; `ended` once cancelled and closed (done once, whoever asks first)."""

    id: str
    eog: set[int]
    max_step_tokens: int  # the most tokens the node takes in one request
    finished: bool = False  # its generate has ended: nothing to cancel
    ended: bool = False


class EventStream(StreamingResponse):
    """A streaming response that always closes its body and then runs `on_close`, so a generation's
    cleanup runs at once when the HTTP client goes away (even before the body was started), not
    whenever the iterator is collected. A client that takes nothing for `send_timeout_s` (its
    socket full, its reader stopped) is taken as gone: the stream ends and its session with it,
    instead of holding the node's KV and a request slot for as long as the client stays."""

    def __init__(
        self, content: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]], send_timeout_s: float
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send: Send) -> None:
        body = self.body_iterator
        assert isinstance(body, AsyncGenerator)

        async def bounded(message: Message) -> None:
            with trio.fail_after(self.send_timeout_s):
                await send(message)

        try:
            async with aclosing(body):
                await super().stream_response(bounded)
        except trio.TooSlowError:
            log.warning("a stream's client took nothing for %g s: the stream ends", self.send_timeout_s)
        finally:
            await self.on_close()


class GatewayMetrics:
    """The gateway's own counters, and the node's `stats` under `neuron_tai_node_`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "neuron_tai_gateway_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "neuron_tai_gateway_request_seconds",
            "time to the full response (or stream end)",
            ["endpoint"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "neuron_tai_gateway_ttft_seconds", "time to the first generated text", registry=self.registry
        )
        self.tokens = Counter("neuron_tai_gateway_completion_tokens", "tokens generated", registry=self.registry)
        self.in_flight = Gauge("neuron_tai_gateway_generations_active", "generations running", registry=self.registry)
        self.node_up = Gauge("neuron_tai_gateway_node_up", "1 when the node answered stats", registry=self.registry)
        self.node_calls = Counter(
            "neuron_tai_gateway_node_calls", "protocol requests sent to the node, by op", ["op"], registry=self.registry
        )
        self.node = SnapshotCollector(prefix="neuron_tai_node_")
        self.registry.register(self.node)


def link_down(stats: dict[str, Any]) -> bool:
    """Whether a chain's head reports its next stage disconnected (a whole-model node has none)."""
    link = stats.get("downstream")
    return isinstance(link, dict) and not link.get("connected", False)


async def _unless_gone(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """What `work` returns; if the HTTP client leaves first, `work` is cancelled (a generation
    stops, its session is closed) and this is a 499 that nobody reads."""
    outcome: list[T] = []
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_when_gone, request, nursery.cancel_scope)
        try:
            outcome.append(await work())
        except Exception as exc:  # raised as itself below, not as a group out of the nursery
            failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if not outcome:  # cancelled: the client is gone
        raise ApiError(499, "the client went away before the answer", code="client_closed")
    return outcome[0]


class Gateway:
    def __init__(self, client: Client, config: GatewayConfig, template: ChatTemplate) -> None:
        self.client = client
        self.config = config
        self.template = template
        self.metrics = GatewayMetrics()
        self.text: GatewayText = NodeText(client, self.count_call)  # `serve_gateway` may use the vocabulary
        self.active = 0
        self.unhealthy: str | None = None  # why /health last said 503, None while it says 200

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={404: http_error, 405: http_error, Exception: http_error},
        )

    # -- endpoints -------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def models(self, _request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "neuron-tai"} for name in self.model_names]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, _request: Request) -> Response:
        stats = await self._node_stats()
        reason = None
        if stats is None or link_down(stats):
            reason = "the node does not answer" if stats is None else "the node's next stage is not connected"
        if reason != self.unhealthy:  # a line when the state changes, not on every poll
            log.log(logging.WARNING if reason else logging.INFO, "health: %s (%s)", reason or "ok", self.config.node)
            self.unhealthy = reason
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "node": self.config.node, "reason": reason}, status_code=503)

    async def prometheus(self, _request: Request) -> Response:
        stats = await self._node_stats()
        self.metrics.node_up.set(1 if stats else 0)
        self.metrics.node.snapshot = stats or {}
        return Response(generate_latest(self.metrics.registry), media_type="text/plain; version=0.0.4")

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.config.model_names

    def count_call(self, op: str) -> None:
        self.metrics.node_calls.labels(op).inc()

    async def _node_stats(self) -> dict[str, Any] | None:
        """The node's `stats`, or None when it does not answer within STATS_TIMEOUT_S."""
        with trio.move_on_after(STATS_TIMEOUT_S), suppress(NodeError, ClientClosed, TimeoutError):
            self.count_call("stats")
            return await self.client.stats(retry=False)
        return None

    # -- one generation --------------------------------------------------------------------

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        endpoint = request.url.path
        start = time.perf_counter()
        try:
            response = await self._respond(request, chat, start)
        except ApiError as err:
            level = logging.WARNING if err.status >= 500 else logging.INFO
            log.log(level, "%s %s: %d %s", request.method, endpoint, err.status, err.message)
            response = error_response(err)
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if not isinstance(response, StreamingResponse):
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    async def _respond(self, request: Request, chat: bool, start: float) -> Response:
        release = self._admit()  # before the body: only requests with room are read
        opened: NodeSession | None = None
        streaming = False
        try:
            body = parse_json(await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s))
            requested_model(body, self.model_names)
            params = generation_params(body, chat=chat)
            shape = Shape.new(chat, self.config.model_name)
            access = access_of(request)
            access.tokens = 0
            prompt = await self._prompt(body, chat)
            opened = await self._open(prompt, params)
            pieces = self._generate(opened, prompt, params, access)
            if not params.stream:
                return await _unless_gone(request, partial(self._full, pieces, shape))

            # The first piece before the 200: a generate the node refuses is this response's status
            # (429 for `busy`, with Retry-After), not an error event after a 200.
            first = await _unless_gone(request, partial(anext, pieces))

            async def on_close() -> None:
                try:
                    await pieces.aclose()  # when the body never started
                    await self._end_session(opened)
                finally:
                    release()
                self.metrics.latency.labels(request.url.path).observe(time.perf_counter() - start)

            streaming = True
            events = self._events(after(first, pieces), shape, params, start)
            return EventStream(events, on_close, self.config.timeout_s)
        except NodeError as exc:
            raise node_error(exc) from None
        except (TimeoutError, ClientClosed) as exc:
            raise unreachable(exc) from None
        finally:
            if not streaming:  # otherwise the stream's end does this
                if opened is not None:
                    await self._end_session(opened)
                release()

    def _admit(self) -> Callable[[], None]:
        """Count a generation in flight (429 at `max_requests`); the returned call ends it, once."""
        if self.active >= self.config.max_requests:
            raise ApiError(
                429,
                "the gateway has too many requests in flight",
                type_="rate_limit_error",
                code="too_many_requests",
                retry_after_s=1,
            )
        self.active += 1
        self.metrics.in_flight.inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1
                self.metrics.in_flight.dec()

        return release

    async def _full(self, pieces: AsyncGenerator[str | Finish, None], shape: Shape) -> Response:
        text: list[str] = []
        async with aclosing(pieces):
            async for piece in pieces:
                if isinstance(piece, Finish):
                    self.metrics.tokens.inc(piece.usage.completion_tokens)
                    return JSONResponse(shape.full("".join(text), piece.reason, piece.usage))
                text.append(piece)
        raise ApiError(502, "the generation ended without a result", type_="server_error")

    async def _events(
        self,
        pieces: AsyncGenerator[str | Finish, None],
        shape: Shape,
        params: GenerationParams,
        start: float,
    ) -> AsyncGenerator[bytes, None]:
        timed = True
        chunks = TextEvents.of(shape)
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
                    if timed:
                        self.metrics.ttft.observe(time.perf_counter() - start)
                        timed = False
                    yield chunks.event(piece)
        except NodeError as exc:
            yield event(self._stream_failed(node_error(exc)).body())
        except (TimeoutError, ClientClosed) as exc:
            yield event(self._stream_failed(unreachable(exc)).body())
        yield event("[DONE]")

    def _stream_failed(self, err: ApiError) -> ApiError:
        log.warning("a stream ended with an error: %d %s", err.status, err.message)
        return err

    async def _prompt(self, body: dict[str, Any], chat: bool) -> Prompt:
        try:
            if not chat:
                prompt = completion_prompt(body)
                ids = prompt if isinstance(prompt, list) else await self.text.tokenize(prompt)
                return Prompt(ids, "prompt")
            messages = chat_messages(body)
            return Prompt(await self._chat_ids(messages), "messages", self.template.turn_stops(messages))
        except NodeError as exc:
            if exc.code == ErrorCode.TOO_LARGE:  # more text than the node tokenizes at once
                param = "messages" if chat else "prompt"
                raise bad(f"the {param} is too long: {exc.message}", param) from None
            raise

    async def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            text = self.template.render(messages)
        except ChatTemplateError as exc:
            raise bad(str(exc), "messages") from None
        specials = self.template.specials
        if not specials.ids:
            return await self.text.tokenize(text)
        ids: list[int] = []
        for part in specials.split(text):
            ids += [part] if isinstance(part, int) else await self.text.tokenize(part, add_special=False)
        if specials.add_bos and specials.bos_id is not None and ids[:1] != [specials.bos_id]:
            ids.insert(0, specials.bos_id)
        return ids

    async def _open(self, prompt: Prompt, params: GenerationParams) -> NodeSession:
        """Open the request's session; a request that can never fit the node is a 400 naming what to change."""
        if not prompt.ids:
            raise bad(f"the {prompt.param} is empty", prompt.param)
        session_id = uuid.uuid4().hex
        need = len(prompt.ids) + params.max_tokens
        try:
            self.count_call("open")
            opened = await self.client.open(
                session_id, need, sampling=params.sampling(), wait_ms=self.config.open_wait_ms
            )
        except NodeError as exc:
            if exc.code in (ErrorCode.TOO_LARGE, ErrorCode.KV_BUDGET):
                await self._refuse_if_never_fits(exc, prompt, params)
            raise
        return NodeSession(session_id, set(opened.stage.eog_tokens), opened.stage.max_step_tokens)

    async def _prefill(self, opened: NodeSession, ids: list[int]) -> int:
        """Steps of the prompt's head, each as long as the node takes, so that what is left fits
        one `generate`; the position the `generate` starts at. A short prompt takes none."""
        pos, most = 0, opened.max_step_tokens
        while len(ids) - pos > most:
            self.count_call("step")
            await self.client.step(opened.id, pos, tokens=ids[pos : pos + most])  # its token is not used
            pos += most
        return pos

    async def _refuse_if_never_fits(self, exc: NodeError, prompt: Prompt, params: GenerationParams) -> None:
        """`too_large` never fits; `kv_budget` never does either when the node's cells are fewer than the
        request needs (a node that says `kv_budget` for that is asked for its `kv_cells_total`)."""
        stats = await self._node_stats()
        cells = stats.get("kv_cells_total") if stats is not None else None
        cells = cells if isinstance(cells, int) else None
        n_prompt = len(prompt.ids)
        if exc.code == ErrorCode.TOO_LARGE or (cells is not None and n_prompt + params.max_tokens > cells):
            raise never_fits(n_prompt, params.max_tokens, cells, prompt.param, exc.message)

    async def _generate(
        self, opened: NodeSession, prompt: Prompt, params: GenerationParams, access: Access
    ) -> AsyncGenerator[str | Finish, None]:
        """Text as it becomes safe to show (stop strings held back), then one `Finish`.
        The session is closed on the way out, whatever the way."""
        text = TextStream(self.text.detokenize)
        stop = StopText(params.stop + prompt.stops)
        made = 0  # tokens generated, counted in `usage`
        reason = "length"
        try:
            start = await self._prefill(opened, prompt.ids)
            self.count_call("generate")
            replies = self.client.generate_tokens(
                opened.id, start, prompt.ids[start:], params.max_tokens, ignore_eog=params.ignore_eos
            )
            async with aclosing(replies):
                async for reply in replies:
                    if isinstance(reply, Done):
                        opened.finished = True
                        reason = "stop" if reply.reason in ("eog", "stop") else "length"
                        made -= reply.reason == "eog"  # the token that ended the run is not part of the answer
                        break
                    shown, kept = await answer_piece(reply.tokens, text, stop, opened.eog)
                    made += kept
                    access.tokens = made
                    if shown:
                        yield shown
                    if stop.stopped:
                        reason = "stop"
                        break
            if shown := stop.push(text.flush()) + stop.flush():
                yield shown
            access.tokens = made
            yield Finish(reason, Usage(len(prompt.ids), made))
        finally:
            await self._end_session(opened)

    async def _end_session(self, session: NodeSession) -> None:
        if session.ended:
            return
        session.ended = True
        with trio.CancelScope(shield=True), trio.move_on_after(self.config.timeout_s):
            with suppress(NodeError, ClientClosed, TimeoutError):
                if not session.finished:
                    self.count_call("cancel")
                    await self.client.cancel(session.id)
            self.count_call("close")
            with suppress(NodeError):  # the node lets the session go with its lease at the latest
                await self.client.close_on_exit(session.id)


async def after(first: T, rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """`first`, then what `rest` yields; closing this closes `rest`."""
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


def listen(config: GatewayConfig) -> tuple[hypercorn.config.Config, hypercorn.config.Sockets]:
    """Hypercorn's config and its bound, listening sockets; ListenError when the address is taken."""
    hc = hypercorn.config.Config()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.accesslog = None
    hc.errorlog = None
    try:
        sockets = hc.create_sockets()
        for sock in sockets.insecure_sockets:
            sock.listen(hc.backlog)
    except OSError as exc:
        raise ListenError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    return hc, sockets


async def serve_gateway(
    config: GatewayConfig,
    *,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until `shutdown` is set (or forever); `task_status.started` gets the bound URLs.
    Raises ListenError before anything else when the HTTP address cannot be bound."""
    hc, sockets = listen(config)
    ACCESS_LOG.setLevel(logging.INFO if config.access_log else logging.WARNING)
    try:
        template = load_chat_template(config.model)
        async with open_client(
            config.node, timeout_s=config.timeout_s, retries=0, server_key=config.server_key, key=config.key
        ) as client:
            gateway = Gateway(client, config, template)
            gateway.text = await gateway_text(config.model, client, gateway.count_call)
            asgi = AccessLog(gateway.app())
            app = hypercorn.utils.wrap_app(asgi, hc.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
            trigger = shutdown.wait if shutdown is not None else None

            async def serve_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
                await hypercorn.trio.run.worker_serve(
                    app, hc, sockets=sockets, shutdown_trigger=trigger, task_status=task_status
                )

            async with trio.open_nursery() as nursery:
                task_status.started(await nursery.start(serve_http))
    finally:
        for sock in sockets.insecure_sockets:
            sock.close()
