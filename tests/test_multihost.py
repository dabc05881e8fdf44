"""`python -m bench.multihost --quick`: a chain across network namespaces, and nothing of it left afterwards."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.multihost import batching_bound, halves, median_pair
from neuron_tai.process_exists import process_exists

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, "-m", "bench.multihost", "--quick"]

needs_namespaces = pytest.mark.skipif(
    shutil.which("ip") is None or os.geteuid() != 0,
    reason="needs root and the `ip` command (iproute2) to create network namespaces and veth links",
)


def test_the_single_node_also_runs_at_the_halves_the_sweep_lacks() -> None:
    assert halves((1, 8, 16)) == [4]
    assert halves((1, 2, 4, 8, 16)) == []
    assert halves((1, 3)) == []
    assert batching_bound(None, 10.0) is None
    assert batching_bound(7.0, 10.0) == 0.7


def test_a_concurrency_is_reported_by_its_median_pair() -> None:
    def pairs(*efficiencies: float | None) -> list[dict[str, float | None]]:
        return [{"efficiency": e} for e in efficiencies]

    assert median_pair(pairs(0.9)) == 0
    assert median_pair(pairs(0.9, 0.5, 0.7)) == 2  # neither the slow spell nor the best pair
    assert median_pair(pairs(0.5, 0.9, 0.7, 0.8)) == 3  # of an even number, the higher middle one
    assert median_pair(pairs(None, 0.6, 0.4)) == 2  # a pair without a figure (no single-node tokens) ranks lowest


def leftovers(tag: str) -> list[str]:
    """Namespaces and links named for this tag that still exist."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return [line for line in namespaces.splitlines() if line.startswith(f"nt-{tag}-")] + [
        line for line in links.splitlines() if f"nt{tag}-" in line
    ]


@needs_namespaces
def test_quick_chain_across_namespaces_matches_single_node_and_leaves_nothing(tmp_path: Path) -> None:
    tag = f"t{os.getpid() % 4096:03x}"
    out = tmp_path / "multihost.json"
    cmd = [*BENCH, "--delays", "2", "--concurrency", "1,8", "--tag", tag, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())

    assert report["topology"]["isolated"] is True
    assert report["topology"]["namespaces"] == [f"nt-{tag}-client", f"nt-{tag}-s0", f"nt-{tag}-s1"]
    plan = report["plan"]
    solo = report["single_solo_tokens"]
    assert len(solo) == plan["requests"]
    assert all(len(tokens) == plan["max_new"] for tokens in solo.values())
    assert len({tuple(tokens) for tokens in solo.values()}) > 1  # distinct prompts, distinct continuations

    [delayed] = report["latency"]["runs"]
    assert delayed["delay_ms"] == 2 and delayed["concurrency"] == 8
    assert delayed["tokens"] == solo  # through both delayed links, 8 at once: the single node's greedy tokens
    chain_runs = [r for r in report["scale_out"]["runs"] if r["system"] == "chain2"]
    assert [r["concurrency"] for r in chain_runs] == [1, 8]
    assert all(r["tokens"] == solo for r in chain_runs)
    assert report["chain_token_mismatches"] == 0
    assert [r["concurrency"] for r in report["scale_out"]["rows"]] == [1, 8]
    assert all(r["pair_efficiencies"] == [r["efficiency"]] for r in report["scale_out"]["rows"])  # one pair each
    singles = {r["concurrency"]: r for r in report["scale_out"]["runs"] if r["system"] == "single"}
    assert sorted(singles) == [1, 4, 8]  # 4: half of 8, for the micro-batching bound
    one, eight = report["scale_out"]["rows"]
    assert one["batching_bound"] is None  # one session: no micro-batches
    assert eight["batching_bound"] == round(singles[4]["tok_s"] / singles[8]["tok_s"], 3)

    names = {p["name"] for p in report["processes"]}
    assert names >= {"single", "head", "tail", "head-2ms", "proxy-client-s0-2ms", "proxy-s0-s1-2ms"}
    assert all(p["exit_status"] == 0 for p in report["processes"])
    assert not [p for p in report["processes"] if process_exists(p["pid"])]
    assert leftovers(tag) == []


@needs_namespaces
def test_sigterm_mid_run_removes_namespaces_links_and_processes(tmp_path: Path) -> None:
    tag = f"u{os.getpid() % 4096:03x}"
    cmd = [*BENCH, "--delays", "2", "--concurrency", "1", "--tag", tag, "--out", str(tmp_path / "m.json")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # the first measurement has begun: every process and link exists
        seen.append(line)
        if line.startswith("multihost: single "):
            break
    assert leftovers(tag), "".join(seen)
    pids = [int(m.group(1)) for line in seen if (m := re.match(r"\S+: pid (\d+), log", line))]
    assert len(pids) >= 6, "".join(seen)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted" in rest
    assert not [pid for pid in pids if process_exists(pid)]
    assert leftovers(tag) == []


def test_loopback_fallback_runs_the_same_chain(tmp_path: Path) -> None:
    """Without namespaces (as without privilege) the same hosts, proxies and checks run on loopback."""
    out = tmp_path / "loopback.json"
    cmd = [*BENCH, "--loopback", "--delays", "2", "--concurrency", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on loopback" in proc.stderr
    report = json.loads(out.read_text())
    assert report["topology"] == {"isolated": False, "note": report["topology"]["note"], "namespaces": [], "veths": []}
    assert all(
        tcp.startswith("tcp://127.0.0.1:") for tcp in report["delayed_chains"][0].values() if isinstance(tcp, str)
    )
    assert report["latency"]["runs"][0]["tokens"] == report["single_solo_tokens"]
    assert report["chain_token_mismatches"] == 0
    assert not [p for p in report["processes"] if process_exists(p["pid"])]
