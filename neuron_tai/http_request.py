"""The client's side of one HTTP request at the gateway: its body, within bounds, and its leaving.

Hypercorn bounds a request's headers, not its body, nor how long the body takes: a client
could declare a gigabyte and trickle it in, holding a connection and its buffer for ever.
The gateway reads a body only up to `limit` bytes (a declared `Content-Length` over it is
refused before anything is read) and within `timeout_s`, and only while it has room for
the request at all (`Gateway._admit` counts it first).

A client that leaves while its answer is computed: Hypercorn tells the application with an
`http.disconnect` message, and does not cancel the handler. A streamed answer notices when
its next write fails; a whole answer watches for the message (`cancel_when_gone`), so the
node's generation stops at once instead of running to `max_tokens` for nobody.
"""

from __future__ import annotations

import trio
from starlette.requests import Request

from neuron_tai.openai_api import ApiError


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body: 413 past `limit` bytes (declared or sent), 408 when it takes over `timeout_s`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout_s) as late:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    if late.cancelled_caught:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout")
    return b"".join(chunks)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over this gateway's limit of {limit} bytes", code="body_too_large")


async def cancel_when_gone(request: Request, scope: trio.CancelScope) -> None:
    """Cancel `scope` when the client disconnects (its body read: the next message is the leaving)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
