"""The gateway tells the truth: health, access log, models, refusals that say what to change,
the plain chat form's turns, text at a cost linear in the answer, and a taken port.

Each test runs the real gateway (in process, or as `neuron-tai gateway`) against real
nodes on the tiny models.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from gguf import GGUFReader

from neuron_tai.client import Client, open_client
from neuron_tai.text_stream import CONTEXT, WINDOW
from testkit.models import vocabulary, write_tiny_model
from tests.nodes import NodeProcess, running
from tests.test_gateway import PROMPT, _free_port, _node_calls, gateway, node_text

TINY = {"model": "tiny"}


@pytest.fixture(scope="module")
def node(tiny_model: Path) -> Iterator[str]:
    proc = NodeProcess(tiny_model, f"tcp://127.0.0.1:{_free_port()}")
    with running(proc):
        yield proc.address


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll `check` every 50 ms for up to 20 s."""
    for _ in range(400):
        if await check():
            return
        await trio.sleep(0.05)
    raise AssertionError("the condition never held")


# -- text at a cost linear in the answer ---------------------------------------------------


async def test_a_long_stream_is_detokenized_a_window_at_a_time(node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    expected, _, made = await node_text(node, PROMPT, 900)  # ignore_eos below: all 900 come
    sizes: list[int] = []
    detokenize = Client.detokenize

    async def counted(self: Client, tokens: list[int]) -> str:
        sizes.append(len(tokens))
        return await detokenize(self, tokens)

    monkeypatch.setattr(Client, "detokenize", counted)
    async with gateway(node) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        body = {**TINY, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
        text = ""
        async with http.stream("POST", "/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    assert text.startswith(expected) if made < 900 else text == expected
    assert len(sizes) <= 900 + 900 // (WINDOW - CONTEXT)
    assert max(sizes) < 2 * WINDOW  # the whole answer so far would be up to 900
    assert sum(sizes) < 900 * 2 * WINDOW


# -- health and the access log ------------------------------------------------------------


async def test_health_is_503_once_the_chains_next_stage_is_gone(
    tiny_shards2: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    addr = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    tail = NodeProcess(tiny_shards2[1], addr[1])
    head = NodeProcess(tiny_shards2[0], addr[0], ["--next", addr[1]])
    with running(tail, head):
        async with (
            gateway(head.address) as base,
            httpx.AsyncClient(base_url=base.removesuffix("/v1"), timeout=60) as http,
        ):

            async def healthy() -> bool:
                return (await http.get("/health")).status_code == 200

            await eventually(healthy)  # the head links up with the tail
            caplog.clear()
            assert (await http.get("/health")).json() == {"status": "ok"}
            tail.kill()

            async def unhealthy() -> bool:
                return (await http.get("/health")).status_code == 503

            await eventually(unhealthy)
            reply = (await http.get("/health")).json()
            assert reply["status"] == "unavailable" and "next stage" in reply["reason"]
            head.kill()
            await eventually(unhealthy)
            assert (await http.get("/health")).json()["reason"] == "the node does not answer"
    changes = [r.getMessage() for r in caplog.records if r.name == "neuron_tai.gateway" and "health" in r.getMessage()]
    assert [c.split(" (")[0] for c in changes] == [  # once per change of state, not per poll
        "health: the node's next stage is not connected",
        "health: the node does not answer",
    ]


LINE = re.compile(r'^127\.0\.0\.1:\d+ - "(\w+) (\S+) HTTP/1\.1" (\d{3}) (\d+|-) \d+\.\d{3}s$')


async def test_every_request_gets_an_access_log_line_and_failures_an_error_line(
    node: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="neuron_tai.gateway")
    async with gateway(node) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        body = {**TINY, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
        full = (await http.post("/completions", json=body)).json()
        await http.post("/completions", json={**body, "stream": True})  # greedy: the same tokens
        await http.post("/completions", json={"model": "gpt-4", "prompt": PROMPT})
        await http.get(base.removesuffix("/v1") + "/health")
    async with (
        gateway(f"tcp://127.0.0.1:{_free_port()}", timeout_s=0.5) as base,
        httpx.AsyncClient(base_url=base, timeout=60) as h,
    ):
        await h.post("/completions", json={**TINY, "prompt": PROMPT})
    access = [r.getMessage() for r in caplog.records if r.name == "neuron_tai.gateway.access"]
    matched = [LINE.match(line) for line in access]
    assert all(matched), access
    made = str(full["usage"]["completion_tokens"])
    assert [m.groups() for m in matched if m] == [
        ("POST", "/v1/completions", "200", made),
        ("POST", "/v1/completions", "200", made),
        ("POST", "/v1/completions", "404", "-"),  # refused before it asked the node for anything
        ("GET", "/health", "200", "-"),
        ("POST", "/v1/completions", "502", "0"),
    ]
    errors = [r for r in caplog.records if r.name == "neuron_tai.gateway" and r.levelno == logging.WARNING]
    assert any("502" in r.getMessage() and "unreachable" in r.getMessage() for r in errors)


# -- models -------------------------------------------------------------------------------


async def test_only_the_served_model_and_its_aliases_are_answered(node: str) -> None:
    async with (
        gateway(node, model_aliases=("tiny-latest", "tiny")) as base,
        httpx.AsyncClient(base_url=base, timeout=60) as http,
    ):
        assert [m["id"] for m in (await http.get("/models")).json()["data"]] == ["tiny", "tiny-latest"]
        reply = await http.post("/completions", json={"model": "tiny-latest", "prompt": PROMPT, "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "tiny"  # answers name the served model
        for body, status, code in [
            ({"model": "gpt-4", "prompt": PROMPT}, 404, "model_not_found"),
            ({"prompt": PROMPT}, 400, None),  # OpenAI requires `model`
            ({"model": 7, "prompt": PROMPT}, 400, None),
        ]:
            reply = await http.post("/completions", json=body)
            assert (reply.status_code, reply.json()["error"]["code"]) == (status, code), reply.json()
            assert reply.json()["error"]["param"] == "model"
            assert reply.json()["error"]["type"] == "invalid_request_error"
        chat = await http.post("/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user"}]})
        assert chat.status_code == 404


# -- requests that can never succeed, and those that may later ----------------------------


async def test_a_request_that_can_never_fit_is_400_naming_the_field(node: str) -> None:
    """The node has 1024 KV cells and takes 512 tokens per request (tests/nodes.py)."""
    async with gateway(node) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("/completions", {"prompt": PROMPT, "max_tokens": 5000}, "max_tokens"),
            ("/completions", {"prompt": "hello world " * 16_667, "max_tokens": 16}, "prompt"),  # 200,000 characters
            ("/chat/completions", {"messages": [{"role": "user", "content": "hi " * 70_000}]}, "messages"),
        ]
        for path, body, param in cases:
            for stream in (False, True):
                reply = await http.post(path, json={**TINY, **body, "stream": stream})
                error = reply.json()["error"]
                assert reply.status_code == 400, (param, error)
                assert (error["type"], error["param"]) == ("invalid_request_error", param), error
                assert error["code"] == "context_length_exceeded", error
                assert "Retry-After" not in reply.headers
        ok = await http.post("/completions", json={**TINY, "prompt": PROMPT, "max_tokens": 4})
        assert ok.status_code == 200  # nothing was left behind


async def test_a_prompt_longer_than_one_request_goes_in_steps(node: str, tiny_model: Path) -> None:
    """The node takes 512 tokens per request: the gateway sends the prompt's head in steps of that
    many, then `generate`s from there, and answers what a node taking it all at once answers."""
    wide = NodeProcess(tiny_model, f"tcp://127.0.0.1:{_free_port()}", ["--max-step-tokens", "1024"])
    body = {**TINY, "prompt": "x" * 600, "max_tokens": 8, "ignore_eos": True}
    answers, steps = [], []
    with running(wide):
        for address in (node, wide.address):
            async with gateway(address) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
                for sampling in ({"temperature": 0}, {"temperature": 1, "seed": 5}):
                    reply = await http.post("/completions", json={**body, **sampling})
                    assert reply.status_code == 200, reply.text
                    answers.append((reply.json()["choices"][0]["text"], reply.json()["usage"]))
                metrics = (await http.get(base.removesuffix("/v1") + "/metrics")).text
                steps.append(_node_calls(metrics).get("step", 0))
    assert answers[:2] == answers[2:] and answers[0][1]["prompt_tokens"] > 512
    assert steps == [2, 0]


async def test_kv_that_is_only_taken_for_now_stays_429(tiny_model: Path) -> None:
    proc = NodeProcess(tiny_model, f"tcp://127.0.0.1:{_free_port()}")
    with running(proc), trio.fail_after(60):
        async with gateway(proc.address) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
            async with open_client(proc.address) as holder:
                await holder.open("held", 1000)
                reply = await http.post("/completions", json={**TINY, "prompt": PROMPT, "max_tokens": 100})
                assert reply.status_code == 429 and reply.json()["error"]["code"] == "kv_budget"
                assert int(reply.headers["Retry-After"]) >= 1
                await holder.close("held")
            reply = await http.post("/completions", json={**TINY, "prompt": PROMPT, "max_tokens": 4}, timeout=60)
            assert reply.status_code == 200


# -- the plain chat form ------------------------------------------------------------------

# A model whose next token depends on the current one alone (attention and feed-forward
# outputs are zero, so the last hidden state is the token's embedding), wired to answer
# the plain form's closing "assistant:" with " hi" and then write a fake turn, forever:
# " hi\nuser: hi\nuser: ...".
CYCLE = ": hi\nuser"


@pytest.fixture(scope="module")
def parrot(model_dir: Path) -> Path:
    path = write_tiny_model(model_dir / "tiny-parrot.gguf")
    tokens = vocabulary()[0]
    byte = {b: tokens.index(f"<0x{b:02X}>") for b in range(256)}
    reader = GGUFReader(path, "r+")
    tensors = {t.name: t.data for t in reader.tensors}
    embd = np.asarray(tensors["token_embd.weight"], np.float64)
    for name, data in tensors.items():
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            data[...] = 0
    tensors["output_norm.weight"][...] = 1
    out = tensors["output.weight"]
    out[...] = 0
    chars = CYCLE.encode()
    for a, b in zip(chars, chars[1:] + chars[:1], strict=True):
        out[byte[b]] = 10 * embd[byte[a]] / np.linalg.norm(embd[byte[a]])
    reader.data.flush()
    del reader
    return path


@pytest.fixture(scope="module")
def parrot_node(parrot: Path) -> Iterator[str]:
    proc = NodeProcess(parrot, f"tcp://127.0.0.1:{_free_port()}")
    with running(proc):
        yield proc.address


async def test_the_plain_chat_form_stops_at_the_next_turn(parrot_node: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with gateway(parrot_node) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        # The same prompt as a completion: the model does write the next turn itself.
        raw = await http.post(
            "/completions", json={**TINY, "prompt": "user: hi\nassistant:", "max_tokens": 12, "temperature": 0}
        )
        assert raw.json()["choices"][0]["text"] == "hi\nuser: hi"  # an answer's first space is dropped
        body: dict[str, Any] = {**TINY, "messages": messages, "max_tokens": 12, "temperature": 0}
        full = (await http.post("/chat/completions", json=body)).json()
        assert full["choices"][0]["message"]["content"] == "hi"
        assert full["choices"][0]["finish_reason"] == "stop"
        streamed = (await http.post("/chat/completions", json={**body, "stream": True})).text
        assert '"content":"\\nuser' not in streamed and "user:" not in streamed
        assert '"finish_reason":"stop"' in streamed


# -- a taken port -------------------------------------------------------------------------


def test_the_gateway_on_a_taken_port_exits_with_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "neuron_tai.cli", "gateway", "--node", "tcp://127.0.0.1:9", "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
