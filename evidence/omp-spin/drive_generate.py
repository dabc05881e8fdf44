"""C concurrent server-side `generate`s of N tokens against a node, REPS times: aggregate
tok/s and the mean time inside `llama_decode` per call, from the node's `stats`.

    python evidence/omp-spin/drive_generate.py ADDRESS N REPS C
"""

import sys
import time

import trio

from neuron_tai.client import Client, open_client


async def one(client: Client, session: str, offset: int, n: int) -> None:
    await client.open(session, 64 + n + 1)
    async for _ in client.generate_tokens(session, 0, list(range(100 + offset, 116 + offset)), n, ignore_eog=True):
        pass
    await client.close(session)


async def main(address: str, n: int, reps: int, c: int) -> None:
    async with open_client(address) as client:
        for rep in range(reps):
            before = await client.stats()
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(c):
                    nursery.start_soon(one, client, f"s{rep}-{i}", i, n)
            wall = time.perf_counter() - start
            after = await client.stats()
            inside = after["llama_decode_seconds_total"] - before["llama_decode_seconds_total"]
            calls = after["step_seconds"]["count"] - before["step_seconds"]["count"]
            print(f"c={c} {c * n / wall:.1f} tok/s  decode {1000 * inside / calls:.2f} ms/call over {calls} calls")


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
