"""Linger policy (pure): how long the loop waits for answered sessions, and whether it should."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.linger import MAX_HEAD_LINGER_MS, SETTLE_GAP_S, Turnarounds, linger_limit_s, lingering, settling
from engine.scheduler import Session, Step


@given(st.floats(-5, 100), st.floats(0, 10_000), st.integers(1, 8), st.floats(0, 10_000))
def test_the_wait_is_bounded_and_off_at_zero(linger_ms: float, step_ms: float, groups: int, back_ms: float) -> None:
    limit = linger_limit_s(linger_ms, step_ms, groups, back_ms)
    if linger_ms <= 0:
        assert limit == 0
    elif groups > 1:  # a chain's head: a group coming back is worth a step, or its usual return
        assert limit == min(max(step_ms, back_ms), MAX_HEAD_LINGER_MS) / 1000
    else:
        assert 0 <= limit <= min(linger_ms, 0.1 * step_ms) / 1000


@given(st.lists(st.floats(0, 5_000), max_size=200))
def test_a_usual_return_covers_nine_in_ten_of_the_recent_ones(returns: list[float]) -> None:
    turnarounds = Turnarounds()
    for ms in returns:
        turnarounds.observe(ms)
    recent = returns[-Turnarounds.WINDOW :]
    typical = turnarounds.typical_ms
    if not recent:
        assert typical == 0
    else:
        covered = sum(1 for ms in recent if ms * Turnarounds.MARGIN <= typical)
        assert covered >= 0.9 * len(recent) and typical <= Turnarounds.MARGIN * max(recent)


def session(name: str, group: int, ready: bool) -> Session[None]:
    step = Step((None, name), 0, 1, 0, 0, None) if ready else None
    return Session((None, name), 64, 0.0, group=group, step=step)


def test_a_group_waits_while_any_of_its_members_is_out_and_not_once_another_group_is_whole() -> None:
    sessions = {s.key: s for s in (session("a", 0, True), session("b", 0, False), session("c", 1, False))}
    assert lingering(sessions, {(None, "b"), (None, "c")})  # group 0 has work, b is still out
    assert not lingering(sessions, {(None, "c")})  # group 0 is whole: it runs, whatever group 1 does
    assert not lingering(sessions, set())  # nobody expected


@given(st.lists(st.booleans(), max_size=6), st.floats(0, 0.01))
def test_a_stage_fed_by_another_settles_only_inside_a_burst_with_someone_still_out(
    ready: list[bool], since_last_s: float
) -> None:
    sessions = {s.key: s for s in (session(str(i), 0, r) for i, r in enumerate(ready))}
    got = settling(sessions, since_last_s, SETTLE_GAP_S)
    assert got == (since_last_s < SETTLE_GAP_S and any(ready) and not all(ready))
