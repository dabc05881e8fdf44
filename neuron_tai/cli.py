"""The `neuron-tai` command: a thin shell over the library.

Each command's options are declared once, on the fields of its config dataclasses
(neuron_tai/cli_options.py); what a user gets wrong is one line, never a traceback
(neuron_tai/cli_errors.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from neuron_tai import __version__
from neuron_tai.cli_errors import UsageError, report
from neuron_tai.cli_options import Option, add_options, build, new_parser, options_of
from neuron_tai.cli_plan import PlanOptions, planned_split, run_plan
from neuron_tai.cli_serve import gateway_options, node_config, run_gateway, run_serve, serve_options
from neuron_tai.command_options import GenerateOptions, KeygenOptions, PingOptions, ShardOptions, StatsOptions
from neuron_tai.security import create_key_pair
from neuron_tai.shard import (
    open_header,
    read_model_layers,
    stage_bounds,
    weight_balanced_bounds,
    write_shard,
    write_stages,
)

__all__ = ["build_parser", "main", "node_config"]


class NoAnswer(ConnectionError):
    """Nothing answered at an address within the time asked for."""


def _cmd_shard(values: Mapping[str, Any]) -> int:
    opts: ShardOptions = build(ShardOptions, options_of(ShardOptions), values)
    if sum(x is not None for x in (opts.layers, opts.stages, opts.split)) != 1:
        raise UsageError("give one of --layers A:B, --stages N or --split B1,B2")
    if opts.layers is not None:
        print(write_shard(opts.model, opts.layers[0], opts.layers[1], opts.output))
        return 0
    header = open_header(opts.model)  # parsed once for all stages
    facts = read_model_layers(opts.model, header)
    if opts.stages is not None and opts.balance == "weights":
        bounds = weight_balanced_bounds(opts.model, opts.stages, header)
    elif opts.stages is not None and opts.balance == "plan":
        bounds = planned_split(opts.model, opts.stages, costs=opts.costs).bounds
    else:
        bounds = stage_bounds(facts.block_count, stages=opts.stages, split=opts.split or ())
    for path, (a, b) in zip(write_stages(opts.model, opts.output, bounds, header), bounds, strict=True):
        print(f"layers {a}:{b}\t{path}")
    return 0


def _cmd_keygen(values: Mapping[str, Any]) -> int:
    opts: KeygenOptions = build(KeygenOptions, options_of(KeygenOptions), values)
    public, secret = create_key_pair(opts.directory, opts.name)
    print(f"public key  {public}  (hand this one out)")
    print(f"key pair    {secret}  (keep this one private)")
    return 0


def _cmd_generate(values: Mapping[str, Any]) -> int:
    import trio  # noqa: PLC0415

    from neuron_tai.client import open_client  # noqa: PLC0415

    opts: GenerateOptions = build(GenerateOptions, options_of(GenerateOptions), values)
    sampling = dataclasses.asdict(opts.sampling)

    async def run() -> None:
        printed = False
        try:
            async with open_client(
                opts.addr, timeout_s=opts.timeout_s, server_key=opts.server_key, key=opts.key
            ) as client:
                pieces = client.generate(
                    opts.prompt, opts.max_tokens, sampling=sampling, server_side=not opts.step_loop
                )
                async for piece in pieces:
                    print(piece, end="", flush=True)
                    printed = printed or bool(piece)
        except BaseException:
            if printed:  # the text so far ends its line; the error gets one of its own
                print(flush=True)
            raise
        print(flush=True)

    trio.run(run)
    return 0


async def _ask(opts: StatsOptions | PingOptions, op: str) -> Any:
    from neuron_tai.client import open_client  # noqa: PLC0415

    try:
        async with open_client(
            opts.addr, timeout_s=opts.timeout_s, retries=0, server_key=opts.server_key, key=opts.key
        ) as client:
            return await (client.stats() if op == "stats" else client.ping())
    except* TimeoutError:  # from inside the client's nursery
        raise NoAnswer(f"no node answered at {opts.addr} within {opts.timeout_s:g}s") from None


def _cmd_stats(values: Mapping[str, Any]) -> int:
    import trio  # noqa: PLC0415

    from neuron_tai.stats_view import summary  # noqa: PLC0415

    opts: StatsOptions = build(StatsOptions, options_of(StatsOptions), values)
    stats = trio.run(_ask, opts, "stats")
    print(json.dumps(stats, indent=2) if opts.json else "\n".join(summary(opts.addr, stats)))
    return 0


def _cmd_ping(values: Mapping[str, Any]) -> int:
    import trio  # noqa: PLC0415

    opts: PingOptions = build(PingOptions, options_of(PingOptions), values)
    seconds = trio.run(_ask, opts, "ping")
    print(f"pong from {opts.addr} in {seconds * 1000:.1f} ms")
    return 0


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    description: str
    options: Callable[[], list[Option]]
    run: Callable[[Mapping[str, Any]], int]
    positional: tuple[str, ...] = ()
    first: tuple[str, ...] = ()  # listed first in --help, in this order


COMMANDS = (
    Command(
        "serve",
        "serve a model or a layer range over ZeroMQ",
        "Serve one stage on a ROUTER socket (PROTOCOL.md v1). Prints 'ready ADDRESS' when it accepts requests; "
        "SIGINT or SIGTERM drains in-flight work and stops. Options may also come from a TOML file (--config).",
        serve_options,
        run_serve,
        ("model",),
        ("model", "layers", "bind", "next", "threads", "max-sessions", "kv-cells", "kv-type"),
    ),
    Command(
        "generate",
        "stream a completion from a node or chain head",
        "Print the text a node generates as it comes.",
        lambda: options_of(GenerateOptions),
        _cmd_generate,
        ("prompt",),
        ("prompt", "addr", "max-tokens"),
    ),
    Command(
        "stats",
        "show a node's telemetry",
        "A summary of a node's stats; --json prints the whole map.",
        lambda: options_of(StatsOptions),
        _cmd_stats,
        ("addr",),
    ),
    Command(
        "ping",
        "check that a node answers",
        "Print the round trip of one ping; exit 1 if nothing answers.",
        lambda: options_of(PingOptions),
        _cmd_ping,
        ("addr",),
    ),
    Command(
        "gateway",
        "serve an OpenAI-compatible HTTP API in front of a node or chain head",
        "POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, /health and /metrics. "
        "Prints 'ready URL' when it accepts requests; SIGINT or SIGTERM stops it.",
        gateway_options,
        run_gateway,
    ),
    Command(
        "shard",
        "cut a GGUF model into layer-range shards",
        "Write layer-range shards of a GGUF model that stock llama.cpp loads. --layers A:B writes one file (-o is "
        "the file); --stages N or --split B1,B2,.. write one file per stage into the directory -o, named "
        "MODEL.layers-A-B.gguf.",
        lambda: options_of(ShardOptions),
        _cmd_shard,
        ("model",),
    ),
    Command(
        "plan",
        "choose each machine's layer range from measured costs",
        "Measure what each layer, the embedding and the output head cost on this machine (cached), choose the "
        "contiguous layer ranges that make the slowest stage fastest for the workload under each host's memory, "
        "and print the split, each stage's predicted share, the predicted scale-out efficiency bound and the "
        "`neuron-tai serve` line of each machine, in the order to start them. --measure on each machine prints "
        "its speed, to give as --host SPEED.",
        lambda: options_of(PlanOptions),
        run_plan,
        ("model",),
        ("model", "stages", "host", "workload"),
    ),
    Command(
        "keygen",
        "write a CurveZMQ key pair",
        "Write NAME.key (the public key, to hand out) and NAME.key_secret (the key pair, to keep private) into "
        "DIR, in ZeroMQ's certificate format. Never overwrites a key.",
        lambda: options_of(KeygenOptions),
        _cmd_keygen,
        ("directory",),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = new_parser(prog="neuron-tai", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"neuron-tai {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        cmd = sub.add_parser(command.name, help=command.help, description=command.description)
        add_options(cmd, command.options(), command.positional, command.first, negatable=command.name == "serve")
        cmd.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # An absent optional positional may come back as argparse's SUPPRESS marker itself.
    values = {k: v for k, v in vars(args).items() if k not in ("run", "command") and v is not argparse.SUPPRESS}
    try:
        return int(args.run(values))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of our output went away (`... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        return report(exc, args.command)


if __name__ == "__main__":
    sys.exit(main())
