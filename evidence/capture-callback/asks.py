"""A head shard's decode calls (1 row): asks of the capture callback per call, the Python time inside it,
and the call's time with and without another Python thread contending for the GIL."""
import sys, threading, time
import numpy as np
from pathlib import Path
from engine import hidden_capture
from engine.backend import ContextConfig, Segment, StageBackend
from engine.messages import Output

asks = [0]; inside = [0.0]
orig = hidden_capture.HiddenCapture._on_eval
def counted(self, tensor, ask, user):
    t = time.perf_counter(); asks[0] += 1
    r = orig(self, tensor, ask, user)
    inside[0] += time.perf_counter() - t
    return r
hidden_capture.HiddenCapture._on_eval = counted

path = Path(sys.argv[1])
b = StageBackend(path, ContextConfig(n_seq_max=8, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=int(sys.argv[2])))
seq = b.open_sequence()
pos = 0
def step():
    global pos
    seg = Segment(seq, pos, tokens=np.array([100], np.int32), output=Output.HIDDEN)
    t = time.perf_counter(); b.decode([seg]); pos += 1
    return time.perf_counter() - t

stop = threading.Event()
def busy():  # an event loop's short bursts of Python work
    while not stop.is_set():
        sum(range(3000)); time.sleep(0.0003)

for _ in range(5): step()
for rnd in range(3):
    for contended in (False, True):
        th = None
        if contended:
            stop.clear(); th = threading.Thread(target=busy); th.start()
        asks[0] = 0; inside[0] = 0.0
        ts = [step() for _ in range(40)]
        if th: stop.set(); th.join()
        print(f"round {rnd} contended={contended}: median {1000*np.median(ts):.2f} ms/call, asks {asks[0]/40:.0f}/call, "
              f"python in callback {1000*inside[0]/40:.3f} ms/call", flush=True)
