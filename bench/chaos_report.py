"""The chaos run's figures from its raw results, what fails it, and the console summary. Pure, but for
`publish`, which writes a part's JSON and says its verdict."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import EVIDENCE, shown, write_evidence
from bench.progress import say

# Classes whose every message must be answered (the others: the peer does not read, or leaves).
ANSWERED = (
    "random_bytes",
    "deep_msgpack",
    "wide_msgpack",
    "huge_strings",
    "huge_frames",
    "out_of_range",
    "flood_ping",
    "flood_stats",
    "flood_close",
    "flood_open",
)
CLASS_ORDER = (*ANSWERED, "never_read", "vanish", "tail_restart", "malformed_next")


def hostile_classes(peers: Sequence[Mapping[str, Any]], drivers: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """Messages sent per class (the peers' own counts, and the drivers' for the two next-stage classes)."""
    out: dict[str, dict[str, Any]] = {}
    for peer in peers:
        for cls, tally in peer.get("classes", {}).items():
            row = out.setdefault(cls, {"sent": 0, "answered": 0, "unanswered": 0, "replies": Counter()})
            row["sent"] += tally["sent"]
            row["answered"] += tally["answered"]
            row["unanswered"] += tally["unanswered"]
            row["replies"].update(tally["replies"])
    for cls, sent in drivers.items():
        out[cls] = {"sent": sent, "answered": None, "unanswered": None, "replies": Counter()}
    ordered = {c: out[c] for c in CLASS_ORDER if c in out}
    ordered.update({c: v for c, v in out.items() if c not in ordered})
    for row in ordered.values():
        row["replies"] = dict(row["replies"].most_common())
    return ordered


def latency(values: Sequence[float | None]) -> dict[str, Any]:
    got = np.array([v for v in values if v is not None], dtype=np.float64)
    lost = sum(v is None for v in values)
    if not len(got):
        return {"pings": 0, "lost": lost}
    return {
        "pings": len(got),
        "lost": lost,
        "p50_ms": round(float(np.percentile(got, 50)), 2),
        "p99_ms": round(float(np.percentile(got, 99)), 2),
        "max_ms": round(float(got.max()), 2),
    }


def ping_phases(
    samples: Mapping[str, Sequence[Sequence[float | None]]], attack: tuple[float, float]
) -> dict[str, dict[str, Any]]:
    """Each node's ping latency before the attack (idle, then the solo runs) and under it, by wall-clock time sent."""
    start, end = attack
    out = {}
    for node, rows in samples.items():
        before = [r[1] for r in rows if r[0] is not None and r[0] < start]
        during = [r[1] for r in rows if r[0] is not None and start <= r[0] <= end]
        out[node] = {"before_attack": latency(before), "under_attack": latency(during)}
    return out


def memory_rows(tracks: Mapping[str, Any], peak_bound: float, final_bound: float) -> dict[str, dict[str, Any]]:
    """Each node's memory against the bounds: VmHWM (its peak) and VmRSS once the clients have left.
    `series_mib`: at most 40 samples (seconds, MiB) over the run, to tell a plateau from a climb."""
    out = {}
    for name, t in tracks.items():
        step = max(1, len(t.samples) // 40)
        out[name] = {
            "pid": t.pid,
            "before_attack_mib": t.before_mib,
            "peak_mib": t.peak_mib,
            "final_mib": t.final_mib,
            "within_bound": (t.peak_mib or 0) <= peak_bound and (t.final_mib or 0) <= final_bound,
            "series_mib": t.samples[::step],
        }
    return out


def failures(result: Mapping[str, Any], plan: Mapping[str, Any]) -> list[str]:
    """Everything that fails the run, each said plainly."""
    out = []
    if result["crashes"]:
        out.append("crashed: " + ", ".join(f"{c['name']} ({c['reason']})" for c in result["crashes"]))
    unclean = [
        f"{p['name']} ({p['exit_status']})"
        for p in result["processes"]
        if not p["killed_on_purpose"] and p["exit_status"] not in (0, None)
    ]
    if unclean:
        out.append("did not stop cleanly on SIGTERM: " + ", ".join(unclean))
    for problem in result.get("bench_errors", []):
        out.append(f"bench: {problem}")
    for name, m in result["memory"].items():
        if not m["within_bound"]:
            out.append(
                f"{name}: memory peak {m['peak_mib']} MiB (bound {plan['rss_peak_mib']}), final "
                f"{m['final_mib']} MiB (bound {plan['rss_final_mib']})"
            )
    for name, v in result["valid"].items():
        if v["mismatches"]:
            out.append(f"{name}: {v['mismatches']} valid sessions differ from their solo runs")
        if v["failed"]:
            out.append(f"{name}: valid sessions that did not complete: {v['failed']}")
        if not v["sessions"]:
            out.append(f"{name}: no valid session completed under attack")
    out += held_failures(result["after_lease"])
    for name, c in result["node_counters"].items():
        if c.get("messages_failed_total"):
            out.append(f"{name}: {c['messages_failed_total']} messages hit an unexpected fault (messages_failed_total)")
        if c.get("kv_sessions_lost_total"):
            out.append(
                f"{name}: {c['kv_sessions_lost_total']} sessions lost by a KV compaction (kv_sessions_lost_total)"
            )
    classes = result["hostile"]["classes"]
    for cls in CLASS_ORDER:
        if not classes.get(cls, {}).get("sent"):
            out.append(f"no message of class {cls} was sent")
    for cls, row in classes.items():
        if cls in ANSWERED and row["unanswered"]:
            out.append(f"{cls}: {row['unanswered']} of {row['sent']} messages never answered")
        if row["replies"].get("error:internal"):
            out.append(f"{cls}: {row['replies']['error:internal']} replies were `internal` errors")
    total, least = result["hostile"]["total"], plan["min_hostile"]
    if total < least:
        out.append(f"{total} hostile messages sent, the plan asks for at least {least}")
    out += malformed_failures(result["malformed_next"])
    out += restart_failures(result["tail_restart"])
    return out


def held_failures(after_lease: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """Nodes that did not answer `stats` one lease after the clients left, or still held sessions."""
    out = []
    for name, h in after_lease.items():
        if h is None:
            out.append(f"{name}: no stats after the lease")
        elif h["sessions_held"]:
            out.append(f"{name}: {h['sessions_held']} sessions still held one lease after the clients left ({h})")
    return out


def publish(payload: dict[str, Any], evidence: str, out: Path | None, quick_path: Path, part: str) -> int:
    """Write a part's JSON (a full run without `out`: into evidence/), say its verdict; its exit status."""
    path = out or (EVIDENCE / evidence if payload["plan"]["mode"] == "full" else quick_path)
    path = write_evidence(path.name, payload, path.parent)
    say(f"wrote {shown(path)} in {payload['seconds']} s")
    if payload["failures"]:
        print(f"FAILED ({part}):\n  " + "\n  ".join(payload["failures"]), file=sys.stderr)
        return 1
    print(f"{part}: passed")
    return 0


def malformed_failures(m: Mapping[str, Any]) -> list[str]:
    out = []
    wrong = {k: v for k, v in m["steps"].items() if k != "downstream"}
    wrong.update({f"generate {k}": v for k, v in m["generates"].items() if k != "downstream"})
    wrong.update({f"open {k}": v for k, v in m["opens"].items() if k not in ("opened", "downstream")})
    if wrong:
        out.append(f"malformed next-stage replies not answered `downstream`: {wrong}")
    if not m["steps"].get("downstream"):
        out.append("the head of the malformed next stage answered no step `downstream`")
    return out


def restart_failures(r: Mapping[str, Any]) -> list[str]:
    out = []
    if not r["cycles"]:
        out.append("the restarted tail was never killed")
    elif not all(c["ready"] for c in r["cycles"]):
        out.append("the restarted tail did not come back")
    elif not r["recovered_after_last_restart"]:
        out.append("no session completed through the restarted tail after its last restart")
    if not r["outcomes"].get("downstream") and not r["outcomes"].get("open:downstream"):
        out.append("the restart head never answered `downstream` while its tail was gone")
    return out


def console(result: Mapping[str, Any]) -> str:
    """The summary printed at the end of a run."""
    lines = ["hostile messages by class:"]
    for cls, row in result["hostile"]["classes"].items():
        replies = ", ".join(f"{k} {v}" for k, v in list(row["replies"].items())[:4])
        answered = "" if row["answered"] is None else f", answered {row['answered']}, unanswered {row['unanswered']}"
        lines.append(f"  {cls:<15} sent {row['sent']:>7}{answered}{'; ' + replies if replies else ''}")
    lines.append(f"  total           sent {result['hostile']['total']:>7}")
    lines.append("memory (MiB): before attack / peak (VmHWM) / final")
    for name, m in result["memory"].items():
        lines.append(f"  {name:<22} {m['before_attack_mib']} / {m['peak_mib']} / {m['final_mib']}")
    lines.append("ping ms, before attack p99 -> under attack p50 / p99 / max (lost):")
    for name, p in result["ping"].items():
        a, b = p["before_attack"], p["under_attack"]
        lines.append(
            f"  {name:<15} {a.get('p99_ms')} -> {b.get('p50_ms')} / {b.get('p99_ms')} / {b.get('max_ms')} "
            f"({b.get('lost')})"
        )
    for name, v in result["valid"].items():
        lines.append(
            f"valid sessions on {name}: {v['sessions']} ({v['tokens']} tokens), mismatches {v['mismatches']}, "
            f"failed {v['failed'] or 0}, open retries {v['open_retries']}"
        )
    held = {n: (h or {}).get("sessions_held") for n, h in result["after_lease"].items()}
    lines.append(f"sessions held one lease after the clients left: {held}")
    r = result["tail_restart"]
    lines.append(f"restarted tail: {len(r['cycles'])} cycles, outcomes {r['outcomes']}")
    m = result["malformed_next"]
    lines.append(f"malformed next stage: steps {m['steps']}, opens {m['opens']}, generates {m['generates']}")
    lines.append(f"crashes: {len(result['crashes'])}")
    return "\n".join(lines)
