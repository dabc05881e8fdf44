import json, time, httpx, sys, trio
from bench.workload import CORPUS, make_requests
import llama_cpp
from engine.llama_handles import LlamaModel, ensure_backend
from pathlib import Path
ensure_backend(); m = LlamaModel(Path(sys.argv[1]), "auto")
corpus = m.tokenize(CORPUS, add_special=False); bos = m.tokenize("", add_special=True)[0]
reqs = make_requests(corpus, 16, 32, seed=12, max_prompt=256, bos=bos)
for req in reqs[:4]:
    body = {"model": "g", "prompt": list(req.prompt), "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True, "cache_prompt": False}
    t0 = time.perf_counter(); marks = []
    with httpx.stream("POST", "http://127.0.0.1:8931/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:]); txt = c["choices"][0].get("text") if c.get("choices") else None
                marks.append((round((time.perf_counter() - t0) * 1000, 1), repr(txt)))
    print(len(req.prompt), marks[:6])
