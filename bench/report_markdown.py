"""evidence/DGR-012/README.md, written from bench.json alone: every figure in it comes from the run."""

from __future__ import annotations

from typing import Any

from bench import report_distribution
from bench.aggregate import SATURATION_SHARE, mean_by, saturation
from bench.report_table import fmt, table
from bench.systems import ALL, BARE, CHAIN, NODE, NODE_FAST, PYTHON, SERVER, SLOTS


def render(r: dict[str, Any]) -> str:
    plan = r["plan"]
    cs = plan["concurrencies"]
    tok = at_every_concurrency(mean_by(r["runs"], "tok_s"), cs)
    systems = [s for s in ALL if s in tok]
    quick = plan["mode"] == "quick"
    parts = [
        _head(r, quick),
        _systems(r),
        _throughput(r, tok, systems, cs),
        _ceiling(r, tok, systems, cs),
        _latency(r, cs),
        _engine_use(r, cs),
        *((_corruption(r), _default_mode(r), _admission(r)) if plan.get("proofs", True) else (NO_PROOFS,)),
        _telemetry(r),
        _pipeline(r),
        report_distribution.stage_memory(r),
        report_distribution.placement(r),
        _gateway(r),
        _speculation(r),
        _compatibility(r),
        _limitations(r, tok),
        _next_step(r),
    ]
    return named_tables("\n\n".join(p for p in parts if p) + "\n", caption(r))


def at_every_concurrency(tok: dict[str, dict[int, float]], cs: list[int]) -> dict[str, dict[int, float]]:
    """A system measured once (`Llama serial` serves one request after another) has that figure at every c."""
    return {s: pts if len(pts) > 1 else dict.fromkeys(cs, *pts.values()) for s, pts in tok.items()}


def caption(r: dict[str, Any]) -> str:
    """What every table of the report measured: the model file and the workload."""
    return f"Model `{r['model']}`, {r.get('workload_name', 'prompt-heavy')} workload:"


def named_tables(markdown: str, text: str) -> str:
    """`text` on its own line above every table, so a table copied out of the report still names its model."""
    out: list[str] = []
    for line in markdown.split("\n"):
        above = next((x for x in reversed(out) if x), "")
        if line.startswith("|") and not above.startswith(("|", "Model `")):  # a table with no caption of its own
            if out and out[-1]:
                out.append("")
            out += [text, ""]
        out.append(line)
    return "\n".join(out)


def _head(r: dict[str, Any], quick: bool) -> str:
    plan = r["plan"]
    cmd = "just bench quick" if quick else "just bench"
    prompts = [w["prompt_tokens"] for w in r["workload"]]
    mixed = r.get("workload_name", "prompt-heavy") == "prompt-heavy"
    mix = " (a third short, medium and long, interleaved)" if mixed else ""
    return f"""# DGR-012: concurrency, saturation, corruption proof and peers

Produced by `{r["command"]}`, from {r["started"]} to {r["finished"]}: one of the suites that
`{cmd}` runs (on a fresh machine: `python3 -m pip install -q rust-just && {cmd}`).
Machine: {r["machine"]}; llama-cpp-python {r["llama_cpp_python"]} (llama.cpp built from its sdist on this machine).
{_cpu(r)}
Model: `{r["model"]}`; 2-stage chain shards: {", ".join(f"`{s}`" for s in r["chain2_shards"])}.

Every figure below is read from `bench.json` of that run. Nothing here is typed in by hand.

## Files

- `bench.json`: the plan, the workload, every run's raw figures (`runs`: tokens, wall time, tok/s,
  TTFT/ITL percentiles per system, concurrency and repetition), the `stats` samples
  (`telemetry`), the corruption checks (`invariant`, with `mismatches`), default-mode
  agreement and teacher-forced logits (`default_mode`), the burst (`admission`), `saturation`,
  each system's kernel path and weight buffers (`systems`), the CPU (`cpu`, `extra_buffer_types`)
  and any process that crashed, with its log's last lines (`crashes`); in a full run, the
  gateway and pipeline parts that `just bench` runs after the report (`gateway`, `pipeline`).
- `throughput.png`: aggregate tok/s against concurrency, every system.
- `latency.png`: TTFT and inter-token latency p50/p99 against concurrency.
- `telemetry.png`: queue depth, batch occupancy and KV pressure over the sweep, sampled from `stats`.
- `just-bench.log` (where kept): the console output of the run, pip's chatter removed.

## Workload

{len(prompts)} requests, {r.get("workload_name", "prompt-heavy")}, with seeded prompts (seed {plan["seed"]}) of
{min(prompts)} to {max(prompts)} tokens{mix}, {plan["max_new"]} generated tokens each, greedy,
end-of-text ignored so every system generates exactly the same number of tokens. At concurrency c,
c clients each send their next request as soon as the last one is answered (closed loop) until
{_served(plan, len(prompts))} are done; aggregate tok/s = generated tokens / wall time, prefill included.
{plan["reps"]} repetition(s) per system and concurrency, in alternating order;
tables show the mean, after one short warm-up request per system. Nodes: `--max-sessions {SLOTS}
--max-waiting {SLOTS} --kv-cells {plan["kv_cells"]}` and llama-server `-np {SLOTS}`: like the bare loop,
every system runs all the sessions of every concurrency at once. Single node and
`llama-server` use 2 threads; each chain stage 1 thread (2 cores in all). `{NODE_FAST}`
is the same node started with `--prefill-share 4` (prefill may add four decode steps' time
to an iteration instead of one: more throughput, longer gaps between tokens). The nodes
generate on their own (server-side `generate`, streamed, as `neuron-tai generate` does);
the chain's head runs the token loop and splits its sessions into 2 micro-batches so both
stages compute at once. The proofs' teacher-forced runs step token by token.{_chain_points(plan)}"""


def _chain_points(plan: dict[str, Any]) -> str:
    """Where the chain ran at some concurrencies only (a report beside the default one, for time)."""
    at = plan.get("chain_at") or ()
    if not at:
        return ""
    shown = ", ".join(map(str, at))
    return (
        f"\nFor time, the chain runs at c = {shown} only: its two stages share this machine's cores here,"
        " and the multi-host suite measures it with a machine per stage."
    )


def _served(plan: dict[str, Any], n: int) -> str:
    """How many of the requests a run at concurrency c serves."""
    k = plan.get("per_client", 0)
    if not k:
        return f"all {n}"
    why = "every request has one shape: more would repeat the run" if plan["workload"] == "decode" else "for time"
    return f"the first {'' if k == 1 else k}c of the {n} (the same ones for every system; {why})"


def _cpu(r: dict[str, Any]) -> str:
    cpu = r.get("cpu")
    if cpu is None:  # a report from before the machine section named the CPU
        return ""
    isa = ", ".join(
        f"{name} {'yes' if cpu[key] else 'no'}"
        for key, name in (("avx2", "AVX2"), ("avx512", "AVX-512"), ("amx", "AMX"))
    )
    offered = ", ".join(f"`{b}`" for b in r["extra_buffer_types"]) or "none"
    return (
        f"CPU: {cpu['model']} ({isa}); extra weight buffer types this llama.cpp build offers: {offered}. "
        "Every system loads its weights as the node's `--kernels auto` does: CPU_REPACK where it is "
        "offered, never AMX (its kernels crash on quantized models on some hosts, llama.cpp #20824)."
    )


def _systems(r: dict[str, Any]) -> str:
    """Each system's kernel path and, for one that crashed, why and its log's last lines."""
    systems = r.get("systems")
    if systems is None:
        return ""
    crashes = {c["name"]: c for c in r.get("crashes", [])}
    rows = []
    for name, s in systems.items():
        buffers = s["weight_buffers"] or {}
        if name == CHAIN and buffers:
            shown = "; ".join(f"{stage}: {_buffers(b)}" for stage, b in buffers.items())
        else:
            shown = _buffers(buffers)
        status = "; ".join(f"**crashed**: {n} {crashes[n]['reason']}" for n in s["crashed"]) or "ran"
        rows.append([name, s["kernel_path"] or "–", shown or "–", status])
    out = [
        "## Systems and kernel paths",
        "",
        "Kernel path: where llama.cpp put the weights, read back from each system (the nodes' `stats`, "
        "llama-server's and llama.cpp's load log): `repack` (CPU_REPACK kernels where the weight "
        "type has a layout), `plain` (ordinary CPU buffer), `amx`.",
        "",
        table(["system", "kernel path", "weight buffers", "status"], rows),
    ]
    if crashes:
        out += [
            "",
            "### Crashed processes",
            "",
            "A process that stops on its own is reported here and the run goes on without what needs "
            "it; the bench then exits 1.",
        ]
        for c in crashes.values():
            tail = "\n".join(c["log_tail"]) or "(empty log)"
            out += ["", f"- `{c['name']}` {c['reason']}; last lines of `{c['log']}`:", "", "```", tail, "```"]
    return "\n".join(out)


def _buffers(buffers: dict[str, int]) -> str:
    return ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in buffers.items())


def _throughput(r: dict[str, Any], tok: dict[str, dict[int, float]], systems: list[str], cs: list[int]) -> str:
    rows = [[s, *[tok[s].get(c) for c in cs]] for s in systems]
    out = [
        "## Aggregate throughput (generated tok/s)",
        "",
        table(["system", *[f"c={c}" for c in cs]], rows),
        "",
        "`Llama serial` serves one request after another: the same figure at every concurrency.",
        "",
        "![throughput](throughput.png)",
        "",
        "### Ratios (same run)",
        "",
    ]
    ratio_rows = []
    for mine, name in ((NODE, "node"), (NODE_FAST, "node, prefill-share 4")):
        for other, label in (
            (BARE, "bare llama_decode (ceiling)"),
            (SERVER, SERVER),
            (PYTHON, "Llama serial"),
        ):
            if mine in tok and other in tok:
                ratio_rows.append([f"{name} / {label}", *[_ratio(tok[mine].get(c), tok[other].get(c)) for c in cs]])
    if CHAIN in tok and NODE in tok:
        ratio_rows.append(["chain2 / node", *[_ratio(tok[CHAIN].get(c), tok[NODE].get(c)) for c in cs]])
    out.append(table(["ratio", *[f"c={c}" for c in cs]], ratio_rows))
    out += [
        "",
        f"### Saturation (rule: the first concurrency whose aggregate tok/s reaches "
        f"{SATURATION_SHARE:.0%} of the best in the sweep; beyond it, more sessions add less than "
        f"{1 - SATURATION_SHARE:.0%})",
        "",
    ]
    sat_rows = []
    for s in systems:
        sat = saturation(r["runs"]).get(s)
        if sat and len(sat["tok_s"]) > 1:
            at = sat["saturates_at"]
            gains = ", ".join(f"{k}: {v:+.0%}" for k, v in sat["gains"].items())
            sat_rows.append([s, f"c={at}", f"{sat['best_tok_s']:.1f}", gains])
    out.append(table(["system", "saturates at", "best tok/s", "gain per doubling"], sat_rows))
    return "\n".join(out)


def _ceiling(r: dict[str, Any], tok: dict[str, dict[int, float]], systems: list[str], cs: list[int]) -> str:
    """Every system as a fraction of llama-batched-bench's decode speed at B = concurrency."""
    ceiling = r.get("ceiling")
    if not ceiling:
        return "## The physical ceiling\n\nNot measured: llama-batched-bench is not built (`just bench` builds it)."
    s_tg = {int(b): v for b, v in ceiling["s_tg"].items()}
    rows: list[list[Any]] = [["llama-batched-bench S_TG (tok/s)", *[s_tg.get(c) for c in cs]]]
    rows += [[f"{s} / ceiling", *[_ratio(tok[s].get(c), s_tg.get(c)) for c in cs]] for s in systems]
    return "\n".join(
        [
            "## The physical ceiling: llama.cpp's own batched decode",
            "",
            f"`{ceiling['command']}`: B sequences of {ceiling['pp']} prompt tokens, {ceiling['tg']} "
            "generated each, decoded in lockstep with no server, sampling or Python. S_TG is generation "
            "speed without prefill; the systems' tok/s include prefill, so 1.0 is out of reach by that "
            "much. B = the concurrency.",
            "",
            table(["", *[f"c={c}" for c in cs]], rows),
        ]
    )


def _gateway_share(plan: dict[str, Any]) -> str:
    k, n = plan.get("per_client", 0), plan["requests"]
    return f"first {k}c of {n} requests at concurrency c" if k else f"{n} requests"


def _gateway_rounds(plan: dict[str, Any]) -> str:
    rounds = plan.get("rounds", 1)
    if rounds <= 1:
        return ""
    return (
        f" Every system ran {rounds} times at each concurrency, in rotated order; a row is its median "
        "round by tok/s (`rounds_tok_s` in the JSON holds each round's)."
    )


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "–"


def _latency(r: dict[str, Any], cs: list[int]) -> str:
    rows = []
    for system in ALL:
        cols = [mean_by(r["runs"], f"{m}_ms").get(system, {}) for m in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")]
        for c in cs:
            if c in cols[0]:
                rows.append([system, str(c), *[col.get(c) for col in cols]])
    return "\n".join(
        [
            "## Latency (ms)",
            "",
            table(["system", "c", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], rows),
            "",
            "TTFT runs from the request's start (before `open`) to its first token, so it includes "
            "waiting for a session slot and the prefill. For `bare llama_decode` a wave's requests "
            "start together; `Llama serial` is measured per request, without the queue in front of it. "
            "llama-server's ITL is between streamed events (one per token).",
            "",
            "![latency](latency.png)",
        ]
    )


ENGINE_USE_COLUMNS = [
    "system",
    "c",
    "calls",
    "decode calls",
    "rows per decode call",
    "in llama_decode (s)",
    "share of wall time",
    "steps (s)",
    "preempted per call",
]


def _engine_use(r: dict[str, Any], cs: list[int]) -> str:
    """Per system and concurrency: llama_decode calls, their rows, and the share of the wall time inside them."""
    used = [{**run, **run["engine"]} for run in r["runs"] if run.get("engine")]
    if not used:
        return ""
    m = {key: mean_by(used, key) for key in ENGINE_USE_KEYS}
    rows = [_use_row(m, s, c) for s in ALL for c in cs if c in m["batches"].get(s, {})]
    return "\n".join(
        [
            "## Where the time goes: llama_decode calls per run",
            "",
            "Counted by each node's engine (`stats` before and after every run; the chain: its head), "
            "by the bare loop itself and by llama-server's metrics (`--metrics`, read before and after "
            "every run); means over repetitions. A call's cost grows slowly with its "
            "rows, so fewer, fuller calls make more tokens per second. Time in llama_decode is the call "
            "alone (a node's `llama_decode_seconds_total`); a node's steps (`step_seconds`) also count "
            "the sampling of the call's tokens and the hand-off to and from its compute thread (the bare "
            "loop samples outside its calls: its steps are its calls). llama-server counts its calls "
            "(`n_decode_total`) and the slots busy in each (`n_busy_slots_per_decode`: each slot serving "
            "a request counts once a call, decoding one row or prefilling a chunk), not their rows or "
            "their time. "
            "Preempted: the process's "
            "involuntary context switches over the run (a node's `preemptions_total`; the bench's own "
            "process for the bare loop; llama-server's threads alive at the two readings), per call: "
            "each one stops a member of the OpenMP team, and the team waits for it at its next barrier.",
            "",
            table(ENGINE_USE_COLUMNS, rows),
        ]
    )


ENGINE_USE_KEYS = (
    "batches",
    "decode_batches",
    "decode_rows",
    "busy_slots",
    "llama_decode_s",
    "llama_decode_share",
    "step_s",
    "preemptions",
)


def _use_row(m: dict[str, dict[str, dict[int, float]]], system: str, c: int) -> list[Any]:
    """One row of the calls table; what a system does not count shows as –."""
    got = {k: m[k].get(system, {}).get(c) for k in ENGINE_USE_KEYS}
    batches, calls = got["batches"], got["decode_batches"]
    fill: Any = "–"
    if calls and got["decode_rows"] is not None:
        fill = round(got["decode_rows"] / calls, 2)
    elif got["busy_slots"] is not None and batches:
        fill = f"{got['busy_slots'] / batches:.2f} busy slots"
    timed = ("llama_decode_s", "llama_decode_share", "step_s", "preemptions")
    seconds, share, steps, preempted = (got[k] for k in timed)
    return [
        system,
        str(c),
        round(batches, 1) if batches is not None else "–",
        "–" if calls is None else round(calls, 1),
        fill,
        "–" if seconds is None else round(seconds, 2),
        "–" if share is None else f"{share:.0%}",
        "–" if steps is None else round(steps, 2),
        "–" if preempted is None or not batches else round(preempted / batches, 2),
    ]


NO_PROOFS = """## Corruption proof, default mode, burst

Not run in this report: they check the node, not the model's speed or the workload, and `just bench` runs
them once, in its default report (gemma-3-270m, prompt-heavy)."""


def _corruption(r: dict[str, Any]) -> str:
    inv = r["invariant"]
    if inv is None:
        return "## Corruption proof\n\nNot run: a node it needs crashed (see above)."
    rows = [[c["check"], str(c["sessions"]), str(c["tokens"]), str(c["mismatches"])] for c in inv["checks"]]
    details = "\n".join(
        f"- {m['check']}: request {m['rid']} parts at step {m['step']}" for m in inv["mismatch_details"]
    )
    return "\n".join(
        [
            "## Corruption proof (bit-exact, nodes in batch-invariant mode)",
            "",
            "Nodes started with `--batch-invariant`: decode batches padded to a multiple of 8 rows, "
            "prefill in calls of its own, closed sessions' KV cells held until a compaction frees them. "
            "Reference: each of 8 sessions run alone on the single node.",
            "",
            table(["check", "sessions", "tokens compared", "mismatches"], rows),
            "",
            f"**mismatches: {r['mismatches']}** (any mismatch is printed and makes the bench exit 1)."
            + (f"\n\n{details}" if details else ""),
        ]
    )


def _agreement_row(label: str, per: list[dict[str, Any]]) -> list[str]:
    """One run's sessions against their solo runs: how many identical, mean agreement, earliest parting."""
    if not per:
        return [label, "token ids not reported", "–", "–"]
    equal = sum(1 for x in per if x["parts_at"] is None)
    parts = [x["parts_at"] for x in per if x["parts_at"] is not None]
    mean = sum(x["agree"] for x in per) / len(per)
    return [label, f"{equal}/{len(per)}", f"{mean:.3f}", str(min(parts)) if parts else "–"]


def _default_mode(r: dict[str, Any]) -> str:
    d = r["default_mode"]
    if d is None:
        return "## Default mode: agreement with the solo run\n\nNot run: the single node crashed (see above)."
    rows = [_agreement_row(label, per) for label, per in d["agreement"].items()]
    tf = d["teacher_forced"]
    parts_at = {x["rid"]: x["parts_at"] for x in d["agreement"].get(f"{NODE} c=8", [])}
    tf_rows = []
    for x in tf:
        step = parts_at.get(x["rid"])
        at = f"{step}: {x['top2_margins'][step]:.3g}" if step is not None and step < len(x["top2_margins"]) else "–"
        spread = [f"{x['max_abs_diff']:.3g}", f"{x['mean_abs_diff']:.3g}", f"{x['logit_std']:.2f}"]
        margin = f"{x['min_top2_margin']:.3g}"
        tf_rows.append([str(x["rid"]), str(x["steps"]), *spread, margin, at, str(x["argmax_differs"])])
    worst = max((x["max_abs_diff"] for x in tf), default=0.0)
    mean = sum(x["mean_abs_diff"] for x in tf) / max(len(tf), 1)
    scale = min((x["logit_std"] for x in tf), default=0.0)
    bare = d.get("teacher_forced_bare", [])
    bare_worst = max((x["max_abs_diff"] for x in bare), default=0.0)
    bare_mean = sum(x["mean_abs_diff"] for x in bare) / max(len(bare), 1)
    bare_flips = sum(x["argmax_differs"] for x in bare)
    return "\n".join(
        [
            "## Default mode: agreement with the solo run",
            "",
            "Without `--batch-invariant`, llama.cpp's quantized kernels legitimately round "
            "differently for different batch shapes, so a greedy token may flip where two "
            "candidates are nearly tied, and the continuation follows. Reference: the single "
            "node at concurrency 1 (every request alone).",
            "",
            table(["run", "sessions identical", "mean token agreement", "earliest parting step"], rows),
            "",
            "Teacher-forced logits: 8 sessions fed the same tokens (their solo run's), once "
            "alone and once all 8 together on the default-mode single node; every step's logits "
            "compared.",
            "",
            table(TF_COLUMNS, tf_rows),
            "",
            f"Node: largest difference {worst:.3g}, mean {mean:.3g}, against a logit spread (std) of at "
            f"least {scale:.2f}; {sum(x['argmax_differs'] for x in tf)} steps with another argmax. "
            "The yardstick is llama.cpp itself: the bare llama_decode loop fed the same tokens, each "
            f"session alone and then all 8 in one batch, differs by up to {bare_worst:.3g} (mean "
            f"{bare_mean:.3g}; {bare_flips} steps with another argmax). 'c=8 parts at' is the step where "
            "the session's tokens at concurrency 8 first differ from its solo run, and the solo "
            "run's top-2 margin at that step: a flip needs a margin within the kernels' difference.",
        ]
    )


TF_COLUMNS = [
    "request",
    "steps",
    "max abs diff",
    "mean abs diff",
    "logit std",
    "smallest top-2 margin",
    "c=8 parts at: margin there",
    "argmax differs",
]


def _admission(r: dict[str, Any]) -> str:
    a = r["admission"]
    if a is None:
        return "## Admission and backpressure\n\nNot run: the burst node crashed (see above)."
    after, before = a["stats_after"], a["stats_before"]
    rejected = {
        k: v - (before.get("admissions_rejected_total") or {}).get(k, 0)
        for k, v in (after.get("admissions_rejected_total") or {}).items()
    }
    lost = "none" if not a["incomplete_sessions"] and a["tokens_received"] == a["tokens_expected"] else "SOME"
    return f"""## Admission and backpressure

A node with `--max-sessions 4 --max-waiting 4 --queue-budget {r["plan"]["burst_queue_bytes"]}` (bytes of queued step
payloads) got {a["clients"]} clients opening at once (each `wait_ms` 120000), each then sending its
prompt in one step. Opens beyond 4 active and 4 waiting were refused at once; prompt steps
that did not fit the queue budget were answered `busy` with `retry_after_ms` and resent.

- accepted: {a["accepted"]} sessions; refused opens by reason: {a["refused"]}
- `busy` step answers retried: {a["busy_retries"]} (largest `retry_after_ms` {a["busy_retry_after_ms_max"]})
- tokens: {a["tokens_received"]} received of {a["tokens_expected"]} expected for the accepted sessions; lost: {lost}
- the node's own `stats` for the burst: `admissions_rejected_total` {rejected},
  `admissions_total` {after.get("admissions_total")} (before: {before.get("admissions_total")}),
  `errors_total` {after.get("errors_total")}"""


def _telemetry(r: dict[str, Any]) -> str:
    single = [s for s in r["telemetry"] if s["node"] == "single"]
    if not single:
        return "## Telemetry\n\nNo samples."
    peak_q = max(s["queue_depth"] for s in single)
    peak_w = max(s["sessions_waiting"] for s in single)
    peak_kv = max(s["kv_pressure"] for s in single)
    return f"""## Telemetry over the sweep

`stats` of the single node and the chain's stages, sampled every 0.25 s ({len(r["telemetry"])} samples).
On the single node: queue depth peaked at {peak_q} steps, waiting opens at {peak_w}, KV pressure
(reserved cells / cells) at {peak_kv:.3f}. Batch occupancy is decode rows per `llama_decode`
call between samples over the 8-session limit.

![telemetry](telemetry.png)"""


def _bound(row: dict[str, Any]) -> str:
    bound = row.get("batching_bound")
    return "-" if bound is None else f"{bound:.2f}"


def _pairs(row: dict[str, Any]) -> str:
    return " / ".join("-" if e is None else f"{e:.2f}" for e in row.get("pair_efficiencies", [row["efficiency"]]))


def _pipeline(r: dict[str, Any]) -> str:
    """The pipeline figures (bench.pipeline_evidence), where `just bench` attached them."""
    p = r.get("pipeline")
    if p is None:
        return ""
    versus = [
        [str(x["concurrency"]), x["node_tok_s"], x["llama_server_tok_s"], f"{x['ratio']:.2f}"]
        for x in p["generate_vs_llama_server"]
    ]
    scale = [
        [str(x["concurrency"]), x["chain_tok_s"], x["one_core_tok_s"], f"{x['efficiency']:.2f}", _bound(x), _pairs(x)]
        for x in p["scale_out"]
    ]
    latency = [
        [f"{x['delay_ms']} ms", str(x["concurrency"]), x["tok_s"], x["itl_p50_ms"], x["itl_p99_ms"]]
        for x in p["latency"]
    ]
    return "\n".join(
        [
            "## Pipeline: server-side generation, scale-out, latency tolerance",
            "",
            f"From `evidence/pipeline.json` of the same `just bench` (`{p['command']}`, commit "
            f"`{str(p.get('commit'))[:12]}`). `generate` against llama-server is this report's own "
            "sweep above; scale-out and latency come from the multi-host part: "
            f"{p['topology']}; each stage pinned to its own core with one thread.",
            "",
            f"### `generate` on a single node against `{SERVER}`",
            "",
            table(["c", "node tok/s", "llama-server tok/s", "ratio"], versus),
            "",
            "### Scale-out: 2-stage chain (one core per stage) against one node on one core",
            "",
            "Efficiency = chain tok/s / (2 x one-core node tok/s). Bound: the chain's head computes "
            "its c sessions in two micro-batches so both stages work at once, so each stage's calls "
            "have c/2 rows; at best (balanced stages, a free hop) the chain makes twice the one-core "
            "node's tok/s at c/2, and the bound is that node's tok/s at c/2 / its tok/s at c. "
            "Each concurrency's row is its median pair of runs (single node, chain); pairs: every "
            "pair's efficiency, in the order they ran.",
            "",
            table(["c", "chain tok/s", "one-core node tok/s", "efficiency", "bound", "pairs"], scale),
            "",
            "### Latency tolerance: the chain with delay added one way on each link",
            "",
            table(["added delay", "c", "tok/s", "ITL p50", "ITL p99"], latency),
            "",
            f"Bit-exact mismatches in the proofs (batch-invariant nodes, `generate`, the pipelined "
            f"chain): **{p['mismatches']}**.",
        ]
    )


_SPECULATION_KEYS = (
    ("tok_s", 1), ("ratio", 3), ("itl_p50_ms", 1), ("accepted_per_pass", 2), ("passes_per_token", 3),
    ("differing_tokens", 0),
)  # fmt: skip


def _speculation(r: dict[str, Any]) -> str:
    """Speculative `generate` against `speculate: 0` (bench.speculation), where attached."""
    s = r.get("speculation")
    if s is None:
        return ""
    header = ["setup", "workload", "c", "speculate", "tok/s", "ratio", "ITL p50", "accepted/pass", "passes/token",
              "differing tokens"]  # fmt: skip
    measured = [*s["results"], *s["invariant_checks"]]
    rows = [[x["setup"], x["workload"], str(x["c"]), str(x["speculate"]),
             *(fmt(x[k], d) for k, d in _SPECULATION_KEYS)] for x in measured]  # fmt: skip
    return "\n".join(
        [
            "## Speculative generation (prompt lookup) against `speculate: 0`",
            "",
            f"From `evidence/speculation.json` of the same `just bench`: `{s['model']}`, {s['max_new']} new tokens "
            f"a session, up to {s['speculate']} drafts a pass; a single node (2 threads) and a 2-stage chain "
            f"(layers {s['chain2_layers']}, one thread each); ratio = tok/s against the `speculate: 0` arm of the "
            "same point. Copy-heavy sessions are shown a source file and asked for it again (greedy); "
            "non-repetitive ones answer open questions (sampled). Differing tokens in default mode are "
            "near-tie rounding; the `-invariant` rows are batch-invariant nodes, where any is a mismatch.",
            "",
            f"Model `{s['model']}`, the suite's copy-heavy and non-repetitive workloads:",
            "",
            table(header, rows),
            "",
            f"Mismatches in batch-invariant mode: **{s['invariant_mismatches']}**.",
        ]
    )


def _gateway(r: dict[str, Any]) -> str:
    """The OpenAI gateway against llama-server's OpenAI endpoint (bench.gateway_bench), where attached."""
    g = r.get("gateway")
    if g is None:
        return ""
    results: dict[str, list[dict[str, Any]]] = g["results"]
    keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    rows = [[system, str(x["concurrency"]), *(x[k] for k in keys)] for system, xs in results.items() for x in xs]
    server = next((xs for system, xs in results.items() if system.startswith("llama-server")), None)
    ratios = []
    if server is not None:
        base = {x["concurrency"]: x["tok_s"] for x in server}
        for system, xs in results.items():
            if xs is not server:
                ratios.append(
                    [f"{system} / llama-server", *[_ratio(x["tok_s"], base.get(x["concurrency"])) for x in xs]]
                )
    cs = [str(x["concurrency"]) for x in next(iter(results.values()), [])]
    plan = g["plan"]
    command = g.get("command", "python -m bench.gateway_bench")
    out = [
        "## OpenAI gateway against llama-server's OpenAI endpoint",
        "",
        f"From `evidence/gateway.json` of the same `just bench` (`{command}`). Every system gets the same "
        f"{_gateway_share(plan)} (token-id prompts up to {plan['max_prompt']} tokens, "
        f"{plan['max_new']} tokens each, greedy, end-of-text ignored) through `POST /v1/completions` "
        "with `stream: true`, from concurrent clients in a closed loop, a new HTTP connection per request. "
        "Aggregate tok/s counts completion tokens over wall time; TTFT is the first streamed text."
        + _gateway_rounds(plan),
        "",
        table(["system", "c", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], rows),
    ]
    if ratios:
        out += ["", table(["tok/s ratio", *[f"c={c}" for c in cs]], ratios)]
    return "\n".join(out)


def _compatibility(r: dict[str, Any]) -> str:
    agree = (r["default_mode"] or {}).get("agreement", {})
    rows = []
    for label in (f"{BARE} c=1", f"{PYTHON} c=1", f"{SERVER} c=1", f"{CHAIN} c=1"):
        if agree.get(label):
            per = agree[label]
            rows.append(
                [
                    label.removesuffix(" c=1"),
                    f"{sum(1 for x in per if x['parts_at'] is None)}/{len(per)}",
                    f"{sum(x['agree'] for x in per) / len(per):.3f}",
                ]
            )
    return "\n".join(
        [
            "## Compatibility notes",
            "",
            *(
                [
                    "Greedy tokens of each system serving one request at a time, against the node's solo run:",
                    "",
                    table(["system", "requests identical", "mean token agreement"], rows),
                    "",
                ]
                if rows
                else []
            ),
            "- The node speaks PROTOCOL.md v1 over ZeroMQ; the peers are driven through their own APIs "
            "(llama-server's `/completion` with token-id prompts, `cache_prompt: false`, "
            "`ignore_eos: true`, streaming; `Llama.generate` with `top_k=1, temp=0` and a reset "
            "between requests; llama.cpp's batch API for the bare loop).",
            f"- llama-server: {r['llama_server']}. Same vendored llama.cpp as the node, static build, "
            f"`-fa on`, `--cache-ram 0`, one slot per session (`-np {SLOTS}`, 512 cells each).",
        ]
    )


def _limitations(r: dict[str, Any], tok: dict[str, dict[int, float]]) -> str:
    lines = [
        "## Limitations",
        "",
        "- One 2-core shared machine: run-to-run drift of about ±10% is usual here; every system "
        "ran in the same session, interleaved, but single-run differences below that are noise.",
        "- The chain's two stages share the same 2 cores, one thread each: it shows the protocol's "
        "cost, the micro-batches' overlap and exactness on one machine, not a multi-machine speed-up.",
        "- The client process shares the cores with the servers, for every system alike.",
        "- The bare loop and `Llama` run inside the bench process; the nodes and llama-server "
        "are separate processes reached over loopback (ZeroMQ / HTTP).",
        "- Batch-invariant mode is proven at concurrency up to 8 (one padded batch shape); it "
        "costs throughput and is meant for verification, not for serving.",
    ]
    itl = mean_by(r["runs"], "itl_p50_ms")
    node_itl, bare_itl = itl.get(NODE, {}).get(1), itl.get(BARE, {}).get(1)
    if node_itl and bare_itl:
        lines.append(
            f"- At concurrency 1 the node's inter-token gap (p50) was {node_itl:.1f} ms against "
            f"{bare_itl:.1f} ms for the bare loop in the bench's own process (the node streams each "
            f"token over loopback to a client process)."
        )
    if SERVER not in tok:
        lines.append(f"- llama-server was not measured: {r['llama_server']}.")
    return "\n".join(lines)


def _next_step(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            "## What a next step can rely on",
            "",
            "- `just bench` is one command: it builds what it needs once (llama-server under "
            "`~/.cache/neuron-tai/`), stops every process it started (also on Ctrl-C or SIGTERM), "
            "and exits non-zero on any bit-exact mismatch, lost session or crashed process (a crash is "
            "reported with its log's last lines; the rest of the report is still written).",
            "- `just bench quick` runs the same code paths on the tiny test model in under two "
            "minutes (the test suite runs it).",
            "- `bench.json` is stable input for comparisons: `runs` rows keyed by system, "
            "concurrency and repetition; `mismatches` is the count a gate should check.",
            "- `python -m bench.report --render-only DIR` redraws the plots and this README from "
            "DIR/bench.json without rerunning.",
        ]
    )
