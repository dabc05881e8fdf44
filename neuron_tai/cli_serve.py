"""`neuron-tai serve` and `neuron-tai gateway`: the servers, from their options to `ready`.

Everything a user can get wrong is checked before the model loads: the options (also
those of a `--config` file), the model file and its layer range, the curve keys, and
whether the addresses to listen on are free.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from neuron_tai.cli_errors import UsageError, bind_failure, check_endpoint_free, check_port_free
from neuron_tai.cli_options import Option, build, from_file, options_of
from neuron_tai.command_options import CurveOptions, GatewayOptions, ServeOptions
from neuron_tai.config import NodeConfig
from neuron_tai.security import ServerCurve
from neuron_tai.shard import read_model_layers
from neuron_tai.shard_cache import cached_shard

if TYPE_CHECKING:
    from neuron_tai.gateway import GatewayConfig

log = logging.getLogger("neuron_tai")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def serve_options() -> list[Option]:
    return [*options_of(NodeConfig), *options_of(ServeOptions), *options_of(CurveOptions)]


def gateway_options() -> list[Option]:
    from neuron_tai.gateway import GatewayConfig  # noqa: PLC0415 - keep the other commands light

    return [*options_of(GatewayConfig), *options_of(GatewayOptions)]


def with_config_file(options: list[Option], typed: Mapping[str, Any]) -> dict[str, Any]:
    """The values of a --config file, overridden by those typed on the command line."""
    path = typed.get("config")
    if path is None:
        return dict(typed)
    try:
        with Path(path).open("rb") as f:
            table = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not a valid TOML file ({exc})") from None
    return {**from_file([o for o in options if o.name != "config"], table, str(path)), **typed}


def stage_model(model: Path, layers: tuple[int, int] | None) -> Path:
    """The model file a node serves: the model itself, or a cached shard of --layers (range checked first)."""
    if layers is not None:
        return cached_shard(model, *layers)  # reads the model's layers first: a clear error for a broken file
    read_model_layers(model)  # a clear error for a missing or broken file, before anything loads
    return model


def server_curve(curve: CurveOptions, has_next: bool) -> ServerCurve | None:
    """--curve-secret and --allow together make a node require CURVE; --next-key needs them."""
    if (curve.curve_secret is None) != (curve.allow is None):
        raise UsageError("--curve-secret and --allow go together: the node's key pair and the keys it admits")
    if curve.next_key is not None and (curve.curve_secret is None or not has_next):
        raise UsageError("--next-key needs --next and the node's own key pair (--curve-secret, --allow)")
    if curve.curve_secret is None or curve.allow is None:
        return None
    return ServerCurve(curve.curve_secret, curve.allow, curve.next_key)


def node_config(values: Mapping[str, Any]) -> NodeConfig:
    """The node `serve` runs, from its options' values (defaults: NodeConfig's and EngineConfig's own)."""
    options = serve_options()
    serve: ServeOptions = build(ServeOptions, options, values)
    curve = server_curve(build(CurveOptions, options, values), values.get("next") is not None)
    if "model" not in values:
        raise UsageError("MODEL is required: the GGUF file to serve (or `model` in the --config file)")
    model = stage_model(values["model"], serve.layers)
    config: NodeConfig = build(NodeConfig, options, {**values, "model": model})
    facts = read_model_layers(model)
    return dataclasses.replace(
        config,
        curve=curve,
        extra_stats={
            "model": facts.name,
            "layers": [facts.start, facts.end],
            "model_layers": facts.source_blocks,
            **config.extra_stats,
        },
    )


def run_serve(values: Mapping[str, Any]) -> int:
    values = with_config_file(serve_options(), values)
    log_level = build(ServeOptions, serve_options(), values).log_level
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    logging.getLogger("llama.cpp").setLevel(logging.ERROR)
    config = node_config(values)
    check_endpoint_free(config.bind)
    if config.metrics_port is not None:
        check_port_free(config.metrics_bind, config.metrics_port, f"http://{config.metrics_bind}:{config.metrics_port}")
    import trio  # noqa: PLC0415

    try:
        trio.run(_serve, config)
    except* zmq.ZMQError as group:  # the node's own bind, if the port was taken after the check above
        raise _bind_errors(group, config.bind) from None
    except* OSError as group:  # the metrics endpoint's
        raise _bind_errors(group, f"http://{config.metrics_bind}:{config.metrics_port}") from None
    return 0


def _bind_errors(group: BaseExceptionGroup[Exception], address: str) -> BaseException:
    """A failed bind as the one line it deserves (BindError); any other error as it was."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.append(bind_failure(exc, address) or exc)
    return found[0] if len(found) == 1 else BaseExceptionGroup("serve", found)


async def _serve(config: NodeConfig) -> None:
    import trio  # noqa: PLC0415

    from neuron_tai.node import open_node  # noqa: PLC0415

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


def run_gateway(values: Mapping[str, Any]) -> int:
    import trio  # noqa: PLC0415

    from neuron_tai.gateway import GatewayConfig  # noqa: PLC0415

    options = gateway_options()
    logging.basicConfig(level=build(GatewayOptions, options, values).log_level.upper(), format=LOG_FORMAT)
    config: GatewayConfig = build(GatewayConfig, options, values)
    address = f"http://{config.host}:{config.port}"
    check_port_free(config.host, config.port, address)
    try:
        trio.run(_gateway, config)
    except* OSError as group:
        raise _bind_errors(group, address) from None
    return 0


async def _gateway(config: GatewayConfig) -> None:
    import trio  # noqa: PLC0415

    from neuron_tai.gateway import serve_gateway  # noqa: PLC0415

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                lambda task_status: serve_gateway(config, shutdown=stop, task_status=task_status)
            )
            print(f"ready {' '.join(binds)}", flush=True)
            async for _signum in signals:
                stop.set()
                break
