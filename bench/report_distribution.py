"""The report's distribution parts: what each stage of a split holds and costs (bench.stage_cost),
and the placement plan's split on unequal stages (bench.placement), where `just bench` attached them."""

from __future__ import annotations

from typing import Any

from bench.report_table import fmt, table

_MEMORY_KEYS = ("weights", "kv", "compute", "rss", "rss_peak", "target")
_MEMORY_HEADER = [
    "split",
    "layers",
    "1 row ms",
    "8 rows ms",
    "weights",
    "KV",
    "compute",
    "RSS",
    "peak",
    "target",
    "within",
]

_PLACEMENT_KEYS = (("tok_s", 2), ("vs_even", 3), ("predicted_tok_s", 2), ("predicted_bound", 3))


def stage_memory(r: dict[str, Any]) -> str:
    """Each split's stages: decode step cost, the efficiency bound it sets, and resident memory
    against weights + KV + 25%."""
    s = r.get("stages")
    if s is None:
        return ""
    rows = []
    for split in s["splits"]:
        for layers, ms in split["step_ms"].items():
            m = split["memory_mib"][layers]
            within = "yes" if m["rss"] <= m["target"] else f"no, +{m['rss'] - m['target']:.1f}"
            rows.append([split["split"], layers, ms["1"], ms["8"], *(m[k] for k in _MEMORY_KEYS), within])
    bounds = [
        [x["split"], _ranges(x["bounds"]), *(fmt(b, 3) for b in x["efficiency_bound"].values())] for x in s["splits"]
    ]
    whole = s["memory_mib"]["whole"]
    return "\n".join(
        [
            "## Stages: what each holds and what each step costs",
            "",
            f"From `{s.get('command', 'python -m bench.stage_cost')}` of the same `just bench`, model "
            f"`{s['model']}`: each shard alone, one thread, decode steps of 1 and 8 sessions (median ms), then in "
            "a fresh process after a full prefill batch and decode steps, its resident memory (VmRSS; peak: "
            "VmHWM, loading included) against the target weights + KV + 25% (MiB). `compute` is llama.cpp's "
            "compute buffer as reserved, which pages in only as far as a call uses it. The `layers` split is "
            f"even; `weights` balances weight bytes. The whole model: RSS {whole['rss']} MiB of a target "
            f"{whole['target']} MiB; the interpreter and libraries hold {whole['process_base']} MiB before any "
            "model loads.",
            "",
            f"Model `{s['model']}`, each stage alone:",
            "",
            table(_MEMORY_HEADER, rows),
            "",
            f"Model `{s['model']}`, the efficiency bound of each split on equal one-core stages (whole-model step / "
            "(stages x slowest step)):",
            "",
            table(["split", "bounds", *(f"{n} rows" for n in s["whole_step_ms"])], bounds),
        ]
    )


def placement(r: dict[str, Any]) -> str:
    """The plan's split against the even and the weight-balanced split on stages of unequal speed."""
    p = r.get("placement")
    if p is None:
        return ""
    rows = [[x["split"], _ranges(x["bounds"]), *(fmt(x[k], d) for k, d in _PLACEMENT_KEYS)] for x in p["splits"]]
    w = p["workload"]
    return "\n".join(
        [
            "## Placement on unequal stages (`neuron-tai plan`)",
            "",
            f"From `{p['command']}` of the same `just bench`, model `{p['model']}`: {p['setup']}. Closed loop at "
            f"c={p['concurrency']}, {w['requests']} requests of {w['prompt_tokens']} prompt and {w['max_new']} new "
            f"tokens, server-side `generate`; median of {p['reps']} runs per split, the splits interleaved. "
            "`vs even`: tok/s over the even split's; the predictions are the plan's, from the costs it measured.",
            "",
            f"Model `{p['model']}`, the tail at half the head's speed:",
            "",
            table(["split", "layers", "tok/s", "vs even", "predicted tok/s", "predicted bound"], rows),
        ]
    )


def _ranges(bounds: list[list[int]]) -> str:
    return ", ".join(f"{a}:{b}" for a, b in bounds)
