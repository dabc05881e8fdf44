"""One access-log line per HTTP request, written when its response has ended (a stream too).

The line is the one ASGI servers write (uvicorn's `client - "request line" status`),
followed by the tokens the request generated (`-` where it generates none) and its time
to the last byte:

    127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 24 0.153s

An endpoint reports its tokens through `Access`, which the middleware puts into the scope.
A request whose client went away before its response started is logged as 499, nginx's
"client closed request".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCESS_LOG = logging.getLogger("neuron_tai.gateway.access")
SCOPE_KEY = "neuron_tai.access"


@dataclass(slots=True)
class Access:
    """What an endpoint tells the access log about its request."""

    tokens: int | None = None  # tokens generated, for the endpoints that generate


def access_of(request: Request) -> Access:
    """The request's `Access` (a detached one when no `AccessLog` is in front)."""
    found = request.scope.get(SCOPE_KEY)
    return found if isinstance(found, Access) else Access()


class AccessLog:
    """ASGI middleware: a line per HTTP request to `ACCESS_LOG` at INFO."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        access = scope[SCOPE_KEY] = Access()
        status = 499  # no response started: the client went away first (nginx's code; an app error sends its 500)

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client")
            peer = f"{client[0]}:{client[1]}" if client else "-"
            path = scope.get("raw_path", scope["path"].encode()).decode("latin-1")
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            line = f"{scope['method']} {path} HTTP/{scope.get('http_version', '1.1')}"
            tokens = "-" if access.tokens is None else str(access.tokens)
            ACCESS_LOG.info('%s - "%s" %d %s %.3fs', peer, line, status, tokens, time.perf_counter() - start)
