import sys, time, json, trio, httpx
from pathlib import Path
from bench.workload import CORPUS, make_requests
from neuron_tai.client import open_client
from engine.llama_handles import LlamaModel, ensure_backend
ensure_backend(); m = LlamaModel(Path(sys.argv[1]), "auto")
corpus = m.tokenize(CORPUS, add_special=False); bos = m.tokenize("", add_special=True)[0]
req = make_requests(corpus, 16, 32, seed=12, max_prompt=256, bos=bos)[3]
async def stats(client):
    s = await client.stats(); return s["llama_decode_seconds_total"], s["batches_total"], s["preemptions_total"]
async def main():
    async with open_client("tcp://127.0.0.1:5731") as client:
        for rnd in range(3):
            a = await stats(client); sid = f"p-{time.monotonic_ns()}"; t0 = time.perf_counter(); first = None
            await client.open(sid, len(req.prompt) + 1, wait_ms=50000)
            async for r in client.generate_tokens(sid, 0, list(req.prompt), 1, ignore_eog=True):
                first = first or time.perf_counter()
            await client.close(sid); b = await stats(client)
            print("direct ", len(req.prompt), "ttft", round((first - t0) * 1000, 1), "decode_s", round(b[0] - a[0], 4), "calls", b[1] - a[1], "preempt", b[2] - a[2], flush=True)
            a = await stats(client)
            body = {"model": "g", "prompt": list(req.prompt), "max_tokens": 1, "temperature": 0, "stream": True}
            async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as http:
                t0 = time.perf_counter(); first = None
                async with http.stream("POST", "http://127.0.0.1:8931/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {"): first = time.perf_counter()
            await trio.sleep(0.2); b = await stats(client)
            print("gateway", len(req.prompt), "ttft", round((first - t0) * 1000, 1), "decode_s", round(b[0] - a[0], 4), "calls", b[1] - a[1], "preempt", b[2] - a[2], flush=True)
trio.run(main)
