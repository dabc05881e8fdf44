"""Decode step times of one model loaded mapped (as before 83fee14) and read into memory, alternating:
bench.stage_cost.step_ms (one thread, 16 timed steps of 1 and of 8 rows), one fresh process each.
Usage: python steps.py MODEL
"""

import sys, time, statistics, multiprocessing
from pathlib import Path
def run(path, mapped):
    import numpy as np
    import engine.llama_handles as H
    if mapped:
        H.reads_every_weight = lambda h, p: False
    from bench.stage_cost import step_ms
    return step_ms(Path(path), 16)
if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    for r in range(3):
        for mapped in (True, False):
            with spawn.Pool(1) as pool:
                print(f"round {r+1} {'mapped' if mapped else 'read  '}: step ms {pool.apply(run, (sys.argv[1], mapped))}", flush=True)
