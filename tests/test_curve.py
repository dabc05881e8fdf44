"""CurveZMQ on real node processes: who gets in, what a chain computes, and revocation.

A peer the node does not admit gets no reply at all (ZeroMQ drops it in the handshake),
so those checks wait a bounded time for a reply that must not come, then ask the node,
as an allowed peer, that nothing of theirs arrived.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from bench.processes import free_ports
from neuron_tai.cli import main
from neuron_tai.client import Client, open_client
from neuron_tai.config import NodeConfig
from neuron_tai.node import open_node
from neuron_tai.security import AllowList, KeyFileError, create_key_pair, is_loopback, read_allowed_keys
from tests.nodes import NodeProcess, running
from tests.test_node import engine_config, logits_run, prompt

NO_REPLY_S = 1.5  # how long a refused peer waits for the reply that must not come


@dataclass(frozen=True, slots=True)
class Keys:
    root: Path

    def public(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def pair(self, name: str) -> Path:
        return self.root / f"{name}.key_secret"

    def allow(self, *names: str) -> Path:
        """A directory holding the public keys of `names` (what an operator hands a node)."""
        directory = self.root / ("allow-" + "-".join(names))
        directory.mkdir()
        for name in names:
            shutil.copy(self.public(name), directory)
        return directory

    def serve(self, name: str, allow: Path, *extra: str) -> list[str]:
        return ["--curve-secret", str(self.pair(name)), "--allow", str(allow), *extra]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    root = tmp_path_factory.mktemp("keys")
    for name in ("node", "other-node", "alice", "bob", "mallory", "head", "mid", "tail", "client"):
        create_key_pair(root, name)
    return Keys(root)


@asynccontextmanager
async def as_peer(
    address: str, keys: Keys, me: str | None, server: str | None, timeout_s: float = 10
) -> AsyncIterator[Client]:
    async with open_client(
        address,
        timeout_s=timeout_s,
        retries=0,
        key=keys.pair(me) if me else None,
        server_key=keys.public(server) if server else None,
    ) as client:
        yield client


async def refused(address: str, keys: Keys, me: str | None, server: str | None) -> None:
    """The peer's open gets no reply within NO_REPLY_S."""
    async with as_peer(address, keys, me, server, timeout_s=NO_REPLY_S) as peer:
        with pytest.raises(TimeoutError):
            await peer.open("intruder", 16)


def test_only_allowed_keys_reach_the_node(tiny_model: Path, keys: Keys) -> None:
    node = NodeProcess(tiny_model, "tcp://127.0.0.1:0", keys.serve("node", keys.allow("alice")))

    async def check() -> None:
        addr = node.address
        async with trio.open_nursery() as nursery:  # the three wait out their bound together
            nursery.start_soon(refused, addr, keys, None, None)  # plain: no CURVE at all
            nursery.start_soon(refused, addr, keys, "mallory", "node")  # a key the node does not list
            nursery.start_soon(refused, addr, keys, "alice", "other-node")  # the wrong server key
        async with as_peer(addr, keys, "alice", "node") as alice:
            stats = await alice.stats()
            assert stats["curve"] and stats["curve_allowed_keys"] == 1
            assert stats["sessions_active"] == 0 and stats["admissions_total"] == 0  # nothing of theirs arrived
            assert stats["auth_failures_total"] >= 1  # mallory, seen by the ZAP handler
            text = "".join([p async for p in alice.generate("the cat", 4)])
            assert text
            assert (await alice.stats())["admissions_total"] == 1

    with running(node):
        trio.run(check)
        assert node.stop() == 0


def test_revoked_key_cannot_connect_again_while_others_can(tiny_model: Path, keys: Keys) -> None:
    allowed = keys.allow("alice", "bob")
    node = NodeProcess(tiny_model, "tcp://127.0.0.1:0", keys.serve("node", allowed))

    async def check() -> None:
        addr = node.address
        async with as_peer(addr, keys, "alice", "node") as alice, as_peer(addr, keys, "bob", "node") as bob_before:
            await bob_before.open("kept", 16)
            (allowed / "bob.key").unlink()
            node.reload_keys()
            for _ in range(200):  # until the node has reread its keys
                if (await alice.stats())["curve_allowed_keys"] == 1:
                    break
                await trio.sleep(0.05)
            assert (await alice.stats())["curve_allowed_keys"] == 1
            failures = (await alice.stats())["auth_failures_total"]
            await refused(addr, keys, "bob", "node")  # a new connection with the revoked key
            assert (await alice.stats())["auth_failures_total"] > failures
            async with as_peer(addr, keys, "alice", "node") as alice_again:  # a new one with a listed key
                assert await alice_again.ping() >= 0
            # ZeroMQ authenticates at the handshake: bob's connection from before the revocation stays up.
            assert (await bob_before.step("kept", 0, tokens=[1, 5])).token is not None

    with running(node):
        trio.run(check)
        assert node.stop() == 0


def test_three_stage_chain_with_keys_on_every_link_is_bit_identical(tiny_shards3: list[Path], keys: Keys) -> None:
    addr = [f"tcp://127.0.0.1:{p}" for p in free_ports(6)]
    plain = [
        NodeProcess(tiny_shards3[2], addr[2]),
        NodeProcess(tiny_shards3[1], addr[1], ["--next", addr[2]]),
        NodeProcess(tiny_shards3[0], addr[0], ["--next", addr[1]]),
    ]
    curve = [
        NodeProcess(tiny_shards3[2], addr[5], keys.serve("tail", keys.allow("mid"))),
        NodeProcess(tiny_shards3[1], addr[4],
                    keys.serve("mid", keys.allow("head"), "--next", addr[5], "--next-key", str(keys.public("tail")))),
        NodeProcess(tiny_shards3[0], addr[3],
                    keys.serve("head", keys.allow("client"), "--next", addr[4], "--next-key", str(keys.public("mid")))),
    ]  # fmt: skip

    async def compare() -> None:
        async with open_client(addr[0]) as one, as_peer(addr[3], keys, "client", "head") as chain:
            for seed in (1, 2):
                ids = prompt(seed, 9)
                assert [a.tobytes() for a in await logits_run(one, "s", ids, 16)] == [
                    b.tobytes() for b in await logits_run(chain, "s", ids, 16)
                ]
            text_plain = "".join([p async for p in one.generate("the cat", 8)])
            text_curve = "".join([p async for p in chain.generate("the cat", 8)])
            assert text_plain == text_curve
            assert "address" not in (await one.stats())["downstream"]  # an unauthenticated peer is not told
            assert (await chain.stats())["downstream"]["address"] == addr[4]
        await refused(addr[4], keys, "client", "mid")  # the client cannot go round the head

    with running(*plain, *curve):
        trio.run(compare)
        assert all(n.stop() == 0 for n in [*reversed(plain), *reversed(curve)])


def test_keygen_allow_lists_and_flag_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keygen", str(tmp_path / "k"), "--name", "a"]) == 0
    public, pair = tmp_path / "k" / "a.key", tmp_path / "k" / "a.key_secret"
    assert public.exists() and pair.stat().st_mode & 0o077 == 0
    assert main(["keygen", str(tmp_path / "k"), "--name", "a"]) == 2  # never overwrites a key
    assert "exists" in capsys.readouterr().err
    create_key_pair(tmp_path / "k", "b")
    assert read_allowed_keys(tmp_path / "k") == read_allowed_keys(public) | read_allowed_keys(tmp_path / "k" / "b.key")
    assert len(read_allowed_keys(tmp_path / "k")) == 2
    with pytest.raises(KeyFileError):
        AllowList(tmp_path)  # no .key files: it would admit nobody
    allow = AllowList(tmp_path / "k")
    shutil.rmtree(tmp_path / "k")
    assert allow.reload() == 2  # an unreadable list keeps the current one
    assert allow.callback("*", b"not a listed key") is False and allow.failures == 1

    serve = ["serve", str(tmp_path / "m.gguf")]
    assert main([*serve, "--curve-secret", str(pair)]) == 2
    assert "--allow" in capsys.readouterr().err
    assert main([*serve, "--next-key", str(public)]) == 2
    assert "--next-key" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("address", "local"),
    [("tcp://127.0.0.1:5555", True), ("tcp://localhost:1", True), ("tcp://[::1]:5", True), ("ipc:///tmp/n", True),
     ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.0.0.2:5555", False), ("tcp://eth0:1", False)],
)  # fmt: skip
def test_loopback_addresses(address: str, local: bool) -> None:
    assert is_loopback(address) == local


async def test_a_plain_node_warns_when_reachable_beyond_loopback(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for bind, warned in (("tcp://127.0.0.1:0", False), ("tcp://0.0.0.0:0", True)):
        caplog.clear()
        async with open_node(NodeConfig(engine_config(tiny_model), bind=bind)) as node:
            assert not node.stats()["curve"] and "curve_allowed_keys" not in node.stats()
        assert any("unauthenticated" in r.getMessage() for r in caplog.records) == warned, bind
