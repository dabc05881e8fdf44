"""An operator's mistakes at the command line, through the real `neuron-tai` process: each is
one line on stderr naming what to change, a non-zero exit, and never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_tai import __version__
from tests.nodes import NodeProcess, running

CLI = [sys.executable, "-m", "neuron_tai.cli"]
NOBODY = "tcp://127.0.0.1:9"  # the discard port: no node listens there


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], check=False, capture_output=True, text=True, timeout=120, env=env or dict(os.environ)
    )


def refused(result: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    """Exit `code`, one line on stderr that says `says`, no traceback, nothing on stdout."""
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert result.stdout == ""


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["generate", "hi", "--max-tokens", "-5"], "argument --max-tokens: must be at least 1, got -5"),
        (["generate", "hi", "--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
        (["generate", "hi", "--addr", "127.0.0.1:5555"], "did you mean tcp://127.0.0.1:5555?"),
        (["generate", "hi", "--top-p", "2"], "argument --top-p: must be at most 1.0"),
        (["generate"], "PROMPT is required"),
        (["stats", "localhost:5555"], "did you mean tcp://localhost:5555?"),
        (["ping", "tcp://127.0.0.1"], "needs a host and a port"),
        (["serve"], "MODEL is required"),
        (["serve", "no-such-model.gguf"], "no-such-model.gguf: no such file"),
        (["serve", "m.gguf", "--bind", "udp://127.0.0.1:5"], "the transport 'udp' is not served"),
        (["serve", "m.gguf", "--next", "127.0.0.1:5556"], "argument --next"),
        (["serve", "m.gguf", "--kv-cells", "lots"], "argument --kv-cells: expected a whole number, got 'lots'"),
        (["serve", "m.gguf", "--queue-budget", "2X"], "expected a size like 512M"),
        (["serve", "m.gguf", "--kernels", "fast"], "must be one of auto, repack, plain, amx"),
        (["serve", "m.gguf", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["gateway", "--node", "127.0.0.1:5555"], "did you mean tcp://127.0.0.1:5555?"),
        (["gateway"], "the following arguments are required: --node"),
        (["shard", "m.gguf", "-o", "out"], "give one of --layers A:B, --stages N or --split B1,B2"),
    ],
)
def test_a_mistake_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    refused(run(*args), 2, says)


def test_a_layer_range_is_checked_before_any_shard_is_written(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    result = run("serve", str(tiny_model), "--layers", "5:99", "--log-level", "info", env=env)
    refused(result, 2, "layer range 5:99 is not within the model's 4 layers")
    assert not (tmp_path / "neuron-tai").exists()


def test_a_file_that_is_no_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    refused(run("serve", str(tmp_path / "notes.txt")), 2, "not a GGUF file")


def test_config_file_mistakes(tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(f'model = "{tiny_model}"\nkv-cellz = 512\n')
    refused(run("serve", "--config", str(config)), 2, "unknown option 'kv-cellz'")
    config.write_text("model = [\n")
    refused(run("serve", "--config", str(config)), 2, "not a valid TOML file")
    refused(run("serve", "--config", str(tmp_path / "none.toml")), 2, "none.toml: No such file or directory")


def test_serve_on_a_port_in_use(tiny_model: Path, held_port: int) -> None:
    address = f"tcp://127.0.0.1:{held_port}"
    refused(run("serve", str(tiny_model), "--bind", address), 2, f"cannot listen on {address}: the port is in use")


def test_addresses_zeromq_refuses_are_one_line_and_the_node_exits(tiny_model: Path, tmp_path: Path) -> None:
    """Addresses that pass the syntax check but that ZeroMQ refuses: the socket is closed, so the
    process ends (a socket left open would keep it waiting for ever) with one line."""
    long_path = "ipc://" + "x" * 120  # longer than a Unix socket's path may be
    refused(
        run("serve", str(tiny_model), "--next", long_path, "--log-level", "warning"),
        2,
        f"cannot connect to the next stage {long_path}: File name too long",
    )
    missing = f"ipc://{tmp_path}/no/such/dir/node.sock"
    refused(run("serve", str(tiny_model), "--bind", missing), 2, f"cannot listen on {missing}")


def test_metrics_on_a_port_in_use(tiny_model: Path, held_port: int) -> None:
    result = run("serve", str(tiny_model), "--bind", "tcp://127.0.0.1:*", "--metrics-port", str(held_port))
    refused(result, 2, f"cannot listen on http://127.0.0.1:{held_port}: the port is in use")


def test_gateway_on_a_port_in_use(held_port: int) -> None:
    result = run("gateway", "--node", NOBODY, "--port", str(held_port))
    refused(result, 2, f"cannot listen on http://127.0.0.1:{held_port}: the port is in use")


def test_nothing_answers(tiny_model: Path) -> None:
    refused(run("ping", NOBODY, "--timeout", "0.5"), 1, f"no node answered at {NOBODY} within 0.5s")
    refused(run("stats", NOBODY, "--timeout", "0.5"), 1, f"no node answered at {NOBODY}")


def test_version() -> None:
    result = run("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"neuron-tai {__version__}")


def test_a_node_that_says_no_is_one_line_and_exit_1(tiny_model: Path) -> None:
    with running(node := NodeProcess(tiny_model, "tcp://127.0.0.1:*")):
        result = run("generate", "hi", "--addr", node.address, "--max-tokens", "100000")
    refused(result, 1, "the node refused: ")


def test_serve_second_node_on_the_same_address(tiny_model: Path) -> None:
    with running(node := NodeProcess(tiny_model, "tcp://127.0.0.1:*")):
        refused(run("serve", str(tiny_model), "--bind", node.address), 2, f"cannot listen on {node.address}")


def test_stats_summary_json_and_ping(tiny_shards2: list[Path]) -> None:
    tail = NodeProcess(tiny_shards2[1], "tcp://127.0.0.1:*")
    with running(tail):
        head = NodeProcess(tiny_shards2[0], "tcp://127.0.0.1:*", ["--next", tail.address])
        with running(head):
            generated = run("generate", "hello", "--addr", head.address, "--max-tokens", "4")
            summary = run("stats", head.address)
            as_json = run("stats", head.address, "--json")
            pinged = run("ping", head.address)
    assert generated.returncode == 0 and generated.stdout.endswith("\n"), generated.stderr
    assert summary.returncode == 0 and summary.stderr == ""
    lines = dict(line.split(None, 1) for line in summary.stdout.replace("next stage", "next_stage").splitlines())
    assert lines["model"].strip() == "tiny-llama, layers 0-1 of 4"
    assert lines["next_stage"].startswith("connected")
    assert "MiB" in lines["memory"] and "{" not in summary.stdout  # no Python reprs
    stats = json.loads(as_json.stdout)
    assert stats["layers"] == [0, 2] and stats["downstream"]["connected"] is True
    assert stats["generated_tokens_total"] >= 1
    assert pinged.returncode == 0 and pinged.stdout.startswith(f"pong from {head.address} in ")
