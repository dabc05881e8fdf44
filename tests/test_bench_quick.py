"""`just bench quick` end to end: real node processes on the tiny model, the report, and clean shutdown."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.faults import ENV as CRASH_ENV
from bench.systems import BARE, CHAIN, NODE, NODE_FAST, PYTHON
from neuron_tai.process_exists import process_exists

ROOT = Path(__file__).resolve().parent.parent
REPORT = [sys.executable, "-m", "bench.report", "quick"]
ALL_QUICK = [sys.executable, "-m", "bench", "all", "--quick"]


def test_quick_bench_reports_every_system_and_proves_sessions_never_mix(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [*REPORT, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} >= {
        "README.md",
        "bench.json",
        "throughput.png",
        "latency.png",
        "telemetry.png",
    }
    report = json.loads((out / "bench.json").read_text())

    assert report["mismatches"] == 0
    assert [c["mismatches"] for c in report["invariant"]["checks"]] == [0, 0, 0]
    assert all(
        c["sessions"] == 8 and c["tokens"] == 8 * report["plan"]["max_new"] for c in report["invariant"]["checks"]
    )

    swept = {(r["system"], r["concurrency"]) for r in report["runs"]}
    for system in (NODE, CHAIN, BARE):
        assert {c for s, c in swept if s == system} == {1, 2, 4, 8, 16}
    assert (PYTHON, 1) in swept
    assert all(r["tokens"] == 16 * report["plan"]["max_new"] for r in report["runs"])  # nothing lost in the sweep
    prompt_tokens = sum(w["prompt_tokens"] for w in report["workload"])
    for r in report["runs"]:  # the engines' own counts of what they computed for each run
        if r["system"] in (NODE, CHAIN, BARE):
            used = r["engine"]
            assert used["decode_rows"] == 16 * (report["plan"]["max_new"] - 1), r
            assert used["prefill_tokens"] == prompt_tokens and used["llama_decode_s"] > 0, r
    assert "## Where the time goes" in (out / "README.md").read_text()

    burst = report["admission"]
    assert burst["accepted"] == 8 and burst["refused"] == {"session_limit": 16}  # 4 active + 4 waiting
    assert burst["busy_retries"] > 0 and not burst["incomplete_sessions"]
    assert burst["tokens_received"] == burst["tokens_expected"] == 8 * report["plan"]["max_new"]
    assert burst["stats_after"]["admissions_rejected_total"]["session_limit"] == 16

    assert len(report["telemetry"]) > 0 and report["saturation"][NODE]["tok_s"]
    assert report["processes"] and not any(process_exists(p["pid"]) for p in report["processes"])
    assert "mismatches: 0" in (out / "README.md").read_text()

    for system in (NODE, NODE_FAST, CHAIN, PYTHON, BARE):  # each system's kernel path, read back from it
        assert report["systems"][system]["kernel_path"] in ("repack", "plain"), report["systems"][system]
    assert report["cpu"]["model"] and "amx" in report["cpu"] and isinstance(report["extra_buffer_types"], list)
    readme = (out / "README.md").read_text()
    assert "## Systems and kernel paths" in readme and "AVX-512" in readme
    for text in (readme, (out / "bench.json").read_text()):  # evidence names no directory of this machine
        assert str(ROOT) not in text and str(Path.home()) + "/" not in text

    # The full run's later parts fold into the same report (here the committed evidence of one).
    evidence = ROOT / "evidence"
    attach = [
        sys.executable,
        "-m",
        "bench.attach",
        "--report-dir",
        str(out),
        "--gateway",
        str(evidence / "gateway.json"),
        "--pipeline",
        str(evidence / "pipeline.json"),
        "--stages",
        str(evidence / "stage_cost.json"),
        "--placement",
        str(evidence / "placement-llama-3.2-1b.json"),
    ]
    subprocess.run(attach, cwd=ROOT, check=True, capture_output=True, timeout=120)
    attached = json.loads((out / "bench.json").read_text())
    assert attached["runs"] == report["runs"] and {"gateway", "pipeline", "stages", "placement"} <= attached.keys()
    readme = (out / "README.md").read_text()
    gateway = json.loads((evidence / "gateway.json").read_text())["results"]
    assert "## OpenAI gateway against llama-server's OpenAI endpoint" in readme
    assert all(f"| {system} | {row['concurrency']} |" in readme for system, rows in gateway.items() for row in rows)
    assert "## Pipeline: server-side generation, scale-out, latency tolerance" in readme
    for split in attached["stages"]["splits"]:  # each stage's memory against its target, said either way
        for layers, m in split["memory_mib"].items():
            within = "yes" if m["rss"] <= m["target"] else f"no, +{m['rss'] - m['target']:.1f}"
            assert f"| {split['split']} | {layers} |" in readme and f"| {m['target']} | {within} |" in readme
    plan = next(x for x in attached["placement"]["splits"] if x["split"] == "plan")
    assert f"| plan | {', '.join(f'{a}:{b}' for a, b in plan['bounds'])} | {plan['tok_s']:.2f} |" in readme
    missing = out / "absent.json"
    absent = ("--gateway", "--pipeline", "--stages", "--placement")
    subprocess.run(
        [*attach[:-8], *(x for flag in absent for x in (flag, str(missing)))],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert "## OpenAI gateway" not in (out / "README.md").read_text()
    assert "## Stages" not in (out / "README.md").read_text()
    assert not {"gateway", "stages", "placement"} & json.loads((out / "bench.json").read_text()).keys()


def test_bench_reports_a_crashed_node_and_still_writes_the_rest(tmp_path: Path) -> None:
    # chain2-tail segfaults while loading; the prefill-share node is sent SIGSEGV as its c=2 run begins.
    out = tmp_path / "report"
    env = {**os.environ, CRASH_ENV: "chain2-tail@start,single-prefill-share-4@c=2"}
    proc = subprocess.run(
        [*REPORT, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED: crashed: " in proc.stderr
    assert {p.name for p in out.iterdir()} >= {
        "README.md",
        "bench.json",
        "throughput.png",
        "latency.png",
        "telemetry.png",
    }
    report = json.loads((out / "bench.json").read_text())

    crashes = {c["name"]: c for c in report["crashes"]}
    assert set(crashes) == {"chain2-tail", "single-prefill-share-4"}
    at_start, mid_run = crashes["chain2-tail"], crashes["single-prefill-share-4"]
    assert at_start["exit_status"] == mid_run["exit_status"] == -signal.SIGSEGV
    assert at_start["reason"] == "killed by SIGSEGV before it was ready"
    assert at_start["log_tail"][-1] == "loading the model ..."
    assert mid_run["reason"] == f"killed by SIGSEGV during {NODE_FAST} c=2" and mid_run["log_tail"]
    assert report["systems"][CHAIN]["crashed"] == ["chain2-tail"]
    assert report["systems"][NODE_FAST]["crashed"] == ["single-prefill-share-4"]

    swept = {(r["system"], r["concurrency"]) for r in report["runs"]}
    assert not {c for s, c in swept if s == CHAIN}
    assert {c for s, c in swept if s == NODE_FAST} == {1}
    for system in (NODE, BARE):
        assert {c for s, c in swept if s == system} == {1, 2, 4, 8, 16}
    assert report["mismatches"] == 0 and report["admission"]["accepted"] == 8  # the proofs still ran
    assert report["default_mode"]["teacher_forced"]

    readme = (out / "README.md").read_text()
    assert "### Crashed processes" in readme
    assert "**crashed**: chain2-tail killed by SIGSEGV before it was ready" in readme
    assert "loading the model ..." in readme and mid_run["log_tail"][-1] in readme
    assert "mismatches: 0" in readme
    assert not any(process_exists(p["pid"]) for p in report["processes"])


@pytest.mark.parametrize("command", [REPORT, ALL_QUICK], ids=["suite", "all"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_bench_stops_every_process_it_started(
    tmp_path: Path, signum: signal.Signals, command: list[str]
) -> None:
    """Signalled alone (as `kill` or a service manager does), a suite, or `python -m bench all`
    with a suite under way, stops every process the suite started and exits 130."""
    # Started as a shell starts a background job, with SIGINT ignored: Ctrl-C must still stop it.
    ignoring_sigint = ["bash", "-c", 'trap "" INT; exec "$@"', "bash"]
    proc = subprocess.Popen(
        [*ignoring_sigint, *command, "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    pids = []
    try:
        for line in proc.stdout:
            pids += [int(p) for p in re.findall(r": pid (\d+),", line)]
            if "workload:" in line:  # every process is up and the sweep begins
                break
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()  # a no-op once it has exited
    assert proc.returncode == 130, rest
    assert len(pids) >= 7
    deadline = time.monotonic() + 10
    while any(process_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if process_exists(p)]


def test_stage_cost_times_both_splits_of_the_tiny_model() -> None:
    out = ROOT / ".bench" / "stage_cost-quick.json"
    out.unlink(missing_ok=True)  # what this run writes, not what an earlier one left
    cmd = [sys.executable, "-m", "bench.stage_cost", "--quick", "--reps", "1", "--steps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert [s["split"] for s in got["splits"]] == ["layers", "weights"]
    for split in got["splits"]:
        assert split["bounds"][0][0] == 0 and split["bounds"][-1][1] == 4
        assert set(split["step_ms"]) == {f"{a}:{b}" for a, b in split["bounds"]}
        bound = split["efficiency_bound"]
        assert set(bound) == {"1", "8"} and all(v > 0 for v in bound.values())


def test_filler_cost_times_each_size_with_and_without_its_fillers() -> None:
    out = ROOT / ".bench" / "filler_cost-quick.json"
    out.unlink(missing_ok=True)  # what this run writes, not what an earlier one left
    cmd = [sys.executable, "-m", "bench", "fillers", "--quick"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["threads"], r["rows"], r["fillers"]) for r in rows] == [
        (t, n, k) for t in (1, 2) for n, k in ((3, 1), (7, 1), (11, 1), (14, 2), (15, 1))
    ]
    assert all(r["bare_ms"] > 0 and r["filled_ms"] > 0 for r in rows)
