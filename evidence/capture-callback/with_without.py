"""A head shard's 1-row decode call, with the capture callback (the node's backend) against the same shard's
context without any callback and no output row (llama.cpp computes the same layers, nothing observed),
alternating; optionally with another Python thread contending for the GIL on the same core."""
import sys, threading, time
import numpy as np
from pathlib import Path
from bench.bare_loop import BareLoop
from engine.backend import ContextConfig, Segment, StageBackend
from engine.messages import Output

path = Path(sys.argv[1]); threads = int(sys.argv[2]); contended = sys.argv[3] == "1"
cfg = ContextConfig(n_seq_max=8, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=threads)
node = StageBackend(path, cfg)
bare = BareLoop(path, cfg)
seq = node.open_sequence(); pos = [0, 0]
def node_step():
    t = time.perf_counter(); node.decode([Segment(seq, pos[0], tokens=np.array([100], np.int32), output=Output.HIDDEN)]); pos[0] += 1
    return time.perf_counter() - t
def bare_step():
    bare.fill([(0, pos[1], 100, False)])
    t = time.perf_counter(); bare.decode(prefill=False); pos[1] += 1
    return time.perf_counter() - t
stop = threading.Event()
def busy():
    while not stop.is_set():
        sum(range(3000)); time.sleep(0.0003)
th = threading.Thread(target=busy) if contended else None
if th: th.start()
for _ in range(5): node_step(); bare_step()
for rnd in range(4):
    a = [node_step() for _ in range(30)]; b = [bare_step() for _ in range(30)]
    print(f"round {rnd} contended={contended}: with callback {1000*np.median(a):.2f} ms, without {1000*np.median(b):.2f} ms, ratio {np.median(a)/np.median(b):.3f}", flush=True)
if th: stop.set(); th.join()
