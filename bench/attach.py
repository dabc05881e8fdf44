"""Fold the full run's later parts into the DGR-012 report, so one README holds every comparison.

`just bench` runs the report first, then the parts with their own processes: the OpenAI
gateway against llama-server's OpenAI endpoint (bench.gateway_bench), speculative generation
(bench.speculation), the pipeline figures (bench.pipeline_evidence: `generate` against
llama-server, scale-out across namespaces, latency tolerance), what each stage of a split
holds in memory (bench.stage_cost) and the plan's split on unequal stages (bench.placement).
This copies their JSON into the report's `bench.json` under `gateway`, `speculation`,
`pipeline`, `stages` and `placement` and redraws its README. A part that is missing is left out.

    python -m bench.attach [--report-dir DIR] [--gateway FILE] [--pipeline FILE] [--speculation FILE]
                           [--stages FILE] [--placement FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench import report_markdown
from bench.common import EVIDENCE, shown

# The parts: each one's option (and key in the report) and its evidence file's stem.
PARTS = (
    ("gateway", "gateway"),
    ("pipeline", "pipeline"),
    ("speculation", "speculation"),
    ("stages", "stage_cost"),
    ("placement", "placement"),
)


def attach(report: dict[str, Any], parts: dict[str, Path]) -> list[str]:
    """Put each existing part's JSON into `report` under its name; the names attached."""
    done = []
    for name, path in parts.items():
        if path.exists():
            report[name] = json.loads(path.read_text())
            done.append(name)
        else:
            report.pop(name, None)
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-dir", type=Path, default=EVIDENCE / "DGR-012")
    for name, stem in PARTS:
        parser.add_argument(f"--{name}", type=Path, default=EVIDENCE / f"{stem}.json")
    args = parser.parse_args()
    path = args.report_dir / "bench.json"
    report = json.loads(path.read_text())
    done = attach(report, {name: getattr(args, name) for name, _ in PARTS})
    path.write_text(json.dumps(report, indent=1) + "\n")
    (args.report_dir / "README.md").write_text(report_markdown.render(report))
    print(f"attached {', '.join(done) or 'nothing'} to {shown(args.report_dir)}/bench.json and README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
