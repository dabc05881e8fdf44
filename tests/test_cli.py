"""The CLI's options come from the config dataclasses: one default, one help text, and --config files."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.gguf_facts import read_facts
from neuron_tai.cli import build_parser
from neuron_tai.cli_options import OptionError
from neuron_tai.cli_serve import node_config, serve_options, with_config_file
from neuron_tai.config import NodeConfig


def values(*argv: str) -> dict[str, object]:
    args = build_parser().parse_args(list(argv))
    return {k: v for k, v in vars(args).items() if k not in ("run", "command") and v is not argparse.SUPPRESS}


def test_serve_defaults_are_the_library_defaults(tiny_model: Path) -> None:
    cli = node_config(values("serve", str(tiny_model)))
    library = NodeConfig(engine=EngineConfig(model=tiny_model))
    differ = [
        f"engine.{f.name}"
        for f in fields(EngineConfig)
        if getattr(cli.engine, f.name) != getattr(library.engine, f.name)
    ]
    differ += [
        f.name
        for f in fields(NodeConfig)
        if f.name not in ("engine", "extra_stats") and getattr(cli, f.name) != getattr(library, f.name)
    ]
    assert not differ, f"`neuron-tai serve` configures these unlike the library's defaults: {differ}"
    assert cli.extra_stats == {"model": "tiny-llama", "layers": [0, 4], "model_layers": 4}


def test_options_reach_the_node_config(tiny_model: Path) -> None:
    bounds = ["--send-hwm", "3", "--max-peer-reply-bytes", "1m", "--max-reply-bytes", "2m"]
    bounds += ["--max-peer-request-bytes", "3m", "--max-request-bytes", "4m", "--max-next-outbox-bytes", "5m"]
    engine_flags = ["--kv-budget", "1G", "--flash-attn", "off", "--compact-at", "0", "--idle-timeout", "2.5"]
    engine_flags += ["--threads", "1", "--n-batch", "64"]
    cfg = node_config(values("serve", str(tiny_model), *bounds, *engine_flags))
    got: tuple[int, ...] = (cfg.send_hwm, cfg.max_peer_reply_bytes, cfg.max_reply_bytes, cfg.max_peer_request_bytes)
    got += (cfg.max_request_bytes, cfg.max_next_outbox_bytes)
    assert got == (3, *(n * 2**20 for n in range(1, 6)))
    engine = cfg.engine
    assert (engine.limits.kv, engine.flash_attn, engine.compact_at, engine.idle_timeout_s) == (2**30, False, None, 2.5)
    assert (engine.n_threads, engine.n_batch) == (1, 64)
    assert engine.context(read_facts(tiny_model)).n_ubatch == 64  # micro-batches follow a smaller n_batch


def test_a_chains_last_stage_computes_prompts_in_smaller_micro_batches(
    tiny_model: Path, tiny_shards3: list[Path]
) -> None:
    def rows(path: Path, *flags: str) -> int:
        return node_config(values("serve", str(path), *flags)).engine.context(read_facts(path)).n_ubatch

    assert [rows(p) for p in (tiny_model, *tiny_shards3)] == [512, 512, 512, 64]  # whole, head, middle, last
    assert rows(tiny_shards3[-1], "--n-ubatch", "256") == rows(tiny_model, "--n-ubatch", "256") == 256
    assert rows(tiny_shards3[-1], "--n-batch", "64") == 64


def test_config_file_then_command_line(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    lines = [f'model = "{tiny_model}"', "kv-cells = 512", "max_sessions = 2", "batch-invariant = true"]
    lines += ['bind = "tcp://127.0.0.1:7000"', 'queue-budget = "1M"']
    path.write_text("\n".join(lines) + "\n")
    typed = values("serve", "--config", str(path), "--kv-cells", "256", "--no-batch-invariant")
    cfg = node_config(with_config_file(serve_options(), typed))
    engine = cfg.engine
    assert (engine.kv_cells, engine.max_sessions, engine.batch_invariant) == (256, 2, False)  # typed wins over the file
    assert (cfg.bind, engine.queue_budget_bytes, engine.model) == ("tcp://127.0.0.1:7000", 2**20, tiny_model)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("kv_cache = 5\n", "unknown option 'kv_cache'"),
        ("max-sessions = 0\n", "max-sessions: must be at least 1, got 0"),
        ("bind = '127.0.0.1:5555'\n", "did you mean tcp://127.0.0.1:5555?"),
        ("batch-invariant = 1\n", "batch-invariant must be true or false"),
    ],
)
def test_config_file_mistakes_name_the_key(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(OptionError, match=says.replace("?", r"\?")) as caught:
        with_config_file(serve_options(), {"config": path})
    assert str(path) in str(caught.value)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    parser = subcommands()[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help, f"{command} {name} has no help"
        assert "(default: None)" not in action.help and action.help.count("(default:") <= 1, (command, name)
        required = action.required or (not action.option_strings and "(default:" not in action.help)
        assert required or "(default:" in action.help, f"{command} {name} does not show its default"


def test_serve_help_lists_what_a_first_time_operator_needs_first() -> None:
    text = subcommands()["serve"].format_help()
    start, limits, tuning = text.index("essentials:"), text.index("\nlimits:"), text.index("\ntuning:")
    assert start < limits < tuning
    first = text[start:limits]
    for flag in ("MODEL", "--layers", "--bind", "--next", "--threads", "--max-sessions", "--kv-cells", "--kv-type"):
        assert flag in first, flag
    assert "--linger-ms" in text[tuning:] and "--max-step-tokens" in text[limits:tuning]
    assert "--log-level" in text and "how much the log says" in text


def test_a_bug_shows_its_traceback_and_asks_for_a_report(capsys: pytest.CaptureFixture[str]) -> None:
    from neuron_tai.cli_errors import BUG, report  # noqa: PLC0415

    try:
        raise ExceptionGroup("nursery", [KeyError("surprise")])
    except ExceptionGroup as exc:
        assert report(exc, "serve") == BUG
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'surprise'" in err
    assert err.rstrip().splitlines()[-1].count("please report this as a bug") == 1
