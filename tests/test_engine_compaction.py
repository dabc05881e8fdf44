"""Batch-invariant mode on a busy node: closed sessions' cells are reused while others stay open.

A session A stays open and generates while sessions B open, run and close beside it in
a 256-cell cache. Held cells alone would soon refuse an open `kv_budget`; the engine
compacts the cache instead, and A and every B keep logits bit-identical to their solo runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from engine.engine import Engine, open_engine
from engine.llama_handles import SeqState
from engine.messages import CloseRequest, Opened, OpenRequest, Output, StepDone, StepRequest
from engine.scheduler import Scheduler
from engine.sessions import Sessions
from protocol.errors import ErrorCode, Fault
from tests.test_engine import config, prompt, tokens

# 256 cells (248 to reserve beside 8 padding rows); no compaction unless an open needs one.
CHURN: dict[str, Any] = {
    "batch_invariant": True, "pad_rows": 8, "flash_attn": True, "kv_cells": 256, "compact_at": None,
    "max_prefill_tokens": 16,
}  # fmt: skip
A = ("a", prompt(7, 30), 60, 100)  # name, prompt, steps, max_tokens
BS = [(f"b{i}", prompt(100 + i, 6 + 4 * (i % 4)), 18, 40) for i in range(12)]  # two lanes of six


Trace = list[np.ndarray] | Fault  # a session's logits, or the refusal of its open


async def trace(
    engine: Engine,
    name: str,
    ids: list[int],
    steps: int,
    max_tokens: int,
    opened: trio.Event | None = None,
    pause: trio.Event | None = None,
) -> Trace:
    """Teacher-forced greedy logits after the prompt and after each of `steps` tokens. `opened`
    is set once open; `pause` is waited for before the last two steps (idle time changes
    nothing in a session's outputs)."""
    answer = await engine.request(OpenRequest("c", name, max_tokens))
    if isinstance(answer, Fault):
        return answer
    assert isinstance(answer, Opened)
    if opened is not None:
        opened.set()
    r = await engine.request(StepRequest("c", name, 0, Output.LOGITS, tokens=tokens(ids)))
    out = []
    for i in range(steps):
        assert isinstance(r, StepDone) and r.logits is not None, r
        out.append(r.logits)
        if pause is not None and i == steps - 2:
            await pause.wait()
        r = await step(engine, name, len(ids) + i, int(np.argmax(r.logits)))
    await engine.request(CloseRequest("c", name))
    return out


async def step(engine: Engine, name: str, pos: int, token: int) -> StepDone | Fault:
    r = await engine.request(StepRequest("c", name, pos, Output.LOGITS, tokens=tokens([token])))
    assert isinstance(r, StepDone | Fault)
    return r


async def churn(engine: Engine) -> dict[str, Trace]:
    """A opens first and stays open; two lanes run B0..B11, one after another in each lane."""
    out: dict[str, Trace] = {}
    a_open, lanes_done = trio.Event(), trio.Event()

    async def run_a() -> None:
        name, ids, steps, max_tokens = A
        out[name] = await trace(engine, name, ids, steps, max_tokens, a_open, lanes_done)

    async def lane(bs: list[tuple[str, list[int], int, int]]) -> None:
        await a_open.wait()
        for name, ids, steps, max_tokens in bs:
            out[name] = await trace(engine, name, ids, steps, max_tokens)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_a)
        async with trio.open_nursery() as lanes:
            lanes.start_soon(lane, BS[0::2])
            lanes.start_soon(lane, BS[1::2])
        lanes_done.set()
    return out


async def solo(path: Path) -> dict[str, Trace]:
    out: dict[str, Trace] = {}
    for name, ids, steps, max_tokens in [A, *BS]:
        async with open_engine(config(path, **CHURN)) as engine:
            out[name] = await trace(engine, name, ids, steps, max_tokens)
    return out


@pytest.mark.parametrize("model", ["tiny_model", "tiny_quant", "tiny_gemma"])
async def test_cells_of_closed_sessions_are_reused_bit_exactly(model: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    alone = await solo(path)
    async with open_engine(config(path, **CHURN)) as engine:
        together = await churn(engine)
        stats = engine.stats()
    refused = {name: r for name, r in together.items() if isinstance(r, Fault)}
    assert not refused, f"opens refused: {refused}"
    for name, logits in alone.items():
        assert isinstance(logits, list)
        got = together[name]
        assert isinstance(got, list) and len(got) == len(logits)
        for step, (x, y) in enumerate(zip(got, logits, strict=True)):
            assert np.array_equal(x, y), f"{name} step {step}: differs by {np.abs(x - y).max()}"
    assert stats["kv_compactions_total"] >= 2 and stats["kv_cells_moved_total"] > 0
    # Every closed session's cells came back, A's when it closed last.
    assert stats["kv_cells_reclaimed_total"] == sum(len(ids) + steps for _, ids, steps, _ in [A, *BS])
    assert stats["kv_sessions_lost_total"] == 0 and stats["kv_compactions_failed_total"] == 0
    assert stats["kv_cells_held"] == 0 and stats["admissions_rejected_total"] == {}


async def test_without_compaction_the_same_churn_is_refused_kv_budget(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Scheduler, "wants_compaction", lambda self: False)
    async with open_engine(config(tiny_model, **CHURN)) as engine:
        together = await churn(engine)
        stats = engine.stats()
    refused = [r for r in together.values() if isinstance(r, Fault)]
    assert refused and all(r.code is ErrorCode.KV_BUDGET for r in refused)
    assert stats["kv_compactions_total"] == 0 and stats["admissions_rejected_total"] == {"kv_budget": len(refused)}


async def test_held_cells_past_compact_at_are_freed_with_no_open_waiting(tiny_model: Path) -> None:
    async with open_engine(config(tiny_model, **(CHURN | {"compact_at": 0.1}))) as engine:
        for name in ("a", "b"):
            assert isinstance(await engine.request(OpenRequest("c", name, 60)), Opened)
            await engine.request(StepRequest("c", name, 0, Output.LOGITS, tokens=tokens(prompt(1, 30))))
        await engine.request(CloseRequest("c", "b"))  # 30 held, past 10% of 248
        await engine.request(StepRequest("c", "a", 30, Output.LOGITS, tokens=tokens([5])))  # one more loop turn
        stats = engine.stats()
    assert stats["kv_compactions_total"] == 1 and stats["kv_cells_reclaimed_total"] == 30
    assert stats["kv_cells_moved_total"] == 30 and stats["kv_cells_held"] == 0


async def test_a_session_whose_cells_cannot_be_put_back_is_closed_and_counted(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp refuses V's copy (truncated here): V is closed and counted, A goes on exact."""
    a_ids = prompt(7, 20)
    async with open_engine(config(tiny_model, **CHURN)) as engine:
        alone = await trace(engine, "a", a_ids, 8, 100)
    async with open_engine(config(tiny_model, **CHURN)) as engine:
        got = []
        for name, max_tokens, ids in [("a", 100, a_ids), ("v", 60, prompt(8, 10)), ("b", 80, prompt(9, 20))]:
            assert isinstance(await engine.request(OpenRequest("c", name, max_tokens)), Opened)
            r = await engine.request(StepRequest("c", name, 0, Output.LOGITS, tokens=tokens(ids)))
            assert isinstance(r, StepDone) and r.logits is not None
            got += [r.logits] if name == "a" else []

        async def a_steps(n: int) -> None:
            for _ in range(n):
                r = await step(engine, "a", len(a_ids) + len(got) - 1, int(np.argmax(got[-1])))
                assert isinstance(r, StepDone) and r.logits is not None
                got.append(r.logits)

        await a_steps(3)
        await engine.request(CloseRequest("c", "b"))  # 20 held: 248 - 160 - 20 = 68 cells free
        victim = engine.scheduler.sessions[("c", "v")].seq
        put = engine.backend.ctx.set_seq_state

        def truncated(seq: int, blob: np.ndarray, **kw: bool) -> SeqState:
            return put(seq, blob[:-1] if seq == victim else blob, **kw)

        monkeypatch.setattr(engine.backend.ctx, "set_seq_state", truncated)
        assert isinstance(await engine.request(OpenRequest("c", "d", 80)), Opened)  # 88 free once compacted
        lost = await step(engine, "v", 10, 3)
        assert isinstance(lost, Fault) and lost.code is ErrorCode.UNKNOWN_SESSION
        await a_steps(4)
        stats = engine.stats()
    assert stats["kv_sessions_lost_total"] == 1 and stats["kv_compactions_total"] == 1
    assert stats["sessions_active"] == 2  # a and d
    assert isinstance(alone, list) and len(got) == len(alone) == 8
    assert all(np.array_equal(x, y) for x, y in zip(got, alone, strict=True))


@pytest.mark.parametrize("hold", [True, False])
async def test_a_rewound_tail_is_held_not_freed_among_other_sessions(
    hold: bool, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B retries a step at an earlier position while A runs: B's dropped cells stay held, as a
    closed session's do. Freed in place (`hold` False, the control) they take A's next
    tokens ahead of A's later cells, and A parts from its solo run."""
    a_ids, b_ids = prompt(7, 12), prompt(8, 20)

    async def run(engine: Engine, with_b: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        a: list[np.ndarray] = []
        b: list[np.ndarray] = []

        async def go(name: str, out: list[np.ndarray], pos: int, ids: list[int]) -> None:
            r = await engine.request(StepRequest("c", name, pos, Output.LOGITS, tokens=tokens(ids)))
            assert isinstance(r, StepDone) and r.logits is not None, r
            out.append(r.logits)

        for name in ("a", "b") if with_b else ("a",):
            assert isinstance(await engine.request(OpenRequest("c", name, 60)), Opened)
        await go("a", a, 0, a_ids)
        if with_b:
            await go("b", b, 0, b_ids)
        for i in range(3):
            await go("a", a, len(a_ids) + i, [int(np.argmax(a[-1]))])
        if with_b:
            await go("b", b, 10, [5])  # a retry from position 10: drops 10 cells
            assert engine.stats()["kv_cells_held"] == (10 if hold else 0)
            await go("b", b, 11, [int(np.argmax(b[-1]))])
        for i in range(3, 8):
            await go("a", a, len(a_ids) + i, [int(np.argmax(a[-1]))])
        return a, b

    async with open_engine(config(tiny_model, **CHURN)) as engine:
        a_alone, _ = await run(engine, with_b=False)
    async with open_engine(config(tiny_model, **CHURN)) as engine:  # B alone, its retry included
        b_alone: list[np.ndarray] = []
        assert isinstance(await engine.request(OpenRequest("c", "b", 60)), Opened)
        for pos, ids in ((0, b_ids), (10, [5]), (11, None)):
            token_ids = ids if ids is not None else [int(np.argmax(b_alone[-1]))]
            r = await engine.request(StepRequest("c", "b", pos, Output.LOGITS, tokens=tokens(token_ids)))
            assert isinstance(r, StepDone) and r.logits is not None
            b_alone.append(r.logits)
    if not hold:
        monkeypatch.setattr(Sessions, "rewind", lambda self, seq, pos: self.backend.rewind(seq, pos))
    async with open_engine(config(tiny_model, **CHURN)) as engine:
        a_shared, b_shared = await run(engine, with_b=True)
    assert all(np.array_equal(x, y) for x, y in zip(b_shared, b_alone, strict=True))
    a_exact = all(np.array_equal(x, y) for x, y in zip(a_shared, a_alone, strict=True))
    assert a_exact == hold


async def test_a_session_mid_prefill_is_compacted_bit_exactly(tiny_quant: Path) -> None:
    """A 150-token prompt runs in chunks of 16, one per iteration; an open that needs the held
    cells arrives after its first chunk, so the compaction moves a half-written prompt."""
    long_ids = prompt(5, 150)
    async with open_engine(config(tiny_quant, **CHURN)) as engine:
        alone = await trace(engine, "long", long_ids, 6, 170)
    async with open_engine(config(tiny_quant, **(CHURN | {"record_iterations": True}))) as engine:
        await engine.request(OpenRequest("c", "x", 10))  # stays open, so closing b leaves its cells held
        await engine.request(StepRequest("c", "x", 0, Output.LOGITS, tokens=tokens(prompt(4, 5))))
        assert isinstance(await trace(engine, "b", prompt(6, 40), 10, 60), list)  # closed beside x: 50 held
        result: dict[str, Trace] = {}

        async def run_long() -> None:
            result["long"] = await trace(engine, "long", long_ids, 6, 170)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_long)
            while not any(chunk[0][1] == "long" for r in engine.iterations for chunk in r.chunks):
                await trio.sleep(0.0005)
            assert isinstance(await engine.request(OpenRequest("c", "c", 60)), Opened)  # 248-180-50 < 60
            step = engine.scheduler.sessions[("c", "long")].step
            assert step is not None and 0 < step.done < step.n, "the compaction ran mid-prefill"
        stats = engine.stats()
    assert stats["kv_compactions_total"] == 1 and stats["kv_cells_reclaimed_total"] >= 50
    got = result["long"]
    assert isinstance(alone, list) and isinstance(got, list)
    assert all(np.array_equal(x, y) for x, y in zip(got, alone, strict=True))


async def test_a_compaction_that_cannot_copy_a_session_changes_nothing(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's copy comes back short: nothing moves, the open that needed it is refused
    `kv_budget` as before, the session goes on exact, and the next close tries again."""
    a_ids = prompt(7, 20)
    async with open_engine(config(tiny_model, **CHURN)) as engine:
        alone = await trace(engine, "a", a_ids, 6, 100)
    async with open_engine(config(tiny_model, **CHURN)) as engine:
        assert isinstance(await engine.request(OpenRequest("c", "a", 100)), Opened)
        r = await engine.request(StepRequest("c", "a", 0, Output.LOGITS, tokens=tokens(a_ids)))
        assert isinstance(r, StepDone) and r.logits is not None
        got = [r.logits]
        assert isinstance(await trace(engine, "b", prompt(9, 30), 10, 100), list)  # 40 held
        taken = engine.backend.ctx.seq_state
        monkeypatch.setattr(engine.backend.ctx, "seq_state", lambda seq: (SeqState.SHORT, taken(seq)[1]))
        refused = await engine.request(OpenRequest("c", "d", 120))  # 248 - 100 - 40 < 120
        assert isinstance(refused, Fault) and refused.code is ErrorCode.KV_BUDGET
        stats = engine.stats()
        assert stats["kv_compactions_failed_total"] == 1 and stats["kv_compactions_total"] == 0
        assert stats["kv_cells_held"] == 40 and engine.scheduler.wants_compaction() is False
        for i in range(5):
            r = await step(engine, "a", len(a_ids) + i, int(np.argmax(got[-1])))
            assert isinstance(r, StepDone) and r.logits is not None
            got.append(r.logits)
        monkeypatch.undo()
        assert isinstance(await trace(engine, "e", prompt(3, 5), 2, 60), list)  # 7 more held: try again
        assert isinstance(await engine.request(OpenRequest("c", "d", 120)), Opened)
        assert engine.stats()["kv_compactions_total"] == 1
    assert isinstance(alone, list) and len(got) == len(alone) == 6
    assert all(np.array_equal(x, y) for x, y in zip(got, alone, strict=True))
