"""The failover part's verdict and summary from its raw results. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.chaos_report import held_failures

MAX_SPREAD = 0.2  # with every replica up, load within 20% across them


def recovery_figures(head: Mapping[str, Any] | None) -> dict[str, Any]:
    """The head's recovery counters, and the mean time one recovery took."""
    if head is None:
        return {}
    keys = (
        "recoveries_total",
        "recoveries_failed_total",
        "replayed_tokens_total",
        "recovery_seconds_total",
        "recovery_seconds_max",
    )
    out = {k: head.get(k) for k in keys}
    n = out["recoveries_total"] or 0
    out["recovery_seconds_mean"] = round(float(out["recovery_seconds_total"] or 0) / n, 6) if n else None
    return out


def placement_spread(fronts: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """Sessions placed on each replica of the middle range (by the head) and of the tail range (by
    both middles together) while every replica was up; spread = (most - fewest) / mean."""
    ranges: dict[str, list[int]] = {}
    for name, stats in fronts.items():
        replicas = ((stats or {}).get("downstream") or {}).get("replicas") or []
        placed = ranges.setdefault("middle" if name == "head" else "tail", [0] * len(replicas))
        for i, replica in enumerate(replicas):
            placed[i] += int(replica.get("placed_total") or 0)
    out: dict[str, Any] = {}
    for name, placed in ranges.items():
        mean = sum(placed) / len(placed) if placed else 0
        out[name] = {"placed": placed, "spread": round((max(placed) - min(placed)) / mean, 3) if mean else None}
    return out


def failures(result: Mapping[str, Any], kinds: tuple[str, ...]) -> list[str]:
    """Everything that fails the part, each said plainly: the pass criteria and what makes them hold."""
    out = []
    if result["crashes"]:
        out.append("crashed: " + ", ".join(f"{c['name']} ({c['reason']})" for c in result["crashes"]))
    for problem in result.get("bench_errors", []):
        out.append(f"bench: {problem}")
    for phase in ("undisturbed", "under_failures"):
        run = result[phase]
        if run["sessions_lost"]:
            out.append(f"{phase}: {run['sessions_lost']} sessions lost {run['lost_by_code']}")
        if run["mismatches"]:
            out.append(f"{phase}: {run['mismatches']} sessions differ from the undisturbed run's tokens")
        if run["unchecked"]:
            out.append(f"{phase}: {run['unchecked']} sessions had no undisturbed reference to compare with")
        if not run["sessions_completed"]:
            out.append(f"{phase}: no session completed")
    for name, placed in (result.get("undisturbed_placement") or {}).items():
        if placed["spread"] is None or placed["spread"] > MAX_SPREAD:
            out.append(f"undisturbed: sessions on the {name} replicas {placed['placed']} spread over {MAX_SPREAD:.0%}")
    done = {f["kind"] for f in result["faults"]}
    missing = [k for k in kinds if k not in done]
    if missing:
        out.append(f"no fault of kind {', '.join(missing)} was injected")
    for f in result["faults"]:
        if not f["up_again"]:
            out.append(f"fault {f['fault']} ({f['kind']} {f['replica']}): the replica was not reported up again")
    return out + held_failures(result["after_lease"])


def console(result: Mapping[str, Any]) -> str:
    """The summary printed at the end of the part."""
    lines = []
    for phase in ("undisturbed", "under_failures"):
        r = result[phase]
        lines.append(
            f"{phase}: {r['sessions_completed']} sessions completed, {r['sessions_lost']} lost, "
            f"{r['mismatches']} mismatches, {r['tok_s']} tok/s over {r['seconds']} s, longest gap per "
            f"session p50 {r['longest_gap_p50_s']} s / p99 {r['longest_gap_p99_s']} s / max "
            f"{r['longest_gap_max_s']} s"
        )
    lines.append(f"throughput under failures / undisturbed: {result['throughput_ratio']}")
    lines.append(f"head recovery: {result['recovery']}")
    lines.append(
        f"undisturbed: sessions placed per replica {result.get('undisturbed_placement')}, "
        f"head recoveries {result.get('undisturbed_recoveries')}"
    )
    for f in result["faults"]:
        lines.append(
            f"  fault {f['fault']}: {f['kind']:<4} {f['replica']:<9} at {f['at_s']} s, restored "
            f"{f['restored_at_s']} s, up again {f['up_at_s']} s ({f['up_again']}), head recoveries so far "
            f"{f.get('head_recoveries_total')}"
        )
    lines.append("VmHWM (MiB): " + ", ".join(f"{n} {m}" for n, m in result["vmhwm_mib"].items()))
    held = {n: (h or {}).get("sessions_held") for n, h in result["after_lease"].items()}
    lines.append(f"sessions held one lease after the clients left: {held}")
    if result.get("notes"):
        lines.append("notes: " + "; ".join(result["notes"]))
    return "\n".join(lines)
