"""The node over tcp://127.0.0.1: protocol v1, chaining, errors, bad peers."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
import zmq

from bench.processes import free_ports
from engine.backend import DecodeFailed, DecodeOutcome
from engine.config import EngineConfig
from neuron_tai.client import Client, NodeError, open_client
from neuron_tai.config import NodeConfig
from neuron_tai.node import Node, open_node
from tests.held import held_decodes, wait_until
from tests.nodes import NodeProcess, running
from transport import wire


def engine_config(model: Path, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = {
        "max_sessions": 4, "kv_cells": 1024, "n_batch": 64, "n_ubatch": 64, "kv_type": "f32", "flash_attn": False,
        "max_step_tokens": 128, "queue_budget_bytes": 1 << 20, "drain_timeout_s": 5.0,
    }  # fmt: skip
    return EngineConfig(model=model, **{**base, **kw})


@asynccontextmanager
async def node_and_client(model: Path, **kw: Any) -> AsyncIterator[tuple[Node, Client]]:
    async with (
        open_node(NodeConfig(engine_config(model, **kw), bind="tcp://127.0.0.1:0")) as node,
        open_client(node.address, timeout_s=10) as client,
    ):
        yield node, client


def prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1, *rng.integers(3, 268, n - 1).tolist()]


async def logits_run(client: Client, session: str, ids: list[int], steps: int) -> list[np.ndarray]:
    await client.open(session, len(ids) + steps + 1)
    r = await client.step(session, 0, tokens=ids, out="logits")
    trace = []
    for i in range(steps):
        assert r.logits is not None
        trace.append(r.logits)
        r = await client.step(session, len(ids) + i, tokens=[int(np.argmax(r.logits))], out="logits")
    await client.close(session)
    return trace


def test_three_stage_chain_is_bit_identical_to_one_node(
    tiny_model: Path, tiny_shards3: list[Path], tmp_path: Path
) -> None:
    addr = [f"tcp://127.0.0.1:{p}" for p in free_ports(4)]
    single = NodeProcess(tiny_model, addr[0])
    tail = NodeProcess(tiny_shards3[2], addr[3])
    mid = NodeProcess(tiny_shards3[1], addr[2], ["--next", addr[3]])
    head = NodeProcess(tiny_shards3[0], addr[1], ["--next", addr[2]])

    async def compare() -> None:
        async with open_client(addr[0]) as one, open_client(addr[1]) as chain:
            for seed in (1, 2):
                ids = prompt(seed, 9)
                assert [a.tobytes() for a in await logits_run(one, "s", ids, 16)] == [
                    b.tobytes() for b in await logits_run(chain, "s", ids, 16)
                ]
            opened = await chain.open("x", 10)
            assert opened.stage.first and opened.stage.last and opened.stage.layers == (0, 4)
            text_one = "".join([p async for p in one.generate("the cat", 8)])
            text_chain = "".join([p async for p in chain.generate("the cat", 8)])
            assert text_one == text_chain

    with running(single, tail, mid, head):
        trio.run(compare)
        assert head.stop() == 0 and mid.stop() == 0 and tail.stop() == 0 and single.stop() == 0


def test_only_a_chains_head_runs_micro_batches_by_default(tiny_shards3: list[Path]) -> None:
    """A stage fed by another runs each group as it comes (groups of its own would cut them up);
    a lone node has nothing to overlap. An operator's --micro-batches is kept everywhere."""

    async def main() -> None:
        tail_cfg = NodeConfig(engine_config(tiny_shards3[2]), bind="tcp://127.0.0.1:0")
        async with open_node(tail_cfg) as tail:
            mid_cfg = NodeConfig(engine_config(tiny_shards3[1]), bind="tcp://127.0.0.1:0", next=tail.address)
            told = NodeConfig(
                engine_config(tiny_shards3[1], micro_batches=3), bind="tcp://127.0.0.1:0", next=tail.address
            )
            async with open_node(mid_cfg) as mid, open_node(told) as told_mid:
                head_cfg = NodeConfig(engine_config(tiny_shards3[0]), bind="tcp://127.0.0.1:0", next=mid.address)
                async with open_node(head_cfg) as head:
                    got = [n.stats()["micro_batches"] for n in (head, mid, tail, told_mid)]
        assert got == [2, 1, 1, 3]

    trio.run(main)


def test_killed_downstream_rolls_back_and_recovers_after_restart(tiny_shards2: list[Path]) -> None:
    addr = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    tail = NodeProcess(tiny_shards2[1], addr[1])
    head = NodeProcess(tiny_shards2[0], addr[0], ["--next", addr[1]])
    ids = prompt(5, 7)

    with running(tail, head):

        async def run_all() -> None:
            expected = await before_kill_same_client()
            tail.kill()
            await while_dead_same_client(expected)
            tail.start()
            await after_restart_same_client(expected)

        # One connection for the whole story: sessions belong to the connection that opened them.
        client_box: dict[str, Client] = {}

        async def before_kill_same_client() -> list[int]:
            c = client_box["c"]
            await c.open("s", 64)
            first = await c.step("s", 0, tokens=ids)
            second = await c.step("s", 7, tokens=[first.token or 0])
            return [first.token or 0, second.token or 0]

        async def while_dead_same_client(expected: list[int]) -> None:
            c = client_box["c"]
            c.retries = 0
            with pytest.raises(NodeError) as info:
                await c.step("s", 8, tokens=[expected[1]])
            assert info.value.code == "downstream"
            stats = await c.stats()
            assert stats["sessions_active"] == 1 and stats["downstream"]["failures_total"] >= 1
            # Rolled back: the session still holds 8 positions, so pos 9 is a gap.
            with pytest.raises(NodeError) as gap:
                await c.step("s", 9, tokens=[1])
            assert gap.value.code == "position"

        async def after_restart_same_client(expected: list[int]) -> None:
            c = client_box["c"]
            again = await c.step("s", 0, tokens=ids)
            assert again.token == expected[0]
            second = await c.step("s", 7, tokens=[expected[0]])
            assert second.token == expected[1]

        async def main() -> None:
            async with open_client(addr[0], timeout_s=20) as c:
                client_box["c"] = c
                await run_all()

        trio.run(main)


async def raw_request(address: str, frames: list[bytes]) -> dict[str, Any]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        for _ in range(500):
            try:
                reply = sock.recv_multipart(zmq.NOBLOCK)
                return msgpack.unpackb(reply[0])  # type: ignore[no-any-return]
            except zmq.Again:
                await trio.sleep(0.01)
        raise AssertionError("no reply")
    finally:
        sock.close()


async def test_every_error_code_is_answered(tiny_model: Path, tiny_shards2: list[Path]) -> None:
    limits = {"max_sessions": 2, "kv_cells": 512, "max_step_tokens": 32, "max_prefill_tokens": 2}
    async with node_and_client(tiny_model, **limits) as (node, c):
        seen: dict[str, dict[str, Any]] = {}

        async def expect(code: str, coro: Any) -> None:
            with pytest.raises(NodeError) as info:
                await coro
            assert info.value.code == code, info.value
            seen[code] = {"retry": info.value.retry_after_ms}

        reply = await raw_request(node.address, [b"\x93garbage"])
        assert reply["op"] == "error" and reply["code"] == "bad_request" and reply["rid"] is None
        seen["bad_request"] = {}
        reply = await raw_request(node.address, [msgpack.packb({"v": 9, "op": "ping", "rid": 4})])
        assert reply["code"] == "unsupported_version" and reply["rid"] == 4
        seen["unsupported_version"] = {}
        await expect("unknown_session", c.step("nope", 0, tokens=[1]))
        await c.open("a", 100)
        await expect("session_exists", c.open("a", 10))
        await expect("position", c.step("a", 3, tokens=[1]))
        await expect("too_large", c.step("a", 0, tokens=[1] * 33))
        await expect("wrong_stage", c.step("a", 0, tokens=[1], out="hidden"))
        await expect("kv_budget", c.open("b", 500))
        await c.open("b", 100)
        await expect("session_limit", c.open("c", 10))
        assert seen["kv_budget"]["retry"] and seen["session_limit"]["retry"]
        # busy: a second step for a session whose step is still queued.
        # (2 prefill tokens per iteration: the 32-token step stays queued for 16 iterations.)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(c.step, "a", 0, tokens=prompt(1, 32)))
            while node.engine.scheduler.pending_steps == 0:
                await trio.sleep(0)
            await expect("busy", c.step("a", 0, tokens=[1]))
        assert seen["busy"]["retry"]
        # internal: the backend fails one batch; the session is rolled back.
        original = node.engine.backend.decode

        def failing(segments: Any) -> Any:
            node.engine.backend.decode = original  # type: ignore[method-assign]
            raise DecodeFailed(DecodeOutcome.FATAL, -3)

        node.engine.backend.decode = failing  # type: ignore[method-assign]
        await expect("internal", c.step("b", 0, tokens=[1, 5, 6]))
        await expect("position", c.step("b", 1, tokens=[5]))  # nothing was kept
        assert (await c.step("b", 0, tokens=[1, 5, 6])).token is not None
        # shutting_down: the engine drains and refuses new work.
        node.engine.begin_shutdown()
        await expect("shutting_down", c.open("z", 10))
    # downstream: a chain whose next stage is not there.
    cfg = NodeConfig(
        engine_config(tiny_shards2[0]),
        bind="tcp://127.0.0.1:0",
        next=f"tcp://127.0.0.1:{free_ports(1)[0]}",
        downstream_timeout_s=0.5,
    )
    async with open_node(cfg) as head, open_client(head.address, timeout_s=5, retries=0) as c:
        await expect("downstream", c.open("s", 10))
        assert (await c.stats())["sessions_active"] == 0
    protocol_codes = {
        "bad_request",
        "unsupported_version",
        "unknown_session",
        "session_exists",
        "position",
        "too_large",
        "wrong_stage",
        "busy",
        "kv_budget",
        "session_limit",
        "downstream",
        "internal",
        "shutting_down",
    }
    assert protocol_codes <= set(seen)


async def test_malformed_traffic_does_not_disturb_valid_sessions(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (node, client):
        clean = await logits_run(client, "ref", prompt(3, 8), 12)
        rng = np.random.default_rng(0)
        stop = trio.Event()
        sent = 0

        async def fuzzer(seed: int) -> None:
            nonlocal sent
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(node.address)
            r = np.random.default_rng(seed)
            ops = ["open", "step", "close", "tokenize", "detokenize", "stats", "ping", "bogus"]
            try:
                while not stop.is_set():
                    kind = r.integers(0, 3)
                    if kind == 0:
                        frames = [r.bytes(int(r.integers(0, 40))) for _ in range(int(r.integers(1, 4)))]
                    else:
                        header = {
                            "v": int(r.choice([1, 1, 2])),
                            "op": str(r.choice(ops)),
                            "rid": int(r.integers(0, 9)),
                            "session": str(r.choice(["ref", "x", ""])),
                            "pos": int(r.integers(-2, 20)),
                            "n": int(r.integers(-1, 5)),
                            "input": "tokens",
                            "out": "token",
                            "max_tokens": int(r.integers(-5, 3000)),
                        }
                        frames = [msgpack.packb(header), r.bytes(int(r.integers(0, 24)))]
                    sock.send_multipart(frames)
                    sent += 1
                    while True:
                        try:
                            sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    await trio.sleep(0.001)
            finally:
                sock.close()

        async with trio.open_nursery() as nursery:
            for seed in range(4):
                nursery.start_soon(fuzzer, seed)
            during = await logits_run(client, "ref", prompt(3, 8), 12)
            stop.set()
        del rng
        assert sent > 50
        assert [a.tobytes() for a in clean] == [b.tobytes() for b in during]
        assert await client.ping() >= 0


async def test_vanished_client_has_its_sessions_freed(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (node, watcher):
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(node.address)
        sock.send_multipart([msgpack.packb({"v": 1, "op": "open", "rid": 1, "session": "gone", "max_tokens": 200})])
        for _ in range(200):
            if (await watcher.stats())["sessions_active"] == 1:
                break
            await trio.sleep(0.01)
        step = {"v": 1, "op": "step", "rid": 2, "session": "gone", "pos": 0, "n": 40, "input": "tokens", "out": "token"}
        sock.send_multipart([msgpack.packb(step), np.array(prompt(1, 40), "<i4").tobytes()])
        sock.close()  # vanish before the reply
        for _ in range(300):
            stats = await watcher.stats()
            if stats["sessions_active"] == 0:
                break
            await trio.sleep(0.01)
        assert stats["sessions_active"] == 0 and stats["kv_cells_reserved"] == 0
        assert stats["peers_gone_total"] >= 1


async def test_sessions_are_bound_to_their_connection(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (node, alice), open_client(node.address) as bob:
        await alice.open("s", 20)
        with pytest.raises(NodeError) as info:
            await bob.step("s", 0, tokens=[1])
        assert info.value.code == "unknown_session"
        assert await bob.close("s") is False
        assert (await alice.step("s", 0, tokens=[1, 5])).token is not None
        assert await alice.close("s") is True


async def test_ping_is_answered_while_the_engine_is_saturated(tiny_model: Path) -> None:
    """The engine is stuck in a decode and the connection holds its cap of handlers: ping and
    stats are still answered, and stats show the saturation at that moment."""
    cfg = NodeConfig(engine_config(tiny_model), bind="tcp://127.0.0.1:0", max_handlers_per_peer=4)
    async with open_node(cfg) as node, open_client(node.address, timeout_s=30, retries=0) as c:
        for i in range(4):
            await c.open(f"s{i}", 200)
        tokens: list[int | None] = []

        async def step(i: int) -> None:
            tokens.append((await c.step(f"s{i}", 0, tokens=prompt(i, 20))).token)

        with held_decodes(node.engine) as (entered, release):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(step, 0)
                await wait_until(entered.is_set)  # the engine is inside llama_decode, and stays there
                for i in range(1, 4):
                    nursery.start_soon(step, i)
                while (await c.stats())["handlers_active"] < 4:
                    await trio.sleep(0.01)
                with pytest.raises(NodeError) as info:
                    await c.open("s4", 10)  # a fifth request on this connection: refused at once
                assert info.value.code == "busy" and info.value.retry_after_ms
                assert await c.ping() >= 0
                stats = await c.stats()
                assert stats["handlers_active"] == 4 and stats["handlers_refused_total"] == 1
                assert stats["queue_depth"] >= 1 and stats["errors_total"]["busy"] == 1
                release.set()
        assert len(tokens) == 4 and all(t is not None for t in tokens)
        assert (await c.stats())["handlers_active"] == 0


async def test_tokenize_and_detokenize(tiny_model: Path) -> None:
    async with node_and_client(tiny_model) as (_node, c):
        ids = await c.tokenize("the cat and the hat")
        assert ids[0] == 1
        assert (await c.detokenize(ids[1:])).strip() == "the cat and the hat"
        with pytest.raises(NodeError) as info:
            await c.detokenize([99999])
        assert info.value.code == "bad_request"


async def test_text_waiting_for_the_tokenizer_is_bounded(tiny_model: Path) -> None:
    config = NodeConfig(
        engine_config(tiny_model), bind="tcp://127.0.0.1:0", max_text_pending_bytes=1, max_text_tokens=2**20
    )
    text = "the cat sat on the mat " * 20_000  # each request alone is over the pending limit: one at a time
    answers: list[str] = []
    async with open_node(config) as node, open_client(node.address, timeout_s=60) as c:

        async def tokenize() -> None:
            try:
                reply = await c.call(wire.Tokenize(0, text), retry=False)
                if isinstance(reply, wire.ErrorReply):
                    raise reply.fault()
                answers.append(
                    "tokens" if isinstance(reply, wire.Tokens) and len(reply.tokens) * 4 > len(text) else "short"
                )
            except NodeError as exc:
                answers.append(exc.code)

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(tokenize)
        assert "tokens" in answers and "busy" in answers and set(answers) == {"tokens", "busy"}, answers
        stats = await c.stats()
        assert stats["text_pending_bytes"] == 0 and stats["errors_total"]["busy"] == answers.count("busy")


def test_cli_serve_help_and_stats(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neuron_tai.cli import main  # noqa: PLC0415

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--batch-invariant" in help_text and "--max-peer-reply-bytes" in help_text
    node_port, metrics_port, nobody = free_ports(3)
    node = NodeProcess(tiny_model, f"tcp://127.0.0.1:{node_port}", ["--metrics-port", str(metrics_port)])
    with running(node):
        assert main(["stats", "--json", "--addr", node.address]) == 0
        out = capsys.readouterr().out
        assert "sessions_active" in out and "kv_budget_bytes" in out
        for bound in ("max_peer_reply_bytes", "max_reply_bytes", "max_peer_request_bytes", "max_request_bytes"):
            assert bound in out, bound
        assert main(["generate", "--addr", node.address, "--max-tokens", "4", "the cat"]) == 0
        on_node = capsys.readouterr().out
        assert main(["generate", "--addr", node.address, "--max-tokens", "4", "--step-loop", "the cat"]) == 0
        assert capsys.readouterr().out == on_node  # greedy: the same text either way
        assert node.stop() == 0
    assert main(["stats", "--addr", f"tcp://127.0.0.1:{nobody}", "--timeout", "0.2"]) == 1
    assert f"no node answered at tcp://127.0.0.1:{nobody}" in capsys.readouterr().err


async def test_a_fault_while_handling_a_message_is_internal_for_that_message(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with node_and_client(tiny_model) as (node, client):
        original = node._dispatch

        def faulty(peer: bytes, request: Any) -> None:
            if getattr(request, "session", None) == "bug":
                raise RecursionError("x" * 100_000)
            original(peer, request)

        monkeypatch.setattr(node, "_dispatch", faulty)
        with pytest.raises(NodeError) as info:
            await client.open("bug", 8)
        assert info.value.code == "internal" and len(str(info.value)) < 400
        await client.open("fine", 8)
        assert (await client.stats())["errors_total"]["internal"] == 1


async def test_oversized_message_drops_only_that_connection(tiny_model: Path) -> None:
    cfg = NodeConfig(engine_config(tiny_model), bind="tcp://127.0.0.1:0", max_message_bytes=4096)
    async with open_node(cfg) as node, open_client(node.address, timeout_s=5) as good:
        await good.open("s", 50)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(node.address)
        header = {"v": 1, "op": "detokenize", "rid": 1}
        bad.send_multipart([msgpack.packb(header), b"\0" * 100_000])
        await trio.sleep(0.2)
        with pytest.raises(zmq.Again):
            bad.recv_multipart(zmq.NOBLOCK)  # refused by ZeroMQ itself: no reply
        bad.close()
        assert (await good.step("s", 0, tokens=[1, 5])).token is not None
        assert (await good.stats())["max_message_bytes"] == 4096


def test_prometheus_endpoint_has_the_telemetry_names(tiny_model: Path) -> None:
    import urllib.request  # noqa: PLC0415

    node_port, port = free_ports(2)
    extra = ["--metrics-port", str(port), "--metrics-bind", "127.0.0.2"]  # another loopback address
    node = NodeProcess(tiny_model, f"tcp://127.0.0.1:{node_port}", extra)
    with running(node):
        text = ""
        for _ in range(50):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                trio.run(trio.sleep, 0.1)
        with pytest.raises(OSError):  # it listens on the address it was given only
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
        for name in (
            "sessions_active",
            "queue_depth",
            "batch_occupancy",
            "kv_pressure",
            "kv_budget_bytes",
            "decode_tokens_per_s",
            "step_seconds_bucket",
            "admissions",
            "auth_failures_total",
            "send_hwm",
            "reply_bytes",
            "max_reply_bytes",
            "request_bytes",
            "max_peer_request_bytes",
            "peer_quota_refused",
        ):
            assert f"neuron_tai_{name}" in text, name
        assert node.stop() == 0


async def next_request(fake_next: zmq.Socket[bytes]) -> tuple[bytes, dict[str, Any]]:
    """The next request a next stage the test answers by hand (a ROUTER socket) received."""
    for _ in range(500):
        try:
            frames = fake_next.recv_multipart(zmq.NOBLOCK)
            return frames[0], msgpack.unpackb(frames[1])
        except zmq.Again:
            await trio.sleep(0.01)
    raise AssertionError("nothing was forwarded")


async def test_chained_step_is_in_flight_until_the_next_stage_answers(tiny_shards2: list[Path]) -> None:
    """A step the head finished but the next stage has not answered yet still counts: `busy`."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    fake_next = ctx.socket(zmq.ROUTER)  # a next stage the test answers by hand
    fake_next.setsockopt(zmq.LINGER, 0)
    port = fake_next.bind_to_random_port("tcp://127.0.0.1")

    cfg = NodeConfig(engine_config(tiny_shards2[0]), bind="tcp://127.0.0.1:0", next=f"tcp://127.0.0.1:{port}")
    try:
        async with open_node(cfg) as head, open_client(head.address, timeout_s=5, retries=0) as c:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(c.open, "s", 20))
                peer, req = await next_request(fake_next)
                assert req["op"] == "open"
                opened = {
                    "v": 1,
                    "op": "opened",
                    "rid": req["rid"],
                    "session": req["session"],
                    "kv_reserved": 20,
                    "stage": {"last": True, "layers": [2, 4]},
                    "lease_ms": 60_000,
                }
                fake_next.send_multipart([peer, msgpack.packb(opened)])
            replies: list[Any] = []

            async def first_step() -> None:
                replies.append(await c.step("s", 0, tokens=[1, 5, 6]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first_step)
                peer, req = await next_request(fake_next)  # computed here, now held by the next stage
                assert req["op"] == "step" and req["input"] == "hidden" and req["n"] == 3
                with pytest.raises(NodeError) as info:
                    await c.step("s", 0, tokens=[1, 5, 6])
                assert info.value.code == "busy"
                result = {
                    "v": 1,
                    "op": "result",
                    "rid": req["rid"],
                    "session": req["session"],
                    "pos": 0,
                    "n": 3,
                    "out": "token",
                }
                fake_next.send_multipart([peer, msgpack.packb(result), np.array([7], "<i4").tobytes()])
            assert replies[0].token == 7
    finally:
        fake_next.close()


async def test_micro_batched_chain_is_bit_identical_to_one_node(tiny_model: Path, tiny_shards2: list[Path]) -> None:
    """Batch-invariant: sessions stepped together through a micro-batching head get the logits each
    gets alone on a single node, and the head never mixes its two groups in one call."""
    kw: dict[str, Any] = {"batch_invariant": True, "flash_attn": True, "max_prefill_tokens": 16}
    prompts = {f"s{i}": prompt(10 + i, 5 + 3 * i) for i in range(4)}
    steps = 12

    async def trace(client: Client, session: str, ids: list[int]) -> list[bytes]:
        r = await client.step(session, 0, tokens=ids, out="logits")
        out = []
        for i in range(steps):
            assert r.logits is not None
            out.append(r.logits.tobytes())
            r = await client.step(session, len(ids) + i, tokens=[int(np.argmax(r.logits))], out="logits")
        return out

    alone: dict[str, list[bytes]] = {}
    async with node_and_client(tiny_model, **kw) as (_node, client):
        for name, ids in prompts.items():
            await client.open(name, 64)
            alone[name] = await trace(client, name, ids)
    tail_cfg = NodeConfig(engine_config(tiny_shards2[1], **kw), bind="tcp://127.0.0.1:0")
    async with open_node(tail_cfg) as tail:
        head_cfg = NodeConfig(
            engine_config(tiny_shards2[0], record_iterations=True, **kw), bind="tcp://127.0.0.1:0", next=tail.address
        )
        async with open_node(head_cfg) as head, open_client(head.address, timeout_s=10) as client:
            assert head.stats()["micro_batches"] == 2 and tail.stats()["micro_batches"] == 1
            for name in prompts:
                await client.open(name, 64)
            group = {key[1]: s.group for key, s in head.engine.scheduler.sessions.items()}
            chained: dict[str, list[bytes]] = {}

            async def run(name: str) -> None:
                chained[name] = await trace(client, name, prompts[name])

            async with trio.open_nursery() as nursery:
                for name in prompts:
                    nursery.start_soon(run, name)
            calls = list(head.engine.iterations)
            tail_late = tail.stats()["late_sessions_total"]
    assert sorted(group.values()) == [0, 0, 1, 1]
    assert tail_late == 0, "a stage fed by another waits for nobody, so nobody is late there"
    assert chained == alone
    for call in calls:
        assert len({group[key[1]] for key, *_ in call.chunks}) == 1, "a call mixed micro-batches"
    assert sum(1 for call in calls for chunk in call.chunks if chunk[3]) == len(prompts) * steps


async def test_a_node_that_cannot_bind_fails_at_once_and_closes_its_socket(tiny_model: Path) -> None:
    """The second node on a port raises the bind error; its socket is closed, so leaving the
    ZeroMQ context does not wait for it (the hang guard is far above any normal start)."""
    async with open_node(NodeConfig(engine_config(tiny_model), bind="tcp://127.0.0.1:0")) as first:
        with trio.fail_after(120), pytest.raises(zmq.ZMQError) as failed:
            async with open_node(NodeConfig(engine_config(tiny_model), bind=first.address)):
                pass
        assert failed.value.errno == zmq.EADDRINUSE


async def test_steps_of_sessions_that_do_not_exist_leave_nothing_behind(tiny_model: Path) -> None:
    """Every step's end is noted for the idle clock, but only of a session that is open: a peer
    stepping made-up sessions must not grow the node's memory."""
    async with node_and_client(tiny_model) as (node, client):
        for i in range(3):
            with pytest.raises(NodeError):
                await client.step(f"never-{i}", 0, tokens=[1])
        peer = next(iter(node.leases.last_heard))
        assert [node.gate.answered_ms((peer, f"never-{i}")) for i in range(3)] == [None] * 3
        assert not node.gate.in_flight
