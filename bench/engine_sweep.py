"""Engine sweep on gemma-3-270m Q4_K_M, in process (no ZeroMQ).

Concurrency 1/2/4/8: aggregate tok/s (every generated token over the whole run,
prefill included), TTFT and ITL p50/p99, batch occupancy and peak KV pressure,
against the bare llama_decode loop timed the same way in the same run
(interleaved, alternating order). Then prefill interference (7 decoding sessions
with and without a 512-token prompt arriving) and the batch-invariant mode
(bit-exactness at concurrency 8 against solo runs, and its throughput).
Writes evidence/engine_sweep.json.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import BareLoop, best_of, gemma_path, paired_ratio, prompt_tokens, table, write_evidence
from engine.engine import Engine, EngineConfig, open_engine
from engine.messages import CloseRequest, Opened, OpenRequest, Output, StepDone, StepRequest

COLUMNS = ["concurrency", "agg_tok_s", "bare_tok_s", "ratio", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "batch_occupancy", "kv_pressure_peak"]  # fmt: skip


@dataclass(slots=True)
class Trace:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)


async def session(
    engine: Engine, name: str, ids: list[int], steps: int, *, logits: bool = False, start_delay: float = 0.0
) -> Trace:
    await trio.sleep(start_delay)
    trace = Trace()
    opened = await engine.request(OpenRequest("bench", name, len(ids) + steps + 1))
    assert isinstance(opened, Opened), opened
    out = Output.LOGITS if logits else Output.TOKEN
    t0 = time.perf_counter()
    r = await engine.request(StepRequest("bench", name, 0, out, tokens=np.array(ids, np.int32)))
    last = time.perf_counter()
    trace.ttft = last - t0
    for i in range(steps + 1):
        assert isinstance(r, StepDone), r
        if logits:
            assert r.logits is not None
            trace.digests.append(hashlib.sha1(r.logits.tobytes()).hexdigest())
            token = int(np.argmax(r.logits))
        else:
            assert r.token is not None
            token = r.token
        trace.tokens.append(token)
        if i == steps:
            break
        r = await engine.request(StepRequest("bench", name, len(ids) + i, out, tokens=np.array([token], np.int32)))
        now = time.perf_counter()
        trace.itl.append(now - last)
        last = now
    await engine.request(CloseRequest("bench", name))
    return trace


async def run_sessions(
    engine: Engine, prompts: list[list[int]], steps: int, *, logits: bool = False, delays: list[float] | None = None
) -> tuple[float, list[Trace], float]:
    """All sessions at once; returns tok/s over the run, the traces and peak KV pressure."""
    traces: list[Trace] = [Trace()] * len(prompts)

    async def one(i: int) -> None:
        delay = delays[i] if delays else 0.0
        traces[i] = await session(engine, f"s{i}", prompts[i], steps, logits=logits, start_delay=delay)

    # The engine tracks its own peak: a polling task would wake the event loop during decodes
    # and, on 2 cores, steal time from llama.cpp's threads.
    engine.telemetry.kv_reserved_peak = 0
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    elapsed = time.perf_counter() - start
    peak = engine.telemetry.kv_reserved_peak / engine.scheduler.config.kv_cells
    return sum(len(t.tokens) for t in traces) / elapsed, traces, peak


def ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else 0.0


async def sweep(args: argparse.Namespace, cfg: EngineConfig) -> dict[str, Any]:
    results = []
    async with open_engine(cfg) as engine:
        # The bare loop runs on the engine's compute thread: one OpenMP team in the process
        # (a second calling thread would bring a second team spinning on the same cores).
        bare = await engine.compute.run(BareLoop, cfg.model, cfg.context())
        for concurrency in (1, 2, 4, 8):
            prompts = prompt_tokens(engine.backend, concurrency)
            ours, theirs, traces_all, peaks, occ = [], [], [], [], []
            for rep in range(args.reps):
                for side in ("bare", "engine") if rep % 2 == 0 else ("engine", "bare"):
                    if side == "bare":
                        run = functools.partial(bare.decode_rate, prompts, args.steps, time_prefill=True)
                        theirs.append((await engine.compute.run(run))[0])
                        continue
                    t = engine.telemetry
                    before = (t.decode_batches_total, t.decode_rows_sum)
                    rate, traces, peak = await run_sessions(engine, prompts, args.steps)
                    batches = t.decode_batches_total - before[0]
                    rows = t.decode_rows_sum - before[1]
                    ours.append(rate)
                    traces_all += traces
                    peaks.append(peak)
                    occ.append(rows / max(1, batches) / concurrency)
            itl = [x for t in traces_all for x in t.itl]
            row = {
                "concurrency": concurrency,
                "agg_tok_s": round(best_of(ours), 2),
                "bare_tok_s": round(best_of(theirs), 2),
                "ratio": round(paired_ratio(ours, theirs), 3),
                "ttft_p50_ms": ms([t.ttft for t in traces_all], 50),
                "ttft_p99_ms": ms([t.ttft for t in traces_all], 99),
                "itl_p50_ms": ms(itl, 50),
                "itl_p99_ms": ms(itl, 99),
                # Mean decode rows per batch that carried decodes, over the sessions running: 1.0
                # when every session shares every batch (the engine's own `batch_occupancy`
                # divides all rows by n_batch, which decode-only load never fills).
                "batch_occupancy": round(float(np.mean(occ)), 3),
                "kv_pressure_peak": round(max(peaks), 4),
                "engine_runs": [round(x, 2) for x in ours],
                "bare_runs": [round(x, 2) for x in theirs],
            }
            results.append(row)
            print(table([row], COLUMNS), flush=True)
        await engine.compute.run(bare.close)
        interference = await measure_interference(engine, args.steps)
    return {"results": results, "interference": interference}


async def measure_interference(engine: Engine, steps: int) -> dict[str, Any]:
    prompts = prompt_tokens(engine.backend, 7)
    long_prompt = (engine.tokenize(" ".join(["The history of the river valley is long and varied."] * 60)))[:512]
    _, quiet, _ = await run_sessions(engine, prompts, steps)
    # Same 7 sessions, plus one 512-token prompt arriving once they are decoding.
    _, noisy, _ = await run_sessions(engine, [*prompts, long_prompt], steps, delays=[0.0] * 7 + [0.3])
    without = ms([x for t in quiet for x in t.itl], 99)
    with_ = ms([x for t in noisy[:7] for x in t.itl], 99)
    return {
        "itl_p99_ms_without": without,
        "itl_p99_ms_with": with_,
        "ratio": round(with_ / without, 3),
        "long_prompt_tokens": len(long_prompt),
        "itl_max_ms_with": ms([x for t in noisy[:7] for x in t.itl], 100),
    }


async def invariant(args: argparse.Namespace, cfg: EngineConfig) -> dict[str, Any]:
    inv = replace(cfg, batch_invariant=True, pad_rows=8, max_sessions=8)
    async with open_engine(inv) as engine:
        prompts = prompt_tokens(engine.backend, 8)
        solo = []
        for p in prompts:
            _, traces, _ = await run_sessions(engine, [p], args.steps, logits=True)
            solo.append(traces[0].digests)
        _, together, _ = await run_sessions(engine, prompts, args.steps, logits=True)
        first_mismatch = {
            f"s{i}": next(
                (k for k, (a, b) in enumerate(zip(solo[i], together[i].digests, strict=True)) if a != b), None
            )
            for i in range(8)
        }
        mismatched = [k for k, v in first_mismatch.items() if v is not None]
        rate1, _, _ = await run_sessions(engine, prompts[:1], args.steps)
        rate8, _, _ = await run_sessions(engine, prompts, args.steps)
    return {
        "invariant_exact": not mismatched,
        "invariant_mismatched_sessions": mismatched,
        # Step (0 = the prompt's logits) where each session first differs from its solo run.
        "invariant_first_mismatch_step": first_mismatch,
        "invariant_tok_s": {"1": round(rate1, 2), "8": round(rate8, 2)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-prefill", type=int, default=64, help="prefill tokens per iteration")
    args = parser.parse_args()
    model = gemma_path()
    cfg = EngineConfig(
        model=model, max_sessions=8, kv_cells=4096, n_batch=512, n_ubatch=512, n_threads=2,
        max_prefill_tokens=args.max_prefill, max_step_tokens=512,
    )  # fmt: skip
    out = trio.run(sweep, args, cfg)
    out.update(trio.run(invariant, args, cfg))
    path = write_evidence(
        "engine_sweep.json",
        {
            "model": model.name,
            "config": {k: str(getattr(cfg, k)) for k in cfg.__dataclass_fields__},
            "steps": args.steps,
            "reps": args.reps,
            **out,
        },
    )
    print()
    print(table(out["results"], COLUMNS))
    print("interference:", out["interference"])
    print("invariant_exact:", out["invariant_exact"], "invariant_tok_s:", out["invariant_tok_s"])
    print("->", path)
    r8 = next(r for r in out["results"] if r["concurrency"] == 8)
    ok = r8["ratio"] >= 0.9 and out["interference"]["ratio"] <= 2.0 and out["invariant_exact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
