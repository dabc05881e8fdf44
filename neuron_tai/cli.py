"""The `neuron-tai` command: a thin shell over the library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from neuron_tai.shard import ShardError, read_model_layers, stage_bounds, write_shard, write_stages


def _layers(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (e.g. 0:6), got {text!r}") from None
    return a, b


def _split(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected boundaries like 6,12, got {text!r}") from None


def _cmd_shard(args: argparse.Namespace) -> int:
    src: Path = args.model
    if args.layers is not None:
        out = write_shard(src, args.layers[0], args.layers[1], args.output)
        print(out)
        return 0
    blocks = read_model_layers(src).block_count
    bounds = stage_bounds(blocks, stages=args.stages, split=args.split or ())
    for path, (a, b) in zip(write_stages(src, args.output, bounds), bounds, strict=True):
        print(f"layers {a}:{b}\t{path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-tai", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    shard = sub.add_parser(
        "shard",
        help="cut a GGUF model into layer-range shards",
        description="Write layer-range shards of a GGUF model that stock llama.cpp loads. "
        "--layers A:B writes one file (-o is the file); --stages N or --split B1,B2,.. write "
        "one file per stage into the directory -o, named MODEL.layers-A-B.gguf.",
    )
    shard.add_argument("model", type=Path, help="the source GGUF model (or a shard of one)")
    how = shard.add_mutually_exclusive_group(required=True)
    how.add_argument("--layers", type=_layers, metavar="A:B", help="layers A (inclusive) to B (exclusive)")
    how.add_argument("--stages", type=int, metavar="N", help="split evenly into N stages")
    how.add_argument("--split", type=_split, metavar="B1,B2", help="split at these layer boundaries")
    shard.add_argument("-o", "--output", type=Path, required=True, help="output file (--layers) or directory")
    shard.set_defaults(run=_cmd_shard)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ShardError as exc:
        print(f"neuron-tai: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
