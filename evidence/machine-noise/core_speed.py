"""One llama.cpp thread, one sequence: ms per decode call of the model given (three runs of
64 greedy steps after one to warm up), on whatever core taskset gives. Usage:
    PYTHONPATH=. taskset -c CORE .venv/bin/python evidence/machine-noise/core_speed.py MODEL CORE"""
import os, sys, time
from pathlib import Path
import llama_cpp as lc
from bench.bare_loop import BareLoop
from engine.backend import ContextConfig
model = Path(os.path.expanduser(sys.argv[1]))
cfg = ContextConfig(n_ctx=1024, n_batch=512, n_seq_max=2, n_threads=1)
bare = BareLoop(model, cfg)
rate, _ = bare.decode_rate([[2, 100, 200, 300]], 64)
t=[]
for _ in range(3):
    rate, _ = bare.decode_rate([[2, 100, 200, 300]], 64)
    t.append(round(1000 / rate, 2))
print(f"core {sys.argv[2]}: ms per decode call {t}", flush=True)
bare.close()
