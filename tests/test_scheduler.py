"""The pure scheduler: policy examples and hypothesis state-machine properties."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.pacing import Demand
from engine.row_blocks import filler_rows
from engine.scheduler import Plan, Scheduler, SchedulerConfig, Session, Step, Waiter
from protocol.errors import ErrorCode, Fault

CFG = SchedulerConfig(
    max_sessions=4, kv_cells=256, n_batch=16, max_prefill_tokens=8, max_step_tokens=64, queue_budget_bytes=10_000
)


def opened(s: Scheduler[None, None], key: str, max_tokens: int = 32, seq: int = 0) -> Session[None]:
    session = s.request_open(key, max_tokens, 0, 0.0, None)
    assert isinstance(session, Session)
    session.seq = seq
    return session


def run(s: Scheduler[None, None], plan: Plan) -> list[Step[None]]:
    return s.commit(plan, 0.0, 10.0)


def planned(cfg: SchedulerConfig, decodes: int, prompts: list[int], budget: int | None) -> Plan | None:
    """The first plan of a scheduler with `decodes` sessions decoding and one session per prompt."""
    s = Scheduler[None, None](cfg)
    for i in range(decodes + len(prompts)):
        opened(s, f"s{i}", max_tokens=48, seq=i)
    for i in range(decodes):
        s.submit(f"s{i}", 0, 1, 4, 0.0, None)
    for j, n in enumerate(prompts):
        s.submit(f"s{decodes + j}", 0, n, 4 * n, 0.0, None)
    return s.plan(prefill_budget=budget)


def quota_that_refused(s: Scheduler[None, None], before: dict[str, int]) -> str | None:
    """The per-owner quota whose refusal count grew since `before` (a copy of `s.quota_refused`)."""
    grew = [q for q in ("sessions", "waiting") if s.quota_refused[q] > before.get(q, 0)]
    assert len(grew) <= 1
    return grew[0] if grew else None


def test_decode_first_then_prefill_round_robin() -> None:
    s = Scheduler[None, None](CFG)
    for i, key in enumerate("abcd"):
        opened(s, key, seq=i)
    s.submit("a", 0, 20, 80, 0.0, None)  # long prefill
    s.submit("b", 0, 20, 80, 0.0, None)  # long prefill
    s.submit("c", 0, 1, 4, 0.0, None)
    s.submit("d", 0, 1, 4, 0.0, None)
    plan = s.plan()
    assert plan is not None
    chunks = list(plan.chunks)
    assert [(c.key, c.count) for c in chunks] == [("c", 1), ("d", 1), ("a", 8)]
    assert {st.key for st in run(s, plan)} == {"c", "d"}
    plan = s.plan()
    assert plan is not None and [(c.key, c.count) for c in plan.chunks] == [("b", 8)]  # b's turn
    run(s, plan)
    plan = s.plan()
    assert plan is not None and [(c.key, c.pos) for c in plan.chunks] == [("a", 8)]


def test_a_zero_prefill_budget_makes_a_decode_only_iteration_but_never_stops_prefill_alone() -> None:
    s = Scheduler[None, None](CFG)
    opened(s, "a", seq=0)
    opened(s, "b", seq=1)
    s.submit("a", 0, 20, 80, 0.0, None)
    s.submit("b", 0, 1, 4, 0.0, None)
    plan = s.plan(prefill_budget=0)
    assert plan is not None and [(c.key, c.count) for c in plan.chunks] == [("b", 1)]  # measures a decode
    run(s, plan)
    plan = s.plan(prefill_budget=0)  # nobody decodes: the budget does not apply
    assert plan is not None and [(c.key, c.count) for c in plan.chunks] == [("a", CFG.max_prefill_tokens)]


def test_demand_counts_ready_decodes_and_sessions_waiting_to_prefill() -> None:
    """What the prefill budget is sized by: a multi-row step of a session that already decodes
    (a verification step) waits in the prefill path like a prompt."""
    s = Scheduler[None, None](CFG)
    for i, key in enumerate("abcd"):
        opened(s, key, seq=i)
    assert s.demand() == Demand(0, 0)
    s.submit("a", 0, 20, 80, 0.0, None)
    s.submit("b", 0, 1, 4, 0.0, None)
    s.submit("c", 0, 1, 4, 0.0, None)
    assert s.demand() == Demand(decoding=2, prefilling=1)
    plan = s.plan(prefill_budget=8)
    assert plan is not None
    run(s, plan)
    assert s.demand() == Demand(decoding=0, prefilling=1)  # b and c answered; a has 12 rows left
    s.submit("b", 1, 3, 12, 0.0, None)  # a decoding session's multi-row step
    assert s.demand() == Demand(decoding=0, prefilling=2)
    plan = s.plan(prefill_budget=8)
    assert plan is not None and [(c.key, c.count) for c in plan.chunks] == [("a", 8)]
    run(s, plan)
    plan = s.plan(prefill_budget=8)  # round-robin: the verification rows first, then a's tail
    assert plan is not None and [(c.key, c.count) for c in plan.chunks] == [("b", 3), ("a", 4)]


def test_large_step_is_split_and_answered_once_complete() -> None:
    s = Scheduler[None, None](CFG)
    opened(s, "a")
    step = s.submit("a", 0, 20, 80, 0.0, None)
    assert isinstance(step, Step)
    answered = []
    while (plan := s.plan()) is not None:
        assert sum(c.count for c in plan.chunks) <= CFG.max_prefill_tokens
        answered += run(s, plan)
    assert answered == [step] and step.done == 20 and s.sessions["a"].length == 20
    assert s.queued_bytes == 0


def test_one_step_in_flight_per_session_and_errors_have_reasons() -> None:
    s = Scheduler[None, None](CFG)
    opened(s, "a", max_tokens=10)
    assert isinstance(s.submit("a", 0, 2, 8, 0.0, None), Step)
    busy = s.submit("a", 2, 1, 4, 0.0, None)
    assert isinstance(busy, Fault) and busy.code is ErrorCode.BUSY and busy.retry_after_ms
    run(s, s.plan())  # type: ignore[arg-type]
    cases = {
        ("b", 0, 1): ErrorCode.UNKNOWN_SESSION,
        ("a", 3, 1): ErrorCode.POSITION,  # gap
        ("a", 2, 9): ErrorCode.POSITION,  # past max_tokens
        ("a", 0, 65): ErrorCode.TOO_LARGE,
        ("a", 2, 0): ErrorCode.BAD_REQUEST,  # an empty step: the one place n >= 1 is checked
    }
    for (key, pos, n), reason in cases.items():
        r = s.submit(key, pos, n, 4 * n, 0.0, None)
        assert isinstance(r, Fault) and r.code is reason and r.message
    assert s.sessions["a"].length == 2


def test_queue_budget_refuses_with_busy_and_nothing_queued() -> None:
    s = Scheduler[None, None](replace(CFG, queue_budget_bytes=100))
    opened(s, "a")
    opened(s, "b", seq=1)
    assert isinstance(s.submit("a", 0, 20, 80, 0.0, None), Step)
    r = s.submit("b", 0, 10, 40, 0.0, None)
    assert isinstance(r, Fault) and r.code is ErrorCode.BUSY and "queue budget" in r.message
    assert s.queued_bytes == 80 and s.sessions["b"].step is None


def test_a_rewind_the_backend_cannot_make_is_refused_and_changes_nothing() -> None:
    s = Scheduler[None, None](CFG)
    opened(s, "a", seq=3)
    s.submit("a", 0, 5, 20, 0.0, None)
    run(s, s.plan())  # type: ignore[arg-type]
    asked: list[tuple[int, int]] = []

    def window(seq: int, pos: int) -> bool:
        asked.append((seq, pos))
        return pos >= 4

    r = s.submit("a", 2, 1, 4, 0.0, None, can_rewind=window)
    assert isinstance(r, Fault) and r.code is ErrorCode.POSITION and "sliding window" in r.message
    assert s.sessions["a"].length == 5 and s.sessions["a"].step is None and asked == [(3, 2)]
    assert isinstance(s.submit("a", 5, 1, 4, 0.0, None, can_rewind=window), Step) and asked == [(3, 2)]  # no rewind
    empty = s.request_open("b", 0, 0, 0.0, None)
    assert isinstance(empty, Fault) and empty.code is ErrorCode.BAD_REQUEST


def test_rewind_shortens_the_session() -> None:
    s = Scheduler[None, None](CFG)
    opened(s, "a")
    s.submit("a", 0, 5, 20, 0.0, None)
    run(s, s.plan())  # type: ignore[arg-type]
    step = s.submit("a", 2, 1, 4, 0.0, None)
    assert isinstance(step, Step) and s.sessions["a"].length == 2
    plan = s.plan()
    assert plan is not None and next(iter(plan.chunks)).pos == 2


def test_admission_waits_in_fifo_then_expires_with_retry_estimate() -> None:
    s = Scheduler[None, None](replace(CFG, max_sessions=1))
    opened(s, "a")
    w1 = s.request_open("b", 10, 100, 0.0, None)
    w2 = s.request_open("c", 10, 50, 0.0, None)
    assert isinstance(w1, Waiter) and isinstance(w2, Waiter)
    assert isinstance(s.request_open("b", 10, 100, 0.0, None), Fault)  # exists (waiting)
    admitted, expired = s.poll_waiting(60.0)
    assert admitted == [] and [w.key for w, _ in expired] == ["c"]
    assert expired[0][1].code is ErrorCode.SESSION_LIMIT and expired[0][1].retry_after_ms
    s.close("a", 70.0)
    admitted, expired = s.poll_waiting(70.0)
    assert [w.key for w, _ in admitted] == ["b"] and not expired
    no_wait = s.request_open("d", 10, 0, 80.0, None)
    assert isinstance(no_wait, Fault) and no_wait.code is ErrorCode.SESSION_LIMIT


def test_kv_is_reserved_up_front_and_never_overcommitted() -> None:
    s = Scheduler[None, None](replace(CFG, kv_cells=100))
    opened(s, "a", max_tokens=60)
    r = s.request_open("b", 50, 0, 0.0, None)
    assert isinstance(r, Fault) and r.code is ErrorCode.KV_BUDGET and "40 of 100 free" in r.message
    huge = s.request_open("c", 101, 1000, 0.0, None)  # more than the node holds: never, not "not now"
    assert isinstance(huge, Fault) and huge.code is ErrorCode.TOO_LARGE and not s.waiting
    assert huge.retry_after_ms is None and "100 KV cells" in huge.message
    opened(s, "b", max_tokens=40)
    assert s.kv_reserved == 100


def test_an_open_that_fits_is_admitted_while_a_larger_one_waits() -> None:
    s = Scheduler[None, None](replace(CFG, kv_cells=2048, max_sessions=8))
    opened(s, "a", max_tokens=1500)  # 548 of 2048 cells free
    big = s.request_open("big", 1000, 10**9, 0.0, None)
    assert isinstance(big, Waiter) and big.deadline_ms == CFG.max_wait_ms  # wait_ms is capped
    small = s.request_open("small", 16, 0, 1.0, None)
    assert isinstance(small, Session) and big.overtaken == 1
    admitted, expired = s.poll_waiting(2.0)
    assert admitted == [] and expired == [] and list(s.waiting) == [big]
    s.close("a", 3.0)
    admitted, _ = s.poll_waiting(3.0)
    assert [w.key for w, _ in admitted] == ["big"]


def test_overtaking_is_bounded_then_the_waiting_open_holds_admission() -> None:
    s = Scheduler[None, None](replace(CFG, kv_cells=100, max_sessions=8, max_overtakes=2))
    opened(s, "a", max_tokens=60)
    big = s.request_open("big", 80, 1000, 0.0, None)
    assert isinstance(big, Waiter)
    assert isinstance(s.request_open("s1", 10, 1000, 0.0, None), Session)
    assert isinstance(s.request_open("s2", 10, 1000, 0.0, None), Session)
    held = s.request_open("s3", 10, 1000, 0.0, None)  # fits, but big has been overtaken twice
    assert isinstance(held, Waiter) and big.overtaken == 2
    refused = s.request_open("s4", 10, 0, 0.0, None)  # fits too, but may not wait: refused, not admitted
    assert isinstance(refused, Fault) and refused.code is ErrorCode.KV_BUDGET
    s.close("s1", 1.0)
    assert s.poll_waiting(1.0) == ([], [])  # s3 still fits and still waits behind big
    for key in ("a", "s2"):
        s.close(key, 2.0)
    admitted, _ = s.poll_waiting(2.0)
    assert [w.key for w, _ in admitted] == ["big", "s3"]


def test_an_expired_open_that_held_admission_lets_the_others_in() -> None:
    s = Scheduler[None, None](replace(CFG, kv_cells=100, max_sessions=8, max_overtakes=0))  # strict arrival order
    opened(s, "a", max_tokens=60)
    assert isinstance(s.request_open("big", 80, 10, 0.0, None), Waiter)
    assert isinstance(s.request_open("small", 10, 1000, 0.0, None), Waiter)
    admitted, expired = s.poll_waiting(10.0)
    assert [w.key for w, _ in expired] == ["big"] and [w.key for w, _ in admitted] == ["small"]


def test_per_owner_quotas_refuse_with_their_reason_and_leave_other_owners_alone() -> None:
    s = Scheduler[None, None](
        replace(CFG, max_sessions=8, kv_cells=100, max_sessions_per_owner=2, max_waiting_per_owner=1)
    )
    assert isinstance(s.request_open("a1", 20, 0, 0.0, None, owner="a"), Session)
    big = s.request_open("a2", 85, 1000, 0.0, None, owner="a")  # waits for cells
    assert isinstance(big, Waiter)
    assert isinstance(s.request_open("a3", 1, 1000, 0.0, None, owner="a"), Session) and s.held_by("a") == (2, 1)
    over = s.request_open("a4", 1, 1000, 0.0, None, owner="a")  # fits, yet a holds its 2: refused at once, not queued
    assert isinstance(over, Fault) and over.code is ErrorCode.SESSION_LIMIT and s.quota_refused["sessions"] == 1
    assert "quota of 2 sessions" in over.message and over.retry_after_ms and big.overtaken == 1
    assert isinstance(s.request_open("b1", 80, 1000, 0.0, None, owner="b"), Waiter)  # another owner may wait...
    second = s.request_open("b2", 80, 1000, 0.0, None, owner="b")  # ... once
    assert isinstance(second, Fault) and second.code is ErrorCode.KV_BUDGET and s.quota_refused["waiting"] == 1
    assert "quota of 1 waiting opens" in second.message and second.retry_after_ms
    assert isinstance(s.request_open("c1", 5, 0, 0.0, None, owner="c"), Session)  # and a third is admitted
    s.close("a1", 1.0)  # room for a2's cells, but a is back at its quota before a2's turn:
    assert isinstance(s.request_open("a5", 1, 0, 1.0, None, owner="a"), Session)
    admitted, refused = s.poll_waiting(2.0)  # a2 is refused, never admitted; b1 behind it is
    assert [w.key for w, _ in admitted] == ["b1"] and [w.key for w, _ in refused] == ["a2"]
    assert s.quota_refused["sessions"] == 2 and refused[0][1].code is ErrorCode.SESSION_LIMIT
    assert s.held_by("a") == (2, 0) and not s.waiting


@given(quota=st.integers(1, 4), held=st.integers(0, 3), more=st.integers(0, 4), overtakes=st.integers(0, 4))
def test_an_open_that_waited_is_admitted_only_while_its_owner_is_under_its_quota(
    quota: int, held: int, more: int, overtakes: int
) -> None:
    """Owner a holds `held` sessions, waits for room with one more open, then asks for `more`
    small ones at once; when room frees, the waiting one is admitted only if a is still under
    its quota (else refused, naming it), and a never holds more than its quota."""
    held = min(held, quota - 1)
    s = Scheduler[None, None](
        replace(CFG, max_sessions=12, kv_cells=100, max_sessions_per_owner=quota, max_overtakes=overtakes)
    )
    assert isinstance(s.request_open("blocker", 60, 0, 0.0, None, owner="z"), Session)
    for i in range(held):
        assert isinstance(s.request_open(f"a{i}", 1, 0, 0.0, None, owner="a"), Session)
    waiter = s.request_open("wait", 50, 1000, 0.0, None, owner="a")
    assert isinstance(waiter, Waiter)
    for i in range(more):
        under = s.held_by("a")[0] < quota
        before = dict(s.quota_refused)
        r = s.request_open(f"more{i}", 1, 0, 0.0, None, owner="a")
        assert isinstance(r, Session) == (under and i < overtakes), r  # bounded overtaking still holds
        assert not isinstance(r, Waiter)
        if isinstance(r, Fault):  # wait_ms 0: a refusal, counted against the quota only when it was the quota
            assert quota_that_refused(s, before) == (None if under else "sessions")
        assert s.held_by("a")[0] <= quota
    s.close("blocker", 1.0)
    before = dict(s.quota_refused)
    admitted, refused = s.poll_waiting(1.0)
    if s.held_by("a")[0] - len(admitted) < quota:
        assert [w.key for w, _ in admitted] == ["wait"] and not refused
    else:
        assert not admitted and [w.key for w, _ in refused] == ["wait"]
        assert quota_that_refused(s, before) == "sessions"
        assert f"quota of {quota} sessions" in refused[0][1].message
    assert s.held_by("a")[0] <= quota and not s.waiting


def test_per_owner_quotas_default_to_the_node_limits() -> None:
    s = Scheduler[None, None](replace(CFG, max_sessions=4))
    assert (s.config.sessions_per_owner, s.config.waiting_per_owner) == (4, CFG.max_waiting_opens)
    for i in range(4):  # one owner (a chain's head) may hold every session
        assert isinstance(s.request_open(f"s{i}", 10, 0, 0.0, None, owner="head"), Session)
    waiting = s.request_open("s4", 10, 1000, 0.0, None, owner="head")  # and wait for room, as on any full node
    assert isinstance(waiting, Waiter)
    full = s.request_open("s5", 10, 0, 0.0, None, owner="head")
    assert isinstance(full, Fault) and full.code is ErrorCode.SESSION_LIMIT and not s.quota_refused
    with pytest.raises(ValueError, match="per_owner"):
        replace(CFG, max_sessions_per_owner=0)


def held_scheduler(**overrides: Any) -> Scheduler[None, None]:
    """Batch-invariant bookkeeping: 100 cells, "a" open with 60 reserved, closed "b" left 25 held."""
    s = Scheduler[None, None](replace(CFG, kv_cells=100, max_sessions=8, batch_invariant=True, pad_rows=8, **overrides))
    opened(s, "a", max_tokens=60)
    opened(s, "b", max_tokens=30)
    s.close("b", 0.0)
    s.hold(25)
    return s


def test_an_open_that_fits_once_held_cells_are_freed_waits_for_a_compaction() -> None:
    s = held_scheduler()
    assert not s.wants_compaction()
    w = s.request_open("c", 30, 0, 1.0, None)  # 15 cells free, 40 once compacted: waits despite wait_ms 0
    assert isinstance(w, Waiter) and w.deadline_ms == 1.0 and s.wants_compaction()
    assert s.release_held() == 25 and s.kv_held == 0 and not s.wants_compaction()
    admitted, expired = s.poll_waiting(2.0)
    assert [w.key for w, _ in admitted] == ["c"] and not expired


def test_an_open_that_would_not_fit_even_then_is_refused_at_once() -> None:
    s = held_scheduler()
    r = s.request_open("c", 41, 0, 1.0, None)
    assert isinstance(r, Fault) and r.code is ErrorCode.KV_BUDGET and not s.waiting
    assert not s.wants_compaction()
    assert isinstance(s.request_open("d", 41, 100, 1.0, None), Waiter) and not s.wants_compaction()


def test_a_failed_compaction_is_not_retried_until_more_cells_are_held() -> None:
    s = held_scheduler()
    assert isinstance(s.request_open("c", 30, 0, 1.0, None), Waiter)
    s.compaction_failed()
    assert not s.wants_compaction() and s.kv_held == 25
    admitted, expired = s.poll_waiting(2.0)  # its deadline has passed: refused as before
    assert not admitted and [(w.key, why.code) for w, why in expired] == [("c", ErrorCode.KV_BUDGET)]
    refused = s.request_open("d", 30, 0, 3.0, None)  # nothing to wait for
    assert isinstance(refused, Fault) and refused.code is ErrorCode.KV_BUDGET
    s.hold(1)
    assert isinstance(s.request_open("e", 30, 0, 4.0, None), Waiter) and s.wants_compaction()


def test_held_cells_past_the_threshold_ask_for_a_compaction_on_their_own() -> None:
    s = held_scheduler(compact_held_cells=26)
    assert not s.wants_compaction()
    s.hold(1)
    assert s.wants_compaction()
    s.begin_shutdown(0.0)
    assert not s.wants_compaction()
    with pytest.raises(ValueError, match="compact_held_cells"):
        replace(CFG, compact_held_cells=0)


def test_failure_rolls_sessions_back_to_step_start() -> None:
    s = Scheduler[None, None](CFG)
    opened(s, "a")
    s.submit("a", 0, 20, 80, 0.0, None)
    run(s, s.plan())  # type: ignore[arg-type]
    assert s.sessions["a"].length == 8
    failed = s.fail(s.plan())  # type: ignore[arg-type]
    assert [f.key for f in failed] == ["a"] and s.sessions["a"].length == 0
    assert s.sessions["a"].step is None and s.queued_bytes == 0 and s.plan() is None


def test_batch_invariant_plans_pad_decode_and_isolate_aligned_prefill() -> None:
    s = Scheduler[None, None](replace(CFG, batch_invariant=True, pad_rows=8))
    for i, key in enumerate("abc"):
        opened(s, key, seq=i)
    s.submit("a", 0, 3, 12, 0.0, None)
    run(s, s.plan())  # type: ignore[arg-type]
    s.submit("a", 3, 1, 4, 0.0, None)
    s.submit("b", 0, 1, 4, 0.0, None)
    s.submit("c", 0, 13, 52, 0.0, None)
    plan = s.plan()
    assert plan is not None
    decode, prefill = plan.calls
    assert decode.rows == 8 and decode.pad_rows == 6
    assert [(c.key, c.pos, c.count) for c in prefill.chunks] == [("c", 0, 8)]
    run(s, plan)
    plan = s.plan()
    assert plan is not None and [(c.pos, c.count) for c in plan.calls[0].chunks] == [(8, 5)]


def test_config_refuses_starvation_prone_shapes() -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        replace(CFG, max_sessions=17)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        replace(CFG, max_prefill_tokens=17)
    with pytest.raises(ValueError, match="row_multiple"):
        replace(CFG, row_multiple=0)


def test_invariant_mode_keeps_every_call_under_the_attention_tile() -> None:
    wide = replace(CFG, n_batch=512, batch_invariant=True, pad_rows=8)
    assert replace(wide, max_sessions=56, max_prefill_tokens=56).batch_invariant
    with pytest.raises(ValueError, match="63 rows"):
        replace(wide, max_sessions=57)  # padded to 64 decode rows
    with pytest.raises(ValueError, match="63 rows"):
        replace(wide, max_prefill_tokens=57)  # a prefill chunk is padded to 64 rows too


def test_micro_batches_are_stable_balanced_groups_each_in_a_call_of_its_own() -> None:
    s = Scheduler[None, None](replace(CFG, max_sessions=5, micro_batches=2))
    for i, key in enumerate("abcde"):
        opened(s, key, seq=i)
    assert [s.sessions[k].group for k in "abcde"] == [0, 1, 0, 1, 0]  # each admitted to the smallest group
    for key in "edcba":  # arrival order: e's group (0) runs first
        s.submit(key, 0, 1, 4, 0.0, None)
    assert s.demand() == Demand(decoding=5, prefilling=0, largest_call=3)  # the pace sizes calls of 3 rows
    plan = s.plan()
    assert plan is not None
    assert [[c.key for c in call.chunks] for call in plan.calls] == [["e", "c", "a"], ["d", "b"]]
    run(s, plan)
    s.submit("b", 1, 1, 4, 0.0, None)  # only group 1 is back: it runs alone
    plan = s.plan()
    assert plan is not None and [[c.key for c in call.chunks] for call in plan.calls] == [["b"]]
    run(s, plan)
    s.close("b", 0.0)
    s.close("d", 0.0)
    opened(s, "f", seq=5)
    assert s.sessions["f"].group == 1 and s.sessions["e"].group == 0  # members stay; newcomers fill the smallest


def test_micro_batches_carry_their_own_prefill_and_pad_each_invariant_call() -> None:
    s = Scheduler[None, None](replace(CFG, micro_batches=2))
    for i, key in enumerate("abc"):
        opened(s, key, seq=i)
    s.submit("a", 0, 1, 4, 0.0, None)
    s.submit("b", 0, 1, 4, 0.0, None)
    s.submit("c", 0, 5, 20, 0.0, None)  # group 0, like a
    plan = s.plan()
    assert plan is not None
    assert [[(c.key, c.count) for c in call.chunks] for call in plan.calls] == [[("a", 1), ("c", 5)], [("b", 1)]]
    s = Scheduler[None, None](replace(CFG, micro_batches=2, batch_invariant=True, pad_rows=4))
    for i, key in enumerate("abc"):
        opened(s, key, seq=i)
        s.submit(key, 0, 1, 4, 0.0, None)
    plan = s.plan()
    assert plan is not None and [(call.rows, call.pad_rows) for call in plan.calls] == [(4, 2), (4, 3)]


def test_halves_split_an_iteration_of_only_decodes_in_arrival_order() -> None:
    s = Scheduler[None, None](replace(CFG, max_sessions=5))
    for i, key in enumerate("abcde"):
        opened(s, key, seq=i)
    for key in "edcba":
        s.submit(key, 0, 1, 4, 0.0, None)
    asked: list[int] = []

    def halves(rows: int) -> bool:
        asked.append(rows)
        return True

    plan = s.plan(halves=halves)
    assert plan is not None and plan.halved and asked == [5]
    assert [[c.key for c in call.chunks] for call in plan.calls] == [["e", "d", "c"], ["b", "a"]]
    assert {st.key for st in run(s, plan)} == set("abcde")  # one iteration: every step answered
    for key in "ab":
        s.submit(key, 1, 1, 4, 0.0, None)
    plan = s.plan(halves=lambda rows: False)
    assert plan is not None and not plan.halved and [len(call.chunks) for call in plan.calls] == [2]


def test_halves_leave_iterations_with_prefill_and_invariant_mode_whole() -> None:
    s = Scheduler[None, None](CFG)
    for i, key in enumerate("abc"):
        opened(s, key, seq=i)
    s.submit("a", 0, 1, 4, 0.0, None)
    s.submit("b", 0, 1, 4, 0.0, None)
    s.submit("c", 0, 5, 20, 0.0, None)  # a prompt: this iteration carries prefill
    plan = s.plan(halves=lambda rows: True)
    assert plan is not None and not plan.halved and len(plan.calls) == 1
    s = Scheduler[None, None](replace(CFG, batch_invariant=True, pad_rows=4))
    for i, key in enumerate("ab"):
        opened(s, key, seq=i)
        s.submit(key, 0, 1, 4, 0.0, None)
    plan = s.plan(halves=lambda rows: True)
    assert plan is not None and not plan.halved and [call.rows for call in plan.calls] == [4]


def test_a_call_the_budget_cuts_short_ends_at_a_row_multiple_and_a_prompt_that_fits_is_not_cut() -> None:
    """Three decodes and a long prompt: 3 + 8 rows would leave 3 rows past a block of 4, each run
    alone by repacked kernels; the prompt gives them to the next iteration. A prompt that ends in
    the call keeps its rows (trimming it would only delay its first token)."""
    s = Scheduler[None, None](replace(CFG, row_multiple=4))
    for i, key in enumerate("abcde"[:4]):
        opened(s, key, seq=i)
    for key in "abc":
        s.submit(key, 0, 1, 4, 0.0, None)
    s.submit("d", 0, 20, 80, 0.0, None)
    plan = s.plan()
    assert plan is not None and [(c.key, c.count) for c in plan.chunks] == [("a", 1), ("b", 1), ("c", 1), ("d", 5)]
    run(s, plan)
    for key in "abc":
        s.submit(key, 1, 1, 4, 0.0, None)
    plan = s.plan()
    assert plan is not None and [(c.key, c.count) for c in plan.chunks] == [("a", 1), ("b", 1), ("c", 1), ("d", 5)]
    run(s, plan)
    for key in "abc":
        s.submit(key, 2, 1, 4, 0.0, None)
    plan = s.plan()  # 10 rows of d's prompt are left: 3 + 8 again, 5 of them
    assert plan is not None and list(plan.chunks)[-1].count == 5
    run(s, plan)
    for key in "abc":
        s.submit(key, 3, 1, 4, 0.0, None)
    plan = s.plan()  # the last 5 rows end the prompt: 8 rows, not cut to 4
    last = list(plan.chunks)[-1] if plan is not None else None
    assert last is not None and last.count == 5 and last.completes


@given(
    decodes=st.integers(0, 5),
    prompts=st.lists(st.integers(2, 40), min_size=1, max_size=3),
    budget=st.one_of(st.none(), st.integers(0, 24)),
    multiple=st.sampled_from([2, 4, 8]),
)
def test_row_alignment_only_moves_a_few_rows_of_an_unfinished_prompt_to_the_next_call(
    decodes: int, prompts: list[int], budget: int | None, multiple: int
) -> None:
    """Against the same scheduler without alignment: the same sessions run, the same steps complete,
    fewer than `multiple` prefill rows wait for the next call, and a call whose last prompt chunk
    stops short of its step's end holds a multiple of `multiple` rows unless that chunk is smaller
    than what would be cut."""
    cfg = replace(CFG, max_sessions=8, kv_cells=1024, n_batch=64, max_prefill_tokens=24)
    plain, aligned = (planned(replace(cfg, row_multiple=m), decodes, prompts, budget) for m in (1, multiple))
    assert plain is not None and aligned is not None
    assert [(c.key, c.completes) for c in plain.chunks] == [(c.key, c.completes) for c in aligned.chunks]
    moved = plain.calls[0].rows - aligned.calls[0].rows
    last, cut = list(plain.chunks)[-1], plain.calls[0].rows % multiple
    if not last.completes and last.count > cut:
        assert aligned.calls[0].rows % multiple == 0 and moved == cut < multiple
    else:
        assert moved == 0


def test_a_call_gets_the_filler_rows_its_kernel_blocks_ask_for_within_the_batch() -> None:
    """Blocks of 16 and 4 rows: 3 decodes run as a call of 4 rows, 2 as a call of 2, and 3 without
    a filler where fillers were measured not to pay a call of only decodes; 15 rows of a prompt
    run as 16 when the batch has room for a filler, as 15 when it has not."""
    s = Scheduler[None, None](replace(CFG, row_blocks=(16, 4)))
    for i, key in enumerate("abcd"):
        opened(s, key, seq=i)
    for key in "abc":
        s.submit(key, 0, 1, 4, 0.0, None)
    plan = s.plan()
    assert plan is not None and [(call.rows, call.pad_rows) for call in plan.calls] == [(4, 1)]
    run(s, plan)
    for key in "ab":
        s.submit(key, 1, 1, 4, 0.0, None)
    plan = s.plan()
    assert plan is not None and [(call.rows, call.pad_rows) for call in plan.calls] == [(2, 0)]
    run(s, plan)
    for key in "abc":
        s.submit(key, 2 - (key == "c"), 1, 4, 0.0, None)
    plan = s.plan(fillers_pay=lambda rows: False)  # measured dearer: a call of only decodes goes without
    assert plan is not None and [(call.rows, call.pad_rows) for call in plan.calls] == [(3, 0)]
    run(s, plan)
    for key in "ab":
        s.submit(key, 3, 1, 4, 0.0, None)
    s.submit("d", 0, 5, 20, 0.0, None)
    plan = s.plan(fillers_pay=lambda rows: False)  # a call with prefill takes what its blocks offer
    assert plan is not None and [(call.rows, call.pad_rows) for call in plan.calls] == [(8, 1)]
    for n_batch, pad in ((16, 1), (15, 0)):
        s = Scheduler[None, None](replace(CFG, n_batch=n_batch, max_prefill_tokens=15, row_blocks=(16, 4)))
        opened(s, "a", seq=0)
        s.submit("a", 0, 15, 60, 0.0, None)
        plan = s.plan()
        assert plan is not None and [call.pad_rows for call in plan.calls] == [pad]


def test_row_blocks_must_be_positive_and_largest_first() -> None:
    for blocks in ((4, 16), (16, 0)):
        with pytest.raises(ValueError, match="row_blocks"):
            replace(CFG, row_blocks=blocks)


@given(
    decodes=st.integers(0, 12),
    prompts=st.lists(st.integers(1, 40), max_size=3),
    budget=st.one_of(st.none(), st.integers(0, 24)),
    micro_batches=st.sampled_from([1, 2]),
)
def test_fillers_change_no_call_but_its_padding(
    decodes: int, prompts: list[int], budget: int | None, micro_batches: int
) -> None:
    """Against the same scheduler without row blocks: the same calls of the same chunks, each with
    the fillers its rows ask for, never past n_batch."""
    cfg = replace(CFG, max_sessions=16, kv_cells=2048, n_batch=32, max_prefill_tokens=24, micro_batches=micro_batches)
    plain, filled = (planned(replace(cfg, row_blocks=b), decodes, prompts, budget) for b in ((), (16, 4)))
    if plain is None:
        assert filled is None
        return
    assert filled is not None and [c.chunks for c in plain.calls] == [c.chunks for c in filled.calls]
    for bare, call in zip(plain.calls, filled.calls, strict=True):
        assert bare.pad_rows == 0 and call.pad_rows == filler_rows(bare.rows, (16, 4), cfg.n_batch)
        assert call.rows <= cfg.n_batch
        event(f"fillers {call.pad_rows}")


OWNERS = ("a", "b", "c")


class AdmissionMachine(RuleBasedStateMachine):
    """Random opens from three owners (with per-owner quotas), waits, expiries, closes and
    gone owners: admission alone, so hypothesis explores its corners (an open that waited
    while its owner reached its quota, say) without the steps' rules diluting them."""

    micro_batches = 1
    quotas: tuple[int | None, int | None] = (2, 2)  # per owner: sessions, waiting opens

    def __init__(self) -> None:
        super().__init__()
        self.cfg = SchedulerConfig(
            max_sessions=5, kv_cells=120, n_batch=8, max_prefill_tokens=5, max_step_tokens=20,
            queue_budget_bytes=200, batch_invariant=False, max_wait_ms=100, max_overtakes=2,
            micro_batches=self.micro_batches, max_waiting_opens=5, max_sessions_per_owner=self.quotas[0],
            max_waiting_per_owner=self.quotas[1],
        )  # fmt: skip
        self.s = Scheduler[None, None](self.cfg)
        self.now = 0.0
        self.keys = 0
        self.lengths: dict[str, int] = {}  # the model: committed length per session
        self.plans_since_submit: dict[str, int] = {}
        # The model of the queue: waiting opens in arrival order, with how many opens were
        # admitted while each waited ahead of them.
        self.queue: dict[str, int] = {}
        self.groups: dict[str, int] = {}  # the model: a session's micro-batch, from admission on
        self.owner: dict[str, str] = {}  # the model: who opened each session or waiting open

    def _held(self, owner: str) -> tuple[int, int]:
        """The owner's open sessions and waiting opens, in the model."""
        sessions = sum(1 for k in self.s.sessions if self.owner[k] == owner)
        return sessions, sum(1 for k in self.queue if self.owner[k] == owner)

    def _grouped(self, session: Session[None]) -> None:
        sizes = [0] * self.cfg.micro_batches
        for key in self.groups:
            if key in self.s.sessions:
                sizes[self.groups[key]] += 1
        assert sizes[session.group] == min(sizes), "a session joins a smallest group"
        self.groups[session.key] = session.group

    def _fits(self, max_tokens: int) -> bool:
        free = self.cfg.kv_cells - self.s.kv_reserved - self.s.kv_held
        return len(self.s.sessions) < self.cfg.max_sessions and max_tokens <= free

    def _waits_for_compaction(self, max_tokens: int) -> bool:
        """Whether an open that does not fit now waits for held cells to be freed (none held here)."""
        return False

    def _closed(self, session: Session[None]) -> None:
        """What the engine does with a closed session's cells (here: frees them at once)."""

    def _admitted(self, key: str) -> None:
        """Every open waiting ahead of `key` (arrived earlier) has been overtaken once more."""
        ahead = list(self.queue)[: list(self.queue).index(key)] if key in self.queue else list(self.queue)
        for k in ahead:
            self.queue[k] += 1
            assert self.queue[k] <= self.cfg.max_overtakes, f"{k} was overtaken more than max_overtakes times"
        self.queue.pop(key, None)
        self.lengths[key] = 0

    @rule(max_tokens=st.integers(1, 70), wait=st.sampled_from([0, 0, 30, 10**6]), owner=st.sampled_from(OWNERS))
    def open(self, max_tokens: int, wait: int, owner: str) -> None:
        """The whole admission decision, modelled: quota first, then fit and overtaking, then waiting."""
        cfg = self.cfg
        self.keys += 1
        key = f"k{self.keys}"
        self.owner[key] = owner
        head_holds = bool(self.queue) and next(iter(self.queue.values())) >= cfg.max_overtakes
        fits = self._fits(max_tokens)
        sessions, waiting = self._held(owner)
        compacting = not fits and not head_holds and self._waits_for_compaction(max_tokens)
        may_wait = (wait > 0 or compacting) and len(self.queue) < cfg.max_waiting_opens
        before = dict(self.s.quota_refused)
        r = self.s.request_open(key, max_tokens, wait, self.now, None, owner=owner)
        quota = quota_that_refused(self.s, before)
        event("held by an overtaken open" if head_holds and fits else "no open held")
        if max_tokens > cfg.kv_cells:
            assert isinstance(r, Fault) and r.code is ErrorCode.TOO_LARGE and quota is None
            assert r.retry_after_ms is None  # never fits: not worth a retry
        elif sessions >= cfg.sessions_per_owner and cfg.sessions_per_owner < cfg.max_sessions:
            event("owner at its session quota")
            assert isinstance(r, Fault) and r.code is ErrorCode.SESSION_LIMIT and quota == "sessions"
            assert f"quota of {cfg.sessions_per_owner} sessions" in r.message and r.retry_after_ms
        elif fits and not head_holds:
            assert isinstance(r, Session), "an owner under its quota was not admitted to room that was free"
            assert r.owner == owner
            self._admitted(key)
            self._grouped(r)
        elif may_wait and waiting < cfg.waiting_per_owner:
            assert isinstance(r, Waiter) and r.owner == owner
            assert r.deadline_ms <= self.now + cfg.max_wait_ms
            if wait == 0:
                event("zero-wait open waits for a compaction")
                assert compacting and self.s.wants_compaction()
            self.queue[key] = 0
        else:
            assert isinstance(r, Fault) and r.code in (ErrorCode.KV_BUDGET, ErrorCode.SESSION_LIMIT) and r.message
            by_quota = may_wait and waiting >= cfg.waiting_per_owner
            event("owner at its waiting quota" if by_quota else "no quota")
            assert (quota == "waiting") == by_quota
            assert (f"quota of {cfg.waiting_per_owner} waiting opens" in r.message) == by_quota

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def open_beside_a_waiting_one(self, data: st.DataObject) -> None:
        """An owner with an open waiting opens a small session too (perhaps its last one)."""
        owner = self.owner[data.draw(st.sampled_from(list(self.queue)))]
        self.open(max_tokens=data.draw(st.integers(1, 5)), wait=0, owner=owner)

    @rule(data=st.data())
    def tick(self, data: st.DataObject) -> None:
        self.now += data.draw(st.sampled_from([1.0, 20.0, 50.0]))
        before = self.s.quota_refused["sessions"]
        admitted, expired = self.s.poll_waiting(self.now)
        for _, session in admitted:
            self._grouped(session)
        by_quota = 0
        for waiter, why in expired:
            assert why.code in (ErrorCode.KV_BUDGET, ErrorCode.SESSION_LIMIT) and why.retry_after_ms
            if "quota of" in why.message:  # its turn came while its owner held its quota (sessions only grew since)
                event("waiting open refused by its owner's quota")
                assert self.s.held_by(waiter.owner)[0] >= self.cfg.sessions_per_owner
                by_quota += 1
            else:
                assert waiter.deadline_ms <= self.now
        assert self.s.quota_refused["sessions"] - before == by_quota
        for waiter, session in admitted:
            assert waiter.key == session.key
        for waiter, _ in expired:  # expired ones no longer count
            self.queue.pop(waiter.key)
        admitted_keys = {w.key for w, _ in admitted}
        for key in [k for k in self.queue if k in admitted_keys]:  # in queue order
            self._admitted(key)
        assert list(self.queue) == [w.key for w in self.s.waiting]
        # No head-of-line blocking: after a poll, a waiting open that fits waits only behind
        # an open that has been overtaken max_overtakes times.
        for i, w in enumerate(self.s.waiting):
            if self._fits(w.max_tokens):
                assert i > 0 and self.s.waiting[0].overtaken >= self.cfg.max_overtakes
            assert w.overtaken == self.queue[w.key]

    @precondition(lambda self: self.s.sessions)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.s.sessions)))
        session = self.s.close(key, self.now)
        assert session is not None
        self._closed(session)
        del self.lengths[key]
        self.plans_since_submit.pop(key, None)

    @rule(owner=st.sampled_from(OWNERS))
    def owner_gone(self, owner: str) -> None:
        """An owner's connection is gone: its sessions close and its waiting opens are dropped."""
        for key in [k for k in self.s.sessions if self.owner[k] == owner]:
            session = self.s.close(key, self.now)
            assert session is not None
            self._closed(session)
            del self.lengths[key]
            self.plans_since_submit.pop(key, None)
        dropped = self.s.drop_waiting(owner)
        assert sorted(w.key for w in dropped) == sorted(k for k in self.queue if self.owner[k] == owner)
        for w in dropped:
            del self.queue[w.key]
        assert self._held(owner) == (0, 0) == self.s.held_by(owner)

    @invariant()
    def admission_holds(self) -> None:
        s = self.s
        assert 0 <= s.kv_reserved <= self.cfg.kv_cells
        assert s.kv_reserved == sum(x.max_tokens for x in s.sessions.values())
        assert len(s.sessions) <= self.cfg.max_sessions and len(s.waiting) <= self.cfg.max_waiting_opens
        for key, session in s.sessions.items():
            assert session.owner == self.owner[key]

    @invariant()
    def no_owner_exceeds_its_quotas(self) -> None:
        for owner in OWNERS:
            sessions, waiting = self.s.held_by(owner)
            assert (sessions, waiting) == self._held(owner)
            assert sessions <= self.cfg.sessions_per_owner
            assert waiting <= self.cfg.waiting_per_owner


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


class SchedulerMachine(AdmissionMachine):
    """Admission as above, with steps (decodes, prefills, rewinds), runs and failures."""

    @precondition(lambda self: self.s.sessions)
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.s.sessions)))
        length = self.lengths[key]
        pos = data.draw(st.integers(0, length + 1))
        n = data.draw(st.sampled_from([1, 1, 1, 3, 7, 12, 25]))
        r = self.s.submit(key, pos, n, 4 * n, self.now, None)
        if isinstance(r, Step):
            assert pos <= length and pos + n <= self.s.sessions[key].max_tokens
            self.lengths[key] = pos
            self.plans_since_submit[key] = 0
        else:
            assert isinstance(r, Fault) and r.message
            assert r.code in (ErrorCode.BUSY, ErrorCode.POSITION, ErrorCode.TOO_LARGE)

    @rule()
    def everyone_decodes(self) -> None:
        """Every idle session sends its next token at once, as sessions in phase do."""
        for key, session in self.s.sessions.items():
            if session.step is None and session.length < session.max_tokens:
                assert isinstance(self.s.submit(key, session.length, 1, 4, self.now, None), Step)
                self.lengths[key] = session.length
                self.plans_since_submit[key] = 0

    @rule(fail=st.sampled_from([False, False, False, True]), halve=st.sampled_from([False, False, True]))
    def run_one(self, fail: bool, halve: bool = False) -> None:
        decode_ready = {k for k, s in self.s.sessions.items() if s.step is not None and s.step.is_decode}
        plan = self.s.plan(halves=lambda rows: halve)
        if plan is None:
            assert self.s.pending_steps == 0
            return
        rows = 0
        for call in plan.calls:
            assert call.rows <= self.cfg.n_batch
            rows += call.rows
        chunks = list(plan.chunks)
        prefill_rows = sum(c.count for c in chunks if c.key not in decode_ready)
        assert prefill_rows <= self.cfg.max_prefill_tokens
        assert decode_ready <= {c.key for c in chunks}, "a decode-ready session was left out"
        call_groups = [{self.groups[c.key] for c in call.chunks} for call in plan.calls]
        assert all(len(g) == 1 for g in call_groups), "a call carries one micro-batch"
        calls_per_group = 2 if plan.halved else 1
        assert len(call_groups) <= calls_per_group * len({min(g) for g in call_groups}), "one call per micro-batch"
        assert not plan.halved or (halve and prefill_rows == 0 and not self.cfg.batch_invariant)
        for c in chunks:
            assert c.pos == self.lengths[c.key], "positions must stay contiguous and in order"
        assert len({c.key for c in chunks}) == len(chunks)
        if fail:
            for step in self.s.fail(plan):
                self.lengths[step.key] = step.pos
            return
        for c in chunks:
            self.lengths[c.key] = c.pos + c.count
        self.s.commit(plan, self.now, 10.0)
        for key in self.plans_since_submit:
            self.plans_since_submit[key] += 1

    @rule()
    def drain(self) -> None:
        """Every accepted step runs to completion within a bounded number of iterations."""
        bound = sum(
            -(-(s.step.n - s.step.done) // 1) for s in self.s.sessions.values() if s.step is not None
        )  # at least one row of every pending step progresses per iteration it is served
        for _ in range(bound + len(self.s.sessions) + 1):
            if self.s.pending_steps == 0:
                break
            self.run_one(fail=False)
        assert self.s.pending_steps == 0

    @invariant()
    def budgets_hold(self) -> None:
        s = self.s
        assert 0 <= s.kv_reserved <= self.cfg.kv_cells
        assert s.kv_reserved == sum(x.max_tokens for x in s.sessions.values())
        assert len(s.sessions) <= self.cfg.max_sessions
        assert 0 <= s.queued_bytes <= self.cfg.queue_budget_bytes
        assert s.queued_bytes == sum(x.step.nbytes for x in s.sessions.values() if x.step is not None)
        for key, session in s.sessions.items():
            assert session.length == self.lengths[key]
            assert session.length <= session.max_tokens
            assert session.group == self.groups[key], "micro-batch membership never changes"


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class MicroBatchMachine(SchedulerMachine):
    micro_batches = 3
    quotas = (None, None)  # the defaults: one owner may use the whole node, waiting included


TestMicroBatchMachine = MicroBatchMachine.TestCase
TestMicroBatchMachine.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)


class HeldCellsMachine(SchedulerMachine):
    """Batch-invariant bookkeeping: a closed session's cells and a rewound session's tail stay
    held until a compaction frees them; an open that would fit once they are freed waits
    for that (even with wait_ms 0) instead of being refused, within its owner's quotas."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = replace(self.cfg, compact_held_cells=90)
        self.s = Scheduler[None, None](self.cfg)

    def _fits_once_compacted(self, max_tokens: int) -> bool:
        free = self.cfg.kv_cells - self.s.kv_reserved
        return len(self.s.sessions) < self.cfg.max_sessions and max_tokens <= free

    def _waits_for_compaction(self, max_tokens: int) -> bool:
        s = self.s
        may_compact = s.kv_held > 0 and s.compaction_failed_at != s.kv_held
        return may_compact and self._fits_once_compacted(max_tokens)

    def _closed(self, session: Session[None]) -> None:
        self.s.hold(session.length)

    @precondition(lambda self: any(s.step is None and s.length < s.max_tokens for s in self.s.sessions.values()))
    @rule(data=st.data())
    def fill_and_close(self, data: st.DataObject) -> None:
        """A session prefills as much as one step may, runs, and closes: its cells stay held."""
        key = data.draw(
            st.sampled_from(sorted(k for k, s in self.s.sessions.items() if s.step is None and s.length < s.max_tokens))
        )
        session = self.s.sessions[key]
        n = min(session.max_tokens - session.length, self.cfg.max_step_tokens)
        end = session.length + n
        assert isinstance(self.s.submit(key, session.length, n, 4 * n, self.now, None), Step)
        self.lengths[key] = session.length
        self.plans_since_submit[key] = 0
        self.drain()
        closed = self.s.close(key, self.now)
        assert closed is not None and closed.length == end
        self._closed(closed)
        del self.lengths[key]
        self.plans_since_submit.pop(key, None)

    @precondition(lambda self: self.s.sessions)
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        """As the engine does: an accepted step that rewinds holds the dropped tail's cells."""
        before = {key: session.length for key, session in self.s.sessions.items()}
        super().submit(data)
        for key, session in self.s.sessions.items():
            if session.length < before[key]:
                self.s.hold(before[key] - session.length)

    @rule(max_tokens=st.integers(1, 70), owner=st.sampled_from(OWNERS))
    def open_now(self, max_tokens: int, owner: str) -> None:
        """An open that may not wait (wait_ms 0): the model above says when it waits for a compaction."""
        self.open(max_tokens=max_tokens, wait=0, owner=owner)

    @rule(fails=st.sampled_from([False, False, True]))
    def compact(self, fails: bool) -> None:
        s = self.s
        waiting_helps = any(not self._fits(w.max_tokens) and self._fits_once_compacted(w.max_tokens) for w in s.waiting)
        may = s.kv_held > 0 and s.compaction_failed_at != s.kv_held
        overcommitted = s.kv_reserved + s.kv_held > self.cfg.kv_cells
        assert s.wants_compaction() == (may and (s.kv_held >= 90 or overcommitted or waiting_helps))
        if not s.wants_compaction():
            return
        if fails:
            s.compaction_failed()
            assert not s.wants_compaction()
        else:
            held = s.kv_held
            assert s.release_held() == held and s.kv_held == 0 and not s.wants_compaction()

    @invariant()
    def held_cells_count_against_admission(self) -> None:
        s = self.s
        assert s.kv_held >= 0
        if s.kv_reserved + s.kv_held > self.cfg.kv_cells:  # only rewound tails overcommit, and ask to be freed
            assert s.wants_compaction() or s.compaction_failed_at == s.kv_held


TestHeldCellsMachine = HeldCellsMachine.TestCase
TestHeldCellsMachine.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)


@given(
    decodes=st.integers(0, 8),
    prefill=st.lists(st.integers(2, 40), max_size=4),
    pad=st.sampled_from([4, 8]),
)
def test_invariant_mode_shapes_do_not_depend_on_load(decodes: int, prefill: list[int], pad: int) -> None:
    cfg = SchedulerConfig(
        max_sessions=12, kv_cells=1000, n_batch=16, max_prefill_tokens=8, max_step_tokens=64,
        queue_budget_bytes=10**6, batch_invariant=True, pad_rows=pad,
    )  # fmt: skip
    s = Scheduler[None, None](cfg)
    for i in range(decodes):
        opened(s, f"d{i}", seq=i)
        s.submit(f"d{i}", 0, 1, 4, 0.0, None)
    for j, n in enumerate(prefill):
        opened(s, f"p{j}", max_tokens=64, seq=8 + j)
        s.submit(f"p{j}", 0, n, 4 * n, 0.0, None)
    while (plan := s.plan()) is not None:
        for call in plan.calls:
            keys = {c.key for c in call.chunks}
            if any(k.startswith("d") for k in keys):
                assert call.rows % pad == 0
            else:
                assert len(call.chunks) == 1
                c = call.chunks[0]
                assert c.pos // 8 == (c.pos + c.count - 1) // 8  # never crosses a chunk boundary
        run(s, plan)
