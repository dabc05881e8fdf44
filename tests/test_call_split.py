"""Halving an iteration's decodes: the measured rule (pure), properties and examples."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.call_split import MAX_RECHECK_EVERY, RECHECK_EVERY, DecodeCallCosts, split_at


def measured(costs: dict[int, float]) -> DecodeCallCosts:
    rule = DecodeCallCosts()
    for rows, ms in costs.items():
        rule.observe(rows, ms)
    return rule


def test_measures_the_whole_call_then_the_halves_once_then_compares() -> None:
    rule = DecodeCallCosts()
    assert not rule.halves(8)  # the whole call is not measured yet: run it whole
    rule.observe(8, 231.0)
    assert rule.halves(8)  # the halves are not measured: split once to see them
    rule.observe(4, 100.0)
    assert rule.halves(8)  # 200 < 0.95 x 231
    rule.observe(4, 120.0)  # the halves' lower median of [100, 120]: still 200
    rule.observe(4, 108.0)  # of [100, 120, 108]: 108 each, 216 < 219.45
    assert rule.halves(8)
    rule.observe(8, 200.0)  # the whole call got cheaper: [231, 200] costs 200, and 216 > 190
    assert not rule.halves(8)


@given(
    whole=st.floats(10.0, 1000.0),
    half_share=st.floats(0.1, 2.0).filter(lambda s: abs(s - DecodeCallCosts.MARGIN) > 1e-3),
    stall=st.floats(1.0, 1e4),
    at=st.integers(0, 400),
)
def test_one_stalled_call_changes_no_decision(whole: float, half_share: float, stall: float, at: int) -> None:
    """Constant costs, once both shapes are measured: one call stretched by any factor (the
    host stalled, the process was stopped) leaves every decision as it was without it."""

    def decisions(stalled_at: int | None) -> list[bool]:
        rule = measured({8: whole, 4: whole * half_share / 2})
        out = []
        for n in range(600):
            halves = rule.halves(8)
            out.append(halves)
            factor = stall if n == stalled_at else 1.0
            if halves:
                rule.observe(4, factor * whole * half_share / 2)
                rule.observe(4, whole * half_share / 2)
            else:
                rule.observe(8, factor * whole)
        return out

    assert decisions(at) == decisions(None)


def test_one_row_is_never_split_and_odd_rows_split_larger_half_first() -> None:
    rule = measured({1: 10.0})
    assert not rule.halves(1)
    assert [split_at(n) for n in (2, 3, 7, 8)] == [1, 2, 4, 4]


@given(
    fixed=st.floats(1.0, 100.0),
    per_row=st.floats(0.1, 50.0),
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=300),
)
def test_where_calls_cost_a_fixed_part_plus_rows_splits_are_only_probes(
    fixed: float, per_row: float, sizes: list[int]
) -> None:
    """With cost = fixed + per_row x rows, two halves always cost more than one call: the rule
    splits a size only to measure its halves, and once per RECHECK_EVERY decisions after."""
    rule = DecodeCallCosts()
    splits: dict[int, int] = {}
    seen: dict[int, int] = {}
    for rows in sizes:
        seen[rows] = seen.get(rows, 0) + 1
        if rule.halves(rows):
            splits[rows] = splits.get(rows, 0) + 1
            first = split_at(rows)
            rule.observe(first, fixed + per_row * first)
            rule.observe(rows - first, fixed + per_row * (rows - first))
        else:
            rule.observe(rows, fixed + per_row * rows)
    for rows, n in splits.items():
        assert rows >= DecodeCallCosts.MIN_ROWS
        assert n <= 1 + seen[rows] // RECHECK_EVERY


def recheck_positions(decisions: int) -> set[int]:
    """Where rechecks fall while the choice stays: RECHECK_EVERY decisions in, then twice as
    far apart each time, never further than MAX_RECHECK_EVERY."""
    at, every, positions = 0, RECHECK_EVERY, set()
    while at + every <= decisions:
        at += every
        positions.add(at)
        every = min(2 * every, MAX_RECHECK_EVERY)
    return positions


@given(whole=st.floats(10.0, 1000.0), half_share=st.floats(0.1, 2.0), decisions=st.integers(1, 3000))
def test_once_measured_the_cheaper_shape_wins_but_for_rechecks(whole: float, half_share: float, decisions: int) -> None:
    """Every decision takes the measured cheaper shape, except the rechecks, which take the
    other one (so a cost that drifted is seen again), further apart while nothing changes."""
    rule = measured({8: whole, 4: whole * half_share / 2})
    cheaper = whole * half_share < DecodeCallCosts.MARGIN * whole
    rechecks = recheck_positions(decisions)
    for n in range(1, decisions + 1):
        assert rule.halves(8) == (cheaper != (n in rechecks))


def test_rechecks_come_soon_again_once_the_choice_changes() -> None:
    """Rechecks far apart after a long steady run; when the costs move enough to change the
    choice, the next recheck is RECHECK_EVERY decisions away again."""
    rule = measured({8: 200.0, 4: 150.0})  # halves 300 ms against 200: run whole
    steady = sum(1 for _ in range(1000) if rule.halves(8))
    assert steady == len(recheck_positions(1000)) == 5  # at 32, 96, 224, 480 and 992
    for _ in range(20):
        rule.observe(4, 60.0)  # the halves got cheap: 120 ms against 200
    choices = [rule.halves(8) for _ in range(RECHECK_EVERY)]
    assert choices == [True] * (RECHECK_EVERY - 1) + [False]
