"""The multi-host bench's client: runs on the client host and prints one JSON object.

    python -m bench.chain_load run ADDR --concurrency 1,2 --requests 16 --max-new 32 --max-prompt 256 --workload decode
    python -m bench.chain_load ping ADDR --count 50
    python -m bench.chain_load stats ADDR [ADDR ...]

`run` builds the report's workload (bench/workload.py) with the node's own tokenizer and
drives it at each concurrency in a closed loop, the node running the token loop
(server-side `generate`): tok/s, TTFT and inter-token percentiles, and every request's
tokens. `ping` times protocol pings, the round trip of a link and the node's answer; `stats` reads
each node's compute counters (batches, their seconds, tokens), for what a run cost each stage.
It is a process of its own so it can run inside the client host's network namespace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

import trio

from bench.latency import summarize
from bench.node_driver import closed_loop
from bench.workload import CORPUS, WORKLOADS, first_per_client, make_requests
from neuron_tai.client import open_client

WARM_TOKENS = 4  # the unmeasured warm-up request's: its prompt's prefill warms the weights' pages


async def run(
    address: str,
    concurrencies: list[int],
    n: int,
    max_new: int,
    max_prompt: int,
    seed: int,
    tag: str,
    workload: str,
    per_client: int = 0,
) -> dict[str, Any]:
    """Closed-loop runs at each concurrency c over the first `per_client` x c of the `n` requests (0: all n)."""
    async with open_client(address, timeout_s=300) as client:
        corpus = await client.tokenize(CORPUS, add_special=False)
        start = await client.tokenize("", add_special=True)
        bos = start[0] if start else None
        buckets = WORKLOADS[workload].buckets
        requests = make_requests(corpus, n, max_new, seed=seed, max_prompt=max_prompt, bos=bos, buckets=buckets)
        # Connections, caches and the weights' pages warm, unmeasured: the first request, a few tokens of it.
        warm, _ = await closed_loop(client, [replace(requests[0], max_new=min(WARM_TOKENS, max_new))], 1, f"{tag}-warm")
        runs = []
        for c in concurrencies:
            share = first_per_client(requests, per_client, c)
            traces, wall = await closed_loop(client, share, c, f"{tag}-c{c}")
            runs.append({"concurrency": c, **summarize(traces, wall), "tokens": {t.rid: t.tokens for t in traces}})
    warm_tokens = sum(len(t.tokens) for t in warm)  # computed by the nodes too, before the runs
    return {
        "address": address,
        "prompt_tokens": [len(r.prompt) for r in requests],
        "runs": runs,
        "warm_tokens": warm_tokens,
    }


async def ping(address: str, count: int) -> dict[str, Any]:
    async with open_client(address, timeout_s=30) as client:
        await client.ping()  # connected
        rtts = []
        for _ in range(count):
            start = time.perf_counter()
            await client.ping()
            rtts.append((time.perf_counter() - start) * 1e3)
    return {"address": address, "rtt_ms": [round(x, 3) for x in rtts]}


STAT_KEYS = ("batches_total", "decode_tokens_total", "prefill_tokens_total")


async def stats(addresses: list[str]) -> dict[str, Any]:
    out = {}
    for address in addresses:
        async with open_client(address, timeout_s=30) as client:
            got = await client.stats()
        out[address] = {key: got[key] for key in STAT_KEYS} | {"step_seconds_sum": got["step_seconds"]["sum"]}
    return {"stats": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("address")
    r.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16])
    r.add_argument("--requests", type=int, default=16)
    r.add_argument("--max-new", type=int, default=32)
    r.add_argument("--max-prompt", type=int, default=256)
    r.add_argument("--seed", type=int, default=12)
    r.add_argument("--tag", default="load")
    r.add_argument("--workload", choices=sorted(WORKLOADS), default="prompt", help="prompt lengths (bench/workload.py)")
    r.add_argument("--per-client", type=int, default=0, help="at concurrency c, the first per-client x c requests")
    p = sub.add_parser("ping")
    p.add_argument("address")
    p.add_argument("--count", type=int, default=50)
    t = sub.add_parser("stats")
    t.add_argument("addresses", nargs="+")
    args = parser.parse_args()
    if args.cmd == "stats":
        out = trio.run(stats, args.addresses)
    elif args.cmd == "run":
        out = trio.run(
            run,
            args.address,
            args.concurrency,
            args.requests,
            args.max_new,
            args.max_prompt,
            args.seed,
            args.tag,
            args.workload,
            args.per_client,
        )
    else:
        out = trio.run(ping, args.address, args.count)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
