"""Time shards alone, one process each (decode ms per row of a `rows`-row step, least of 5)."""
import sys, json
from pathlib import Path
from neuron_tai.layer_costs import _time_files, Measure
how = Measure(threads=1, decode_rows=int(sys.argv[2]), prefill_rows=64, reps=5)
t = _time_files({"x": Path(sys.argv[1])}, how, "x")["x"]
print(json.dumps({"file": Path(sys.argv[1]).name, "rows": how.decode_rows, "decode_ms_per_row": round(1000 * t.decode / how.decode_rows, 3)}))
