"""The OpenAI-compatible gateway, in process, in front of a real node on the tiny model.

Driven with the official `openai` client (sync and async, streamed and not) and with raw
HTTP, and compared with what the node itself generates.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, MutableMapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam

from neuron_tai.chat_template import FALLBACK_TEMPLATE, NO_SPECIALS, ChatTemplate, SpecialTokens, load_chat_template
from neuron_tai.client import Done, Generated, open_client
from neuron_tai.config import NodeConfig
from neuron_tai.gateway import EventStream, GatewayConfig, serve_gateway
from neuron_tai.node import open_node
from neuron_tai.stop_text import StopText
from neuron_tai.text_stream import TextStream, answer_piece
from tests.held import held_decodes, wait_until
from tests.nodes import NodeProcess, running
from tests.test_generate import stop_asked
from tests.test_node import engine_config

PROMPT = "The lighthouse keeper climbed the stairs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def node(tiny_model: Path) -> Iterator[str]:
    proc = NodeProcess(tiny_model, f"tcp://127.0.0.1:{_free_port()}")
    with running(proc):
        yield proc.address


@asynccontextmanager
async def gateway(node: str, **kwargs: Any) -> AsyncIterator[str]:
    """A gateway serving on a free port; yields its base URL (`http://127.0.0.1:PORT/v1`)."""
    stop = trio.Event()
    config = GatewayConfig(node=node, port=0, model_name="tiny", **kwargs)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve_gateway, config, shutdown=stop))
        try:
            yield binds[0] + "/v1"
        finally:
            stop.set()


async def node_text(node: str, prompt: str | list[int], max_new: int) -> tuple[str, int, int]:
    """The node's own greedy generate: (text without end-of-generation tokens, prompt tokens, tokens made)."""
    async with open_client(node) as client:
        ids = prompt if isinstance(prompt, list) else await client.tokenize(prompt)
        session = uuid.uuid4().hex
        opened = await client.open(session, len(ids) + max_new)
        eog = set(opened.stage.eog_tokens)
        out: list[int] = []
        async for reply in client.generate_tokens(session, 0, ids, max_new):
            if isinstance(reply, Generated):
                out += [t for t in reply.tokens if t not in eog]
            assert isinstance(reply, Generated | Done)
        await client.close(session)
        return await client.detokenize(out), len(ids), len(out)


async def node_stats(node: str) -> dict[str, Any]:
    async with open_client(node) as client:
        return await client.stats()


# -- pure pieces --------------------------------------------------------------------------


def test_stop_text_holds_back_a_possible_start_and_cuts_at_the_stop() -> None:
    stop = StopText(("END",))
    assert stop.push("abcE") == "abc"  # "E" could begin "END"
    assert stop.push("N") == ""
    assert stop.push("x") == "ENx"  # it did not
    assert stop.push("yEND and more") == "y"
    assert stop.stopped
    assert stop.text == "abcENxy"
    assert stop.push("more") == "" and stop.flush() == ""


def test_stop_text_flush_releases_what_was_held() -> None:
    stop = StopText(("\n\n", "###"))
    assert stop.push("line\n") == "line"
    assert stop.flush() == "\n"
    assert not stop.stopped


@settings(max_examples=200, deadline=None)
@given(
    letters=st.lists(st.sampled_from("ab c"), min_size=1, max_size=12),
    stops=st.lists(st.text("ab c", min_size=1, max_size=3), max_size=2),
    cut=st.integers(0, 11),
)
def test_a_reply_is_kept_up_to_the_token_that_completes_a_stop_string(
    letters: list[str], stops: list[str], cut: int
) -> None:
    """Token i is the one-character text `letters[i]`; the tokens come in two replies. The
    answer keeps every token up to the first whose text completes a stop string, and shows
    the text before that stop string, however the replies split the tokens."""

    async def detokenize(ids: list[int]) -> str:
        return "".join(letters[i] for i in ids)

    async def run() -> tuple[str, int]:
        text, stop = TextStream(detokenize), StopText(tuple(stops))
        ids = list(range(len(letters)))
        shown, kept = "", 0
        for reply in (ids[:cut], ids[cut:]):
            piece, n = await answer_piece(reply, text, stop, set())
            shown, kept = shown + piece, kept + n
            if stop.stopped:
                break
        return shown + stop.push(text.flush()) + stop.flush(), kept

    whole = "".join(letters)
    ends = [whole.find(s) + len(s) for s in stops if s in whole]
    if ends:  # the first stop string to be complete, and the text before the first one in it then
        kept = min(ends)
        expected = (whole[: min(whole[:kept].find(s) for s in stops if s in whole[:kept])], kept)
    else:
        expected = (whole, len(letters))
    assert trio.run(run) == expected


def test_chat_template_renders_with_llama_cpp_globals_and_splits_special_tokens() -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    specials = SpecialTokens({"<s>": 1, "<|user|>": 5, "<|end|>": 6, "<|assistant|>": 7}, "<s>", "</s>", 1, True)
    text = ChatTemplate(source, specials).render([{"role": "user", "content": "hi <|end"}])
    assert text == "<s><|user|>hi <|end<|end|><|assistant|>"
    assert specials.split(text) == [1, 5, "hi <|end", 6, 7]


def _split_one_place_at_a_time(ids: dict[str, int], text: str) -> list[str | int]:
    """The reference: at each place, the longest name that starts there, else one character on."""
    out: list[str | int] = []
    start = i = 0
    while i < len(text):
        hit = max((n for n in ids if n and text.startswith(n, i)), key=len, default=None)
        if hit is None:
            i += 1
            continue
        out += [text[start:i]] if i > start else []
        out.append(ids[hit])
        i = start = i + len(hit)
    return out + ([text[start:]] if start < len(text) else [])


@given(
    names=st.lists(st.text("<|>ab", min_size=1, max_size=5), max_size=8, unique=True),
    text=st.text("<|>abc", max_size=40),
)
def test_special_tokens_split_at_the_longest_name_at_each_place(names: list[str], text: str) -> None:
    ids = {name: i for i, name in enumerate(names)}
    assert SpecialTokens(ids, "", "", None, True).split(text) == _split_one_place_at_a_time(ids, text)


def test_an_open_may_not_wait_at_the_node_longer_than_the_gateway_waits_for_it() -> None:
    GatewayConfig("tcp://127.0.0.1:1", open_wait_ms=59_000, timeout_s=60)
    with pytest.raises(ValueError, match="--open-wait-ms"):  # admitted after the gateway gave up: for nobody
        GatewayConfig("tcp://127.0.0.1:1", open_wait_ms=60_000, timeout_s=60)


def test_chat_template_exceptions_are_reported() -> None:
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}", NO_SPECIALS)
    with pytest.raises(ValueError, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])
    source = "{% for m in messages %}{% for c in m.tool_calls %}{{ c }}{% endfor %}{% endfor %}"
    loops = ChatTemplate(source, NO_SPECIALS)
    with pytest.raises(ValueError, match="TypeError"):  # a message's own value breaks the template: 400
        loops.render([{"role": "assistant", "content": "", "tool_calls": 5}])


def test_a_model_without_a_template_gets_the_fallback(tiny_model: Path) -> None:
    template = load_chat_template(tiny_model)
    assert template.source == FALLBACK_TEMPLATE
    assert template.specials.bos_id is not None and template.specials.bos  # read from the vocabulary's raw bytes
    assert template.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


# -- against a node -----------------------------------------------------------------------


async def test_greedy_completions_equal_the_nodes_own_generate(node: str) -> None:
    expected, prompt_tokens, made = await node_text(node, PROMPT, 24)
    async with gateway(node) as base:
        client = openai.AsyncOpenAI(base_url=base, api_key="none")
        full = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        assert full.choices[0].text == expected
        assert full.usage is not None
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, made)
        assert full.choices[0].finish_reason == ("length" if made == 24 else "stop")

        stream = await client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, reasons, usage = [], [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            usage = chunk.usage or usage
        assert "".join(pieces) == expected
        assert reasons[-1] == full.choices[0].finish_reason and not any(reasons[:-1])
        assert usage is not None and usage.completion_tokens == made


async def test_sync_client_chat_streamed_and_not_equal_the_node_on_the_rendered_prompt(node: str) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea"}]
    rendered = load_chat_template(None).render([dict(m) for m in messages])
    expected, prompt_tokens, _ = await node_text(node, rendered, 16)
    async with gateway(node) as base:

        def chat() -> tuple[str, str, int]:
            client = openai.OpenAI(base_url=base, api_key="none")
            full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
            parts = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            assert full.usage is not None
            return full.choices[0].message.content or "", streamed, full.usage.prompt_tokens

        full, streamed, prompt_used = await trio.to_thread.run_sync(chat)
    assert full == streamed == expected
    assert prompt_used == prompt_tokens


async def test_stop_strings_cut_the_text_also_across_a_token_boundary(node: str) -> None:
    prompt = "Once upon a time"  # the tiny model answers with single-character tokens among others
    async with open_client(node) as client:
        ids = await client.tokenize(prompt)
        session = uuid.uuid4().hex
        opened = await client.open(session, len(ids) + 24)
        out: list[int] = []
        async for reply in client.generate_tokens(session, 0, ids, 24):
            if isinstance(reply, Generated):
                out += [t for t in reply.tokens if t not in opened.stage.eog_tokens]
        await client.close(session)
        texts = [await client.detokenize(out[:k]) for k in range(len(out) + 1)]
    full = texts[-1]

    def printable_boundary(k: int) -> bool:
        before, after = texts[k], texts[k + 1]
        return (
            bool(before)
            and after.startswith(before)
            and len(after) > len(before)
            and before[-1].isprintable()
            and before[-1] != "\ufffd"
            and after[len(before)].isprintable()
            and after[len(before)] != "\ufffd"
            and "\ufffd" not in after[len(before) :]
        )

    # The stop string is the last character of token k's text and the first of token k+1's:
    # neither token alone holds it.
    k = next(k for k in range(1, len(out) - 1) if printable_boundary(k))
    stop = texts[k][-1] + texts[k + 1][len(texts[k])]
    expected = full[: full.find(stop)]
    print(f"stop {stop!r} spans tokens {k - 1} and {k}; expected {expected!r}")
    async with gateway(node) as base:
        client2 = openai.AsyncOpenAI(base_url=base, api_key="none")
        for stream in (False, True):
            body: dict[str, Any] = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "stop": ["never-in-this-text", stop],
            }
            if stream:
                chunks = await client2.completions.create(**body, stream=True)
                got, reason = "", None
                async for chunk in chunks:
                    got += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
            else:
                result = await client2.completions.create(**body)
                got, reason = result.choices[0].text, result.choices[0].finish_reason
            assert (got, reason) == (expected, "stop"), (stream, stop)


async def test_errors_are_openai_shaped_with_http_status(node: str) -> None:
    async with gateway(node) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        reply = await http.post("/completions", json={"model": "tiny", "prompt": "x", "n": 2})
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "n"
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
        reply = await http.post("/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
        reply = await http.post("/chat/completions", json={"model": "tiny", "messages": []})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
        reply = await http.post("/completions", json={"model": "tiny", "prompt": "x", "temperature": 9})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "temperature"
        reply = await http.post(
            "/completions", json={"model": "tiny", "prompt": [1, 10**6]}
        )  # a token outside the vocabulary
        assert reply.status_code == 400
        for raw in (rb'{"model": "\ud800", "prompt": "x"}', rb'{"model": "tiny", "prompt": "x\udfff"}'):
            reply = await http.post("/completions", content=raw)  # lone surrogates: no UTF-8 text holds them
            assert reply.status_code == 400 and "surrogate" in reply.json()["error"]["message"], reply.text
        assert (await http.get("/models")).json()["data"][0]["id"] == "tiny"
        for method, path, status in (("GET", "/nowhere", 404), ("GET", "/completions", 405)):
            reply = await http.request(method, path)
            assert reply.status_code == status and set(reply.json()["error"]) == {"message", "type", "param", "code"}
        assert (await http.get(base.removesuffix("/v1") + "/health")).json() == {"status": "ok"}
        client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt="x", n=2)


async def test_fields_the_gateway_cannot_honour_are_refused_and_their_defaults_accepted(node: str) -> None:
    async with gateway(node) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        base_body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        refused: list[tuple[str, Any]] = [
            ("tools", [{"type": "function", "function": {"name": "f"}}]),
            ("logprobs", 2),
            ("echo", True),
            ("logit_bias", {"5": 100}),
            ("presence_penalty", 0.5),
            ("response_format", {"type": "json_object"}),
            ("min_p", 0.05),
            ("repeat_penalty", 1.1),
            ("top_k", -2),
        ]
        for key, value in refused:
            reply = await http.post("/completions", json={**base_body, key: value})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == key, (key, reply.text)
        neutral: dict[str, Any] = {"tools": [], "logprobs": None, "echo": False, "frequency_penalty": 0.0}
        neutral |= {"stream": None, "response_format": {"type": "text"}, "repetition_penalty": 1.0, "min_p": 0}
        reply = await http.post("/completions", json={**base_body, **neutral})
        assert reply.status_code == 200, reply.text
        answers = set()
        for sampling in ({"temperature": 0}, *({"temperature": 2, "top_k": 1, "seed": s} for s in range(3))):
            reply = await http.post("/completions", json={**base_body, "max_tokens": 8, **sampling})
            answers.add(reply.json()["choices"][0]["text"])
        assert len(answers) == 1  # `top_k` reaches the node: the likeliest token alone is greedy
        too_big: list[tuple[str, Any]] = [("prompt", [1, 2**40]), ("max_tokens", 2**64), ("seed", 2**70)]
        for key, value in too_big:
            reply = await http.post("/completions", json={**base_body, key: value})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == key, (key, reply.text)


async def test_bodies_too_big_too_slow_or_too_deep_are_refused_and_the_gateway_goes_on(node: str) -> None:
    async with (
        gateway(node, max_body_bytes=8192, body_timeout_s=0.5) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        body = json.dumps({"model": "tiny", "prompt": "x" * 9000, "max_tokens": 2}).encode()
        declared = await http.post("/completions", content=body)
        assert declared.status_code == 413 and declared.json()["error"]["code"] == "body_too_large"

        async def chunks(data: bytes, pause_s: float = 0.0) -> AsyncIterator[bytes]:
            for i in range(0, len(data), 1024):
                yield data[i : i + 1024]
                await trio.sleep(pause_s)

        sent = await http.post("/completions", content=chunks(body))  # chunked: no length declared
        assert sent.status_code == 413
        small = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).encode()
        slow = await http.post("/completions", content=chunks(small, pause_s=2.0))
        assert slow.status_code == 408 and slow.json()["error"]["code"] == "request_timeout"
        for raw in (b"[" * 3000, b'{"model": ' + b"1" * 4400 + b"}"):
            reply = await http.post("/completions", content=raw)
            assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
        assert (await http.post("/completions", content=small)).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_before_its_first_text_stops_its_generation(tiny_model: Path, stream: bool) -> None:
    """The node's decodes are held while the client leaves (a stream's before its headers, which
    wait for the first text): the gateway cancels the run at once, instead of letting it run to
    `max_tokens` for nobody."""
    cfg = NodeConfig(engine_config(tiny_model), bind="tcp://127.0.0.1:0")
    async with open_node(cfg) as node, gateway(node.address) as base:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": stream}
        with held_decodes(node.engine) as (entered, release):
            async with trio.open_nursery() as nursery, httpx.AsyncClient(base_url=base, timeout=30) as http:
                nursery.start_soon(partial(http.post, "/completions", json=body))
                await wait_until(entered.is_set)
                nursery.cancel_scope.cancel()  # the client leaves: its connection closes
            await wait_until(lambda: stop_asked(node))
            release.set()
        await wait_until(lambda: not node.generations.runs and not node.engine.scheduler.sessions)


async def test_a_stream_whose_client_takes_nothing_ends_and_runs_its_cleanup() -> None:
    """A reader that stopped reading (its socket full) is taken as gone after the send timeout:
    the stream ends and its cleanup (cancel and close on the node) runs."""
    cleaned = trio.Event()

    async def events() -> AsyncGenerator[bytes, None]:
        while True:
            yield b'data: {"choices": []}\n\n'

    async def on_close() -> None:
        cleaned.set()

    async def full_socket(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await trio.sleep_forever()

    with trio.fail_after(30):  # a guard: without the timeout the send waits for ever
        await EventStream(events(), on_close, send_timeout_s=0.05).stream_response(full_socket)
    assert cleaned.is_set()


async def test_a_full_node_is_429_with_retry_after(tiny_model: Path) -> None:
    proc = NodeProcess(tiny_model, f"tcp://127.0.0.1:{_free_port()}", ["--max-sessions", "1"])
    with running(proc):
        async with open_client(proc.address) as holder, gateway(proc.address) as base:
            await holder.open("held", 16)
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                reply = await http.post("/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
                assert reply.status_code == 429
                assert int(reply.headers["Retry-After"]) >= 1
                assert reply.json()["error"]["code"] == "session_limit"
                streamed = await http.post(
                    "/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}
                )
                assert streamed.status_code == 429
            await holder.close("held")
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                assert (
                    await http.post("/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
                ).status_code == 200


async def test_a_stream_whose_generate_the_node_refuses_gets_the_refusal_as_its_status(
    tiny_shards2: list[Path],
) -> None:
    """A chain's first stage alone opens sessions but cannot generate (`wrong_stage`): a streamed
    request gets that refusal as its HTTP status, not a 200 and an error event."""
    cfg = NodeConfig(engine_config(tiny_shards2[0]), bind="tcp://127.0.0.1:0")
    async with (
        open_node(cfg) as node,
        gateway(node.address) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 2, "stream": True}
        reply = await http.post("/completions", json=body)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "wrong_stage", reply.text
        assert (await node_stats(node.address))["sessions_active"] == 0


async def test_a_node_with_nothing_listening_is_502() -> None:
    async with (
        gateway(f"tcp://127.0.0.1:{_free_port()}", timeout_s=0.5) as base,
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        reply = await http.post("/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert reply.status_code == 502
        assert reply.json()["error"]["code"] == "node_unreachable"
        assert (await http.get(base.removesuffix("/v1") + "/health")).status_code == 503


async def test_a_client_that_disconnects_mid_stream_leaves_no_session(node: str) -> None:
    async with gateway(node) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 900,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        async with http.stream("POST", "/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    break  # leave after the first text: the connection closes under the generation
        stats: dict[str, Any] = {}
        for _ in range(200):  # the gateway notices the disconnect, cancels and closes
            stats = await node_stats(node)
            if stats["sessions_active"] == 0:
                break
            await trio.sleep(0.05)
        assert stats["sessions_active"] == 0 and stats["generations_active"] == 0


async def test_metrics_count_requests_and_carry_the_nodes_stats(node: str) -> None:
    async with gateway(node) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        await http.post("/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        await http.post("/completions", json={"model": "tiny", "prompt": PROMPT, "n": 3})
        text = (await http.get(base.removesuffix("/v1") + "/metrics")).text
    assert 'neuron_tai_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'neuron_tai_gateway_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert "neuron_tai_gateway_request_seconds_count" in text
    assert "neuron_tai_node_sessions_max 4.0" in text
    assert "neuron_tai_gateway_node_up 1.0" in text


def _node_calls(metrics: str) -> dict[str, float]:
    calls = {}
    for line in metrics.splitlines():
        if line.startswith("neuron_tai_gateway_node_calls_total{"):
            op = line.split('op="', 1)[1].split('"', 1)[0]
            calls[op] = float(line.rsplit(" ", 1)[1])
    return calls


async def _streamed_texts(base: str, prompts: list[str], max_tokens: int) -> tuple[list[str], dict[str, float]]:
    texts = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            async with http.stream("POST", "/completions", json=body) as reply:
                assert reply.status_code == 200
                events = [line[6:] async for line in reply.aiter_lines() if line.startswith("data: {")]
            texts.append("".join(json.loads(e)["choices"][0]["text"] for e in events))
        metrics = (await http.get(base.removesuffix("/v1") + "/metrics")).text
    return texts, _node_calls(metrics)


async def test_with_the_model_file_a_stream_costs_the_node_one_open_generate_and_close(
    node: str, tiny_model: Path
) -> None:
    prompts = [PROMPT, "Ünïcode and numbers 1234", "a"]
    by_node, node_calls = await _streamed_texts_via(node, None, prompts)
    local, local_calls = await _streamed_texts_via(node, tiny_model, prompts)
    assert local == by_node and all(local)
    assert node_calls["detokenize"] >= 3 * 2  # without the vocabulary: a round trip per reply
    n = len(prompts)
    # per request one open, one generate, one close; besides: the start's vocabulary check and the /metrics scrape
    assert local_calls == {"open": n, "generate": n, "close": n, "tokenize": 1, "detokenize": 1, "stats": 1}


async def _streamed_texts_via(node: str, model: Path | None, prompts: list[str]) -> tuple[list[str], dict[str, float]]:
    async with gateway(node, model=model) as base:
        return await _streamed_texts(base, prompts, 12)
