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
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import trio

from bench.common import (
    BareLoop,
    bench_model,
    best_of,
    interleaved,
    paired_ratio,
    prompt_tokens,
    shown,
    table,
    write_evidence,
)
from bench.latency import Trace, percentile_ms
from bench.node_driver import generate
from bench.workload import Request
from engine.config import EngineConfig
from engine.engine import Engine, open_engine
from engine.gguf_facts import read_facts
from engine.messages import CloseRequest, Opened, OpenRequest, Output, StepDone, StepRequest
from neuron_tai.client import NodeError, StepReply
from protocol.errors import Fault

R = TypeVar("R")

COLUMNS = [
    "concurrency",
    "agg_tok_s",
    "bare_tok_s",
    "ratio",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "batch_occupancy",
    "kv_pressure_peak",
]


OWNER = "bench"


@dataclass(slots=True)
class EngineClient:
    """The engine in process behind the node client's session calls: the same driver measures both."""

    engine: Engine
    answered: set[str] = field(default_factory=set)  # sessions that have had a step answered
    _news: trio.Event = field(default_factory=trio.Event)  # set when one more has

    async def open(self, session: str, max_tokens: int, *, wait_ms: int = 0) -> dict[str, Any]:
        return {
            "kv_reserved": _ok(
                await self.engine.request(OpenRequest(OWNER, session, max_tokens, wait_ms=wait_ms)), Opened
            ).kv_reserved
        }

    async def step(self, session: str, pos: int, *, tokens: list[int], out: str) -> StepReply:
        request = StepRequest(OWNER, session, pos, Output(out), tokens=np.array(tokens, np.int32))
        done = _ok(await self.engine.request(request), StepDone)
        if session not in self.answered:
            self.answered.add(session)
            self._news.set()
            self._news = trio.Event()
        return StepReply(None, token=done.token, logits=done.logits)  # no node answered: no wire result

    async def first_tokens(self, n: int) -> None:
        """Wait until `n` sessions have had their first token."""
        while len(self.answered) < n:
            await self._news.wait()

    async def close_on_exit(self, session: str) -> None:
        with trio.CancelScope(shield=True):
            await self.engine.request(CloseRequest(OWNER, session))


def _ok(result: object, kind: type[R]) -> R:
    if isinstance(result, Fault):
        raise NodeError(result.code, result.message, result.retry_after_ms)
    assert isinstance(result, kind), result
    return result


async def run_sessions(
    engine: Engine,
    prompts: list[list[int]],
    steps: int,
    *,
    logits: bool = False,
    delays: list[float] | None = None,
    late: int | None = None,
) -> tuple[float, list[Trace], float, list[list[str]]]:
    """All sessions at once (or each after its delay), `steps` decode steps each after the prompt;
    session `late`, if given, once every other one has had its first token (they decode).

    Returns tok/s over the run, the traces (in prompt order), peak KV pressure and, with
    `logits`, each session's digests of its logits step by step.
    """
    client = EngineClient(engine)
    traces: list[Trace] = [Trace(i) for i in range(len(prompts))]
    digests: list[list[str]] = [[] for _ in prompts]

    def keep(rid: int, _step: int, row: npt.NDArray[np.float32]) -> None:
        digests[rid].append(hashlib.sha1(row.tobytes()).hexdigest())

    async def one(i: int) -> None:
        await trio.sleep(delays[i] if delays else 0.0)
        if i == late:
            await client.first_tokens(len(prompts) - 1)
        req = Request(i, tuple(prompts[i]), steps + 1)
        traces[i] = await generate(client, req, f"s{i}", on_logits=keep if logits else None)

    # The engine tracks its own peak: a polling task would wake the event loop during decodes
    # and, on 2 cores, steal time from llama.cpp's threads.
    engine.telemetry.kv_reserved_peak = 0
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    elapsed = time.perf_counter() - start
    peak = engine.telemetry.kv_reserved_peak / engine.scheduler.config.kv_cells
    return sum(len(t.tokens) for t in traces) / elapsed, traces, peak, digests


def ms(values: list[float], q: float) -> float:
    return percentile_ms(values, q) or 0.0


async def sweep(args: argparse.Namespace, cfg: EngineConfig) -> dict[str, Any]:
    results = []
    async with open_engine(cfg) as engine:
        # The bare loop runs on the engine's compute thread: one OpenMP team in the process
        # (a second calling thread would bring a second team spinning on the same cores).
        bare = await engine.compute.run(BareLoop, cfg.model, cfg.context(read_facts(cfg.model)))
        for concurrency in (1, 2, 4, 8):
            prompts = prompt_tokens(engine.backend, concurrency)
            ours, theirs, traces_all, peaks, occ = [], [], [], [], []
            for _rep, side in interleaved(args.reps, ("bare", "engine")):
                if side == "bare":
                    run = functools.partial(bare.decode_rate, prompts, args.steps, time_prefill=True)
                    theirs.append((await engine.compute.run(run))[0])
                    continue
                t = engine.telemetry
                before = (t.decode_batches_total, t.decode_rows_sum)
                rate, traces, peak, _ = await run_sessions(engine, prompts, args.steps)
                batches = t.decode_batches_total - before[0]
                rows = t.decode_rows_sum - before[1]
                ours.append(rate)
                traces_all += traces
                peaks.append(peak)
                occ.append(rows / max(1, batches) / concurrency)
            itl = [x for t in traces_all for x in t.gaps]
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
    _, quiet, _, _ = await run_sessions(engine, prompts, steps)
    # Same 7 sessions, plus one 512-token prompt arriving once they are decoding (all 7 have had
    # their first token: on a slow machine a fixed delay let it meet their own prompts).
    _, noisy, _, _ = await run_sessions(engine, [*prompts, long_prompt], steps, late=7)
    without = ms([x for t in quiet for x in t.gaps], 99)
    with_ = ms([x for t in noisy[:7] for x in t.gaps], 99)
    return {
        "itl_p99_ms_without": without,
        "itl_p99_ms_with": with_,
        "ratio": round(with_ / without, 3),
        "long_prompt_tokens": len(long_prompt),
        "itl_max_ms_with": ms([x for t in noisy[:7] for x in t.gaps], 100),
    }


async def invariant(args: argparse.Namespace, cfg: EngineConfig) -> dict[str, Any]:
    inv = replace(cfg, batch_invariant=True, pad_rows=8, max_sessions=8)
    async with open_engine(inv) as engine:
        prompts = prompt_tokens(engine.backend, 8)
        solo = []
        for p in prompts:
            _, _, _, digests = await run_sessions(engine, [p], args.steps, logits=True)
            solo.append(digests[0])
        _, _, _, together = await run_sessions(engine, prompts, args.steps, logits=True)
        first_mismatch = {
            f"s{i}": next((k for k, (a, b) in enumerate(zip(solo[i], together[i], strict=True)) if a != b), None)
            for i in range(8)
        }
        mismatched = [k for k, v in first_mismatch.items() if v is not None]
        rate1, _, _, _ = await run_sessions(engine, prompts[:1], args.steps)
        rate8, _, _, _ = await run_sessions(engine, prompts, args.steps)
    return {
        "invariant_exact": not mismatched,
        "invariant_mismatched_sessions": mismatched,
        # Step (0 = the prompt's logits) where each session first differs from its solo run.
        "invariant_first_mismatch_step": first_mismatch,
        "invariant_tok_s": {"1": round(rate1, 2), "8": round(rate8, 2)},
    }


def interference_only(cfg: EngineConfig, steps: int) -> int:
    """A short run: the interference figure alone, for tuning the prefill budget."""

    async def measure() -> dict[str, Any]:
        async with open_engine(cfg) as engine:
            return await measure_interference(engine, steps)

    figure = trio.run(measure)
    print("interference:", figure)
    return 0 if figure["ratio"] <= 2.0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-prefill", type=int, default=64, help="prefill tokens per iteration")
    parser.add_argument(
        "--interference-only", action="store_true", help="only the prefill interference figure (printed, not written)"
    )
    args = parser.parse_args()
    model = bench_model(quick=False)
    cfg = EngineConfig(
        model=model, max_sessions=8, kv_cells=4096, n_batch=512, n_ubatch=512, n_threads=2,
        max_prefill_tokens=args.max_prefill, max_step_tokens=512,
    )  # fmt: skip
    if args.interference_only:
        return interference_only(cfg, args.steps)
    out = trio.run(sweep, args, cfg)
    out.update(trio.run(invariant, args, cfg))
    path = write_evidence(
        "engine_sweep.json",
        {
            "model": model.name,
            "config": {k: shown(str(getattr(cfg, k))) for k in cfg.__dataclass_fields__},
            "steps": args.steps,
            "reps": args.reps,
            **out,
        },
    )
    print()
    print(table(out["results"], COLUMNS))
    print("interference:", out["interference"])
    print("invariant_exact:", out["invariant_exact"], "invariant_tok_s:", out["invariant_tok_s"])
    print("->", shown(path))
    r8 = next(r for r in out["results"] if r["concurrency"] == 8)
    ok = r8["ratio"] >= 0.9 and out["interference"]["ratio"] <= 2.0 and out["invariant_exact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
