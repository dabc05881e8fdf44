"""The `neuron-tai` command: a thin shell over the library."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.budgets import BudgetError
from neuron_tai.client import NodeError
from neuron_tai.security import ServerCurve, create_key_pair
from neuron_tai.shard import (
    ShardError,
    open_header,
    read_model_layers,
    stage_bounds,
    weight_balanced_bounds,
    write_shard,
    write_stages,
)
from transport import memory_bounds as bounds
from transport import wire

if TYPE_CHECKING:
    from neuron_tai.config import NodeConfig

log = logging.getLogger("neuron_tai")


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
    header = open_header(src)  # parsed once for all stages
    facts = read_model_layers(src, header)
    if args.stages is not None and args.balance == "weights":
        bounds = weight_balanced_bounds(src, args.stages, header)
    else:
        bounds = stage_bounds(facts.block_count, stages=args.stages, split=args.split or ())
    for path, (a, b) in zip(write_stages(src, args.output, bounds, header), bounds, strict=True):
        print(f"layers {a}:{b}\t{path}")
    return 0


def _bytes(text: str) -> int:
    """A size like 64M, 2G or 1048576."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    try:
        if text[-1:].lower() in units:
            return int(float(text[:-1]) * units[text[-1].lower()])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 2G, got {text!r}") from None


def shard_cache_path(model: Path, a: int, b: int) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "neuron-tai" / "shards"
    return cache / f"{model.stem}.layers-{a}-{b}.gguf"


def _stage_model(model: Path, layers: tuple[int, int] | None) -> Path:
    """The model file a node serves: the model itself, or a cached shard of --layers."""
    if layers is None:
        return model
    out = shard_cache_path(model, *layers)
    if not out.exists() or out.stat().st_mtime < model.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info("writing shard %s", out)
        write_shard(model, layers[0], layers[1], out)
    return out


def node_config(args: argparse.Namespace) -> NodeConfig:
    from engine.budgets import Limits  # noqa: PLC0415 - keep `neuron-tai shard` light
    from engine.config import EngineConfig  # noqa: PLC0415
    from neuron_tai.config import NodeConfig  # noqa: PLC0415

    engine = EngineConfig(
        model=_stage_model(args.model, args.layers),
        max_sessions=args.max_sessions,
        max_waiting_opens=args.max_waiting,
        max_wait_ms=args.max_wait_ms,
        max_overtakes=args.max_overtakes,
        max_sessions_per_peer=args.max_sessions_per_peer,
        max_waiting_per_peer=args.max_waiting_per_peer,
        max_queued_per_peer=args.max_queued_per_peer,
        kv_cells=args.kv_cells,
        n_batch=args.n_batch,
        n_ubatch=min(args.n_batch, args.n_ubatch),
        n_threads=args.threads,
        kv_type=args.kv_type,
        flash_attn={"auto": None, "on": True, "off": False}[args.flash_attn],
        kernels=args.kernels,
        max_prefill_tokens=args.max_prefill,
        max_step_tokens=args.max_step_tokens,
        queue_budget_bytes=args.queue_budget,
        batch_invariant=args.batch_invariant,
        pad_rows=args.pad_rows,
        compact_at=args.compact_at or None,
        idle_timeout_s=args.idle_timeout or None,
        limits=Limits(weights=args.weight_budget, kv=args.kv_budget, scratch=args.scratch_budget),
        linger_ms=args.linger_ms,
        prefill_share=args.prefill_share,
        micro_batches=args.micro_batches,
    )
    return NodeConfig(
        engine=engine,
        bind=args.bind,
        next=",".join(args.next) if args.next else None,
        max_message_bytes=args.max_message_bytes,
        downstream_timeout_s=args.downstream_timeout,
        recovery_attempts=args.recovery_attempts,
        recovery_deadline_s=args.recovery_deadline,
        lease_s=args.lease,
        metrics_port=args.metrics_port,
        metrics_bind=args.metrics_bind,
        curve=server_curve(args),
        max_text_bytes=args.max_text_bytes,
        max_text_tokens=args.max_text_tokens,
        send_hwm=args.send_hwm,
        max_peer_reply_bytes=args.max_peer_reply_bytes,
        max_reply_bytes=args.max_reply_bytes,
        max_peer_request_bytes=args.max_peer_request_bytes,
        max_request_bytes=args.max_request_bytes,
        max_next_outbox_bytes=args.max_next_outbox_bytes,
    )


def server_curve(args: argparse.Namespace) -> ServerCurve | None:
    """--curve-secret and --allow together make a node require CURVE; --next-key needs them."""
    if (args.curve_secret is None) != (args.allow is None):
        raise ValueError("--curve-secret and --allow go together: the node's key pair and the keys it admits")
    if args.next_key is not None and (args.curve_secret is None or args.next is None):
        raise ValueError("--next-key needs --next and the node's own key pair (--curve-secret, --allow)")
    if args.curve_secret is None:
        return None
    return ServerCurve(args.curve_secret, args.allow, args.next_key)


def _cmd_keygen(args: argparse.Namespace) -> int:
    public, secret = create_key_pair(args.directory, args.name)
    print(f"public key  {public}  (hand this one out)")
    print(f"key pair    {secret}  (keep this one private)")
    return 0


# llama.cpp's OpenMP workers spin this long after each op before sleeping. libgomp's default
# keeps them spinning well after a decode ends, competing with the node's socket and event
# loop threads on a small machine; a short spin measured the same decode speed and a faster
# node. Read by libgomp when llama.cpp loads, so it is set before that import.
OMP_SPIN_DEFAULT = "20000"


def _cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_DEFAULT)
    import trio  # noqa: PLC0415

    from neuron_tai.node import open_node  # noqa: PLC0415

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("llama.cpp").setLevel(logging.ERROR)
    config = node_config(args)

    async def serve() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async with open_node(config) as node:
                print(f"ready {node.address}", flush=True)
                async for signum in signals:
                    if signum == signal.SIGHUP:  # an operator changed the allowed keys
                        if node.allow is None:
                            log.warning("SIGHUP: no allowed keys to reload (the node does not require CURVE)")
                        else:
                            node.allow.reload()
                        continue
                    log.info("%s: draining in-flight work, refusing new work", signal.Signals(signum).name)
                    break
        log.info("stopped")

    trio.run(serve)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import trio  # noqa: PLC0415

    from neuron_tai.client import open_client  # noqa: PLC0415

    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}

    async def run() -> None:
        async with open_client(args.addr, timeout_s=args.timeout, server_key=args.server_key, key=args.key) as client:
            pieces = client.generate(args.prompt, args.max_tokens, sampling=sampling, server_side=not args.step_loop)
            async for piece in pieces:
                print(piece, end="", flush=True)
            print()

    trio.run(run)
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    import trio  # noqa: PLC0415

    from neuron_tai.client import open_client  # noqa: PLC0415

    async def run() -> dict[str, Any]:
        async with open_client(
            args.addr, timeout_s=args.timeout, retries=0, server_key=args.server_key, key=args.key
        ) as client:
            return await client.stats()

    stats = trio.run(run)
    width = max(map(len, stats))
    for name, value in stats.items():
        shown = f"count {value['count']}, sum {value['sum']}s" if name == "step_seconds" else value
        print(f"{name.ljust(width)}  {shown}")
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    import trio  # noqa: PLC0415

    from neuron_tai.gateway import GatewayConfig, serve_gateway  # noqa: PLC0415

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = GatewayConfig(node=args.node, host=args.host, port=args.port, model_name=args.model_name,
                           model=args.model, server_key=args.server_key, key=args.key, timeout_s=args.timeout,
                           max_requests=args.max_requests, open_wait_ms=args.open_wait_ms)  # fmt: skip

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(lambda task_status: serve_gateway(config, shutdown=stop,
                                                                              task_status=task_status))  # fmt: skip
                print(f"ready {' '.join(binds)}", flush=True)
                async for _signum in signals:
                    stop.set()
                    break

    trio.run(run)
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
    how.add_argument("--stages", type=int, metavar="N", help="split into N stages (see --balance)")
    how.add_argument("--split", type=_split, metavar="B1,B2", help="split at these layer boundaries")
    shard.add_argument("-o", "--output", type=Path, required=True, help="output file (--layers) or directory")
    shard.add_argument(
        "--balance",
        choices=["weights", "layers"],
        default="weights",
        help="--stages: give each stage about the same weight bytes to read per token, the last "
        "stage's vocabulary projection included (weights), or the same number of layers",
    )
    shard.set_defaults(run=_cmd_shard)

    serve = sub.add_parser(
        "serve",
        help="serve a model or a layer range over ZeroMQ",
        description="Serve one stage on a ROUTER socket (PROTOCOL.md v1). Prints 'ready ADDRESS' when "
        "it accepts requests; SIGINT or SIGTERM drains in-flight work and stops.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("model", type=Path, help="GGUF model or shard")
    serve.add_argument("--layers", type=_layers, metavar="A:B", help="serve only layers A..B-1 (shard cached)")
    serve.add_argument("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ address to bind")
    serve.add_argument("--next", metavar="ADDR", action="append",
                       help="address of the next stage: forward results there; repeat it (or separate addresses with "
                            "commas) for replicas of the next layer range")  # fmt: skip
    serve.add_argument("--max-sessions", type=int, default=8, help="sessions served at once")
    serve.add_argument("--max-waiting", type=int, default=64, help="opens that may wait for room (with wait_ms)")
    serve.add_argument("--max-wait-ms", type=int, default=60_000, help="cap on an open's wait_ms")
    serve.add_argument(
        "--max-overtakes", type=int, default=4, help="opens admitted ahead of a waiting open before it holds admission"
    )
    serve.add_argument(
        "--max-sessions-per-peer",
        type=int,
        default=None,
        help="sessions one connection may hold open (default: --max-sessions; a chain's head sends all "
        "its sessions over one connection, so a next stage must not cap it below the head's --max-sessions)",
    )
    serve.add_argument(
        "--max-waiting-per-peer",
        type=int,
        default=None,
        help="opens of one connection that may wait (default: --max-waiting)",
    )
    serve.add_argument(
        "--max-queued-per-peer",
        type=int,
        default=None,
        help="opens and steps of one connection queued for the engine at once; beyond it, busy "
        "(default: half the engine's inbox of 256, at least --max-sessions)",
    )
    serve.add_argument(
        "--max-text-bytes",
        type=int,
        default=wire.MAX_TEXT_BYTES,
        help="largest tokenize text (UTF-8 bytes); bounds headers too",
    )
    serve.add_argument(
        "--max-text-tokens", type=int, default=wire.MAX_TEXT_TOKENS, help="most token ids a (de)tokenize may carry"
    )
    serve.add_argument("--kv-cells", type=int, default=4096, help="KV cells shared by all sessions")
    serve.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="KV cache element type")
    serve.add_argument("--n-batch", type=int, default=512, help="rows one llama_decode call may carry")
    serve.add_argument("--n-ubatch", type=int, default=512, help="rows llama.cpp computes at once")
    serve.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    serve.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto", help="flash attention")
    serve.add_argument(
        "--kernels",
        choices=["auto", "repack", "plain", "amx"],
        default="auto",
        help="weight kernel path: auto = repacked CPU kernels where llama.cpp offers them, else plain; "
        "never AMX unless asked (its kernels crash on quantized models on some hosts)",
    )
    serve.add_argument("--max-prefill", type=int, default=256, help="most prefill tokens per iteration")
    serve.add_argument("--max-step-tokens", type=int, default=512, help="most tokens one step may carry")
    serve.add_argument("--queue-budget", type=_bytes, default=64 * 2**20, help="bytes of queued step payloads")
    serve.add_argument("--weight-budget", type=_bytes, help="refuse to start if the weights need more")
    serve.add_argument("--kv-budget", type=_bytes, help="refuse to start if the KV cache needs more")
    serve.add_argument("--scratch-budget", type=_bytes, help="refuse to start if compute buffers need more")
    serve.add_argument("--batch-invariant", action="store_true", help="pad decode batches: load-independent outputs")
    serve.add_argument(
        "--pad-rows",
        type=int,
        default=None,
        help="batch-invariant mode pads decode rows to a multiple of this (default: what the kernel path needs)",
    )
    serve.add_argument(
        "--compact-at",
        type=float,
        default=0.5,
        help="batch-invariant mode: compact the KV cache once closed sessions hold this share of its cells "
        "(0 = only when an open needs them)",
    )
    serve.add_argument(
        "--linger-ms",
        type=float,
        default=6.0,
        help="wait this long (at most 10%% of a step) for answered sessions' next steps, so they share the next batch",
    )
    serve.add_argument(
        "--prefill-share",
        type=float,
        default=1.0,
        help="while sessions decode, an iteration's prefill may add this many decode steps' time "
        "(higher: faster prefill and more throughput, longer gaps between tokens)",
    )
    serve.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="run sessions in this many groups, each sent on to the next stage while the next computes "
        "(default: 2 with --next, else 1 = off; a chain of N stages keeps all busy with N)",
    )
    serve.add_argument(
        "--lease",
        type=float,
        default=15.0,
        help="free the sessions of a connection silent this long (s; clients ping every lease/3)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=0.0,
        help="also close a session with no step or open this long, even if its client is alive (s; 0 off)",
    )
    serve.add_argument("--max-message-bytes", type=_bytes, default=bounds.MAX_MESSAGE_BYTES, help="ZMQ_MAXMSGSIZE")
    memory = serve.add_argument_group("memory bounds (see README, 'Memory bounds')")
    memory.add_argument(
        "--send-hwm",
        type=int,
        default=bounds.SEND_HWM,
        help="messages ZeroMQ queues for one connection, and for the next stage",
    )
    for flag, default, text in (
        ("--max-peer-reply-bytes", bounds.MAX_PEER_REPLY_BYTES,
         "replies waiting for one connection that does not read: past this it is treated as gone"),
        ("--max-reply-bytes", bounds.MAX_REPLY_BYTES,
         "replies waiting for all connections (the ones furthest behind are cut off first)"),
        ("--max-peer-request-bytes", bounds.MAX_PEER_REQUEST_BYTES,
         "bytes one connection's requests in progress hold; more: busy"),
        ("--max-request-bytes", bounds.MAX_REQUEST_BYTES, "bytes all requests in progress hold; more: busy"),
        ("--max-next-outbox-bytes", bounds.MAX_OUTBOX_BYTES,
         "requests waiting to go out to the next stage; more fails with downstream"),
    ):  # fmt: skip
        memory.add_argument(flag, type=_bytes, default=default, help=text)
    serve.add_argument("--downstream-timeout", type=float, default=30.0, help="seconds to wait for the next stage")
    serve.add_argument("--recovery-attempts", type=int, default=3,
                       help="a chain's head replays a session whose route broke onto a route that is up, at most this "
                            "many times (0: never)")  # fmt: skip
    serve.add_argument("--recovery-deadline", type=float, default=30.0,
                       help="seconds a recovery may take before the step fails with `downstream`")  # fmt: skip
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on PORT (plain HTTP)")
    serve.add_argument("--metrics-bind", default="127.0.0.1", help="address the metrics endpoint listens on")
    curve = serve.add_argument_group("CurveZMQ (authenticated, encrypted links)")
    curve.add_argument(
        "--curve-secret", type=Path, metavar="FILE", help="the node's key pair (.key_secret): require CURVE"
    )
    curve.add_argument(
        "--allow",
        type=Path,
        metavar="DIR_OR_FILE",
        help="public keys admitted: a directory of .key files or one file; reread on SIGHUP",
    )
    curve.add_argument(
        "--next-key",
        type=Path,
        metavar="FILE",
        help="the next stage's public key: the --next link authenticates with the node's key pair",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(run=_cmd_serve)

    gen = sub.add_parser("generate", help="stream a completion from a node or chain head")
    gen.add_argument("prompt")
    gen.add_argument("--addr", default="tcp://127.0.0.1:5555")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--timeout", type=float, default=60.0)
    _client_keys(gen)
    gen.add_argument(
        "--step-loop", action="store_true", help="run the token loop here, one step per token (default: on the node)"
    )
    gen.set_defaults(run=_cmd_generate)

    stats = sub.add_parser("stats", help="print a node's telemetry")
    stats.add_argument("--addr", default="tcp://127.0.0.1:5555")
    stats.add_argument("--timeout", type=float, default=10.0)
    _client_keys(stats)
    stats.set_defaults(run=_cmd_stats)

    gateway = sub.add_parser(
        "gateway",
        help="serve an OpenAI-compatible HTTP API in front of a node or chain head",
        description="POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, "
        "/health and /metrics. Prints 'ready URL' when it accepts requests; SIGINT or SIGTERM stops it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gateway.add_argument("--node", required=True, metavar="ADDR", help="the node (or chain head) to serve from")
    gateway.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    gateway.add_argument("--port", type=int, default=8080, help="HTTP port (0: any free port)")
    gateway.add_argument("--model-name", default="neuron-tai", help="the model id clients see and send")
    gateway.add_argument(
        "--model", type=Path, metavar="FILE", help="the GGUF model (or its first shard): chat prompts use its template"
    )
    gateway.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each reply of the node")
    gateway.add_argument("--max-requests", type=int, default=64, help="generations in flight; more get 429")
    gateway.add_argument(
        "--open-wait-ms", type=int, default=0, help="a request may wait this long in a full node's queue before 429"
    )
    _client_keys(gateway)
    gateway.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    gateway.set_defaults(run=_cmd_gateway)

    keygen = sub.add_parser(
        "keygen",
        help="write a CurveZMQ key pair",
        description="Write NAME.key (the public key, to hand out) and NAME.key_secret (the key pair, to keep "
        "private) into DIR, in ZeroMQ's certificate format. Never overwrites a key.",
    )
    keygen.add_argument("directory", type=Path, metavar="DIR")
    keygen.add_argument("--name", default="node", help="file name stem")
    keygen.set_defaults(run=_cmd_keygen)
    return parser


def _client_keys(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server-key", type=Path, metavar="FILE", help="the node's public key (CURVE)")
    parser.add_argument("--key", type=Path, metavar="FILE", help="this client's key pair, .key_secret (CURVE)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = 2
    try:
        code = _run(args)
    except* (NodeError, TimeoutError, ConnectionError) as group:  # from inside the client's nursery
        for exc in group.exceptions:
            print(f"neuron-tai: error: {exc}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.run(args))
    except BrokenPipeError:  # the reader of our output went away (`... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ShardError, BudgetError, NodeError, ValueError, OSError) as exc:
        print(f"neuron-tai: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
