"""Replicas and recovery at the head: a chain loses a replica mid-generation and no session is lost.

Real node processes on the tiny quantized model, every stage batch-invariant, so a session
replayed onto another replica must go on with exactly the tokens of an undisturbed run.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from bench.processes import free_ports
from neuron_tai.client import Client, Done, Generated, NodeError, open_client
from tests.nodes import NodeProcess, running

SESSIONS = 8
NEW_TOKENS = 40
# Flash attention walks KV cells one by one: where a replayed session's cells land in the new
# replica's cache does not change its sums (without it they differ at 1e-6 with the layout).
INVARIANT = ["--batch-invariant", "--flash-attn", "on", "--max-sessions", str(SESSIONS)]


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[1, *rng.integers(3, 268, 5 + i).tolist()] for i in range(SESSIONS)]


async def generate(client: Client, name: str, ids: list[int], seen: list[int]) -> list[int]:
    """One session's generated tokens (appended to `seen` as they stream in)."""
    await client.open(name, len(ids) + NEW_TOKENS + 1)
    async for reply in client.generate_tokens(name, 0, ids, NEW_TOKENS, ignore_eog=True):
        if isinstance(reply, Generated):
            seen.extend(reply.tokens)
        else:
            assert isinstance(reply, Done) and reply.generated == NEW_TOKENS
    await client.close(name)
    return seen


async def all_sessions(client: Client, tag: str, seen: list[list[int]]) -> None:
    async with trio.open_nursery() as nursery:
        for i, ids in enumerate(prompts()):
            nursery.start_soon(generate, client, f"{tag}{i}", ids, seen[i])


def chain(shards: list[Path], tails: int) -> tuple[list[NodeProcess], list[NodeProcess]]:
    """A head, a middle stage and `tails` replicas of the tail: (every node, the tails)."""
    ports = free_ports(2 + tails)
    tail = [NodeProcess(shards[2], f"tcp://127.0.0.1:{p}", INVARIANT) for p in ports[2:]]
    nexts = [arg for t in tail for arg in ("--next", t.address)]
    mid = NodeProcess(shards[1], f"tcp://127.0.0.1:{ports[1]}", [*INVARIANT, *nexts])
    head = NodeProcess(shards[0], f"tcp://127.0.0.1:{ports[0]}", [*INVARIANT, "--next", mid.address])
    return [*tail, mid, head], tail


def test_killing_a_tail_replica_mid_generation_loses_no_token(tiny_quant_shards3: list[Path]) -> None:
    nodes, tails = chain(tiny_quant_shards3, tails=2)
    head = nodes[-1]

    async def scenario() -> None:
        async with open_client(head.address, timeout_s=60) as client:
            undisturbed: list[list[int]] = [[] for _ in range(SESSIONS)]
            await all_sessions(client, "calm", undisturbed)
            disturbed: list[list[int]] = [[] for _ in range(SESSIONS)]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(all_sessions, client, "storm", disturbed)
                while min(len(s) for s in disturbed) < 8:  # every stream is under way
                    await trio.sleep(0.01)
                placed = [r["sessions"] for r in (await mid_stats())["downstream"]["replicas"]]
                assert all(placed), (await mid_stats())["downstream"]["replicas"]  # both tails carry sessions
                assert tails[0].proc is not None
                tails[0].proc.send_signal(signal.SIGKILL)
            assert disturbed == undisturbed
            stats = await client.stats()
            assert stats["recoveries_total"] >= 1 and stats["recoveries_failed_total"] == 0
            assert stats["replayed_tokens_total"] > 0

    async def mid_stats() -> dict[str, Any]:
        async with open_client(nodes[-2].address, timeout_s=10) as mid:
            return await mid.stats()

    with running(*nodes):
        trio.run(scenario)


def test_with_no_route_left_a_step_fails_downstream_after_its_attempts(tiny_quant_shards3: list[Path]) -> None:
    nodes, tails = chain(tiny_quant_shards3, tails=1)
    head = nodes[-1]
    head.args += ["--recovery-attempts", "2", "--recovery-deadline", "5"]

    async def scenario() -> None:
        async with open_client(head.address, timeout_s=60) as client:
            ids = prompts()[0]
            await client.open("s", len(ids) + NEW_TOKENS + 1)
            first = await client.step("s", 0, tokens=ids)
            tails[0].kill()
            with pytest.raises(NodeError) as failed:
                await client.step("s", len(ids), tokens=[first.token or 0])
            assert failed.value.code == "downstream"
            stats = await client.stats()
            assert stats["recoveries_failed_total"] == 1 and stats["recoveries_total"] == 0

    with running(*nodes):
        trio.run(scenario)
