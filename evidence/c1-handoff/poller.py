"""Poll `stats` of every given node every PERIOD seconds, as bench/stats_sampler.py does, until killed."""
import sys
import trio
from bench.stats_sampler import StatsSampler

async def main(period: float, addrs: list[str]) -> None:
    s = StatsSampler({f"n{i}": a for i, a in enumerate(addrs)})
    s.period_s = period
    async with trio.open_nursery() as n:
        await n.start(s.run)

trio.run(main, float(sys.argv[1]), sys.argv[2:])
