import multiprocessing
import sys
from pathlib import Path


def run(path: Path, trim: bool) -> dict:
    import engine.backend as b
    if not trim:
        b.release_free_heap = lambda: True
    from bench.stage_cost import stage_memory
    return stage_memory(path)


if __name__ == "__main__":
    for trim in (False, True, False, True):
        with multiprocessing.get_context("spawn").Pool(1) as p:
            m = p.apply(run, (Path(sys.argv[1]), trim))
            print("trim", trim, m["rss"], m["rss_anon"], m["rss_file"], m["process_base"], flush=True)
