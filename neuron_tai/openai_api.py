"""OpenAI's completion and chat request bodies, checked, and its response shapes.

Only what the gateway honours is accepted with a meaning; anything that would change the
answer in a way it cannot honour (`n` other than 1, several prompts, tools, log
probabilities, penalties: `UNHONOURED`) is refused with a 400 and OpenAI's error body
rather than silently ignored. Their neutral values (`null`, `false`, 0, empty, a `text`
response format), which clients send as defaults, are accepted.
"""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

MAX_STOPS = 4
MAX_INT = 2**31 - 1  # token ids and counts: what the node's int32 payloads and sessions hold
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # chat has no limit by default at OpenAI; a node session needs one


class ApiError(Exception):
    """An HTTP error with OpenAI's body: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """What one request asks of the node, whatever the endpoint."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # llama-server's extension: end-of-generation tokens do not end the run
    top_k: int = 0  # llama-server's and vLLM's extension: sample from the k likeliest tokens (0: all)

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a UTF-16 surrogate's escape, paired or not


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:  # JSON's \ud800-\udfff escapes decode to lone surrogates, which no UTF-8 text holds
        if _SURROGATE_ESCAPE.search(raw):  # only then is the body encoded again to find an unpaired one
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad("the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    return body


def requested_model(body: dict[str, Any], names: tuple[str, ...]) -> str:
    """The `model` the request names, one of `names`. OpenAI requires the field (400 without it)
    and answers a model it does not serve with 404 `model_not_found`, as vLLM does too."""
    model = body.get("model")
    if model is None:
        raise bad("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model not in names:
        message = f"the model '{model}' does not exist; this server serves {', '.join(map(repr, names))}"
        raise ApiError(404, message, param="model", code="model_not_found")
    return model


def _number(
    body: dict[str, Any], key: str, default: float, low: float, high: float, *, open_low: bool = False
) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"'{key}' must be a number", key)
    if value > high or value < low or (open_low and value == low):
        raise bad(f"'{key}' must be in {'(' if open_low else '['}{low}, {high}], got {value}", key)
    return float(value)


def _int(body: dict[str, Any], key: str, default: int | None, low: int, high: int = MAX_INT) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{key}' must be an integer", key)
    if not low <= value <= high:
        raise bad(f"'{key}' must be in [{low}, {high}], got {value}", key)
    return value


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:  # absent, or null as clients send unset fields
        return False
    if not isinstance(value, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stops if s)


# Fields that change an answer in a way the gateway does not: refused unless neutral (`_neutral`).
UNHONOURED = (
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "repeat_penalty",
    "repetition_penalty",
)
_NEUTRAL_AT_ONE = ("repeat_penalty", "repetition_penalty")  # a factor: 1 changes nothing


def refuse_unhonoured(body: dict[str, Any]) -> None:
    """400 for a field that would change the answer in a way this gateway does not do."""
    for key in UNHONOURED:
        if not _neutral(key, body.get(key)):
            raise bad(f"'{key}' is not supported by this server", key)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad("only the response format {'type': 'text'} is supported", "response_format")


def _neutral(key: str, value: Any) -> bool:
    """What clients send for a field they leave unset: null, false, 0 (1 for a penalty factor), empty;
    "none" for a tool choice."""
    if value is None or value is False or value in ([], {}, ""):
        return True
    unchanged = 1 if key in _NEUTRAL_AT_ONE else 0
    if isinstance(value, int | float) and not isinstance(value, bool) and value == unchanged:
        return True
    return key in ("tool_choice", "function_call") and value == "none"


def generation_params(body: dict[str, Any], *, chat: bool) -> GenerationParams:
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise bad(f"only n=1 is supported, got n={n}", "n")
    if body.get("best_of") not in (None, 1):
        raise bad("only best_of=1 is supported", "best_of")
    default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = _int(body, "max_tokens", None, 1)
    if chat and max_tokens is None:
        max_tokens = _int(body, "max_completion_tokens", None, 1)
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    refuse_unhonoured(body)
    seed = _int(body, "seed", None, -(2**63), 2**64 - 1)
    return GenerationParams(
        max_tokens=max_tokens or default,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        seed=(seed if seed is not None else random.getrandbits(31)) % 2**31,
        stop=_stop(body),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        ignore_eos=_flag(body, "ignore_eos"),
        top_k=max(0, _int(body, "top_k", 0, -1) or 0),  # vLLM's -1 is all, as 0 is
    )


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """One prompt: a string, or a list of token ids; a list of one of those is that one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t <= MAX_INT for t in prompt):
            raise bad(f"token ids must be in [0, {MAX_INT}]", "prompt")
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("only one prompt per request is supported", "prompt")
    raise bad("'prompt' must be a string or a list of token ids", "prompt")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages with `content` as plain text (text parts joined); other keys kept for the template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role'", "messages")
        content = message.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise bad(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(parts)  # type: ignore[arg-type]
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({**message, "content": content})
    return out


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def body(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


@dataclass(frozen=True, slots=True)
class Shape:
    """The response shapes of one endpoint: text completions or chat."""

    chat: bool
    model: str
    id: str
    created: int

    @staticmethod
    def new(chat: bool, model: str) -> Shape:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return Shape(chat, model, prefix + uuid.uuid4().hex, int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        obj = kind + ".chunk" if chunk and self.chat else kind
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(False), "choices": [choice], "usage": usage.body()}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage.body()}


def event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: {...}` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass(frozen=True, slots=True)
class TextEvents:
    """A response's streamed text chunks as server-sent events: everything but the text is encoded
    once per response, so a token costs one string encoding, not a dict and a whole JSON document."""

    head: bytes
    tail: bytes

    MARKER = "\x00"  # stands for the text; no model name or id holds it

    @staticmethod
    def of(shape: Shape) -> TextEvents:
        whole = event(shape.chunk(TextEvents.MARKER))
        head, found, tail = whole.partition(json.dumps(TextEvents.MARKER).encode())
        assert found and json.dumps(TextEvents.MARKER).encode() not in tail, "the marker must appear once"
        return TextEvents(head, tail)

    def event(self, text: str) -> bytes:
        """What `event(shape.chunk(text))` gives, for a text that is not empty."""
        return self.head + json.dumps(text).encode() + self.tail
