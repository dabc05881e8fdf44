"""The Trio engine with the real llama.cpp backend on the tiny model."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import FrozenInstanceError, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import trio

from engine import executor as executor_module
from engine.backend import ContextConfig, DecodeFailed, DecodeOutcome, Segment, SegmentResult, StageBackend
from engine.budgets import BudgetError, Limits
from engine.call_split import DecodeCallCosts
from engine.config import EngineConfig
from engine.engine import Engine, open_engine
from engine.gguf_facts import read_facts
from engine.kernels import INVARIANT_PAD_ROWS
from engine.messages import (
    CloseAnswered,
    Closed,
    CloseRequest,
    DropOwner,
    EndReason,
    Opened,
    OpenRequest,
    Output,
    Result,
    Rollback,
    SessionEnd,
    SessionEnded,
    StepDone,
    StepRequest,
)
from engine.session_ends import SESSION_ENDS_BUFFER
from engine.statistics import wire_stats
from protocol.errors import ErrorCode, Fault
from protocol.sampling import Sampling
from tests.held import held_decodes, wait_until


def config(model: Path, **overrides: Any) -> EngineConfig:
    base = EngineConfig(
        model=model, max_sessions=8, kv_cells=2048, n_batch=64, n_ubatch=16, kv_type="f32", flash_attn=False,
        max_prefill_tokens=16, max_step_tokens=512, record_iterations=True, drain_timeout_s=5.0,
    )  # fmt: skip
    return replace(base, **overrides)


def prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1, *rng.integers(3, 268, n - 1).tolist()]


def tokens(values: list[int]) -> np.ndarray:
    return np.array(values, np.int32)


async def generate(engine: Engine, name: str, ids: list[int], steps: int, owner: str = "c") -> list[int]:
    opened = await engine.request(OpenRequest(owner, name, max_tokens=len(ids) + steps + 1))
    assert isinstance(opened, Opened), opened
    out: list[int] = []
    result = await engine.request(StepRequest(owner, name, 0, Output.TOKEN, tokens=tokens(ids)))
    for _ in range(steps):
        assert isinstance(result, StepDone) and result.token is not None, result
        out.append(result.token)
        pos = len(ids) + len(out) - 1
        result = await engine.request(StepRequest(owner, name, pos, Output.TOKEN, tokens=tokens([out[-1]])))
    assert isinstance(result, StepDone) and result.token is not None
    out.append(result.token)
    await engine.request(CloseRequest(owner, name))
    return out


async def test_concurrent_sessions_match_their_solo_runs(tiny_model: Path) -> None:
    prompts = {f"s{i}": prompt(i, 3 + 5 * i) for i in range(8)}
    solo = {}
    async with open_engine(config(tiny_model)) as engine:
        for name, ids in prompts.items():
            solo[name] = await generate(engine, name, ids, 24)
    together: dict[str, list[int]] = {}
    async with open_engine(config(tiny_model)) as engine:

        async def one(name: str) -> None:
            together[name] = await generate(engine, name, prompts[name], 24)

        async with trio.open_nursery() as nursery:
            for name in prompts:
                nursery.start_soon(one, name)
        rows = [r.chunks for r in engine.iterations]
        assert max(len(c) for c in rows) >= 6, "sessions were really batched together"
        assert engine.stats()["sessions_active"] == 0
    assert together == solo


async def test_a_halved_iteration_is_priced_from_its_first_call_to_its_last(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its price holds the hand-over between the two calls, not only their compute: on a clock
    that ticks one second a reading, each call computes for one second, and the iteration
    costs more than the two seconds of its calls."""
    ticks = itertools.count()
    monkeypatch.setattr(
        executor_module, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks)), monotonic=time.monotonic)
    )
    monkeypatch.setattr(DecodeCallCosts, "halves", lambda self, rows: True)
    async with open_engine(config(tiny_model)) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(generate, engine, f"s{i}", prompt(i, 4), 6)
        costs = engine.executor.call_costs
    assert costs.halved.samples, "decode-only iterations of 2 and 3 rows ran halved"
    assert all(ms > 2000 for samples in costs.halved.samples.values() for ms in samples)


@pytest.mark.parametrize("split_decodes", [True, False])
async def test_halved_iterations_answer_every_session_as_one_call_would(
    split_decodes: bool, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two half calls said cheaper at every size, an iteration of only decodes runs as two
    calls (unless --no-split-decodes), and every session gets the tokens of its solo run."""
    prompts = {f"s{i}": prompt(i, 3 + 4 * i) for i in range(5)}
    solo = {}
    async with open_engine(config(tiny_model)) as engine:
        for name, ids in prompts.items():
            solo[name] = await generate(engine, name, ids, 16)
    monkeypatch.setattr(DecodeCallCosts, "halves", lambda self, rows: True)
    together: dict[str, list[int]] = {}
    async with open_engine(config(tiny_model, split_decodes=split_decodes)) as engine:

        async def one(name: str) -> None:
            together[name] = await generate(engine, name, prompts[name], 16)

        async with trio.open_nursery() as nursery:
            for name in prompts:
                nursery.start_soon(one, name)
        calls_per_iteration = Counter(r.iteration for r in engine.iterations)
        decode_only = engine.executor.pace.steps.measured()
        halved = engine.stats()["decode_halved_total"]
        costs = engine.executor.call_costs
        halved_rows = Counter(
            sum(rows for r in engine.iterations if r.iteration == it for _, _, rows, _, _ in r.chunks)
            for it, n in calls_per_iteration.items()
            if n == 2
        )
    assert together == solo
    assert (max(calls_per_iteration.values()) == 2) == split_decodes
    assert halved == sum(1 for n in calls_per_iteration.values() if n == 2), "stats count each halved iteration"
    assert decode_only, "the pace measured decode steps (a halved iteration counts as one)"
    # Each halved iteration is one measurement of halving its rows, none of a half's own size:
    # whole calls are measured only where nothing was halved (one row).
    assert {rows: costs.halved.count(rows) for rows in costs.halved.samples} == {
        rows: min(n, costs.halved.keep) for rows, n in halved_rows.items()
    }
    assert set(costs.whole.samples) <= ({1} if split_decodes else set())


async def test_long_prefill_delays_no_decode_by_more_than_one_iteration(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model, kv_cells=4096)) as engine:
        stop = trio.Event()

        async def decoder(name: str) -> None:
            ids = prompt(hash(name) % 1000, 4)
            assert isinstance(await engine.request(OpenRequest("c", name, 400)), Opened)
            r = await engine.request(StepRequest("c", name, 0, Output.TOKEN, tokens=tokens(ids)))
            pos = len(ids)
            while not stop.is_set() and pos < 390:
                assert isinstance(r, StepDone) and r.token is not None
                r = await engine.request(StepRequest("c", name, pos, Output.TOKEN, tokens=tokens([r.token])))
                pos += 1

        async def long_prompt() -> None:
            await trio.sleep(0.05)
            assert isinstance(await engine.request(OpenRequest("c", "long", 400)), Opened)
            r = await engine.request(StepRequest("c", "long", 0, Output.TOKEN, tokens=tokens(prompt(99, 300))))
            assert isinstance(r, StepDone)
            stop.set()

        async with trio.open_nursery() as nursery:
            for i in range(7):
                nursery.start_soon(decoder, f"d{i}")
            nursery.start_soon(long_prompt)
        log = engine.iterations
        prefill_iterations = [r for r in log if any(c[0][1] == "long" for c in r.chunks)]
        assert len(prefill_iterations) >= 300 // 16
        mixed = [r for r in prefill_iterations if any(c[3] for c in r.chunks)]
        assert len(mixed) >= len(prefill_iterations) // 2, "decodes ran beside the prefill"
        waits = [c[4] for r in log for c in r.chunks if c[3]]
        assert waits and max(waits) <= 1, f"a decode waited {max(waits)} iterations"
        for r in prefill_iterations:
            assert sum(c[2] for c in r.chunks if not c[3]) <= 16


async def test_flood_gets_busy_and_stays_bounded(tiny_model: Path) -> None:
    cfg = config(tiny_model, inbox_size=8, queue_budget_bytes=4 * 40)
    async with open_engine(cfg) as engine:
        for i in range(8):
            assert isinstance(await engine.request(OpenRequest("c", f"s{i}", 200)), Opened)
        replies: list[Result] = []

        async def ask(step: StepRequest) -> None:
            replies.append(await engine.request(step))

        async with trio.open_nursery() as nursery:
            for round_ in range(40):
                for i in range(8):
                    step = StepRequest("c", f"s{i}", 0, Output.TOKEN, tokens=tokens(prompt(round_ + i, 20)))
                    nursery.start_soon(ask, step)
                stats = engine.stats()
                assert stats["queue_bytes"] <= cfg.queue_budget_bytes
                assert engine._inbox.receiver.statistics().current_buffer_used <= cfg.inbox_size
                await trio.sleep(0)
        immediate = [r for r in replies if isinstance(r, Fault) and "inbox is full" in r.message]
        busy = [f for f in replies if isinstance(f, Fault) and f.code == "busy"]
        done = [r for r in replies if isinstance(r, StepDone)]
        assert immediate and all(f.code == "busy" and f.retry_after_ms for f in immediate)
        assert busy and done
        assert len(busy) + len(done) == 320, "every request was answered, by a result or busy"
        stats = engine.stats()
        assert stats["admissions_rejected_total"]["busy"] >= len(busy) - len(immediate)
        assert stats["queue_bytes"] == 0 and stats["queue_depth"] == 0


async def test_waiting_open_is_admitted_when_capacity_frees(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model, max_sessions=1)) as engine:
        assert isinstance(await engine.request(OpenRequest("c", "a", 100)), Opened)
        quick = await engine.request(OpenRequest("c", "b", 100, wait_ms=30))
        assert isinstance(quick, Fault) and quick.code == "session_limit" and quick.retry_after_ms
        got: list[Result] = []

        async def waiter() -> None:
            got.append(await engine.request(OpenRequest("c", "b", 100, wait_ms=10_000)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.sleep(0.05)
            assert not got and engine.stats()["sessions_waiting"] == 1
            await engine.request(CloseRequest("c", "a"))
        assert isinstance(got[0], Opened)
        assert engine.stats()["admissions_rejected_total"] == {"session_limit": 1}


async def test_kv_budget_rejection_and_reservation(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model, kv_cells=512)) as engine:
        assert engine.stats()["kv_cells_total"] == 512
        opened = await engine.request(OpenRequest("c", "a", 400))
        assert isinstance(opened, Opened) and opened.max_tokens == 400
        r = await engine.request(OpenRequest("c", "b", 200))
        assert isinstance(r, Fault) and r.code == "kv_budget" and "112 of 512 free" in r.message
        assert r.retry_after_ms is not None  # not now: it fits once "a" closes
        stats = engine.stats()
        assert stats["kv_cells_reserved"] == 400 and stats["kv_pressure"] == pytest.approx(400 / 512)


async def test_an_open_that_can_never_fit_is_too_large_not_kv_budget(tiny_model: Path) -> None:
    """More than the node's KV cells (a sequence may have all of them, no more) never fits: no retry."""
    async with open_engine(config(tiny_model, kv_cells=512)) as engine:
        for max_tokens in (513, 100_000):
            r = await engine.request(OpenRequest("c", "huge", max_tokens, wait_ms=1000))
            assert isinstance(r, Fault) and r.code is ErrorCode.TOO_LARGE and r.retry_after_ms is None, r
            assert "512 KV cells" in r.message
        assert isinstance(await engine.request(OpenRequest("c", "all", 512)), Opened)  # the whole cache fits
        empty = await engine.request(OpenRequest("c", "x", 0))
        assert isinstance(empty, Fault) and empty.code is ErrorCode.BAD_REQUEST
        stats = engine.stats()
        assert stats["errors_total"]["too_large"] == 2 and stats["sessions_waiting"] == 0


async def test_cancelled_request_frees_its_session(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model)) as engine:
        await engine.request(OpenRequest("c", "a", 400))
        batches = engine.telemetry.batches_total
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.request, StepRequest("c", "a", 0, Output.TOKEN, tokens=tokens(prompt(1, 300))))
            while engine.telemetry.batches_total == batches:
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()  # the requester leaves mid-step
        for _ in range(500):
            if engine.stats()["sessions_active"] == 0:
                break
            await trio.sleep(0.01)
        assert engine.stats()["sessions_active"] == 0
        assert engine.stats()["kv_cells_reserved"] == 0


async def test_sessions_belong_to_their_owner_and_drop_owner_frees_them(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model)) as engine:
        await engine.request(OpenRequest("alice", "s", 50))
        r = await engine.request(StepRequest("bob", "s", 0, Output.TOKEN, tokens=tokens([1, 5])))
        assert isinstance(r, Fault) and r.code == "unknown_session"
        closed = await engine.request(CloseRequest("bob", "s"))
        assert closed.existed is False  # type: ignore[union-attr]
        assert isinstance(await engine.request(OpenRequest("bob", "s", 50)), Opened)  # same id, other owner
        assert engine.stats()["sessions_active"] == 2
        await engine.cleanup(DropOwner("alice"))
        assert engine.stats()["sessions_active"] == 1


async def test_step_errors_are_answered_and_change_nothing(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model, max_step_tokens=32)) as engine:
        await engine.request(OpenRequest("c", "s", 20))
        first = await engine.request(StepRequest("c", "s", 0, Output.LOGITS, tokens=tokens([1, 5, 6])))
        assert isinstance(first, StepDone) and (first.length, first.max_tokens) == (3, 20)  # nothing to ask after
        cases = [
            (StepRequest("c", "s", 5, Output.TOKEN, tokens=tokens([5])), "position"),
            (StepRequest("c", "s", 3, Output.TOKEN, tokens=tokens([5] * 33)), "too_large"),
            (StepRequest("c", "s", 3, Output.TOKEN, tokens=tokens([5] * 18)), "position"),
            (StepRequest("c", "s", 3, Output.TOKEN, tokens=tokens([999])), "bad_request"),
            (StepRequest("c", "s", 3, Output.HIDDEN, tokens=tokens([5])), "wrong_stage"),
            (StepRequest("c", "s", 3, Output.TOKEN, hidden=np.zeros((1, 64), np.float32)), "wrong_stage"),
            (StepRequest("c", "nope", 0, Output.TOKEN, tokens=tokens([5])), "unknown_session"),
        ]
        for request, code in cases:
            r = await engine.request(request)
            assert isinstance(r, Fault) and r.code == code, (request, r)
        # Retrying the first step (a rewind to 0) is idempotent.
        again = await engine.request(StepRequest("c", "s", 0, Output.LOGITS, tokens=tokens([1, 5, 6])))
        assert isinstance(again, StepDone) and again.logits is not None and first.logits is not None
        np.testing.assert_allclose(again.logits, first.logits, rtol=1e-5, atol=1e-5)
        assert engine.stats()["errors_total"]["position"] == 2


async def test_shutdown_drains_in_flight_work_and_refuses_new(tiny_model: Path) -> None:
    results: list[Result] = []
    async with open_engine(config(tiny_model)) as engine:
        await engine.request(OpenRequest("c", "s", 400))

        async def step() -> None:
            results.append(await engine.request(StepRequest("c", "s", 0, Output.TOKEN, tokens=tokens(prompt(2, 200)))))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(step)
            while engine.stats()["queue_depth"] == 0:
                await trio.sleep(0)
            engine.begin_shutdown()
            refused = await engine.request(OpenRequest("c", "t", 10))
            assert isinstance(refused, Fault) and refused.code == "shutting_down"
    assert len(results) == 1 and isinstance(results[0], StepDone)


async def test_a_requester_that_stops_waiting_has_its_session_closed(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model)) as engine:
        await engine.request(OpenRequest("c", "s", 400))
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    engine.request, StepRequest("c", "s", 0, Output.TOKEN, tokens=tokens(prompt(2, 200)))
                )
                while engine.stats()["queue_depth"] == 0:
                    await trio.sleep(0)
                scope.cancel()  # the step's requester leaves while the step is queued
        assert scope.cancelled_caught
        while engine.stats()["queue_depth"]:
            await trio.sleep(0.01)
        # The computed step found nobody waiting: the session was freed, not left to the idle timeout.
        assert engine.stats()["sessions_active"] == 0 and engine.stats()["kv_cells_reserved"] == 0


async def test_cleanups_are_taken_when_the_inbox_is_full_and_while_draining(tiny_model: Path) -> None:
    cfg = config(tiny_model, inbox_size=1)
    async with open_engine(cfg) as engine:
        for i in range(3):
            await engine.request(OpenRequest("c", f"s{i}", 50))
        first = await engine.request(StepRequest("c", "s0", 0, Output.TOKEN, tokens=tokens([1, 5, 6])))
        assert isinstance(first, StepDone)
        refusals: list[Result] = []
        async with trio.open_nursery() as nursery:
            for _ in range(6):  # more than the inbox holds: some are refused `busy` at once
                nursery.start_soon(lambda: _append(refusals, engine.request(OpenRequest("d", "x", 5000))))
            # ... yet cleanups are taken: two for one session merge into one, the rollback is done.
            done = engine.cleanup_nowait(Rollback("c", "s0", 1))
            assert engine.cleanup_nowait(Rollback("c", "s0", 2)) is done
            engine.cleanup_nowait(CloseRequest("c", "s1"))
            await done.wait()
        assert any(isinstance(r, Fault) and "inbox is full" in r.message for r in refusals)
        gap = await engine.request(StepRequest("c", "s0", 2, Output.TOKEN, tokens=tokens([5])))
        assert isinstance(gap, Fault) and gap.code == "position"  # rolled back to 1
        assert engine.stats()["sessions_active"] == 2 and engine.stats()["cleanups_total"] == 3
        engine.begin_shutdown()
        await engine.cleanup(DropOwner("c"))
        assert engine.stats()["sessions_active"] == 0


async def _append(into: list[Result], result: Any) -> None:
    into.append(await result)


async def test_an_owner_past_its_share_of_the_inbox_is_busy_while_others_are_taken(tiny_model: Path) -> None:
    cfg = config(tiny_model, inbox_size=8, max_queued_per_peer=3)
    async with open_engine(cfg) as engine:
        for owner in ("a", "b"):
            assert isinstance(await engine.request(OpenRequest(owner, "s", 100)), Opened)
        flood: list[Result] = []
        other: list[Result] = []
        with held_decodes(engine) as (entered, release):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _append, flood, engine.request(StepRequest("a", "s", 0, Output.TOKEN, tokens=tokens([1, 5])))
                )
                await wait_until(entered.is_set)
                for i in range(5):  # the loop is inside llama_decode: the inbox is not drained meanwhile
                    step = StepRequest("a", f"x{i}", 0, Output.TOKEN, tokens=tokens([1]))
                    nursery.start_soon(_append, flood, engine.request(step))
                await wait_until(lambda: len(flood) >= 2)
                nursery.start_soon(
                    _append, other, engine.request(StepRequest("b", "s", 0, Output.TOKEN, tokens=tokens([1, 5])))
                )
                await trio.sleep(0.05)
                assert not other, "another owner's step was answered while the loop was held"
                release.set()
        busy = [r for r in flood if isinstance(r, Fault) and r.code == "busy"]
        assert len(busy) == 2 and all("quota of 3 requests" in f.message and f.retry_after_ms for f in busy)
        codes = sorted(r.code for r in flood if isinstance(r, Fault) and r.code != "busy")
        assert codes == ["unknown_session"] * 3 and sum(isinstance(r, StepDone) for r in flood) == 1
        assert len(other) == 1 and isinstance(other[0], StepDone)
        stats = engine.stats()
        assert stats["max_queued_per_peer"] == 3 and stats["inbox_size"] == 8
        assert stats["peer_quota_refused_total"] == {"sessions": 0, "waiting": 0, "queued": 2}
        assert engine.config.queued_per_peer() == 3
        assert replace(cfg, max_queued_per_peer=None).queued_per_peer() == 8  # half the inbox, at least max_sessions


async def test_closes_are_never_refused_and_duplicates_merge(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model, inbox_size=1)) as engine:
        for name in ("s0", "s1"):
            assert isinstance(await engine.request(OpenRequest("c", name, 100)), Opened)
        results: list[Result] = []
        refused: list[Result] = []
        with held_decodes(engine) as (entered, release):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _append, results, engine.request(StepRequest("c", "s0", 0, Output.TOKEN, tokens=tokens([1, 5])))
                )
                await wait_until(entered.is_set)
                for i in range(3):  # the inbox holds one: the others are refused
                    nursery.start_soon(_append, refused, engine.request(OpenRequest(f"z{i}", "x", 10)))
                await wait_until(lambda: len(refused) >= 2)
                for name in ("s1", "s1", "s1", "nope"):
                    nursery.start_soon(_append, results, engine.request(CloseRequest("c", name)))
                await trio.sleep(0.05)
                assert engine.stats()["cleanups_pending"] == 2  # three closes of s1 are one
                release.set()
        assert [r.code for r in refused if isinstance(r, Fault)] == ["busy", "busy"]
        closed = [r for r in results if isinstance(r, Closed)]
        assert sorted((c.session, c.existed) for c in closed) == [
            ("nope", False),
            ("s1", False),
            ("s1", False),
            ("s1", True),
        ]
        assert engine.stats()["sessions_active"] == 2  # s0, and the session of the open that was queued


async def _drain(channel: trio.MemoryReceiveChannel[SessionEnd], into: list[SessionEnd]) -> None:
    async for end in channel:
        into.append(end)


async def test_every_freed_session_ends_once_on_the_channel(tiny_model: Path) -> None:
    """Whatever frees a session (close, failed rollback, gone connection, gone requester,
    shutdown), its end reaches the one consumer once; every close is answered there too."""
    ends: list[SessionEnd] = []
    async with trio.open_nursery() as nursery, open_engine(config(tiny_model)) as engine:
        nursery.start_soon(_drain, engine.session_ends, ends)
        for owner, name in (("a", "closed"), ("a", "rolled"), ("b", "g1"), ("b", "g2"), ("a", "kept")):
            assert isinstance(await engine.request(OpenRequest(owner, name, 50)), Opened)
        assert await engine.request(CloseRequest("a", "closed")) == Closed("closed", True)
        assert await engine.request(CloseRequest("a", "nope")) == Closed("nope", False)
        await engine.cleanup(Rollback("a", "rolled", 5))  # past its length (0): cannot go back there
        await engine.cleanup(DropOwner("b"))
        with held_decodes(engine) as (entered, release):  # the requester leaves before its answer
            nursery.start_soon(engine.request, StepRequest("a", "kept", 0, Output.TOKEN, tokens=tokens([1])))
            await wait_until(entered.is_set)
            async with trio.open_nursery() as requesters:
                requesters.start_soon(engine.request, OpenRequest("a", "left", 50))
                await wait_until(lambda: engine._inbox.receiver.statistics().current_buffer_used == 1)
                requesters.cancel_scope.cancel()
            release.set()  # the open that nobody waits for any more is taken: what it opened is freed
        await wait_until(lambda: len(ends) >= 7)
    assert ends == [
        SessionEnded("a", "closed", EndReason.CLOSED),
        CloseAnswered("a", "closed", True),
        CloseAnswered("a", "nope", False),
        SessionEnded("a", "rolled", EndReason.ROLLBACK_FAILED),
        SessionEnded("b", "g1", EndReason.OWNER_GONE),
        SessionEnded("b", "g2", EndReason.OWNER_GONE),
        SessionEnded("a", "left", EndReason.REQUESTER_GONE),
        SessionEnded("a", "kept", EndReason.SHUTDOWN),  # the channel ends after the engine stops
    ]


async def test_a_slow_consumer_of_session_ends_slows_the_engine_and_loses_nothing(
    tiny_model: Path, mock_clock: trio.testing.MockClock
) -> None:
    """The channel holds SESSION_ENDS_BUFFER ends; past that the engine waits for its consumer
    (at a safe point of its loop) instead of dropping any. Lingering for the sessions it opens
    (which come and go meanwhile) ends once a channel's worth of ends waits: Trio's clock
    stands still until the consumer is let go, so no linger ends by time, and an engine that
    lingered on would take every open before it waited."""
    ends: list[SessionEnd] = []
    opened: list[int] = []
    go = trio.Event()

    async def consume(channel: trio.MemoryReceiveChannel[SessionEnd]) -> None:
        await go.wait()
        await _drain(channel, ends)

    async def churn(engine: Engine, n: int) -> None:
        for i in range(n):
            assert isinstance(await engine.request(OpenRequest("c", f"s{i}", 10)), Opened)
            opened.append(i)
            engine.cleanup_nowait(CloseRequest("c", f"s{i}"))  # each: a SessionEnded and a CloseAnswered

    n = 3 * SESSION_ENDS_BUFFER  # six buffers' worth of ends
    async with trio.open_nursery() as nursery, open_engine(config(tiny_model)) as engine:
        channel = engine.session_ends
        nursery.start_soon(consume, channel)
        async with trio.open_nursery() as producers:
            producers.start_soon(churn, engine, n)
            await trio.testing.wait_all_tasks_blocked()  # opens and closes run no llama.cpp call
            try:
                assert channel.statistics().current_buffer_used == SESSION_ENDS_BUFFER
                assert 0 < engine._ends.backlog <= SESSION_ENDS_BUFFER + 4  # it waits for room...
                assert engine._inbox.receiver.statistics().current_buffer_used == 1  # ... and takes no request
                assert len(opened) < n
            finally:
                go.set()
                mock_clock.rate = 1  # lingers end by time again (and a failed test ends)
        await engine.cleanup(CloseRequest("c", "last"))
        await wait_until(lambda: len(ends) == 2 * n + 1)
    expected: list[SessionEnd] = []
    for i in range(n):
        expected += [SessionEnded("c", f"s{i}", EndReason.CLOSED), CloseAnswered("c", f"s{i}", True)]
    assert ends == [*expected, CloseAnswered("c", "last", False)]


async def test_statistics_are_frozen_and_stats_is_their_flat_form(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model)) as engine:
        await generate(engine, "s", prompt(1, 5), 3)
        statistics = engine.statistics()
        with pytest.raises(FrozenInstanceError):
            statistics.kv.cells_used = 1  # type: ignore[misc]
        with pytest.raises(TypeError):
            statistics.errors_total["busy"] = 1  # type: ignore[index]

        def steady(stats: dict[str, Any]) -> dict[str, Any]:  # rates and the OS's counts move between two reads
            moving = ("rss_", "preemptions_")
            return {k: v for k, v in stats.items() if not k.endswith("_per_s") and not k.startswith(moving)}

        assert steady(engine.stats()) == steady(wire_stats(statistics))
        assert statistics.batches.decode_tokens_total == engine.stats()["decode_tokens_total"] == 3
        assert statistics.sessions.admissions_total == 1 and statistics.queue.cleanups_total == 1
        # the calls alone, inside the steps that also sample and hand off to the compute thread
        inside, steps = statistics.batches.llama_decode_seconds_total, statistics.batches.step_seconds.sum
        assert 0 < inside <= steps and inside == engine.backend.decode_seconds
        assert isinstance(engine.stats()["preemptions_total"], int)  # present, and the OS's own count


async def test_stats_report_memory_part_by_part_and_what_the_process_holds(
    tiny_model: Path, tiny_shards2: list[Path]
) -> None:
    for path in (tiny_model, tiny_shards2[0]):
        async with open_engine(config(path)) as engine:
            stats = engine.stats()
            info, ctx = engine.info, engine.config.context(read_facts(path))
        assert stats["scratch_bytes"] == stats["compute_bytes"] + stats["output_buffer_bytes"] > 0
        # llama.cpp keeps a logits row per output row; a non-last stage asks for none (its capture
        # block), a last stage for up to a whole batch (`out: "tokens"`: every row of a step)
        rows = ctx.n_seq_max if not info.last else max(ctx.n_batch, ctx.n_seq_max)
        assert stats["output_buffer_bytes"] == 4 * info.n_vocab * rows
        assert 0 < stats["rss_anon_bytes"] < stats["rss_bytes"] <= stats["rss_peak_bytes"]
        assert stats["rss_anon_bytes"] + stats["rss_file_bytes"] <= stats["rss_bytes"]


async def test_a_gone_owner_s_waiting_open_is_answered(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model, max_sessions=1)) as engine:
        assert isinstance(await engine.request(OpenRequest("a", "s", 100)), Opened)
        answer: list[Result] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_append, answer, engine.request(OpenRequest("x", "w", 100, wait_ms=60_000)))
            await wait_until(lambda: engine.stats()["sessions_waiting"] > 0)
            await engine.cleanup(DropOwner("x"))
            await wait_until(lambda: bool(answer))  # answered (within 10 s), not left hanging
        assert isinstance(answer[0], Fault) and answer[0].code == "unknown_session"
        assert engine.stats()["sessions_waiting"] == 0 and engine.stats()["sessions_active"] == 1


async def test_sampling_through_the_engine_is_seeded(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model)) as engine:
        outs = []
        for name in ("a", "b"):
            await engine.request(OpenRequest("c", name, 50, Sampling(temperature=1.2, top_k=50, seed=7)))
            r = await engine.request(StepRequest("c", name, 0, Output.TOKEN, tokens=tokens(prompt(4, 10))))
            assert isinstance(r, StepDone)
            outs.append(r.token)
        assert outs[0] == outs[1]


def test_impossible_budgets_are_refused_at_start(tiny_model: Path) -> None:
    async def start(cfg: EngineConfig) -> None:
        async with open_engine(cfg):
            pass

    with pytest.raises(BudgetError, match=r"weights budget: need \d+ bytes"):
        trio.run(start, config(tiny_model, limits=Limits(weights=1000)))
    with pytest.raises(BudgetError, match="kv budget"):
        trio.run(start, config(tiny_model, limits=Limits(kv=2**20)))
    with pytest.raises(BudgetError, match="scratch budget"):
        trio.run(start, config(tiny_model, limits=Limits(scratch=1000)))


@pytest.mark.parametrize(("model", "kv_type", "cells"), [("tiny_model", "f16", 3000), ("tiny_gemma", "f32", 5000)])
def test_kv_budget_matches_llama_cpp_allocation(
    model: str, kv_type: str, cells: int, request: pytest.FixtureRequest
) -> None:
    from engine.engine import plan_budgets  # noqa: PLC0415

    path: Path = request.getfixturevalue(model)
    cfg = config(path, kv_cells=cells, kv_type=kv_type, max_sessions=4)
    budgets, padded = plan_budgets(cfg, read_facts(path))
    backend = StageBackend(path, cfg.context(read_facts(path)))
    try:
        logged = [line for line in backend.context_log if "KV buffer size" in line]
        llama_bytes = sum(float(line.rsplit("=", 1)[1].split()[0]) for line in logged) * 2**20
        cells_logged = [
            int(line.split("size = ")[1].split()[0]) for line in backend.context_log if "KV cache, size" in line
        ]
    finally:
        backend.close()
    assert padded == -(-cells // 256) * 256
    assert abs(budgets.kv_bytes - llama_bytes) <= 0.01 * 2**20 * len(logged), (budgets.kv_bytes, llama_bytes)
    if model == "tiny_gemma":
        assert cells_logged == [padded, 256]  # full-attention cache, then the window cache


Traces = dict[str, list[np.ndarray]]


async def invariant_traces(
    model: Path,
    pad_rows: int | None,
    partners: int,
    *,
    kernels: str = "auto",
    max_prefill: int = 16,
    mine_len: int = 37,
    partner_len: int = 5,
    n_batch: int = 64,
) -> tuple[Traces, Traces]:
    """Every session's teacher-forced logits alone, then all of them (`me` and `partners`) together."""
    # Flash attention on: its kernel walks KV cells one by one, so where a session's cells sit
    # in the shared cache does not change its sums (the non-FA softmax sums across cells in SIMD
    # groups and differs at 1e-6 with the layout).
    cfg = config(
        model,
        batch_invariant=True,
        pad_rows=pad_rows,
        max_prefill_tokens=max_prefill,
        flash_attn=True,
        n_batch=n_batch,
        n_ubatch=min(n_batch, 256),
        kernels=kernels,
    )

    async def trace(engine: Engine, name: str, ids: list[int], steps: int = 20) -> list[np.ndarray]:
        await engine.request(OpenRequest("c", name, 200))
        r = await engine.request(StepRequest("c", name, 0, Output.LOGITS, tokens=tokens(ids)))
        out = []
        for i in range(steps):
            assert isinstance(r, StepDone) and r.logits is not None
            out.append(r.logits)
            nxt = int(np.argmax(r.logits))
            r = await engine.request(StepRequest("c", name, len(ids) + i, Output.LOGITS, tokens=tokens([nxt])))
        await engine.request(CloseRequest("c", name))  # partners leave at different times
        return out

    sessions = {"me": prompt(42, mine_len)} | {f"p{i}": prompt(i, partner_len + 7 * i) for i in range(partners)}
    alone: Traces = {}
    for name, ids in sessions.items():
        async with open_engine(cfg) as engine:
            alone[name] = await trace(engine, name, ids)
    async with open_engine(cfg) as engine:
        together: Traces = {}

        async def run(name: str, ids: list[int]) -> None:
            together[name] = await trace(engine, name, ids)

        async with trio.open_nursery() as nursery:
            for name, ids in sessions.items():
                nursery.start_soon(run, name, ids)
        assert pad_rows == 1 or any(r.pad_rows for r in engine.iterations)
        assert max(sum(1 for c in r.chunks if c[3]) for r in engine.iterations) == len(sessions), "all decoded at once"
        stats = engine.stats()
        assert stats["kv_cells_held"] == 0 and stats["kv_cells_reserved"] == 0  # released once all closed
    return alone, together


def max_diff(a: Traces, b: Traces) -> float:
    """Largest |difference| between any session's logits in `a` and in `b`."""
    assert a.keys() == b.keys()
    return max(float(np.abs(x - y).max()) for name in a for x, y in zip(a[name], b[name], strict=True))


# Padding found by trying 1, 2, 4, 8, 16 rows with up to 7 partners. The F32 model needs 2
# (one row takes another kernel path). Q4_K_M needs 8 with llama.cpp's default weight
# placement (Q4_K repacked): batches of 1-3 rows run the repacked matrix-vector kernel and
# 4+ rows the matrix-matrix one (up to 0.12 apart), and batches of 4 and 8 rows differ by
# 1e-6; every batch padded to 8 rows is exact.
@pytest.mark.parametrize(
    ("model", "pad_rows", "partners"),
    [("tiny_model", 8, 6), ("tiny_model", 2, 1), ("tiny_model", 2, 4), ("tiny_quant", 8, 6)],
)
async def test_batch_invariant_mode_is_bit_exact_whatever_else_runs(
    model: str, pad_rows: int, partners: int, request: pytest.FixtureRequest
) -> None:
    alone, together = await invariant_traces(request.getfixturevalue(model), pad_rows, partners)
    assert max_diff(alone, together) == 0.0


@pytest.mark.parametrize("kernels", ["auto", "plain"])
async def test_each_kernel_path_gets_the_padding_it_needs(kernels: str, tiny_quant: Path) -> None:
    """With no --pad-rows the engine pads for its kernel path (engine/kernels.py INVARIANT_PAD_ROWS)."""
    async with open_engine(config(tiny_quant, batch_invariant=True, kernels=kernels)) as engine:
        stats = engine.stats()
    assert stats["pad_rows"] == INVARIANT_PAD_ROWS[stats["kernel_path"]]
    alone, together = await invariant_traces(tiny_quant, None, 6, kernels=kernels)
    assert max_diff(alone, together) == 0.0


@pytest.mark.parametrize("model", ["tiny_model", "tiny_quant"])
async def test_batch_invariant_mode_is_bit_exact_for_long_prompts(model: str, request: pytest.FixtureRequest) -> None:
    """Prompts longer than llama.cpp's flash-attention query tile (64 rows) beside partners' cells.

    The CPU kernel tiles 64+ query rows over the KV cells in blocks, so a prompt's sums
    would depend on where its cells fall among other sessions' cells; invariant mode keeps
    its prefill calls below that size (the configured 256 is clamped).
    """
    path: Path = request.getfixturevalue(model)
    alone, together = await invariant_traces(path, 8, 3, max_prefill=256, mine_len=150, partner_len=90, n_batch=256)
    assert max_diff(alone, together) == 0.0


@pytest.mark.parametrize(("model", "pad_rows", "partners"), [("tiny_model", 1, 3), ("tiny_quant", 4, 4)])
async def test_tiny_models_need_their_padding(
    model: str, pad_rows: int, partners: int, request: pytest.FixtureRequest
) -> None:
    """Padded less than their kernels need (see above), sessions' outputs move with the batch size."""
    alone, together = await invariant_traces(request.getfixturevalue(model), pad_rows, partners)
    assert max_diff(alone, together) > 0.0


def test_engine_refuses_nonsense_context(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="n_ubatch"):
        ContextConfig(n_batch=16, n_ubatch=32)


async def test_idle_sessions_are_closed(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model, idle_timeout_s=0.05)) as engine:
        await engine.request(OpenRequest("c", "idle", 50))
        assert engine.stats()["sessions_active"] == 1
        for _ in range(100):
            if engine.stats()["sessions_active"] == 0:
                break
            await trio.sleep(0.01)
        assert engine.stats()["sessions_active"] == 0 and engine.stats()["kv_cells_reserved"] == 0


@pytest.mark.parametrize(("micro_batches", "late"), [(2, 0), (1, 1)])
async def test_a_group_runs_without_the_absent_members_of_another(
    micro_batches: int, late: int, tiny_model: Path
) -> None:
    """With micro-batches, a session that has not sent its next step is expected by its own group
    only: the other group's calls run without it and do not count it late."""
    async with open_engine(config(tiny_model, micro_batches=micro_batches)) as engine:
        for name in ("a", "b"):
            assert isinstance(await engine.request(OpenRequest("c", name, 32)), Opened)
        groups = [s.group for s in engine.scheduler.sessions.values()]
        assert groups == ([0, 1] if micro_batches == 2 else [0, 0])
        for name in ("a", "b"):  # both answered: both expected back
            assert isinstance(await engine.request(StepRequest("c", name, 0, Output.TOKEN, tokens([1, 5]))), StepDone)
        for pos in range(2, 6):  # "a" stays away; "b" goes on
            assert isinstance(await engine.request(StepRequest("c", "b", pos, Output.TOKEN, tokens([7]))), StepDone)
        assert engine.stats()["late_sessions_total"] == late
        assert engine.stats()["micro_batches"] == micro_batches


@pytest.mark.parametrize(("micro_batches", "late"), [(2, 0), (1, 1)])
async def test_a_chains_head_does_not_hold_a_group_for_a_session_whose_prompt_it_answered(
    micro_batches: int, late: int, tiny_model: Path
) -> None:
    """At a chain's head the stages below prefill a prompt before its session's next step comes:
    its group runs without waiting for it. A single node still expects it back."""
    async with open_engine(config(tiny_model, micro_batches=micro_batches)) as engine:
        for name in ("a", "b", "c"):  # with 2 micro-batches: a and c in group 0
            assert isinstance(await engine.request(OpenRequest("c", name, 32)), Opened)
        for name in ("a", "c"):
            assert isinstance(await engine.request(StepRequest("c", name, 0, Output.TOKEN, tokens([1, 5]))), StepDone)
        for pos in range(2, 5):  # "a" is still being prefilled below; "c" decodes
            assert isinstance(await engine.request(StepRequest("c", "c", pos, Output.TOKEN, tokens([7]))), StepDone)
        assert engine.stats()["late_sessions_total"] == late


@pytest.mark.parametrize(("micro_batches", "together"), [(1, True), (2, False)])
async def test_sessions_opened_together_prefill_together(
    micro_batches: int, together: bool, tiny_model: Path, mock_clock: trio.testing.MockClock
) -> None:
    """A single node lingers for a session it just opened as for one it just answered: its
    requester's first step follows the news, so prompts that come a moment apart share a call.
    A chain's head does not hold a group for a newcomer. Trio's clock stands still here (no
    linger ends by time): the second step comes while the first waits, or after it ran alone."""
    async with open_engine(config(tiny_model, micro_batches=micro_batches)) as engine:
        for name in ("a", "b"):
            assert isinstance(await engine.request(OpenRequest("c", name, 32)), Opened)
        assert engine.sessions.expects(("c", "b")) is together
        answers: list[object] = []

        async def step(name: str) -> None:
            answers.append(await engine.request(StepRequest("c", name, 0, Output.TOKEN, tokens([1, 5, 9]))))
            engine.steps_ended("c", name)  # no next step: the loop stops lingering for it

        async with trio.open_nursery() as nursery:
            nursery.start_soon(step, "a")
            await trio.testing.wait_all_tasks_blocked()  # "a" waits in the linger, or in its call
            nursery.start_soon(step, "b")
        assert all(isinstance(a, StepDone) for a in answers)
        prefills = [sorted(chunk[0][1] for chunk in r.chunks) for r in engine.iterations]
        assert (["a", "b"] in prefills) is together
        assert engine.stats()["late_sessions_total"] == 0  # a newcomer that has not stepped is not late


def no_kv_slot_for(engine: Engine, fails: Callable[[list[Segment]], bool]) -> list[int]:
    """Make llama_decode answer 1 (no KV slot; nothing written) for the calls `fails` picks.

    Returns the segment counts of every call the backend was asked to run.
    """
    real, calls = engine.backend.decode, []

    def decode(segments: list[Segment]) -> list[SegmentResult]:
        calls.append(len(segments))
        if fails(segments):
            raise DecodeFailed(DecodeOutcome.NO_KV_SLOT, 1)
        return real(segments)

    engine.backend.decode = decode  # type: ignore[method-assign,assignment]
    return calls


async def test_no_kv_slot_splits_the_call_and_every_session_gets_its_tokens(tiny_model: Path) -> None:
    prompts = {f"s{i}": prompt(i, 4 + 3 * i) for i in range(4)}
    solo = {}
    async with open_engine(config(tiny_model)) as engine:
        for name, ids in prompts.items():
            solo[name] = await generate(engine, name, ids, 12)
    together: dict[str, list[int]] = {}
    async with open_engine(config(tiny_model)) as engine:
        calls = no_kv_slot_for(engine, lambda segments: len(segments) > 1)

        async def one(name: str) -> None:
            together[name] = await generate(engine, name, prompts[name], 12)

        async with trio.open_nursery() as nursery:
            for name in prompts:
                nursery.start_soon(one, name)
        stats = engine.stats()
    assert together == solo
    assert any(n > 1 for n in calls), "several sessions met in one call, which failed"
    assert stats["decode_no_kv_slot_total"] > 0 and not stats["errors_total"].get("internal")


async def test_a_step_that_finds_no_kv_slot_alone_is_busy_and_changes_nothing(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model)) as engine:
        await engine.request(OpenRequest("c", "s", 64))
        first = await engine.request(StepRequest("c", "s", 0, Output.TOKEN, tokens=tokens(prompt(1, 6))))
        assert isinstance(first, StepDone)
        real = engine.backend.decode
        no_kv_slot_for(engine, lambda _segments: True)
        refused = await engine.request(StepRequest("c", "s", 6, Output.TOKEN, tokens=tokens([5])))
        assert isinstance(refused, Fault) and refused.code == ErrorCode.BUSY and refused.retry_after_ms
        engine.backend.decode = real  # type: ignore[method-assign]
        again = await engine.request(StepRequest("c", "s", 6, Output.TOKEN, tokens=tokens([5])))
        assert isinstance(again, StepDone) and engine.stats()["kv_cells_used"] == 7
