"""The OpenAI gateway in front of a single node and of a 2-stage chain, against the node driven
directly over the protocol and llama-server's own OpenAI endpoint, with the same workload at
concurrency 1 to 16.

    python -m bench.gateway_bench            # gemma-3-270m (the bench extra); builds llama-server once
    python -m bench.gateway_bench --quick    # the tiny test model: checks that it all runs, numbers mean nothing

Every system gets the same requests (token-id prompts, greedy, `ignore_eos`, a fixed number
of tokens) through `POST /v1/completions` with `stream: true`, from concurrent clients in a
closed loop. Measured per concurrency: aggregate completion tokens per second over the wall
time (prefill included; tokens from each response's `usage`), time to the first streamed
text, and the gaps between streamed chunks (one chunk per token from llama-server; the
gateway sends what the node delivered together, usually one token). At each concurrency every
system runs `rounds` times, the order rotated each round, and its row is its median round by
tok/s (every round's tok/s is kept beside it): one short run per point moves with whatever
else the machine does. The node driven directly
(open, a streamed server-side `generate`, close; token ids, no text) is what the gateway in
front of it should cost nothing against; each gateway's node calls per request, by op, come
from its /metrics. Writes JSON to `.bench/` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.common import SHARDS, WORK, bench_model, command_line, shown
from bench.latency import percentile_ms
from bench.llama_server import cached_binary, ensure_llama_server
from bench.node_driver import generate, run_closed_loop
from bench.processes import Processes, free_ports, node_ready, open_processes, serve_command
from bench.server_peer import healthy, server_command
from bench.workload import CORPUS, Request, first_per_client, make_requests
from engine.llama_handles import weight_placement
from neuron_tai.client import open_client
from neuron_tai.shard import weight_balanced_bounds
from neuron_tai.shard_cache import cached_stages
from neuron_tai.timing_rounds import rotated

SLOTS = 8  # node sessions and llama-server slots
DIRECT = "single node, protocol direct"


@dataclass(frozen=True, slots=True)
class Plan:
    requests: int
    max_new: int
    max_prompt: int
    concurrencies: tuple[int, ...]
    kv_cells: int
    ctx_per_slot: int
    per_client: int = 0  # at concurrency c, the first per_client x c requests (0: all of them)
    rounds: int = 1  # every system this many times at each concurrency, in rotated order


FULL = Plan(
    requests=16, max_new=32, max_prompt=256, concurrencies=(1, 2, 4, 8, 16), kv_cells=4096, ctx_per_slot=512,
    per_client=4, rounds=3,
)  # fmt: skip
QUICK = Plan(requests=16, max_new=8, max_prompt=64, concurrencies=(1, 2, 4, 8, 16), kv_cells=2048, ctx_per_slot=256)


@dataclass(slots=True)
class Seen:
    """One streamed completion: when it started, when each text chunk came, how many tokens it made."""

    start: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0


async def complete(http: httpx.AsyncClient, url: str, model: str, req: Request) -> Seen:
    body = {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": req.max_new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": False,
    }
    seen = Seen(time.perf_counter())
    async with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url} answered {reply.status_code}: {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                seen.chunks.append(time.perf_counter())
            if chunk.get("usage"):
                seen.tokens = int(chunk["usage"]["completion_tokens"])
    if seen.tokens != req.max_new:
        raise RuntimeError(f"{url}: {seen.tokens} tokens for request {req.rid}, not {req.max_new}")
    return seen


async def closed_loop(url: str, model: str, requests: list[Request], concurrency: int) -> dict[str, Any]:
    # A new connection per request, for every system alike: llama-server's HTTP library closes a
    # kept-alive connection after a few requests, and a request racing that close fails.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        by_rid, wall = await run_closed_loop(requests, concurrency, partial(complete, http, url, model))
    seen = list(by_rid.values())
    gaps = [b - a for s in seen for a, b in zip(s.chunks, s.chunks[1:], strict=False)]
    ttfts = [s.chunks[0] - s.start for s in seen if s.chunks]
    return measured(concurrency, len(seen), sum(s.tokens for s in seen), wall, ttfts, gaps)


def measured(
    concurrency: int, requests: int, tokens: int, wall: float, ttfts: list[float], gaps: list[float]
) -> dict[str, Any]:
    """One system's row at one concurrency."""
    return {
        "concurrency": concurrency,
        "requests": requests,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "ttft_p99_ms": percentile_ms(ttfts, 99),
        "itl_p50_ms": percentile_ms(gaps, 50),
        "itl_p99_ms": percentile_ms(gaps, 99),
    }


async def direct_loop(address: str, requests: list[Request], concurrency: int) -> dict[str, Any]:
    """The same closed loop against the node itself: open, streamed `generate`, close."""
    async with open_client(address) as client:
        traces, wall = await run_closed_loop(
            requests, concurrency, lambda req: generate(client, req, f"direct-{req.rid}-{time.monotonic_ns()}")
        )
    seen = list(traces.values())
    gaps = [gap for t in seen for gap in t.gaps]
    ttfts = [t.ttft for t in seen if t.times]
    return measured(concurrency, len(seen), sum(len(t.tokens) for t in seen), wall, ttfts, gaps)


async def node_calls(url: str) -> dict[str, float]:
    """A gateway's protocol requests to its node so far, by op (its /metrics)."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(url.removesuffix("/v1/completions") + "/metrics")).text
    calls = {}
    for line in text.splitlines():
        if line.startswith("neuron_tai_gateway_node_calls_total{"):
            calls[line.split('op="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return calls


def model_for(quick: bool) -> Path:
    return bench_model(quick)


def start(procs: Processes, model: Path, plan: Plan, quick: bool) -> tuple[dict[str, str], str]:
    """Nodes, a gateway in front of each, and llama-server: ({system name: completions URL}, the single node)."""
    shards = cached_stages(model, weight_balanced_bounds(model, 2), SHARDS)
    p = free_ports(6)
    limits = [
        "--max-sessions",
        str(SLOTS),
        "--max-waiting",
        "64",
        "--kv-cells",
        str(plan.kv_cells),
        "--log-level",
        "warning",
    ]

    def node(name: str, path: Path, port: int, threads: int, extra: tuple[str, ...] = ()) -> str:
        address = f"tcp://127.0.0.1:{port}"
        if not procs.start(name, serve_command(path, address, threads=threads, flags=[*limits, *extra]), node_ready):
            raise RuntimeError(f"{name} did not start; see {shown(procs.log(name))}")
        return address

    def gateway(name: str, address: str, port: int) -> str:
        if not procs.start(name, gateway_command(model, address, port), node_ready):
            raise RuntimeError(f"{name} did not start; see {shown(procs.log(name))}")
        return f"http://127.0.0.1:{port}/v1/completions"

    single = node("single", model, p[0], 2)
    urls = {DIRECT: single, "gateway + single node": gateway("gateway-single", single, p[1])}
    tail = node("chain2-tail", shards[1], p[2], 1)
    urls["gateway + 2-stage chain"] = gateway(
        "gateway-chain2", node("chain2-head", shards[0], p[3], 1, ("--next", tail)), p[4]
    )
    server = start_llama_server(procs, model, plan, p[5], quick)
    if server is not None:
        urls[f"llama-server -np {SLOTS}"] = server
    return urls, single


def gateway_command(model: Path, node: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "neuron_tai.cli", "gateway", "--node", node, "--port", str(port),
        "--model-name", model.stem, "--model", str(model), "--open-wait-ms", "50000", "--timeout", "120",
    ]  # fmt: skip


def start_llama_server(procs: Processes, model: Path, plan: Plan, port: int, quick: bool) -> str | None:
    """llama-server's completions URL once it is healthy (built first unless `quick`); None without it."""
    binary = cached_binary()
    if binary is None and not quick:
        print("building llama-server from the vendored llama.cpp (once; about 6 minutes on 2 cores) ...", flush=True)
        binary, note = ensure_llama_server()
        print(note, flush=True)
    if binary is None:
        print("llama-server: not built yet, skipped (`python -m bench.gateway_bench` builds it)", flush=True)
        return None
    cmd = server_command(binary, model, port, SLOTS, plan.ctx_per_slot, 2, weight_placement(model))
    if procs.start("llama-server", cmd, lambda _log: healthy(port)):
        return f"http://127.0.0.1:{port}/v1/completions"
    return None


async def workload(node: str, plan: Plan) -> list[Request]:
    async with open_client(node) as client:
        corpus = await client.tokenize(CORPUS, add_special=False)
        start = await client.tokenize("", add_special=True)
    bos = start[0] if start else None
    return make_requests(corpus, plan.requests, plan.max_new, seed=12, max_prompt=plan.max_prompt, bos=bos)


def measure_concurrency(
    urls: dict[str, str], model: str, share: list[Request], concurrency: int, rounds: int
) -> dict[str, dict[str, Any]]:
    """Every system's median round (by tok/s) at one concurrency, with each round's tok/s."""
    seen: dict[str, list[dict[str, Any]]] = {system: [] for system in urls}
    for k, (system, url) in rotated(rounds, list(urls.items())):
        if system == DIRECT:
            row = trio.run(direct_loop, url, share, concurrency)
        else:
            row = trio.run(closed_loop, url, model, share, concurrency)
        seen[system].append(row)
        print(
            f"{system:28} c={concurrency:<3} {row['tok_s']:8.2f} tok/s  TTFT p50/p99 {row['ttft_p50_ms']}/"
            f"{row['ttft_p99_ms']} ms  ITL p50/p99 {row['itl_p50_ms']}/{row['itl_p99_ms']} ms"
            + (f"  (round {k + 1} of {rounds})" if rounds > 1 else ""),
            flush=True,
        )
    return {system: median_round(rows) for system, rows in seen.items()}


def median_round(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median tok/s (the lower middle of an even count), with every round's tok/s."""
    middle = sorted(rows, key=lambda row: row["tok_s"])[(len(rows) - 1) // 2]
    return {**middle, "rounds_tok_s": [row["tok_s"] for row in rows]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny test model, few tokens: a check that it runs")
    parser.add_argument("--out", type=Path, help="JSON results (default: .bench/gateway[-quick].json)")
    parser.add_argument("--concurrency", help="only these concurrencies, separated by commas (e.g. 1,8)")
    parser.add_argument("--rounds", type=int, help="runs of every system at each concurrency (default: 3; quick: 1)")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error("--rounds is at least 1")
        plan = replace(plan, rounds=args.rounds)
    if args.concurrency:
        plan = replace(plan, concurrencies=tuple(int(c) for c in args.concurrency.split(",")))
    model = model_for(args.quick)
    out = args.out or WORK / f"gateway{'-quick' if args.quick else ''}.json"
    results: dict[str, list[dict[str, Any]]] = {}
    with open_processes(WORK / "gateway-logs") as procs:
        urls, single = start(procs, model, plan, args.quick)
        requests = trio.run(workload, single, plan)
        for c in plan.concurrencies:  # systems interleaved at each concurrency: drift hits all alike
            share = first_per_client(requests, plan.per_client, c)
            for system, row in measure_concurrency(urls, model.stem, share, c, plan.rounds).items():
                results.setdefault(system, []).append(row)
        calls = {s: trio.run(node_calls, u) for s, u in urls.items() if s.startswith("gateway")}
    served = plan.rounds * sum(len(first_per_client(requests, plan.per_client, c)) for c in plan.concurrencies)
    per_request = {s: {op: round(n / served, 3) for op, n in c.items()} for s, c in calls.items()}
    print(f"node calls per request (/metrics, the gateway's own scrapes included): {per_request}", flush=True)
    ratios = {
        s: [round(r["tok_s"] / d["tok_s"], 3) for r, d in zip(rows, results[DIRECT], strict=True)]
        for s, rows in results.items()
        if s != DIRECT
    }
    print(f"tok/s against the node driven directly, c={list(plan.concurrencies)}: {ratios}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command_line(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": shown(model),
        "plan": asdict(plan),
        "results": results,
        "node_calls_per_request": per_request,
        "tok_s_over_direct": ratios,
    }
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {shown(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
