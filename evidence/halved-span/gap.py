"""Where the node's time per generated token goes against the bare loop's, per report and concurrency.

    python3 gap.py ROOT SUB...   (the reports ROOT/SUB/bench.json)

Reads each report's bench.json (the node's and the bare loop's wall time, time inside
llama_decode and steps; llama-server's calls and busy slots) and prints, in ms per generated
token: the node's extra time inside llama_decode, its steps beyond the call (sampling, the
compute thread's hand-off), its time outside its steps, and the bare loop's time between its
calls. One repetition a point, as the reports ran.
"""

import json
import sys
from pathlib import Path

NODE, SERVER, BARE = "neuron-tai single", "llama-server -np 16", "bare llama_decode"
REPORTS = ["", "report-decode", "report-llama-3.2-1b", "report-decode-llama-3.2-1b"]


def row(runs: dict[tuple[str, int], dict], c: int) -> str:
    node, bare, server = runs[(NODE, c)], runs[(BARE, c)], runs[(SERVER, c)]
    ne, be, se = node["engine"], bare["engine"], server.get("engine", {})
    tokens = round(node["tok_s"] * node["wall_s"])

    def ms(seconds: float) -> str:
        return f"{1000 * seconds / tokens:.2f}"

    calls = f"{ne['batches']} / {se.get('batches', '–')} / {be['batches']}"
    return " | ".join(
        [
            str(c),
            f"{node['tok_s'] / server['tok_s']:.2f}",
            f"{node['tok_s'] / bare['tok_s']:.2f}",
            f"{server['tok_s'] / bare['tok_s']:.2f}",
            calls,
            ms(ne["llama_decode_s"] - be["llama_decode_s"]),
            ms(ne["step_s"] - ne["llama_decode_s"]),
            ms(node["wall_s"] - ne["step_s"]),
            ms(bare["wall_s"] - be["llama_decode_s"]),
        ]
    )


def main(root: Path, reports: list[str]) -> None:
    for sub in reports:
        d = json.loads((root / sub / "bench.json").read_text())
        runs = {(r["system"], r["concurrency"]): r for r in d["runs"]}
        print(f"\n{d['model']}, {d['workload_name']} ({sub or '.'}), commit {d['commit']}\n")
        print("| c | node ÷ server | node ÷ bare | server ÷ bare | calls node / server / bare | "
              "node's calls' extra | node's steps beyond the call | node outside steps | bare between calls |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c in sorted({c for s, c in runs if s == NODE}):
            print(f"| {row(runs, c)} |")


main(Path(sys.argv[1]), sys.argv[2:])
