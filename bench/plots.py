"""The report's PNG plots, drawn from bench.json alone (so they can be redrawn without a rerun)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import matplotlib

from bench.aggregate import mean_by, saturation
from bench.systems import NODE, SERVED

matplotlib.use("Agg")
import matplotlib.pyplot as plt

FILES = ("throughput.png", "latency.png", "telemetry.png")


def draw_all(report: dict[str, Any], out: Path) -> None:
    throughput(report, out / FILES[0])
    latency(report, out / FILES[1])
    telemetry(report, out / FILES[2])


def throughput(report: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    concurrencies = report["plan"]["concurrencies"]
    for system, points in mean_by(report["runs"], "tok_s").items():
        if len(points) == 1:  # serves one request at a time: the same at every concurrency
            ax.plot(
                concurrencies,
                [next(iter(points.values()))] * len(concurrencies),
                ":",
                label=f"{system} (one at a time)",
            )
        else:
            ax.plot(list(points), list(points.values()), "o-", label=system)
    for system, sat in saturation(report["runs"]).items():
        if sat["saturates_at"] is not None and system == NODE:
            c = sat["saturates_at"]
            ax.axvline(c, color="grey", lw=0.8, ls="--")
            ax.annotate(f"saturation: c={c}", (c, ax.get_ylim()[1] * 0.95), fontsize=8, ha="right")
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("aggregate generated tokens / s")
    ax.set_title(f"{report['model']}: aggregate throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency(report: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    concurrencies = report["plan"]["concurrencies"]
    for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
        for i, system in enumerate(SERVED):
            for q, style in (("p50", "o-"), ("p99", "x--")):
                points = mean_by(report["runs"], f"{metric}_{q}_ms").get(system)
                if points:
                    ax.plot(list(points), list(points.values()), style, color=f"C{i}", label=f"{system} {q}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel("ms")
        ax.set_title("time to first token" if metric == "ttft" else "inter-token latency")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def telemetry(report: dict[str, Any], path: Path) -> None:
    samples = report["telemetry"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    for i, node in enumerate(("single", "chain2-head")):
        rows = [s for s in samples if s["node"] == node]
        if not rows:
            continue
        t = [s["t"] for s in rows]
        queue = gaps_broken(t, [s["queue_depth"] for s in rows])
        axes[0].plot(t, queue, color=f"C{i}", label=f"{node}: queued steps")
        waiting = gaps_broken(t, [s["sessions_waiting"] for s in rows])
        axes[0].plot(t, waiting, color=f"C{i}", ls=":", label=f"{node}: waiting opens")
        occ_t, occ = occupancy(rows, report.get("sessions_max", 8))
        axes[1].plot(occ_t, gaps_broken(occ_t, occ), color=f"C{i}", label=node)
        axes[2].plot(t, gaps_broken(t, [s["kv_pressure"] for s in rows]), color=f"C{i}", label=node)
    for start, end, label in phases(samples, NODE):
        for ax in axes:
            ax.axvspan(start, end, color="C0", alpha=0.06)
        axes[0].annotate(label, (start, 0), fontsize=7, rotation=90, va="bottom")
    axes[0].set_ylabel("queue")
    axes[1].set_ylabel("batch occupancy\n(decode rows / max sessions)")
    axes[2].set_ylabel("KV pressure\n(reserved / cells)")
    axes[2].set_xlabel("seconds into the sweep (shaded: single node busy; label = concurrency)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("node telemetry sampled from `stats` every 0.25 s during the sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gaps_broken(t: list[float], values: list[float], gap_s: float = 1.0) -> list[float]:
    """Values with NaN where sampling paused (the bench ran an in-process peer), so no line spans it."""
    return [float("nan") if i and t[i] - t[i - 1] > gap_s else v for i, v in enumerate(values)]


def occupancy(rows: list[dict[str, Any]], sessions_max: int) -> tuple[list[float], list[float]]:
    """Mean decode rows per llama_decode call between consecutive samples, over the session limit."""
    t, occ = [], []
    for a, b in itertools.pairwise(rows):
        batches = b["decode_batches_total"] - a["decode_batches_total"]
        if batches > 0:
            t.append(b["t"])
            occ.append((b["decode_rows_total"] - a["decode_rows_total"]) / batches / sessions_max)
    return t, occ


def phases(samples: list[dict[str, Any]], system: str) -> list[tuple[float, float, str]]:
    """(start, end, "c=N") spans during which the bench drove `system`."""
    out: list[tuple[float, float, str]] = []
    rows = [s for s in samples if s["node"] == "single"]
    for s in rows:
        if s["phase"].startswith(system + " "):
            label = s["phase"].split()[-1]
            if out and out[-1][2] == label and s["t"] - out[-1][1] < 1.0:
                out[-1] = (out[-1][0], s["t"], label)
            else:
                out.append((s["t"], s["t"], label))
    return out
