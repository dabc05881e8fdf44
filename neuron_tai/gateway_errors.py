"""What the gateway answers when a request does not succeed: the node's refusals as HTTP.

Temporary refusals (`busy`, `session_limit`, `kv_budget`) are 429 with `Retry-After`, so
a client retries them. A request that can never succeed is a 400 naming the field to
change (`param`), never a 429: a client would retry it forever. Bodies are OpenAI's
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from neuron_tai.client import NodeError
from neuron_tai.openai_api import ApiError
from protocol.errors import ErrorCode

RATE_LIMITED = {ErrorCode.BUSY, ErrorCode.SESSION_LIMIT, ErrorCode.KV_BUDGET}
BAD_INPUT = {ErrorCode.BAD_REQUEST, ErrorCode.POSITION, ErrorCode.TOO_LARGE}
TOO_LONG = "context_length_exceeded"  # OpenAI's code for a prompt plus completion over the model's context


def node_error(exc: NodeError) -> ApiError:
    if exc.code in RATE_LIMITED:
        wait = max(1, math.ceil((exc.retry_after_ms or 1000) / 1000))
        message = f"the node is at capacity ({exc.code}): {exc.message}"
        return ApiError(429, message, type_="rate_limit_error", code=exc.code, retry_after_s=wait)
    if exc.code in BAD_INPUT:
        return ApiError(400, f"the node refused the request ({exc.code}): {exc.message}", code=exc.code)
    if exc.code == ErrorCode.SHUTTING_DOWN:
        return ApiError(503, "the node is shutting down", type_="server_error", code=exc.code, retry_after_s=1)
    return ApiError(502, f"the node failed ({exc.code}): {exc.message}", type_="server_error", code=exc.code)


def unreachable(exc: Exception) -> ApiError:
    return ApiError(502, f"the node is unreachable: {exc}", type_="server_error", code="node_unreachable")


def never_fits(n_prompt: int, max_tokens: int, cells: int | None, prompt_param: str, detail: str) -> ApiError:
    """A prompt plus `max_tokens` over what the node can hold (`cells`, when its stats told):
    the prompt is at fault when even one generated token would not fit, else `max_tokens`."""
    if cells is None:
        message = f"the request can never fit the node ({detail}); shorten the {prompt_param} or lower max_tokens"
        return ApiError(400, message, param="max_tokens", code=TOO_LONG)
    if n_prompt >= cells:
        message = f"the {prompt_param} has {n_prompt} tokens; the node holds at most {cells}, generated tokens included"
        return ApiError(400, message, param=prompt_param, code=TOO_LONG)
    need = f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} for max_tokens)"
    message = f"this request needs {need}; the node holds at most {cells}: lower max_tokens to {cells - n_prompt}"
    return ApiError(400, message, param="max_tokens", code=TOO_LONG)


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def http_error(_request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (an unknown path, a method a path does not take) in OpenAI's body."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    response = error_response(ApiError(status, detail, code=code))
    if isinstance(exc, HTTPException) and exc.headers:  # a 405's `Allow`
        response.headers.update(exc.headers)
    return response
