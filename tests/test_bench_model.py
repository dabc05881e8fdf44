"""`python -m bench report --quick --model FILE`: the bench runs on a GGUF it has never seen and names it everywhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tables(markdown: str) -> list[tuple[str, str]]:
    """(the last non-blank line before the table, the table's header) of every markdown table."""
    found, previous, inside = [], "", False
    for line in markdown.splitlines():
        if line.startswith("|") and not inside:
            found.append((previous, line))
        inside = line.startswith("|")
        previous = line if line.strip() and not inside else previous
    return found


def test_report_on_a_named_model_names_that_file_in_every_table(tiny_shaped: Path, tmp_path: Path) -> None:
    model = shutil.copy(tiny_shaped, tmp_path / "never-seen-model.gguf")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "report", "--quick", "--model", str(model), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "report (" in proc.stdout and "suite times: report" in proc.stdout  # each suite's time is printed

    report_dir = out / "report-never-seen-model"
    report = json.loads((report_dir / "bench.json").read_text())
    assert report["model"] == "never-seen-model.gguf" and report["workload_name"] == "prompt-heavy"
    assert all(Path(s).name.startswith("never-seen-model") for s in report["chain2_shards"])  # sharded it itself
    found = tables((report_dir / "README.md").read_text())
    assert len(found) >= 8, found  # systems, throughput, ratios, saturation, ceiling or not, latency, engine use, ...
    for caption, header in found:
        assert caption == "Model `never-seen-model.gguf`, prompt-heavy workload:", (caption, header)
