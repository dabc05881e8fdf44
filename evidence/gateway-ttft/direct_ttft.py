import sys, time, trio
from pathlib import Path
from bench.workload import CORPUS, make_requests
from bench.node_driver import generate
from neuron_tai.client import open_client
from engine.llama_handles import LlamaModel, ensure_backend
ensure_backend(); m = LlamaModel(Path(sys.argv[1]), "auto")
corpus = m.tokenize(CORPUS, add_special=False); bos = m.tokenize("", add_special=True)[0]
reqs = make_requests(corpus, 16, 32, seed=12, max_prompt=256, bos=bos)
async def main():
    async with open_client("tcp://127.0.0.1:5731") as client:
        for req in reqs[:4]:
            t = await generate(client, req, f"d-{req.rid}-{time.monotonic_ns()}")
            print(len(req.prompt), round(t.ttft * 1000, 1), [round(g * 1000, 1) for g in t.gaps[:4]])
trio.run(main)
