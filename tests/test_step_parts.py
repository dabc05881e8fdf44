"""A chain stage sends a long step on in parts: where it cuts, what the requester sees, and a
part the next stage refuses undoing the whole step here."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
import zmq
from hypothesis import given
from hypothesis import strategies as st

from neuron_tai.client import NodeError, open_client
from neuron_tai.config import NodeConfig
from neuron_tai.node import open_node
from neuron_tai.step_parts import step_parts
from tests.test_node import engine_config, next_request, prompt


@given(st.integers(0, 10_000), st.integers(1, 2_000), st.integers(0, 300))
def test_parts_cover_the_step_in_order_none_longer_than_asked(pos: int, n: int, rows: int) -> None:
    parts = step_parts(pos, n, rows)
    assert parts[0][0] == pos and sum(count for _, count in parts) == n
    assert all(a + m == b for (a, m), (b, _) in itertools.pairwise(parts))  # contiguous
    if rows == 0 or n <= rows:
        assert parts == [(pos, n)]
    else:
        assert len(parts) == -(-n // rows) and all(count == rows for _, count in parts[:-1])


def test_parts_of_nothing_are_refused() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        step_parts(0, 0, 4)


async def _chain_prompt(shards: list[Path], part_rows: int, ids: list[int]) -> tuple[Any, list[tuple[int, int]]]:
    """The reply to one prompt step through a 2-stage chain, and the (pos, rows) the tail computed."""
    tail_cfg = NodeConfig(engine_config(shards[1], record_iterations=True), bind="tcp://127.0.0.1:0")
    async with open_node(tail_cfg) as tail:
        head_cfg = NodeConfig(
            engine_config(shards[0]), bind="tcp://127.0.0.1:0", next=tail.address, part_rows=part_rows
        )
        async with open_node(head_cfg) as head, open_client(head.address, timeout_s=10) as client:
            await client.open("s", 32)
            reply = await client.step("s", 0, tokens=ids, out="logits")
            computed = [(pos, rows) for call in tail.engine.iterations for _key, pos, rows, *_ in call.chunks]
    return reply, computed


async def test_a_long_prompt_goes_on_in_parts_and_is_answered_as_one_step(tiny_shards2: list[Path]) -> None:
    ids = prompt(3, 11)
    whole, whole_calls = await _chain_prompt(tiny_shards2, 0, ids)
    parted, parted_calls = await _chain_prompt(tiny_shards2, 4, ids)
    assert whole_calls == [(0, 11)]
    assert parted_calls == [(0, 4), (4, 4), (8, 3)]  # three steps at the tail, in order
    assert parted.result is not None and (parted.result.pos, parted.result.n) == (0, 11)  # not the last part's
    assert parted.logits is not None and whole.logits is not None
    assert int(np.argmax(parted.logits)) == int(np.argmax(whole.logits))
    np.testing.assert_allclose(parted.logits, whole.logits, rtol=1e-4, atol=1e-4)


def _answer(sock: zmq.Socket[bytes], peer: bytes, req: dict[str, Any], reply: dict[str, Any], *frames: bytes) -> None:
    sock.send_multipart([peer, msgpack.packb({"v": 1, "rid": req["rid"], "session": req["session"], **reply}), *frames])


async def test_a_part_the_next_stage_refuses_undoes_the_whole_step_here(tiny_shards2: list[Path]) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    fake_next = ctx.socket(zmq.ROUTER)  # a next stage the test answers by hand
    fake_next.setsockopt(zmq.LINGER, 0)
    port = fake_next.bind_to_random_port("tcp://127.0.0.1")
    cfg = NodeConfig(
        engine_config(tiny_shards2[0]), bind="tcp://127.0.0.1:0", next=f"tcp://127.0.0.1:{port}", part_rows=2
    )
    try:
        async with open_node(cfg) as head, open_client(head.address, timeout_s=5, retries=0) as c:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(c.open, "s", 20))
                peer, req = await next_request(fake_next)
                stage = {"last": True, "layers": [2, 4]}
                _answer(fake_next, peer, req, {"op": "opened", "kv_reserved": 20, "stage": stage, "lease_ms": 60_000})
            failed: list[NodeError] = []

            async def step() -> None:
                with pytest.raises(NodeError) as info:
                    await c.step("s", 0, tokens=[1, 5, 6, 7, 8])
                failed.append(info.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(step)
                peer, req = await next_request(fake_next)
                assert (req["pos"], req["n"], req["out"]) == (0, 2, "token")  # a part: its token is dropped
                token = np.array([7], "<i4").tobytes()
                _answer(fake_next, peer, req, {"op": "result", "pos": 0, "n": 2, "out": "token"}, token)
                peer, req = await next_request(fake_next)
                assert (req["pos"], req["n"]) == (2, 2)
                _answer(fake_next, peer, req, {"op": "error", "code": "position", "message": "refused by the test"})
            assert failed[0].code == "position"
            (session,) = head.engine.scheduler.sessions.values()
            assert session.length == 0  # both parts computed here were undone
    finally:
        fake_next.close()
