"""Run `neuron-tai serve` with every llama_decode call logged to $TRACE (probe only)."""
import json, os, sys, time
import engine.executor as ex

_orig = ex.Executor._observe
_out = open(os.environ["TRACE"], "w", buffering=1)

def _observe(self, plan, call, seconds):
    decode_rows = sum(c.count for c in call.chunks if self._step(c).is_decode)
    prefill_rows = sum(c.count for c in call.chunks) - decode_rows
    _orig(self, plan, call, seconds)
    p = self.pace
    _out.write(json.dumps({"t": round(time.monotonic(), 4), "d": decode_rows, "p": prefill_rows,
        "ms": round(seconds * 1000, 1), "gain": round(p.gain, 3), "target": p.target_ms and round(p.target_ms, 1),
        "ptok": p.prefill_token_ms and round(p.prefill_token_ms, 2), "budget": p.budget_rows, "boost": p.boosted}) + "\n")

ex.Executor._observe = _observe
from neuron_tai.cli import main
sys.exit(main())
