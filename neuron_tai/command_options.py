"""The options of each `neuron-tai` command that no library config holds, declared as those are
(field metadata, read by neuron_tai/cli_options.py): the commands' own knobs, and the client's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.sampling import Sampling

LOG_LEVELS = ("debug", "info", "warning", "error")
_NO_CURVE = "none: no CURVE"


def log_level(default: str) -> Any:
    return field(default=default, metadata={"help": "how much the log says", "choices": LOG_LEVELS})


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeOptions:
    layers: tuple[int, int] | None = field(
        default=None,
        metadata={
            "help": "serve only layers A..B-1 of MODEL (the shard is written once, then cached)",
            "group": "start",
            "kind": "layers",
            "metavar": "A:B",
            "shown": "all of MODEL's layers",
        },
    )
    config: Path | None = field(
        default=None,
        metadata={
            "help": "read options from this TOML file (keys: the long option names, e.g. kv-cells = 2048); "
            "options given on the command line win",
            "metavar": "FILE",
            "shown": "none",
        },
    )
    log_level: str = log_level("info")


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveOptions:
    """A node that requires CURVE: --curve-secret and --allow go together; --next-key needs both."""

    curve_secret: Path | None = field(
        default=None,
        metadata={
            "help": "the node's key pair (.key_secret): require CURVE",
            "group": "curve",
            "metavar": "FILE",
            "shown": _NO_CURVE,
        },
    )
    allow: Path | None = field(
        default=None,
        metadata={
            "help": "public keys admitted: a directory of .key files or one file; reread on SIGHUP",
            "group": "curve",
            "metavar": "DIR_OR_FILE",
            "shown": _NO_CURVE,
        },
    )
    next_key: Path | None = field(
        default=None,
        metadata={
            "help": "the next stage's public key: the --next link authenticates with the node's key pair",
            "group": "curve",
            "metavar": "FILE",
            "shown": _NO_CURVE,
        },
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientOptions:
    addr: str = field(
        default="tcp://127.0.0.1:5555",
        metadata={"help": "the node (or chain head) to ask", "group": "start", "kind": "address", "metavar": "ADDR"},
    )
    server_key: Path | None = field(
        default=None, metadata={"help": "the node's public key (CURVE)", "metavar": "FILE", "shown": _NO_CURVE}
    )
    key: Path | None = field(
        default=None,
        metadata={"help": "this client's key pair, .key_secret (CURVE)", "metavar": "FILE", "shown": _NO_CURVE},
    )


_SAMPLING = {
    "temperature": {"help": "sampling temperature (0: greedy)", "min": 0.0},
    "top_k": {"help": "sample among the k likeliest tokens (0: off)", "min": 0},
    "top_p": {"help": "sample among the likeliest tokens that make up this share (1: off)", "min": 0.0, "max": 1.0},
    "seed": {"help": "the sampler's random seed", "min": 0},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateOptions(ClientOptions):
    prompt: str = field(metadata={"help": "the text to continue", "group": "start"})
    max_tokens: int = field(default=64, metadata={"help": "tokens to generate at most", "group": "start", "min": 1})
    sampling: Sampling = field(default_factory=Sampling, metadata={"nested": _SAMPLING})
    timeout_s: float = field(
        default=60.0, metadata={"help": "seconds to wait for each reply of the node", "flag": "timeout", "min": 0}
    )
    step_loop: bool = field(
        default=False, metadata={"help": "run the token loop here, one step per token, instead of on the node"}
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsOptions(ClientOptions):
    json: bool = field(default=False, metadata={"help": "print the node's whole stats map as JSON, for scripts"})
    timeout_s: float = field(
        default=10.0, metadata={"help": "seconds to wait for the node's answer", "flag": "timeout", "min": 0}
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PingOptions(ClientOptions):
    timeout_s: float = field(
        default=3.0, metadata={"help": "seconds to wait for the node's answer", "flag": "timeout", "min": 0}
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayOptions:
    log_level: str = log_level("warning")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardOptions:
    """Exactly one of --layers, --stages and --split."""

    model: Path = field(metadata={"help": "the source GGUF model (or a shard of one)", "group": "start"})
    output: Path = field(
        metadata={
            "help": "output file (--layers) or directory (--stages, --split)",
            "group": "start",
            "metavar": "PATH",
            "short": "-o",
        }
    )
    layers: tuple[int, int] | None = field(
        default=None,
        metadata={
            "help": "write layers A (inclusive) to B (exclusive) into one file",
            "group": "start",
            "kind": "layers",
            "metavar": "A:B",
            "shown": "none",
        },
    )
    stages: int | None = field(
        default=None,
        metadata={
            "help": "split into N stages (see --balance)",
            "group": "start",
            "min": 1,
            "metavar": "N",
            "shown": "none",
        },
    )
    split: list[int] | None = field(
        default=None,
        metadata={
            "help": "split at these layer boundaries",
            "group": "start",
            "kind": "split",
            "metavar": "B1,B2",
            "shown": "none",
        },
    )
    balance: str = field(
        default="plan",
        metadata={
            "help": "--stages: the split `neuron-tai plan` chooses from costs measured on this machine (plan), "
            "about the same weight bytes to read per token, the last stage's vocabulary projection included "
            "(weights), or the same number of layers (layers, or even)",
            "choices": ("plan", "weights", "layers", "even"),
        },
    )
    costs: Path | None = field(
        default=None,
        metadata={
            "help": "--balance plan: read the costs from this JSON file instead of measuring",
            "metavar": "FILE",
            "shown": "measured once, then cached",
        },
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class KeygenOptions:
    directory: Path = field(metadata={"help": "where to write the key files", "group": "start", "metavar": "DIR"})
    name: str = field(default="node", metadata={"help": "the key files' name stem"})
