"""`neuron-tai serve` with no options configures the node exactly as the library's defaults do."""

from __future__ import annotations

from dataclasses import fields

from engine.config import EngineConfig
from neuron_tai.cli import build_parser, node_config
from neuron_tai.config import NodeConfig


def test_serve_defaults_are_the_library_defaults() -> None:
    cli = node_config(build_parser().parse_args(["serve", "model.gguf"]))
    library = NodeConfig(engine=EngineConfig(model=cli.engine.model))
    differ = [
        f"engine.{f.name}"
        for f in fields(EngineConfig)
        if getattr(cli.engine, f.name) != getattr(library.engine, f.name)
    ]
    differ += [
        f.name for f in fields(NodeConfig) if f.name != "engine" and getattr(cli, f.name) != getattr(library, f.name)
    ]
    assert not differ, f"the CLI's defaults differ from NodeConfig's and EngineConfig's: {differ}"


def test_memory_bound_options_reach_the_node_config() -> None:
    args = ["serve", "model.gguf", "--send-hwm", "3", "--max-peer-reply-bytes", "1m", "--max-reply-bytes", "2m",
            "--max-peer-request-bytes", "3m", "--max-request-bytes", "4m", "--max-next-outbox-bytes", "5m"]  # fmt: skip
    cfg = node_config(build_parser().parse_args(args))
    got = (cfg.send_hwm, cfg.max_peer_reply_bytes, cfg.max_reply_bytes, cfg.max_peer_request_bytes,
           cfg.max_request_bytes, cfg.max_next_outbox_bytes)  # fmt: skip
    assert got == (3, *(n * 2**20 for n in range(1, 6)))
