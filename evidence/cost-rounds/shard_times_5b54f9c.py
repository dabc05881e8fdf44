"""Time shards as the plan's measurement does (decode of 4 rows per row, best of reps), one process each."""
import sys, json
from pathlib import Path
from neuron_tai.layer_costs import _time_file, Measure
how = Measure(threads=1, decode_rows=int(sys.argv[2]), prefill_rows=64, reps=5)
t = _time_file(Path(sys.argv[1]), how)
print(json.dumps({"file": Path(sys.argv[1]).name, "decode_ms_per_row": round(1000 * t.decode / how.decode_rows, 3)}))
