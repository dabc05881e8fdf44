"""evidence/pipeline.json: the pipeline figures of one `just bench`, gathered from its reports.

Server-side `generate` on a single node against `llama-server -np 16` comes from the
DGR-012 report (bench.report); scale-out and latency tolerance from the multi-host bench
(bench.multihost); mismatches are the report's bit-exact proofs (batch-invariant nodes,
generating, the chain pipelined in micro-batches).

    python -m bench.pipeline_evidence [--report evidence/DGR-012/bench.json] [--multihost evidence/multihost.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.aggregate import mean_by
from bench.common import EVIDENCE, shown, write_evidence
from bench.systems import NODE, SERVER


def gather(report: dict[str, Any], multihost: dict[str, Any]) -> dict[str, Any]:
    tok = mean_by(report["runs"], "tok_s")
    node, server = tok.get(NODE, {}), tok.get(SERVER, {})
    versus = [
        {
            "concurrency": c,
            "node_tok_s": round(node[c], 2),
            "llama_server_tok_s": round(server[c], 2),
            "ratio": round(node[c] / server[c], 3),
        }
        for c in sorted(node)
        if server.get(c)
    ]
    scale = [
        {
            "concurrency": r["concurrency"],
            "chain_tok_s": r["chain_tok_s"],
            "one_core_tok_s": r["single_tok_s"],
            "efficiency": r["efficiency"],
            "batching_bound": r.get("batching_bound"),
            "pair_efficiencies": r.get("pair_efficiencies", [r["efficiency"]]),
        }
        for r in multihost["scale_out"]["rows"]
    ]
    c = multihost["latency"]["concurrency"]
    latency = [
        {
            "delay_ms": r["delay_ms"],
            "concurrency": c,
            "tok_s": r["tok_s"],
            "itl_p50_ms": r["itl_p50_ms"],
            "itl_p99_ms": r["itl_p99_ms"],
        }
        for r in multihost["latency"]["rows"]
    ]
    return {
        "generate_vs_llama_server": versus,
        "scale_out": scale,
        "latency": latency,
        # The bit-exact proofs: batch-invariant nodes generating, alone, beside swapped partners and
        # through the chain pipelined in micro-batches. The multi-host chain runs in default mode,
        # where a quantized model's greedy tokens may legitimately part from a solo run at near-ties
        # (batch-shape rounding): those differences are reported beside, not as corruption.
        # None where the report ran no proofs (a report beside the default one leaves them to it).
        "mismatches": None if report["mismatches"] is None else int(report["mismatches"]),
        "multihost_default_mode_requests_differing_from_solo": int(multihost["chain_token_mismatches"]),
        "topology": multihost["topology"]["note"],
        "sources": {"report": report["command"], "multihost": multihost["command"]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=EVIDENCE / "DGR-012" / "bench.json")
    parser.add_argument("--multihost", type=Path, default=EVIDENCE / "multihost.json")
    args = parser.parse_args()
    payload = gather(json.loads(args.report.read_text()), json.loads(args.multihost.read_text()))
    path = write_evidence("pipeline.json", payload)
    print(json.dumps(payload, indent=1))
    print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
