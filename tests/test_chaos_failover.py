"""The chaos run's failover part: its verdict names every broken criterion, and its quick run passes.

The quick run starts a head, two middle and two tail replicas on the tiny quantized model,
kills, hangs and cuts off replicas in turn while 16 sessions generate, and must lose no
session, change no token and leave no session held one lease after its clients left.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.chaos_failover_report import failures
from bench.netns import namespaces_unavailable
from neuron_tai.process_exists import process_exists

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("kill", "stop", "cut")


def clean_result() -> dict[str, Any]:
    run = {"sessions_completed": 10, "sessions_lost": 0, "lost_by_code": {}, "mismatches": 0, "unchecked": 0}
    return {
        "crashes": [],
        "bench_errors": [],
        "undisturbed": dict(run),
        "under_failures": dict(run),
        "faults": [{"fault": i + 1, "kind": k, "replica": "mid-0", "up_again": True} for i, k in enumerate(KINDS)],
        "after_lease": {"head": {"sessions_held": 0}, "mid-0": {"sessions_held": 0}},
    }


def test_the_verdict_names_each_broken_criterion() -> None:
    assert failures(clean_result(), KINDS) == []
    broken = copy.deepcopy(clean_result())
    broken["under_failures"].update(sessions_lost=2, lost_by_code={"downstream": 2}, mismatches=1)
    broken["faults"] = broken["faults"][:2]
    broken["after_lease"]["mid-0"] = {"sessions_held": 3}
    found = failures(broken, KINDS)
    assert any("2 sessions lost" in f for f in found)
    assert any("1 sessions differ" in f for f in found)
    assert any("no fault of kind cut" in f for f in found)
    assert any("mid-0: 3 sessions still held" in f for f in found)
    assert failures(broken, ("kill", "stop")) == [f for f in found if "kind cut" not in f]


def test_quick_failover_run_loses_no_session_and_changes_no_token(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.chaos_failover", "quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["failures"] == [] and report["crashes"] == []
    for phase in ("undisturbed", "under_failures"):
        run = report[phase]
        assert run["sessions_completed"] > 0 and run["sessions_lost"] == 0 and run["mismatches"] == 0, run
        assert run["unchecked"] == 0
    assert all(h is not None and h["sessions_held"] == 0 for h in report["after_lease"].values())

    # Every kind was really injected: a cut where namespaces can be made, each replica back up after it.
    kinds = set(KINDS) if namespaces_unavailable() is None else {"kill", "stop"}
    assert {f["kind"] for f in report["faults"]} == kinds and all(f["up_again"] for f in report["faults"])
    killed = [p for p in report["processes"] if p["killed_on_purpose"]]
    assert killed and all(p["exit_status"] == -9 for p in killed)
    assert report["recovery"]["recoveries_total"] > 0 and report["recovery"]["recoveries_failed_total"] == 0
    assert report["processes"] and not any(process_exists(p["pid"]) for p in report["processes"])
