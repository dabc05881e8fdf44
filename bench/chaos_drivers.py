"""The chaos run's own clients: valid sessions, and the drivers of the restarted and the broken next stage.

- `valid_load`: well-behaved sessions, greedy, the node running the token loop, each compared
  token for token with the same request's solo run on the same node (`solo_tokens`, before
  the attack). An open the node refuses for room is tried again, as a client would.
- `restart_load`: sessions on the head whose next stage is stopped, killed and restarted;
  every outcome and how long its answer took.
- `malformed_load`: sessions on the head whose next stage answers garbage; each step must
  come back `downstream`.
- `held`: what every node still holds (sessions, KV) and the counters the report shows.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Awaitable, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

import trio

from bench.corruption import first_difference
from bench.node_driver import OpenRefused, each_alone, generate
from bench.workload import Request
from neuron_tai.client import Client, ClientClosed, NodeError, open_client

OPEN_ATTEMPTS = 200  # a valid session's open is retried this often while the node has no room


async def solo_tokens(address: str, requests: Sequence[Request], tag: str) -> dict[int, list[int]]:
    """Each request alone on the node: the reference its runs under attack must equal."""
    async with open_client(address, timeout_s=60) as client:
        return await each_alone(client, requests, tag)


@dataclass(slots=True)
class ValidRun:
    """What the valid sessions on one node did under attack."""

    sessions: int = 0
    tokens: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    failed: Counter[str] = field(default_factory=Counter)  # sessions that ended in an error, by code
    open_retries: int = 0
    busy_retries: int = 0

    def report(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "tokens": self.tokens,
            "mismatches": len(self.mismatches),
            "mismatch_details": self.mismatches[:20],
            "failed": dict(self.failed),
            "open_retries": self.open_retries,
            "busy_retries": self.busy_retries,
        }


async def _one_valid(client: Client, req: Request, session: str, run: ValidRun) -> list[int] | None:
    for attempt in range(OPEN_ATTEMPTS):
        busy: list[int] = []
        try:
            trace = await generate(client, req, f"{session}-a{attempt}", busy=busy)
        except OpenRefused:
            run.open_retries += 1
            await trio.sleep(0.05)
            continue
        except NodeError as exc:
            run.failed[str(exc.code)] += 1
            return None
        except (TimeoutError, ClientClosed):
            run.failed["timeout"] += 1
            return None
        finally:
            run.busy_retries += len(busy)
        return trace.tokens
    run.failed["open_refused"] += 1
    return None


async def valid_load(
    address: str,
    requests: Sequence[Request],
    solo: dict[int, list[int]],
    stop: trio.Event,
    concurrency: int,
    think_s: float,
    tag: str,
    run: ValidRun,
) -> None:
    """`concurrency` workers each run the requests in turn, `think_s` apart, until `stop`; every result
    checked against `solo`."""
    async with open_client(address, timeout_s=60) as client:
        pending = itertools.cycle(requests)
        numbers = itertools.count()

        async def worker() -> None:
            while not stop.is_set():
                req = next(pending)
                tokens = await _one_valid(client, req, f"{tag}-{next(numbers)}", run)
                if tokens is None:
                    continue
                run.sessions += 1
                run.tokens += len(tokens)
                step = first_difference(solo[req.rid], tokens)
                if step is not None:
                    run.mismatches.append(
                        {
                            "rid": req.rid,
                            "step": step,
                            "expected": solo[req.rid][step : step + 4],
                            "got": tokens[step : step + 4],
                        }
                    )
                with trio.move_on_after(think_s):
                    await stop.wait()

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)


@dataclass(slots=True)
class Outcomes:
    """Requests a driver sent, and how each of its operations ended (`ok`, an error code, `timeout`)."""

    sent: int = 0
    opens: Counter[str] = field(default_factory=Counter)
    steps: Counter[str] = field(default_factory=Counter)
    generates: Counter[str] = field(default_factory=Counter)
    answer_s: dict[str, float] = field(default_factory=dict)  # outcome -> longest time to that answer
    timeline: list[tuple[float, str, float]] = field(default_factory=list)  # (t, outcome, seconds to answer)

    def note(self, counter: Counter[str], outcome: str, seconds: float) -> None:
        counter[outcome] += 1
        self.answer_s[outcome] = round(max(self.answer_s.get(outcome, 0.0), seconds), 3)

    def report(self) -> dict[str, Any]:
        counts = {"opens": dict(self.opens), "steps": dict(self.steps), "generates": dict(self.generates)}
        return {"sent": self.sent, **counts, "longest_answer_s": self.answer_s}


async def _close_quietly(client: Client, session: str, out: Outcomes) -> None:
    out.sent += 1
    with trio.move_on_after(5), suppress(NodeError, TimeoutError, ClientClosed):
        await client.close(session)


async def _outcome(call: Awaitable[object], ok: str = "ok") -> str:
    """`ok` once `call` is answered, else what went wrong: the node's error code, or "timeout"."""
    try:
        await call
    except NodeError as exc:
        return str(exc.code)
    except (TimeoutError, ClientClosed):
        return "timeout"
    return ok


async def _generate(client: Client, session: str, prompt: list[int], max_new: int) -> str:
    async def run() -> None:
        async with aclosing(client.generate_tokens(session, 0, prompt, max_new, ignore_eog=True)) as replies:
            async for _ in replies:
                pass

    return await _outcome(run())


SETTLE_LIMIT_S = 30.0  # after `stop`, how long the restart driver waits to see the chain serve again


async def restart_load(
    address: str, prompt: list[int], stop: trio.Event, settled: trio.Event, t0: float, out: Outcomes
) -> None:
    """Open, generate 8 tokens, close, over and over, through a head whose next stage comes and goes.

    Runs until `stop`, and past it until a session that began once the tail stopped changing
    (`settled`) has gone through (at most `SETTLE_LIMIT_S` more): whether the chain serves again
    after its last restart is never left to how the timing fell."""
    served_after_settling = False
    stopped_at: float | None = None
    async with open_client(address, timeout_s=15, retries=0) as client:
        for k in itertools.count():
            if stop.is_set():
                stopped_at = stopped_at if stopped_at is not None else trio.current_time()
                if served_after_settling or trio.current_time() - stopped_at > SETTLE_LIMIT_S:
                    return
            began_settled = settled.is_set()
            session, started = f"tr-{k}", trio.current_time()
            out.sent += 1
            outcome = await _outcome(client.open(session, len(prompt) + 8), "opened")
            if outcome == "opened":
                out.sent += 1
                outcome = await _generate(client, session, prompt, 8)
            else:
                outcome = f"open:{outcome}"
            await _close_quietly(client, session, out)
            seconds = trio.current_time() - started
            out.note(out.generates, outcome, seconds)
            out.timeline.append((round(started - t0, 3), outcome, round(seconds, 3)))
            served_after_settling |= began_settled and outcome == "ok"
            await trio.sleep(0.02)


async def malformed_load(address: str, prompt: list[int], stop: trio.Event, workers: int, out: Outcomes) -> None:
    """Sessions on a head whose next stage answers garbage: opens, steps (tokens, logits), a generate."""
    async with open_client(address, timeout_s=15, retries=0) as client:

        async def worker(w: int) -> None:
            for k in itertools.count():
                if stop.is_set():
                    return
                session, started = f"mf-{w}-{k}", trio.current_time()
                out.sent += 1
                opened = await _outcome(client.open(session, 64), "opened")
                out.note(out.opens, opened, trio.current_time() - started)
                if opened != "opened":
                    continue
                for j in range(6):
                    started = trio.current_time()
                    out.sent += 1
                    outcome = await _outcome(
                        client.step(session, 0, tokens=prompt, out=("token", "logits")[j % 2]), "result"
                    )
                    out.note(out.steps, outcome, trio.current_time() - started)
                started = trio.current_time()
                out.sent += 1
                out.note(out.generates, await _generate(client, session, prompt, 4), trio.current_time() - started)
                await _close_quietly(client, session, out)

        async with trio.open_nursery() as nursery:
            for w in range(workers):
                nursery.start_soon(worker, w)


PEAK_KEYS = (
    "sessions_active",
    "sessions_waiting",
    "handlers_active",
    "queue_depth",
    "kv_cells_reserved",
    "kv_cells_held",
    "text_pending_bytes",
)


async def stats_peaks(address: str, stop: trio.Event, peaks: dict[str, int], period_s: float = 1.0) -> None:
    """The most of each of `PEAK_KEYS` a node's `stats` showed, polled until `stop` (a node that does
    not answer is skipped until it does)."""
    async with open_client(address, timeout_s=5, retries=0) as client:
        while not stop.is_set():
            try:
                stats = await client.stats()
            except (NodeError, TimeoutError, ClientClosed):
                stats = {}
            for key in PEAK_KEYS:
                if isinstance(stats.get(key), int):
                    peaks[key] = max(peaks.get(key, 0), stats[key])
            with trio.move_on_after(period_s):
                await stop.wait()


HELD_KEYS = ("sessions_active", "sessions_waiting", "kv_cells_reserved", "kv_cells_held", "kv_cells_used")
COUNTERS = (
    "errors_total",
    "peers_gone_total",
    "leases_expired_total",
    "messages_failed_total",
    "handlers_refused_total",
    "admissions_rejected_total",
    "cleanups_pending",
    "kv_compactions_total",
    "kv_compactions_failed_total",
    "kv_cells_reclaimed_total",
    "kv_sessions_lost_total",
)


async def node_stats(address: str) -> dict[str, Any] | None:
    """A node's `stats`, or None when it does not answer."""
    async with open_client(address, timeout_s=10, retries=1) as client:
        try:
            return await client.stats()
        except (NodeError, TimeoutError, ClientClosed):
            return None


def held(stats: dict[str, Any]) -> dict[str, Any]:
    """What a node still holds for sessions, from its `stats`."""
    out = {k: stats.get(k) for k in HELD_KEYS}
    if "downstream" in stats:
        out["downstream_sessions"] = stats["downstream"].get("sessions")
    out["sessions_held"] = (
        int(stats.get("sessions_active") or 0)
        + int(stats.get("sessions_waiting") or 0)
        + int(out.get("downstream_sessions") or 0)
    )
    return out
