"""llama.cpp's `llama-server` as a peer: started with `-np` slots, driven over HTTP with streaming."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.latency import Trace
from bench.workload import Request
from engine.kernels import KernelPath, Placement, path_of_buffers
from engine.llama_handles import logged_buffers


def kernel_args(placement: Placement) -> list[str]:
    """llama-server's flags for the node's weight placement (`weight_placement(model, "auto")`).

    llama-server is built without AMX where the node's library has it (bench.llama_server),
    so its default placement is the node's repack path; for a plain node it gets `--no-repack`.
    """
    return ["--no-repack"] if placement.path is KernelPath.PLAIN else []


def server_command(
    binary: Path, model: Path, port: int, slots: int, ctx_per_slot: int, threads: int, placement: Placement
) -> list[str]:
    """`-lv 4`: only at trace verbosity does llama-server log where the weights went (`<type> model buffer
    size`); it adds about 20 lines per request, none per token."""
    return [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-b",
        "512",
        "-ub",
        "512",
        "-fa",
        "on",
        "--cache-ram",
        "0",
        "--no-webui",
        "-lv",
        "4",
        "--metrics",
        *kernel_args(placement),
    ]


def weight_buffers(log: Path) -> tuple[KernelPath, dict[str, int]]:
    """The kernel path llama-server's weights are on, from its own log (`<type> model buffer size = x MiB`)."""
    buffers = logged_buffers(log.read_text(errors="replace").splitlines())
    return path_of_buffers(buffers), buffers


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def metrics(port: int) -> dict[str, float]:
    """llama-server's own counters (`--metrics`, Prometheus text), by name without `llamacpp:`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        if resp.status != 200:
            raise RuntimeError(f"llama-server's /metrics answered {resp.status}: {text[:200]!r}")
    finally:
        conn.close()
    return parsed_metrics(text)


def parsed_metrics(text: str) -> dict[str, float]:
    """`llamacpp:NAME VALUE` lines; comments, labelled series and other prefixes are skipped."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("llamacpp:") and "{" not in name:
            found[name.removeprefix("llamacpp:")] = float(value)
    return found


def calls_between(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """llama-server's llama_decode calls between two readings of its metrics, and the slots busy in
    them (each slot serving a request counts once a call, decoding or prefilling):
    `n_busy_slots_per_decode` is an average since it started, over `n_decode_total` calls."""
    calls = after["n_decode_total"] - before["n_decode_total"]
    busy = after["n_busy_slots_per_decode"] * after["n_decode_total"]
    busy -= before["n_busy_slots_per_decode"] * before["n_decode_total"]
    return {"batches": round(calls), "busy_slots": round(busy)}


def complete(port: int, req: Request) -> Trace:
    """One streamed /completion: greedy, `max_new` tokens, end-of-text ignored, no prompt cache."""
    body = {
        "prompt": list(req.prompt),
        "n_predict": req.max_new,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": True,
        "return_tokens": True,
    }
    trace = Trace(req.rid)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:200]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            trace.tokens += [int(t) for t in event.get("tokens", [])]
            # Tokens held back (inside a UTF-8 character) arrive with a later event: same arrival time.
            trace.times += [now] * (int(event.get("tokens_predicted", 0)) - len(trace.times))
            if event.get("stop"):
                break
    finally:
        conn.close()
    if len(trace.times) != req.max_new:
        raise RuntimeError(f"llama-server generated {len(trace.times)} tokens for request {req.rid}, not {req.max_new}")
    return trace


def closed_loop(port: int, requests: Sequence[Request], concurrency: int) -> tuple[list[Trace], float]:
    """`concurrency` client threads, each sending the next request when its last one is done."""
    pending = iter(requests)
    lock = threading.Lock()
    traces: dict[int, Trace] = {}

    def worker() -> None:
        while True:
            with lock:
                req = next(pending, None)
            if req is None:
                return
            traces[req.rid] = complete(port, req)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    return [traces[r.rid] for r in requests], time.perf_counter() - start
